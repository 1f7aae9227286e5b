"""Speculative decoding (n-gram): the proposer against vLLM's rule, the config's errors, greedy token ids
equal to transformers and to the engine without speculation at tp 1, tp 2, dp 2 x tp 2 and pp 2 (with
chunked prefill, prefix caching and preemption in play, and under a JSON schema), seeded sampling equal
to plain sampling, the sampled distribution equal to the target's (a statistical test with its bound,
which an accept-every-draft sampler fails), stops inside an accepted run, the KV rollback's block
accounting, and the metrics."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.tiny_models import hf_greedy, make_checkpoint, make_tokenized_checkpoint
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.speculative import SpeculativeConfig, propose_ngram

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# repeats (proposals stand), a shared 8-token prefix (prefix cache), one long prompt (chunked prefill)
PROMPTS = [[5, 17, 300, 42, 9, 5, 17, 300, 42, 9, 5, 17], [5, 17, 300, 42, 9, 5, 17, 300, 8, 8],
           [7, 8, 9, 10, 11, 12, 13, 7, 8, 9] * 3, [999, 3]]
TOKENS = 24
# small blocks, a 16-token budget (prompts split over steps) and a pool that forces preemption
ENGINE = dict(block_size=4, max_num_batched_tokens=16, num_gpu_blocks=18, max_model_len=64, progress=False)


def reference_ngram(tokens, k, hi, lo):
    """vLLM's rule written plainly: the longest suffix n-gram (hi..lo) seen earlier, its earliest occurrence."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for s in range(len(tokens) - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_proposer_follows_vllms_rule():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    assert propose_ngram([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 2, 3, 1) == [9, 2]        # the longest n-gram wins
    assert propose_ngram([5, 6, 7, 5, 6, 8, 5, 6], 2, 2, 2) == [7, 5]              # its earliest occurrence
    assert propose_ngram([1, 2, 3, 4], 3, 2, 1) == []                              # nothing repeats
    assert propose_ngram([4, 4, 4], 5, 2, 1) == [4]                                # overlapping, up to the end


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 5), st.integers(1, 4),
       st.integers(1, 4))
def test_proposer_equals_the_plain_rule(tokens, k, hi, lo):
    lo = min(lo, hi)
    assert propose_ngram(tokens, k, hi, lo) == reference_ngram(tokens, k, hi, lo)


