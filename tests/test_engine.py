"""Generation: cached decode == uncached forward, greedy == transformers at every tp, batching,
compaction, stop conditions, streaming, seeds and bad input."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.tiny_models import hf_greedy, make_checkpoint, make_tokenized_checkpoint
from tp_jax.serving.kv_cache import cache_shape, new_cache
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = [[5, 17, 300, 42, 9], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 200, 300], [999, 3]]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def hf_refs(root):
    out = {}
    for name in ("gqa", "h9kv3", "tied", "bias"):
        path = make_checkpoint(name, root)
        out[name] = (path, [hf_greedy(path, p, 12) for p in PROMPTS])
    return out


@pytest.fixture(scope="module")
def tokenized(root, smollm2_path):
    return make_tokenized_checkpoint(root, smollm2_path)


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2)], ids=str)
@pytest.mark.parametrize("name", ["gqa", "h9kv3", "tied", "bias"])
def test_greedy_equals_transformers(hf_refs, name, tp, dp):
    path, refs = hf_refs[name]
    llm = LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, progress=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    alone = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids          # same as in the batch
    assert alone == refs[1]


@pytest.mark.parametrize("tp", [1, 4, 8])
def test_cached_decode_equals_uncached_forward(hf_refs, tp):
    """Every step's logits from prefill + cached decode == the full forward of the whole sequence."""
    path, _ = hf_refs["h9kv3"]
    llm = LLM(path, tensor_parallel_size=tp, progress=False)
    eng = llm.engine
    lengths = np.array([len(p) for p in PROMPTS[:2]], np.int32)
    ids = np.zeros((2, 16), np.int32)
    for i, p in enumerate(PROMPTS[:2]):
        ids[i, :len(p)] = p
    cache = new_cache(cache_shape(llm.config, tp, 2, 64, np.float32), llm.mesh)
    pos = np.broadcast_to(np.arange(16, dtype=np.int32), ids.shape)
    logits, cache = jax.jit(eng.prefill_logits)(eng.state, ids, pos, lengths, cache)
    seqs, steps = [list(p) for p in PROMPTS[:2]], [[], []]
    decode = jax.jit(eng.decode_logits)
    for _ in range(8):
        for i, s in enumerate(seqs):
            steps[i].append(np.asarray(logits[i]))
            s.append(int(np.argmax(logits[i])))
        tokens = np.array([s[-1] for s in seqs], np.int32)
        positions = np.array([len(s) - 1 for s in seqs], np.int32)
        logits, cache = decode(eng.state, tokens, positions, cache)
    for i, s in enumerate(seqs):                 # causal: position t of the full forward is step t
        full = llm.get_logits([s[:-1]])[0, lengths[i] - 1:]
        worst = float(np.abs(np.stack(steps[i]) - full).max())
        assert worst <= 1e-4, worst


def test_finished_sequences_are_compacted_away(hf_refs):
    path, refs = hf_refs["gqa"]
    llm = LLM(path, tensor_parallel_size=2, progress=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (2, 12, 3)] + [
        SamplingParams(max_tokens=1, temperature=0.0)]
    outs = llm.generate(PROMPTS + [PROMPTS[0]], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 12, 3, 1]
    assert outs[1].outputs[0].token_ids == refs[1]
    assert outs[0].outputs[0].token_ids == refs[0][:2]
    assert llm.engine.stats["compactions"] >= 1


def test_logprobs_match_forward(hf_refs):
    path, refs = hf_refs["gqa"]
    llm = LLM(path, tensor_parallel_size=2, progress=False)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))[0].outputs[0]
    full = llm.get_logits([PROMPTS[0] + out.token_ids[:-1]])[0, len(PROMPTS[0]) - 1:]
    ref = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    for t, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp[tok] == pytest.approx(ref[t, tok], abs=1e-4)
        top3 = np.argsort(-ref[t])[:3]
        assert set(top3) <= set(lp)
    assert out.cumulative_logprob == pytest.approx(sum(ref[t, k] for t, k in enumerate(out.token_ids)), abs=1e-3)


def test_seeded_sampling_is_repeatable(hf_refs):
    path, _ = hf_refs["gqa"]
    llm = LLM(path, tensor_parallel_size=2, progress=False)
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=123)
    a = llm.generate(PROMPTS, p)
    b = llm.generate(PROMPTS, p)
    c = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=124))
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_stop_strings_stop_ids_and_streaming(tokenized):
    llm = LLM(tokenized, tensor_parallel_size=2, progress=False)
    base = llm.generate("Hello there", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(base.token_ids) == 20 and base.finish_reason == "length" and len(text) > 10
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = llm.generate("Hello there", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     stop=[stop]))[0].outputs[0]
    assert out.text == text[:text.find(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    keep = llm.generate("Hello there", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True))[0].outputs[0]
    assert keep.text == text[:text.find(stop) + len(stop)]
    sid = base.token_ids[5]
    out = llm.generate("Hello there", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[sid]))[0].outputs[0]
    first = base.token_ids.index(sid)
    assert out.token_ids == base.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", sid)
    events = list(llm.generate_stream("Hello there", SamplingParams(max_tokens=20, temperature=0.0,
                                                                    ignore_eos=True)))
    assert [e.token_id for e in events] == base.token_ids
    assert "".join(e.text for e in events) == text
    assert events[-1].finished and events[-1].finish_reason == "length"


def test_eos_ends_generation(tokenized):
    llm = LLM(tokenized, progress=False)
    base = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0]
    llm.engine.eos = (base.token_ids[2],)                 # pretend the model's EOS is the third token
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(base.token_ids[2]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None


# --- bad input --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(hf_refs):
    return LLM(hf_refs["gqa"][0], max_model_len=32, max_num_seqs=4, progress=False)


@pytest.mark.parametrize("prompts,msg", [
    ([[]], r"prompt 0 is empty"),
    ([""], r"prompt 0 is an empty string"),
    ([list(range(40))], r"prompt 0 has 40 tokens, but max_model_len=32"),
    ([[1]] * 5, r"5 prompts exceed max_num_seqs=4"),
    ([[1, 5000]], r"outside \[0, 1000\)"),
    ([], r"no prompts given"),
])
def test_bad_prompts(small, prompts, msg):
    with pytest.raises(ValueError, match=msg):
        small.generate(prompts, GREEDY)


def test_bad_sampling_values():
    with pytest.raises(ValueError, match=r"max_tokens=0 must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"temperature=-1"):
        SamplingParams(temperature=-1)


def test_generation_stops_at_max_model_len(small):
    out = small.generate([list(range(1, 29))], SamplingParams(max_tokens=100, temperature=0.0))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def run_script(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "scripts/generate.py", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_script_tp_that_does_not_fit(hf_refs):
    r = run_script("--model", hf_refs["gqa"][0], "--simulate-devices", "4", "--tp", "8")
    assert r.returncode != 0
    assert "= 8 devices, but only 4 cpu device(s)" in r.stderr
    assert "Traceback" not in r.stderr


def test_script_end_to_end_tp8(tokenized):
    import json
    from transformers import AutoTokenizer
    r = run_script("--model", tokenized, "--simulate-devices", "8", "--tp", "8", "--prompt", "Hello there",
                   "--max-tokens", "10", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ids = AutoTokenizer.from_pretrained(tokenized)("Hello there").input_ids
    assert out["token_ids"] == hf_greedy(tokenized, ids, 10)
    assert "decode" in r.stderr and "time to first token" in r.stderr
