"""Weights that change under a running engine (tp_jax/serving/weights.py): `update_weights` equals a fresh load of
the same weights (tokens and logprobs equal) at tp 1, tp 2, dp 2 x tp 2 and pp 2 x tp 2, with the default method
and float32, from arrays on another mesh, under a trainer's names; a tree that does not fit is refused and the old
weights still served; sleep levels 1 and 2 free the pool and the weights and wake up to the same outputs; the
rollout's logprobs against the trainer's forward (`get_logits`) on the same weights."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny_models import hf_config, make_checkpoint, randomize
from tp_jax.loaders.bind import CheckpointMismatchError, MissingWeightError
from tp_jax.parallel.layers import WeightShapeError
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.weights import WeightUpdateError

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=0)


def other_weights(name: str, root: str, seed: int = 123) -> str:
    """Variant `name` with other random weights (the same architecture and config), written once."""
    import torch
    from transformers import LlamaForCausalLM
    path = os.path.join(root, f"{name}_other")
    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        model = randomize(LlamaForCausalLM(hf_config(name)).eval())
        model = model.to(torch.bfloat16) if name == "bf16sharded" else model
        model.save_pretrained(path, safe_serialization=True)
    return path


def arrays_of(path: str) -> dict[str, jax.Array]:
    """A checkpoint's tensors as jax arrays by name (what a trainer holds), in their stored dtype."""
    from safetensors import safe_open
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "flax") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def outputs(llm, params=GREEDY):
    return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("update_weights"))


@pytest.fixture(scope="module")
def gqa(root):
    return make_checkpoint("gqa", root), other_weights("gqa", root)


@pytest.fixture(scope="module")
def tp2(gqa):
    return LLM(gqa[0], tensor_parallel_size=2, progress=False)


def check_update(old: str, new: str, weights, **kw) -> LLM:
    llm = LLM(old, progress=False, **kw)
    before = outputs(llm)
    moved = llm.update_weights(weights)
    fresh = LLM(new, progress=False, **kw)
    assert outputs(llm) == outputs(fresh) != before
    assert np.array_equal(llm.get_logits(PROMPTS[1]), fresh.get_logits(PROMPTS[1]))
    assert moved["host_bytes"] == 0 and moved["device_bytes"] > 0
    return llm


@pytest.mark.parametrize("mesh", [dict(tensor_parallel_size=2),
                                  dict(data_parallel_size=2, tensor_parallel_size=2),
                                  dict(pipeline_parallel_size=2, tensor_parallel_size=2)],
                         ids=["tp2", "dp2tp2", "pp2tp2"])
def test_update_equals_a_fresh_load(gqa, mesh):
    check_update(*gqa, arrays_of(gqa[1]), **mesh)


def test_padded_heads_replicated_kv_and_a_padded_vocab(root):
    """9 query heads and 3 KV heads at tp 4 (padded query slots, KV heads replicated over ranks), vocab 1001 padded."""
    old, new = make_checkpoint("h9kv3", root), other_weights("h9kv3", root)
    check_update(old, new, arrays_of(new), tensor_parallel_size=4)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_update_at_tp1_default_method_and_float32(root, dtype):
    """bf16-stored weights at tp 1: "auto" holds them with the bf16 method in the switched layer loop."""
    old, new = make_checkpoint("bf16sharded", root), other_weights("bf16sharded", root)
    llm = check_update(old, new, arrays_of(new), dtype=dtype)
    assert llm.quantization == ("bf16" if dtype == "auto" else "none")


def test_update_from_another_mesh_under_a_trainers_names(gqa, tp2):
    """The trainer's arrays live on devices 4..7 sharded its own way, nested under its own names."""
    trainer = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[4:8])
    nested = {}
    for name, x in arrays_of(gqa[1]).items():
        spec = jax.P("fsdp") if x.shape[0] % 4 == 0 else jax.P()
        nested.setdefault("policy", {})[name.replace(".", "/")] = jax.device_put(
            x, jax.NamedSharding(trainer, spec))
    tp2.update_weights(nested, mapping=lambda n: n.removeprefix("policy.").replace("/", "."))
    assert outputs(tp2) == outputs(LLM(gqa[1], tensor_parallel_size=2, progress=False))
    tp2.update_weights(arrays_of(gqa[0]))                      # back to the fixture's weights