@pytest.mark.parametrize("value,msg", [
    ({"model": "/some/draft", "num_speculative_tokens": 3}, "the draft model '/some/draft' is neither"),
    ({"model": 5, "num_speculative_tokens": 3}, "model=5 must be the draft model's checkpoint"),
    ({"method": "ngram", "model": "/x", "num_speculative_tokens": 3}, "unknown key(s) ['model'] for method 'ngram'"),
    ({"model": "/x", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "unknown key(s) ['prompt_lookup_max']"),
    ({"model": "/x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}, "runs on the target's mesh"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "method='eagle3' is not supported"),
    ({"method": "ngram"}, "num_speculative_tokens=None must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "prompt_lookup_min=3 exceeds prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "unknown key(s) ['lookahead']"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size=0"),
])
def test_bad_configs_are_refused_naming_the_key(value, msg):
    with pytest.raises(ValueError, match=None) as e:
        LLM(None, speculative_config=value, progress=False)
    assert msg in str(e.value) and str(e.value).startswith("LLM: speculative_config")


def test_config_defaults_and_the_command_line_flag():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (5, 5)                    # vLLM's defaults
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    import argparse
    from tp_jax.serving import engine_args
    parser = argparse.ArgumentParser()
    engine_args.add_cli_arguments(parser)
    ns = parser.parse_args(["--speculative-config", json.dumps(SPEC)])
    assert engine_args.from_cli(ns).speculative_config == SPEC
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram"'])        # not JSON: argparse's error


# --- greedy: token for token the engine without speculation, and transformers --------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def gqa(root):
    path = make_checkpoint("gqa", root)
    return path, [hf_greedy(path, p, TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain_llm(gqa):
    return LLM(gqa[0], **ENGINE)


@pytest.fixture(scope="module")
def spec_llm(gqa):
    return LLM(gqa[0], speculative_config=SPEC, **ENGINE)


@pytest.fixture(scope="module")
def plain(plain_llm):
    return plain_llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=2))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


MESHES = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1)]


@pytest.mark.parametrize("dp,pp,tp", MESHES, ids=str)
def test_greedy_equals_plain_decoding_and_transformers(gqa, plain, spec_llm, dp, pp, tp):
    path, refs = gqa
    llm = spec_llm if (dp, pp, tp) == (1, 1, 1) else LLM(path, speculative_config=SPEC, tensor_parallel_size=tp,
                                                         data_parallel_size=dp, pipeline_parallel_size=pp, **ENGINE)
    _check_greedy(llm, plain, refs, (dp, pp, tp))


def _check_greedy(llm, plain, refs, mesh):
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=2)
    outs = llm.generate(PROMPTS, params)
    assert _ids(outs) == _ids(plain) == refs
    for o, p in zip(outs, plain):                        # each token's logprob, as plain decoding scored it
        got = [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        want = [lp[t].logprob for t, lp in zip(p.outputs[0].token_ids, p.outputs[0].logprobs)]
        np.testing.assert_allclose(got, want, atol=2e-5 if mesh != (1, 1, 1) else 0)
    core = llm.engine.core
    assert core.spec.accepted_tokens > 10 and core.spec.draft_tokens > core.spec.accepted_tokens  # both paths ran
    assert core.stats["preemptions"] > 0
    alone = llm.generate(PROMPTS[2], params)[0]            # alone == in the batch, from blocks the batch cached
    assert alone.outputs[0].token_ids == refs[2] and alone.num_cached_tokens > 0
    assert core.kv_usage()[0] == 0                                                  # every block came back


def test_rejected_drafts_never_reach_the_prefix_cache(gqa, spec_llm):
    """Blocks held stay within the computed tokens + one after every step, and a request that finds a
    speculated sequence's blocks in the prefix cache continues as transformers does."""
    path, refs = gqa
    llm = spec_llm
    core = llm.engine.core
    core.reset_prefix_cache()
    before = (core.spec.draft_tokens, core.spec.accepted_tokens)
    for i, n in ((0, TOKENS), (1, 6), (3, 6)):          # 0 ends last: its blocks are the last evicted
        llm.engine.add_request(str(i), PROMPTS[i], SamplingParams(max_tokens=n, temperature=0.0))
    while llm.engine.has_unfinished():
        llm.engine.step()
        for req in core.scheduler.running[0]:
            assert len(core.scheduler.blocks[0].table(req.request_id)) <= -(-(req.num_computed_tokens + 1) // 4)
    assert core.spec.draft_tokens - before[0] > core.spec.accepted_tokens - before[1] > 0
    longer = PROMPTS[0] + refs[0]                      # its blocks were written with drafts in flight
    out = llm.generate(longer, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.num_cached_tokens >= 24
    assert out.outputs[0].token_ids == hf_greedy(path, longer, 8)


# --- a draft model (tp_jax/serving/draft_model.py) ---------------------------------------------------

def _edited(src: str, dst: str, edit) -> str:
    """A copy of the checkpoint at `src` with `edit(model)` applied to its weights, at `dst`."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        edit(model)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def _weaker_and_deeper(model):
    """The target's last MLP zeroed (about half its greedy proposals stand), then a third layer that adds
    nothing (its output projections zero): another KV layout (3 layers; at pp 2 padded to 4)."""
    import copy
    model.model.layers[-1].mlp.down_proj.weight.zero_()
    extra = copy.deepcopy(model.model.layers[-1])
    extra.self_attn.layer_idx = len(model.model.layers)
    extra.self_attn.o_proj.weight.zero_()
    model.model.layers.append(extra)
    model.config.num_hidden_layers = len(model.model.layers)


@pytest.fixture(scope="module")
def draft(gqa, root):
    return _edited(gqa[0], f"{root}/draft", _weaker_and_deeper)


def _draft_spec(path: str, k: int = 3) -> dict:
    return {"model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def draft_llm(gqa, draft):
    return LLM(gqa[0], speculative_config=_draft_spec(draft), **ENGINE)


@pytest.mark.parametrize("dp,pp,tp", MESHES, ids=str)
def test_draft_model_greedy_equals_plain_decoding_and_transformers(gqa, plain, draft, draft_llm, dp, pp, tp):
    path, refs = gqa
    llm = draft_llm if (dp, pp, tp) == (1, 1, 1) else LLM(
        path, speculative_config=_draft_spec(draft), tensor_parallel_size=tp, data_parallel_size=dp,
        pipeline_parallel_size=pp, **ENGINE)
    _check_greedy(llm, plain, refs, (dp, pp, tp))


def test_the_draft_pool_follows_the_target(gqa, draft_llm):
    """The target as its own draft: every proposal must stand, through chunked prefill, preemption and
    prefix-cache hits, which holds only if the draft's pool has the keys of every token the target's has
    (a stale or missing block would change its argmax)."""
    path, refs = gqa
    llm = LLM(path, speculative_config=_draft_spec(path, 4), **ENGINE)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    assert _ids(llm.generate(PROMPTS, params)) == refs
    longer = [PROMPTS[0] + refs[0][:10]] * 2                 # the second finds the first's blocks cached
    outs = llm.generate(longer, SamplingParams(max_tokens=8, temperature=0.0))
    assert outs[1].num_cached_tokens >= 16 and _ids(outs) == [refs[0][10:18]] * 2
    c = llm.engine.core
    assert c.stats["preemptions"] > 0 and c.spec.draft_tokens > 50 and c.spec.acceptance_rate == 1.0
    other = draft_llm.engine.core                                      # the mesh tests' draft: its own layout
    assert (other.drafter.pool.layout.num_layers, c.pool.layout.num_layers) == (3, 2)


def test_the_draft_pool_holds_the_targets_kv_cache_dtype(gqa):
    """An int8 KV cache: the draft's pool stores the target's format (the target as its own draft: every proposal
    stands only if both quantize alike)."""
    path, _ = gqa
    llm = LLM(path, speculative_config=_draft_spec(path, 4), kv_cache_dtype="int8", **ENGINE)
    llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0.0))
    c = llm.engine.core
    assert c.drafter.pool.layout.quant == c.pool.layout.quant and c.drafter.pool.shape == c.pool.shape
    assert c.pool.shape[-1] == c.pool.layout.head_dim + 2                   # int8 values, then the float16 scale
    assert c.spec.draft_tokens > 20 and c.spec.acceptance_rate == 1.0


def test_the_kv_budget_pays_for_both_pools():
    """A byte budget buys blocks of the target's and the draft's KV together (both pools have that many)."""
    from tp_jax.models.cache import KVLayout
    import jax
    from tp_jax.parallel.mesh import make_mesh
    from tp_jax.serving.kv_pool import block_bytes_per_device, plan_pool
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    target, draft = KVLayout(2, 2, 16, np.dtype(np.float32)), KVLayout(3, 1, 8, np.dtype(np.float32))
    both = sum(block_bytes_per_device(x, 4, (1, 1, 1)) for x in (target, draft))
    assert both == 2 * 4 * 4 * (2 * 2 * 16 + 3 * 1 * 8)                    # K and V, f32, block of 4 tokens
    from tp_jax.serving.engine_args import EngineArgs
    limits = EngineArgs(block_size=4, max_model_len=64, max_num_seqs=64, kv_cache_memory_bytes=50 * both)
    plan = lambda **kw: plan_pool(target, mesh, limits, **kw).num_blocks       # noqa: E731
    assert plan(draft_layout=draft) == 50 and plan() == 50 * both // block_bytes_per_device(target, 4, (1, 1, 1))


def test_a_draft_too_short_for_max_model_len_is_refused():
    from types import SimpleNamespace
    from tp_jax.serving.draft_model import check_draft
    target, draft = (SimpleNamespace(vocab_size=1000, max_position_embeddings=n) for n in (4096, 512))
    with pytest.raises(ValueError, match=r"the draft model reaches 512 positions, fewer than max_model_len=1024; "
                                         r"lower max_model_len"):
        check_draft(target, draft, 1024, "LLM: speculative_config")
    check_draft(target, draft, 512, "LLM: speculative_config")                   # enough: no error


def test_a_draft_of_another_vocabulary_is_refused(gqa):
    with pytest.raises(ValueError, match=r"the draft model's vocabulary \(1000 tokens\) differs from the target's"):
        LLM(None, speculative_config=_draft_spec(gqa[0]), progress=False)


# --- sampling -------------------------------------------------------------------------------------

def test_seeded_sampling_equals_plain_sampling(plain_llm, spec_llm, draft_llm):
    params = [SamplingParams(max_tokens=TOKENS, temperature=t, top_p=0.9, top_k=k, seed=s, logprobs=1)
              for t, k, s in [(1.0, 0, 1), (0.7, 50, 2), (1.3, 0, 3), (1.0, 5, 4)]]
    a = plain_llm.generate(PROMPTS, params)
    for llm in (spec_llm, draft_llm):
        drafts = llm.engine.core.spec.draft_tokens
        assert _ids(llm.generate(PROMPTS, params)) == _ids(a) and llm.engine.core.spec.draft_tokens > drafts


def _tiny_vocab_model(root: str, seed: int = 11) -> str:
    """One layer, 8 tokens, a sharp random head: a distribution worth testing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(f"{root}/vocab8_{seed}", safe_serialization=True)
    return f"{root}/vocab8_{seed}"


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_sampled_distribution_is_the_targets(root, proposer):
    """Every prompt token occurs once, so after any first token t1 the n-gram proposer drafts what followed
    t1 in the prompt; a draft model (another random vocab-8 model) drafts its argmax after prompt + t1. The
    second token t2 goes through verification. Over N seeded requests the joint frequency of (t1, t2) must
    be within total variation 0.08 of transformers' p(t1) p(t2 | t1) (sampling noise at N = 3000 over 64
    cells: about 0.05). A sampler that accepted every draft puts t2 = draft(t1) and is far outside the
    bound (checked below from the same p)."""
    import torch
    from transformers import AutoModelForCausalLM
    path, prompt, n = _tiny_vocab_model(root), [3, 1, 4, 0, 5, 2, 6, 7], 3000

    def next_probs(model_path):                                                 # [t1, t2 | prompt + t1]
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        with torch.no_grad():
            return (torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1).numpy(),
                    np.stack([torch.softmax(hf(torch.tensor([prompt + [t]])).logits[0, -1], -1).numpy()
                              for t in range(8)]))
    p1, p2 = next_probs(path)
    target = p1[:, None] * p2                                                   # [t1, t2]
    if proposer == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 1}
        draft = {t: prompt[prompt.index(t) + 1] if prompt.index(t) + 1 < len(prompt) else None for t in range(8)}
    else:
        other = _tiny_vocab_model(root, seed=12)
        spec = _draft_spec(other, 2)
        draft = dict(enumerate(next_probs(other)[1].argmax(-1).tolist()))
    llm = LLM(path, speculative_config={**spec, "disable_by_batch_size": n}, progress=False)
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=1.0, seed=s) for s in range(n)])
    joint = np.zeros((8, 8))
    for o in outs:
        t1, t2 = o.outputs[0].token_ids[:2]
        joint[t1, t2] += 1 / n
    assert llm.engine.core.spec.draft_tokens >= n          # every t2 was verified (a prompt cut 1 short: 2 drafts)
    tv = 0.5 * np.abs(joint - target).sum()
    assert tv < 0.08, tv
    accept_all = np.zeros((8, 8))
    for t1 in range(8):
        if draft[t1] is not None:
            accept_all[t1, draft[t1]] = p1[t1]
        else:
            accept_all[t1] = p1[t1] * p2[t1]
    assert 0.5 * np.abs(accept_all - target).sum() > 0.3                        # the test tells them apart


