"""Multi-LoRA serving: PEFT adapters written by peft (rank 4 on attention only, rank 8 on every linear layer,
rank 16 rsLoRA; random nonzero A and B) served beside the base model in one mixed batch, greedy tokens and
logprobs equal to peft's merged model at tp 1, 2 (scan loop), 4, dp 2 x tp 2 and pp 2 with fewer device slots
than adapters (requests wait for a slot; the host LRU re-reads an evicted adapter); base rows bit for bit the
engine without LoRA; an adapter's row the same alone and in the mix; the prefix cache kept apart per adapter;
the compiled step's collectives those of the base step; the embedded SmolLM2 with a rank-8 adapter at tp 2;
and every refused adapter with its message."""

import json
import os
import re

import numpy as np
import pytest

from tests.tiny_models import make_checkpoint
from tp_jax import LLM, LoRARequest, SamplingParams
from tp_jax.serving.batch import StepBatch

ADAPTERS = {"r4attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            "r8all": dict(r=8, lora_alpha=16, target_modules="all-linear"),
            "r16rs": dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True)}
LONG = [(7 * i) % 997 + 3 for i in range(40)]            # 2 full blocks of 16: the prefix cache is in play
PROMPTS = [LONG, [5, 17, 300, 42, 9], [999, 3, 4]]
NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=1, ignore_eos=True)
MESHES = {"tp1": {}, "tp2scan": dict(tensor_parallel_size=2, layer_loop="scan"), "tp4": dict(tensor_parallel_size=4),
          "dp2tp2": dict(data_parallel_size=2, tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, progress=False)


def write_adapter(base: str, out: str, seed: int, **config) -> str:
    """A PEFT adapter of `base` saved by peft, its A and B random (peft starts B at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    if not os.path.isdir(out):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(**config))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.2 * torch.randn_like(p))
        model.save_pretrained(out)
    return out


def peft_greedy(base: str, adapter: str | None, prompts, new: int = NEW):
    """(tokens, their logprobs) per prompt from transformers, with the adapter merged by peft."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.eval().generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            tokens = g.sequences[0, len(p):].tolist()
            out.append((tokens, np.array([float(torch.log_softmax(x[0], -1)[t]) for x, t in zip(g.logits, tokens)])))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base checkpoint, {name: LoRARequest}, {None or name: peft's (tokens, logprobs) per prompt})."""
    root = str(tmp_path_factory.mktemp("lora"))
    base = make_checkpoint("gqa", root)
    requests = {name: LoRARequest(name, i + 1, write_adapter(base, f"{root}/{name}", 100 + i, **cfg))
                for i, (name, cfg) in enumerate(ADAPTERS.items())}
    refs = {name: peft_greedy(base, None if name is None else requests[name].lora_path, PROMPTS)
            for name in [None, *ADAPTERS]}
    for name in ADAPTERS:           # each adapter changes the answer (a zero B would pass for the base)
        assert refs[name][0][0] != refs[None][0][0]
    return base, requests, refs


@pytest.fixture(scope="module")
def engines(tiny):
    built = {}

    def at(mesh: str) -> LLM:
        if mesh not in built:
            built[mesh] = LLM(tiny[0], **MESHES[mesh], **LORA) if mesh != "plain" else \
                LLM(tiny[0], tensor_parallel_size=2, progress=False)
        return built[mesh]
    return at


def mixed(requests):
    """Every prompt for the base and for each adapter, interleaved: (prompts, lora_request per prompt, name)."""
    names = [None, *ADAPTERS]
    rows = [(p, n) for p in PROMPTS for n in names]
    return [p for p, _ in rows], [None if n is None else requests[n] for _, n in rows], [n for _, n in rows]


def traces(outs):
    """(tokens, their logprobs) of each output's one sample."""
    return [(c.token_ids, np.array([lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids)]))
            for c in (o.outputs[0] for o in outs)]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_mixed_batch_equals_peft_merged(tiny, engines, mesh):
    _, requests, refs = tiny
    prompts, loras, names = mixed(requests)
    outs = traces(engines(mesh).generate(prompts, GREEDY, lora_request=loras))
    for k, ((tokens, lps), name) in enumerate(zip(outs, names)):
        ref_tokens, ref_lps = refs[name][k // (1 + len(ADAPTERS))]
        assert tokens == ref_tokens, (mesh, name, k)
        assert float(np.abs(lps - ref_lps).max()) <= 2e-5, (mesh, name, k)


def test_base_rows_are_the_engine_without_lora_bit_for_bit(tiny, engines):
    _, requests, _ = tiny
    prompts, loras, names = mixed(requests)
    with_lora = traces(engines("tp2scan").generate(prompts, GREEDY, lora_request=loras))
    plain = traces(engines("plain").generate(prompts, GREEDY))
    for (t, lp), (pt, plp), name in zip(with_lora, plain, names):
        if name is None:
            assert t == pt and np.array_equal(lp, plp)


@pytest.mark.default_compile          # at the suite's LLVM -O0 a float32 row moves by 1 ulp with its neighbours
def test_an_adapter_row_is_the_same_alone_and_in_the_mix(tiny, engines):
    """Batch invariance per adapter, as users compile (every row alone and in the mix, bit for bit)."""
    _, requests, _ = tiny
    prompts, loras, names = mixed(requests)
    llm = engines("tp1")
    together = traces(llm.generate(prompts, GREEDY, lora_request=loras))
    for k in range(len(prompts)):
        alone = traces(llm.generate([prompts[k]], GREEDY, lora_request=loras[k]))[0]
        assert alone[0] == together[k][0] and np.array_equal(alone[1], together[k][1]), names[k]


def test_the_prefix_cache_is_kept_apart_per_adapter(tiny, engines):
    base, requests, _ = tiny
    llm = engines("tp1")
    prompt = [(11 * i) % 991 + 5 for i in range(40)]                # new to this engine: 2 full blocks of 16
    llm.generate([prompt], GREEDY)                                  # the base's blocks of it are cached
    first = llm.generate([prompt], GREEDY, lora_request=requests["r8all"])[0]
    again = llm.generate([prompt], GREEDY, lora_request=requests["r8all"])[0]
    base_again = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0                             # not the base's blocks
    assert again.num_cached_tokens == 32 and base_again.num_cached_tokens == 32
    ref = peft_greedy(base, requests["r8all"].lora_path, [prompt])[0][0]
    assert traces([first])[0][0] == traces([again])[0][0] == ref


def test_the_engine_takes_a_lora_request_per_request(tiny, engines):
    _, requests, refs = tiny
    engine = engines("tp1").engine
    engine.add_request("with-r16", PROMPTS[1], GREEDY, lora_request=requests["r16rs"])
    engine.add_request("base", PROMPTS[1], GREEDY)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["with-r16"].outputs[0].token_ids == refs["r16rs"][1][0]
    assert done["base"].outputs[0].token_ids == refs[None][1][0]


def collectives(hlo: str) -> dict[str, int]:
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo))
            for op in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")}