def test_int8_quantizes_per_device_as_a_fresh_load_does(gqa):
    """int8's values and scales are derived per device at load: the update takes the loader's host path."""
    llm = LLM(gqa[0], tensor_parallel_size=2, quantization="int8", progress=False)
    moved = llm.update_weights(arrays_of(gqa[1]))
    assert outputs(llm) == outputs(LLM(gqa[1], tensor_parallel_size=2, quantization="int8", progress=False))
    assert moved["host_bytes"] > 0 and llm.quantization == "int8"


def test_gguf_blocks_are_refused_with_the_way_out():
    llm = LLM(None, max_model_len=64, progress=False)          # the embedded SmolLM2 GGUF, its blocks kept
    with pytest.raises(WeightUpdateError, match="update_weights_from_disk"):
        llm.update_weights({})


def test_names_from_an_nnx_state_a_nested_dict_or_a_mapping():
    from flax import nnx

    from tp_jax.serving.weights import named_arrays
    x = np.zeros(2)
    state = nnx.State({"model": {"layers": {0: {"mlp": {"up_proj": {"weight": x}}}}, "norm": {"weight": x}}})
    assert sorted(named_arrays(state)) == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    trainer = {"blocks_0_up": x, "final_norm": x, "optimizer_step": x}
    mapping = {"blocks_0_up": "model.layers.0.mlp.up_proj.weight", "final_norm": "model.norm.weight",
               "optimizer_step": None}
    assert sorted(named_arrays(trainer, mapping)) == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    with pytest.raises(WeightUpdateError, match="two arrays are named 'model.norm.weight'"):
        named_arrays(trainer, lambda n: "model.norm.weight")


def test_a_tree_that_does_not_fit_is_refused_and_the_old_weights_stay(gqa, tp2):
    served = outputs(tp2)
    good = arrays_of(gqa[1])
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = [({k: v for k, v in good.items() if k != q}, MissingWeightError, q),
             ({**good, "model.layers.2.mlp.up_proj.weight": good["model.layers.0.mlp.up_proj.weight"]},
              CheckpointMismatchError, "model.layers.2.mlp.up_proj.weight"),
             ({**good, q: good[q][:, :32]}, WeightShapeError, q),
             ({**good, q: good[q].astype(jnp.int32)}, WeightUpdateError, q),
             ({**good, q: good[q] * jnp.nan}, WeightUpdateError, "self_attn")]
    for weights, error, named in cases:
        with pytest.raises(error, match=named.replace(".", r"\.")) as e:
            tp2.update_weights(weights)
        assert "old weights" in str(e.value) or error is WeightUpdateError
        assert outputs(tp2) == served


def test_sleep_frees_the_pool_then_the_weights_and_wakes_to_the_same_outputs(gqa, tp2):
    served = outputs(tp2)
    programs = tp2.engine.core.runner._forward._cache_size()
    live = lambda: sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())     # noqa: E731
    pool = tp2.engine.core.runner.k.nbytes + tp2.engine.core.runner.v.nbytes
    awake = live()
    tp2.sleep(level=1)
    assert tp2.is_sleeping and awake - live() >= pool
    with pytest.raises(RuntimeError, match="sleeping"):
        tp2.generate(PROMPTS, GREEDY)
    tp2.wake_up()
    assert not tp2.is_sleeping and outputs(tp2) == served
    tp2.sleep(level=2)
    asleep = live()
    weights = sum(x.nbytes for x in jax.tree.leaves(arrays_of(gqa[0])))
    assert awake - asleep >= pool + weights * 0.9
    tp2.update_weights(arrays_of(gqa[1]))                      # level 2's weights come back from the trainer
    tp2.wake_up()
    assert outputs(tp2) == outputs(LLM(gqa[1], tensor_parallel_size=2, progress=False))
    tp2.sleep(level=2)
    tp2.wake_up()                                              # none given while asleep: the checkpoint's again
    assert outputs(tp2) == served
    assert tp2.engine.core.runner._forward._cache_size() == programs          # nothing compiled again
    print(f"\nsleep: live bytes awake {awake}, asleep at level 2 {asleep} (pool {pool}, weights {weights})")