# --- stops inside an accepted run, constraints, metrics ----------------------------------------------

@pytest.fixture(scope="module")
def tokenized(root, smollm2_path):
    return make_tokenized_checkpoint(root, smollm2_path)


@pytest.fixture(scope="module")
def looping(root, gqa, smollm2_path):
    """The tiny gqa model (its greedy text falls into loops that proposals predict) with SmolLM2's tokenizer."""
    import shutil
    from tp_jax.serving.tokenizer import load_tokenizer
    path = f"{root}/gqa_tokenizer"
    shutil.copytree(gqa[0], path)
    load_tokenizer(smollm2_path).save_pretrained(path)
    return path


def test_stops_and_max_tokens_inside_an_accepted_run(looping):
    plain, spec = LLM(looping, progress=False), LLM(looping, speculative_config=SPEC, progress=False)
    prompt = PROMPTS[0]
    base = plain.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert spec.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].outputs[0] \
        .token_ids == base.token_ids
    assert spec.engine.core.spec.accepted_tokens > 0
    text, sid = base.text, base.token_ids[7]
    cases = [dict(max_tokens=m) for m in range(1, 12)] + [dict(stop_token_ids=[sid]), dict(stop=[text[9:12]]),
                                                           dict(stop=[text[9:12]], include_stop_str_in_output=True)]
    for kw in cases:
        p = SamplingParams(**{"max_tokens": 30, **kw}, temperature=0.0, ignore_eos=True, logprobs=1)
        a, b = plain.generate([prompt], p)[0].outputs[0], spec.generate([prompt], p)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.stop_reason), kw
        assert len(b.logprobs) == len(b.token_ids)
    spec.engine.core.eos = plain.engine.core.eos = frozenset({base.token_ids[6]})    # an EOS inside the run
    p = SamplingParams(max_tokens=30, temperature=0.0)
    assert _ids(spec.generate([prompt], p)) == _ids(plain.generate([prompt], p))
    events = list(spec.generate_stream([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    assert [e.token_id for e in events] == base.token_ids and "".join(e.text for e in events) == text
    out = spec.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    m = out.metrics
    assert m.spec_draft_tokens >= m.spec_accepted_tokens > 0 and m.spec_mean_accepted_length > 1
    from prometheus_client import CollectorRegistry, generate_latest
    from tp_jax.server.metrics import _EngineCollector, engine_snapshot
    collector, registry = _EngineCollector(), CollectorRegistry()
    registry.register(collector)
    collector.snapshot = engine_snapshot(spec.engine)
    text = generate_latest(registry).decode()
    c = spec.engine.core.spec
    assert f"tp_jax:spec_decode_num_accepted_tokens_total {float(c.accepted_tokens)}" in text
    assert f"tp_jax:spec_decode_num_draft_tokens_total {float(c.draft_tokens)}" in text
    assert f'tp_jax:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {float(c.accepted_per_pos[0])}' \
        in text
    from tp_jax.serving.stats import GenerationStats
    assert f"mean accepted length {c.mean_accepted_length:.2f}" in GenerationStats(spec=c).line()


def test_json_schema_outputs_equal_and_validate(tokenized):
    import jsonschema
    from tp_jax.serving.structured import StructuredOutputsParams
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["aa", "bb", "cc"]},
                                                        "maxItems": 6}},
              "required": ["name", "tags"], "additionalProperties": False}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    prompts = ["List tags: aa bb cc aa bb", "name tags tags tags", "{\"name\": \"x\", \"tags\": [\"aa\", \"aa\""]
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=so)
    a = LLM(tokenized, progress=False).generate(prompts, params)
    # the model as its own draft: unconstrained, its proposals leave the grammar and are cut there
    for config in (SPEC, _draft_spec(tokenized, 4)):
        spec = LLM(tokenized, speculative_config=config, progress=False)
        b = spec.generate(prompts, params)
        assert _ids(a) == _ids(b)
        for o in b:
            jsonschema.validate(json.loads(o.outputs[0].text), schema)
        assert spec.engine.core.spec.accepted_tokens > 0


def test_disable_by_batch_size_and_penalties_turn_proposals_off(gqa):
    """Proposals only while at most disable_by_batch_size requests run (named, or on CPU 4: the resolve
    step's rule), never for a penalized request."""
    from tp_jax.serving.resolve import CPU_SPEC_BATCH
    path, refs = gqa
    auto = LLM(path, speculative_config=SPEC, progress=False)
    assert auto.engine.core.config.speculative_config.disable_by_batch_size == CPU_SPEC_BATCH
    assert f'"disable_by_batch_size": {CPU_SPEC_BATCH}' in auto.setup.summary()          # said, with its reason
    off = LLM(path, speculative_config={**SPEC, "disable_by_batch_size": 2}, progress=False)
    outs = off.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0.0))
    assert _ids(outs) == refs
    drafts = off.engine.core.spec.draft_tokens                   # only while fewer than 2 requests ran
    off.generate(PROMPTS[:1], SamplingParams(max_tokens=TOKENS, temperature=0.0, repetition_penalty=1.2))
    assert off.engine.core.spec.draft_tokens == drafts            # a penalized request is not speculated
    assert math.isclose(off.engine.core.spec.acceptance_rate,
                        off.engine.core.spec.accepted_tokens / max(drafts, 1))