def step_hlo(llm) -> str:
    core = llm.engine.core
    shape = max(core.runner.compiled_shapes)
    batch = StepBatch.empty(shape)
    runner = core.runner
    adapters = () if runner.lora is None else (runner.lora.args(), runner.put(np.full(batch.ids.shape, -1, np.int32)))
    return runner._forward.lower(runner.weights, runner.put(batch.packed()), runner.k, runner.v, shape=shape,
                                 adapters=adapters).compile().as_text()


def test_a_lora_step_compiles_the_collectives_of_the_base_step(tiny, engines):
    _, requests, _ = tiny
    lora, plain = engines("tp2scan"), engines("plain")
    lora.generate([PROMPTS[1]], GREEDY, lora_request=requests["r8all"])
    plain.generate([PROMPTS[1]], GREEDY)
    shape = max(lora.engine.core.runner.compiled_shapes & plain.engine.core.runner.compiled_shapes)
    lora.engine.core.runner.compiled_shapes = plain.engine.core.runner.compiled_shapes = {shape}
    ours, base = collectives(step_hlo(lora)), collectives(step_hlo(plain))
    assert ours == base and base["all-reduce"] > 0, (ours, base)


def test_the_embedded_smollm2_with_a_rank_8_adapter_at_tp2(smollm2_path, smollm2_converted, tmp_path):
    adapter = write_adapter(smollm2_converted, str(tmp_path / "smollm2_r8"), 7, r=8, lora_alpha=16,
                            target_modules=["q_proj", "v_proj", "down_proj"])
    prompts = [[1, 504, 3458, 2114, 28, 253, 1345], [1, 4093, 1142, 314, 2]]
    ref = peft_greedy(smollm2_converted, adapter, prompts, new=12)
    llm = LLM(smollm2_path, dtype="float32", tensor_parallel_size=2, enable_lora=True, max_lora_rank=8,
              progress=False)
    outs = traces(llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True),
                               lora_request=LoRARequest("r8", 1, adapter)))
    base = traces(llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    for (tokens, lps), (ref_tokens, ref_lps), (base_tokens, _) in zip(outs, ref, base):
        assert tokens == ref_tokens and tokens != base_tokens
        assert float(np.abs(lps - ref_lps).max()) <= 2e-3


# --- refused adapters -------------------------------------------------------------------------------------

def edited(src: str, dst: str, **changes) -> str:
    import shutil
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


def test_bad_adapters_are_refused_before_anything_runs(tiny, engines, tmp_path):
    _, requests, _ = tiny
    llm = engines("tp1")
    good = requests["r8all"].lora_path
    cases = [
        (LoRARequest("none", 9, str(tmp_path / "missing")), "no adapter_config.json there"),
        (LoRARequest("mts", 10, edited(good, str(tmp_path / "mts"), modules_to_save=["lm_head"])),
         "modules_to_save=['lm_head']: fully trained modules are not served"),
        (LoRARequest("dora", 11, edited(good, str(tmp_path / "dora"), use_dora=True)), "use_dora=True"),
        (LoRARequest("c_attn", 12, edited(good, str(tmp_path / "c_attn"), target_modules=["c_attn"])),
         "target_modules ['c_attn'] are not layers of this LlamaForCausalLM"),
    ]
    for req, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            llm.generate([[5, 6]], GREEDY, lora_request=req)
    llm.generate([[5, 6]], GREEDY, lora_request=requests["r8all"])
    with pytest.raises(ValueError, match=re.escape("lora_int_id 2 already names")):
        llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("other", 2, requests["r4attn"].lora_path))
    with pytest.raises(ValueError, match="got 2 lora_requests for 1 prompts"):
        llm.generate([[5, 6]], GREEDY, lora_request=[None, None])
    with pytest.raises(TypeError, match="must be a tp_jax.LoRARequest"):
        llm.generate([[5, 6]], GREEDY, lora_request="r8all")
    assert not llm.engine.has_unfinished()