def rollout_vs_trainer(llm) -> tuple[float, float, float]:
    """For the sampled tokens, the rollout's logprobs against (a) the trainer's forward, `get_logits` then the
    sampler's log-softmax: (max |Δ|, max |exp(Δ) - 1|), and (b) the engine scoring the rollout as a prompt
    (`prompt_logprobs`): max |Δ|."""
    from tp_jax.parallel.invariant import row_log_softmax
    dense, scored = [], []
    for prompt, (tokens, logprobs) in zip(PROMPTS, outputs(llm, SAMPLED)):
        rollout = np.asarray(logprobs, np.float32)
        scores = np.asarray(jax.jit(row_log_softmax)(llm.get_logits(prompt + tokens[:-1])[0]))
        dense.append(np.abs(scores[len(prompt) - 1 + np.arange(len(tokens)), tokens] - rollout))
        again = llm.generate([prompt + tokens], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
        prompt_lp = again[0].prompt_logprobs
        scored.append(np.abs(np.array([prompt_lp[len(prompt) + i][t].logprob for i, t in enumerate(tokens)],
                                      np.float32) - rollout))
    d = np.concatenate(dense)
    return float(d.max()), float(np.abs(np.expm1(d)).max()), float(np.concatenate(scored).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_logprobs_against_the_trainers_forward(gqa, tp2, dtype):
    """The engine scoring the rollout (prompt_logprobs) equals it bit for bit; the dense forward (`get_logits`)
    is measured (docs/rollouts.md): float32 (tp 2, CPU's default dtype) within a few ulps, bf16 within 1e-2."""
    llm = tp2 if dtype == "float32" else LLM(gqa[0], dtype=dtype, progress=False)
    worst, ratio, scored = rollout_vs_trainer(llm)
    print(f"\n{dtype}: get_logits max |dlogprob| {worst:.3g}, max |exp(d) - 1| {ratio:.3g}; "
          f"prompt_logprobs max |dlogprob| {scored}")
    assert scored == 0.0
    assert worst < (2e-6 if dtype == "float32" else 1e-2)


def test_the_servers_dev_endpoints(gqa, tp2, monkeypatch):
    """Off by default (404); with TP_JAX_SERVER_DEV_MODE=1 (what `tp-jax serve` reads): /sleep, /is_sleeping,
    /wake_up, /update_weights_from_disk, and a request made while asleep is a 400."""
    import asyncio

    import httpx

    from tp_jax.server.app import create_app
    from tp_jax.server.dev import add_dev_routes, dev_mode
    from tp_jax.serving.async_engine import AsyncLLMEngine
    monkeypatch.setenv("TP_JAX_SERVER_DEV_MODE", "1")
    assert dev_mode()
    aengine = AsyncLLMEngine(tp2.engine)
    plain = create_app(aengine, None, model_names=["tiny"], max_model_len=tp2.max_model_len)
    dev = create_app(aengine, None, model_names=["tiny"], max_model_len=tp2.max_model_len)
    add_dev_routes(dev, aengine, tp2)
    ask = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 0}
    answer = lambda r: r.json()["choices"][0]["logprobs"]["token_logprobs"]      # noqa: E731 (no tokenizer: no text)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain), base_url="http://app") as c:
            off = await c.post("/sleep")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=dev), base_url="http://app") as c:
            before = answer(await c.post("/v1/completions", json=ask))
            slept = await c.post("/sleep", params={"level": 1})
            sleeping = (await c.get("/is_sleeping")).json()
            refused = await c.post("/v1/completions", json=ask)
            woke = await c.post("/wake_up")
            again = answer(await c.post("/v1/completions", json=ask))
            updated = (await c.post("/update_weights_from_disk", json={"model_path": gqa[1]})).json()
            other = answer(await c.post("/v1/completions", json=ask))
            await c.post("/update_weights_from_disk", json={"model_path": gqa[0]})
            return off, before, slept, sleeping, refused, woke, again, updated, other

    try:
        off, before, slept, sleeping, refused, woke, again, updated, other = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert off.status_code == 404
    assert slept.status_code == 200 and sleeping == {"is_sleeping": True}
    assert refused.status_code == 400 and "sleeping" in refused.json()["error"]["message"]
    assert woke.status_code == 200 and again == before
    assert updated["success"] and other != before