def test_a_rank_above_max_lora_rank_and_lora_without_enable_lora_are_refused(tiny, engines):
    base, requests, _ = tiny
    small = LLM(base, enable_lora=True, max_lora_rank=8, progress=False)
    with pytest.raises(ValueError, match=re.escape("rank 16 exceeds max_lora_rank=8; raise max_lora_rank to at "
                                                   "least 16")):
        small.generate([[5, 6]], GREEDY, lora_request=requests["r16rs"])
    with pytest.raises(ValueError, match=re.escape("a lora_request needs LLM(..., enable_lora=True)")):
        engines("plain").generate([[5, 6]], GREEDY, lora_request=requests["r8all"])
    with pytest.raises(ValueError, match="lora_int_id=0 must be an integer >= 1"):
        LoRARequest("x", 0, "/x")


def test_jax_sees_each_devices_slice_only(tiny, engines):
    """A column layer's B and a row layer's A are split over tp: each device holds 1/tp of them."""
    llm = engines("tp4")
    weights = llm.engine.core.lora
    qkv, o = weights.layers["self_attn.qkv_proj"], weights.layers["self_attn.o_proj"]
    for arr, dim in ((qkv.b, 3), (o.a, 2)):
        shard = arr.addressable_shards[0].data
        assert shard.shape[dim] * 4 == arr.shape[dim], (arr.shape, shard.shape)


# --- the server ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_server(tiny_path, tmp_path_factory):
    """`tp-jax serve` of the tiny tokenized Llama with two adapters (and a third to load at run time)."""
    from tests.server_process import ServerProcess
    root = tmp_path_factory.mktemp("lora_server")
    paths = {name: write_adapter(tiny_path, str(root / name), 200 + i, **ADAPTERS[cfg])
             for i, (name, cfg) in enumerate([("sql", "r8all"), ("chat", "r4attn"), ("late", "r16rs")])}
    args = [tiny_path, "--served-model-name", "tiny", "--max-model-len", "128", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"sql={paths['sql']}", f"chat={paths['chat']}",
            "--allow-runtime-lora-updating"]
    with ServerProcess(args, str(root), name="lora") as srv:
        yield srv.wait_ready(), paths, tiny_path


def test_the_server_serves_adapters_as_models_equal_to_peft(lora_server):
    import httpx
    from openai import NotFoundError, OpenAI
    srv, paths, base = lora_server
    client = OpenAI(base_url=srv.base, api_key="unused", max_retries=0, timeout=600)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "sql", "chat"}
    assert models["sql"].model_extra["parent"] == "tiny" and models["sql"].model_extra["root"] == paths["sql"]
    prompt = [5, 17, 300, 42, 9, 11]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(base)
    for name in ("sql", "chat", None):
        ref_tokens, ref_lps = peft_greedy(base, paths.get(name), [prompt])[0]
        got = client.completions.create(model=name or "tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                        logprobs=1, extra_body={"ignore_eos": True})
        lps = np.array(got.choices[0].logprobs.token_logprobs)
        assert got.choices[0].text == tokenizer.decode(ref_tokens), name
        assert float(np.abs(lps - ref_lps).max()) <= 2e-5, name
    msgs = [{"role": "user", "content": "Hi there"}]                 # chat: the template, then the adapter
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ref_tokens, _ = peft_greedy(base, paths["sql"], [tokenizer.encode(text, add_special_tokens=False)])[0]
    chat = client.chat.completions.create(model="sql", messages=msgs, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tokenizer.decode(ref_tokens)
    # run-time loading: a rank above --max-lora-rank is refused, a good one is served, then unloaded
    load = lambda body: httpx.post(f"{srv.base}/load_lora_adapter", json=body, timeout=120)
    r = load({"lora_name": "late", "lora_path": paths["late"]})
    assert r.status_code == 400 and "rank 16 exceeds max_lora_rank=8" in r.json()["error"]["message"]
    r = load({"lora_name": "nowhere", "lora_path": "/no/such/adapter"})
    assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
    r = load({"lora_name": "sql", "lora_path": paths["chat"]})
    assert r.status_code == 400 and "already served" in r.json()["error"]["message"]
    r = load({"lora_name": "chat2", "lora_path": paths["chat"]})
    assert r.status_code == 200 and r.text.startswith("Success"), r.text
    again = client.completions.create(model="chat2", prompt=prompt, max_tokens=NEW, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == client.completions.create(model="chat", prompt=prompt, max_tokens=NEW,
                                                              temperature=0, extra_body={"ignore_eos": True}
                                                              ).choices[0].text
    r = httpx.post(f"{srv.base}/unload_lora_adapter", json={"lora_name": "chat2"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(NotFoundError, match="the model `chat2` does not exist"):
        client.completions.create(model="chat2", prompt=prompt, max_tokens=2)
    r = httpx.post(f"{srv.base}/unload_lora_adapter", json={"lora_name": "chat2"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("flags,msg", [
    (["--lora-modules", "sql=/a"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "sql"], "--lora-modules 'sql': give NAME=PATH"),
    (["--enable-lora", "--lora-modules", "{bad"], "--lora-modules '{bad' is not valid JSON"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "the name 'a' is used twice"),
])
def test_bad_lora_module_flags_exit_2_before_the_model_loads(flags, msg):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "tp_jax.server.cli", "serve", "/no/such/model", *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert "/no/such/model" not in r.stderr                          # refused before the model was looked for
