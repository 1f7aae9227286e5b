"""Sampling: params validation, repeatable per-row draws, filters, penalties, logprobs == numpy."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tp_jax.serving.sampling import SamplingParams, SamplingTensors, apply_penalties, process_logits, sample

F32_MIN = np.finfo(np.float32).min
DRAWS = 2000


def tensors(*params, vocab=16, **kw):
    return SamplingTensors.from_params(list(params), vocab, **kw)


def draws(logits, t, n=DRAWS, step_fn=lambda s, b: s):
    """tokens[n, B]: `sample` at steps step_fn(0..n-1, B), vmapped."""
    b = logits.shape[0]
    return np.asarray(jax.vmap(lambda s: sample(logits, t, step_fn(s, b))[0])(jnp.arange(n)))


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# --- SamplingParams ---------------------------------------------------------------------

BAD = [
    (dict(n=0), "n=0 must be >= 1"),
    (dict(n=1.5), "n=1.5 must be an int"),
    (dict(max_tokens=0), "max_tokens=0 generates nothing; it is allowed only with prompt_logprobs"),
    (dict(max_tokens=-1), "max_tokens=-1 must be >= 1"),
    (dict(prompt_logprobs=-1), "prompt_logprobs=-1 must be >= 0"),
    (dict(prompt_logprobs=2.0), "prompt_logprobs=2.0 must be an int"),
    (dict(max_tokens=1.5), "max_tokens=1.5 must be an int"),
    (dict(temperature=-1), "temperature=-1 must be >= 0"),
    (dict(temperature=float("nan")), "temperature=nan must be a finite number"),
    (dict(temperature=float("inf")), "temperature=inf must be a finite number"),
    (dict(temperature="hot"), "temperature='hot' must be a finite number"),
    (dict(temperature=True), "temperature=True must be a finite number"),
    (dict(top_p=0), "top_p=0 must be in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
    (dict(top_k=-2), "top_k=-2 must be >= -1"),
    (dict(top_k=2.5), "top_k=2.5 must be an int"),
    (dict(min_p=-0.1), "min_p=-0.1 must be in [0, 1]"),
    (dict(min_p=1.5), "min_p=1.5 must be in [0, 1]"),
    (dict(repetition_penalty=0), "repetition_penalty=0 must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty=-1.0 must be > 0"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5 must be in [-2, 2]"),
    (dict(presence_penalty=-3), "presence_penalty=-3 must be in [-2, 2]"),
    (dict(frequency_penalty=-2.1), "frequency_penalty=-2.1 must be in [-2, 2]"),
    (dict(seed=1.5), "seed=1.5 must be an int"),
    (dict(seed="7"), "seed='7' must be an int"),
    (dict(logprobs=-1), "logprobs=-1 must be >= 0"),
    (dict(stop=""), "stop[0]='' must be a non-empty string"),
    (dict(stop=["a", ""]), "stop[1]='' must be a non-empty string"),
    (dict(stop=["a", 3]), "stop[1]=3 must be a non-empty string"),
    (dict(stop=5), "stop=5 must be a string or a list of strings"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids[1]=-1 must be >= 0"),
    (dict(stop_token_ids=["a"]), "stop_token_ids[0]='a' must be an int"),
    (dict(stop_token_ids=3), "stop_token_ids=3 must be a list of ints"),
    (dict(ignore_eos="yes"), "ignore_eos='yes' must be a bool"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output=1 must be a bool"),
]


@pytest.mark.parametrize("kw, message", BAD, ids=[m for _, m in BAD])
def test_invalid_params_raise(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kw)


def test_params_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0.0)
    assert (p.stop, p.stop_token_ids, p.seed, p.logprobs, p.greedy) == ((), (), None, None, False)
    q = SamplingParams(stop="###", stop_token_ids=[np.int64(2), 7], top_k=-1, temperature=0,
                       seed=np.int32(3), max_tokens=None, logprobs=0)
    assert q.stop == ("###",) and q.stop_token_ids == (2, 7) and type(q.stop_token_ids[0]) is int
    assert q.greedy and q.seed == 3 and SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert hash(q) == hash(dataclasses.replace(q))           # frozen, tuples: hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.top_p = 0.5


def test_tensors_pack_rows():
    t = tensors(SamplingParams(top_k=-1), SamplingParams(top_k=5, temperature=0.5),
                SamplingParams(top_k=99, repetition_penalty=1.2, seed=2**40 + 1), vocab=16)
    np.testing.assert_array_equal(t.top_k, [0, 5, 0])        # -1 and k >= V are both "off"
    np.testing.assert_allclose(t.temperature, [1, 0.5, 1])
    np.testing.assert_allclose(t.repetition_penalty, [1, 1, 1.2])
    assert t.top_k.dtype == jnp.int32 and t.top_p.dtype == jnp.float32 and t.keys.shape == (3,)


# --- keys: repeatable, seed-dependent, batch-independent -------------------------------------

def flat_logits(b, v=16):
    return jnp.zeros((b, v), jnp.float32)


def test_fixed_seed_repeats_and_seeds_differ():
    logits = flat_logits(1)
    run = lambda **kw: draws(logits, tensors(SamplingParams(**kw)), n=64)[:, 0]
    np.testing.assert_array_equal(run(seed=5), run(seed=5))
    assert (run(seed=5) != run(seed=6)).any()
    assert (run(seed=5) != run(seed=5 + 2**32)).any()         # all 64 bits of the seed count
    assert len(set(run(seed=5).tolist())) > 8                  # steps give fresh draws
    unseeded = lambda **kw: draws(logits, tensors(SamplingParams(), **kw), n=64)[:, 0]
    np.testing.assert_array_equal(unseeded(engine_seed=1), unseeded(engine_seed=1))
    assert (unseeded(engine_seed=1) != unseeded(engine_seed=2)).any()


def test_row_draws_do_not_depend_on_the_batch():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    me = SamplingParams(seed=11, top_p=0.9, temperature=0.7)
    others = [SamplingParams(top_k=3), SamplingParams(temperature=0), SamplingParams(min_p=0.2, seed=1)]
    alone = draws(logits[2:3], tensors(me, vocab=32), n=200)[:, 0]
    batch = tensors(others[0], others[1], me, others[2], vocab=32)
    steps = lambda s, b: jnp.stack([s + 7, 3 * s, s, s + 1])  # other rows at other positions
    np.testing.assert_array_equal(draws(logits, batch, n=200, step_fn=steps)[:, 2], alone)


def test_unseeded_rows_follow_their_seq_id():
    logits = flat_logits(3)
    p = SamplingParams()
    a = draws(logits, tensors(p, p, p, seq_ids=[10, 11, 12]), n=64)
    b = draws(logits, tensors(p, p, p, seq_ids=[12, 10, 11]), n=64)
    np.testing.assert_array_equal(a[:, 0], b[:, 1])
    np.testing.assert_array_equal(a[:, 2], b[:, 0])
    assert (a[:, 0] != a[:, 1]).any()


# --- filters: exactly the allowed set, at the renormalized frequencies -----------------------

BASE_P = np.array([.25, .18, .14, .11, .09, .07, .06, .05, .03, .02])
PERM = np.random.default_rng(1).permutation(10)              # crafted probs at shuffled ids
FILTER_ROWS = [
    dict(),
    dict(top_k=3),
    dict(top_p=0.6),
    dict(min_p=0.3),
    dict(top_k=5, top_p=0.7, temperature=0.8),
    dict(temperature=1.5, min_p=0.2),
    dict(top_p=0.2, top_k=-1),                                # only the top token
]


def filter_logits(v=16):
    logits = np.full(v, F32_MIN, np.float32)                   # ids >= 10: padded vocab
    logits[PERM] = np.log(BASE_P) + 3.0
    return logits


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """numpy vLLM filters: top-k, then top-p (exclusive descending cumsum < p), then min-p."""
    x = np.where(logits <= F32_MIN, -np.inf, logits.astype(np.float64) / temperature)
    order = np.argsort(-x, kind="stable")
    keep = np.isfinite(x)
    if top_k > 0:
        keep[order[top_k:]] = False
    p = softmax(np.where(keep, x, -np.inf))[order]
    keep[order[(np.cumsum(p) - p) >= top_p]] = False
    p = softmax(np.where(keep, x, -np.inf))
    keep &= p >= min_p * p.max()
    return softmax(np.where(keep, x, -np.inf))


def test_filters_keep_exactly_the_allowed_set():
    logits = np.stack([filter_logits()] * len(FILTER_ROWS))
    t = tensors(*(SamplingParams(seed=i, **kw) for i, kw in enumerate(FILTER_ROWS)))
    kept = np.isfinite(np.asarray(process_logits(jnp.where(logits <= F32_MIN, -jnp.inf, logits), t)))
    for row, kw in enumerate(FILTER_ROWS):
        np.testing.assert_array_equal(kept[row], ref_probs(logits[row], **kw) > 0, err_msg=str(kw))


def test_sampled_frequencies_match_renormalized_probs():
    logits = jnp.asarray(np.stack([filter_logits()] * len(FILTER_ROWS)))
    t = tensors(*(SamplingParams(seed=i, **kw) for i, kw in enumerate(FILTER_ROWS)))
    tokens = draws(logits, t)                                  # [DRAWS, B]
    for row, kw in enumerate(FILTER_ROWS):
        p = ref_probs(np.asarray(logits[row]), **kw)
        assert set(tokens[:, row].tolist()) == set(np.flatnonzero(p > 0).tolist()), kw
        freq = np.bincount(tokens[:, row], minlength=p.size) / DRAWS
        bound = 5 * np.sqrt(p * (1 - p) / DRAWS) + 0.005      # > 5 sigma per token
        assert (np.abs(freq - p) <= bound).all(), (kw, freq.round(3), p.round(3))


def test_draws_are_jax_categoricals():
    """A row draws jax.random.categorical(fold_in(key, step), processed logits): seeded outputs are kept."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 2048)).astype(np.float32) * 3
    logits[:, 2000:] = F32_MIN                                 # padded vocab
    t = tensors(*(SamplingParams(seed=i, **kw) for i, kw in enumerate(
        [dict(), dict(top_k=50, temperature=0.7), dict(top_p=0.8), dict(min_p=0.05, temperature=1.3)])), vocab=2048)
    x = process_logits(jnp.where(logits <= F32_MIN, -jnp.inf, logits), t)
    for step in range(5):
        keys = jax.vmap(jax.random.fold_in)(t.keys, jnp.full((4,), step))
        want = jax.vmap(jax.random.categorical)(keys, x)
        np.testing.assert_array_equal(sample(jnp.asarray(logits), t, step)[0], want)


def test_ties_at_a_boundary_are_kept():
    """vLLM keeps logits >= the k-th largest (all ties) and drops only probs < min_p * max."""
    logits = jnp.asarray([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0], [3.0, 1.0, 3.0, 2.0, 0.0, 0.0]])
    t = tensors(SamplingParams(top_k=2), SamplingParams(min_p=1.0), vocab=6)
    kept = np.isfinite(np.asarray(process_logits(logits, t)))
    np.testing.assert_array_equal(kept, [[0, 1, 1, 1, 1, 0], [1, 0, 1, 0, 0, 0]])


# --- greedy -------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1e-6, 1e-4])
def test_tiny_temperature_is_argmax(temperature):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, 64)).astype(np.float32)
    logits[:, 50:] = F32_MIN                                   # padded vocab
    top = logits.argmax(-1)
    logits[np.arange(4), top] += 1.0                           # a clear winner, for 1e-4
    rows = [dict(), dict(top_k=3), dict(top_p=0.5, seed=3), dict(min_p=0.5)]
    t = tensors(*(SamplingParams(temperature=temperature, **kw) for kw in rows), vocab=64)
    np.testing.assert_array_equal(draws(jnp.asarray(logits), t, n=50), np.tile(top, (50, 1)))


def test_argmax_equals_numpy():
    from tp_jax.serving.sampling import argmax
    nan, inf = np.nan, np.inf
    edge = np.array([[1, 3, 3, 2], [nan, 1, nan, 5], [2, nan, 9, 9], [-inf] * 4, [0.0, -0.0, 0.0, -1],
                     [-0.0, 0.0, 0.0, 0.0], [F32_MIN, F32_MIN, -inf, F32_MIN], [-inf, -inf, inf, inf]], np.float32)
    vocab = np.random.default_rng(7).standard_normal((5, 49152)).astype(np.float32)
    vocab[1, [17, 40000]] = 9.0                                # a tie between two far-apart ids
    for x in (edge, vocab):
        got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, x.argmax(-1))


def test_greedy_fast_path_equals_sample():
    from tp_jax.serving.sampling import greedy, sample
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 64)).astype(np.float32)
    logits[:, 60:] = F32_MIN
    logits[1, 61] = F32_MIN                                    # padded ids never win
    t = tensors(*(SamplingParams(temperature=0.0) for _ in range(3)), vocab=64)
    tok_a, lp_a = greedy(jnp.asarray(logits), num_logprobs=4)
    tok_b, lp_b = sample(jnp.asarray(logits), t, 0, num_logprobs=4)
    np.testing.assert_array_equal(tok_a, logits.argmax(-1))
    np.testing.assert_array_equal(tok_a, tok_b)
    for a, b in zip(lp_a, lp_b):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# --- penalties ------------------------------------------------------------------------------

def ref_penalties(logits, prompt_mask, counts, rep, pres, freq):
    out = logits.astype(np.float64).copy()
    for b, v in np.ndindex(*logits.shape):
        if prompt_mask[b, v] or counts[b, v] > 0:
            out[b, v] = out[b, v] / rep[b] if out[b, v] > 0 else out[b, v] * rep[b]
        out[b, v] -= freq[b] * counts[b, v] + pres[b] * (counts[b, v] > 0)
    return out


def penalty_case(b=4, v=24, seed=3):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((b, v))).astype(np.float32)
    prompt_mask = rng.random((b, v)) < 0.3
    counts = np.where(rng.random((b, v)) < 0.3, rng.integers(1, 5, (b, v)), 0).astype(np.int32)
    params = [SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f)
              for r, p, f in [(1.3, 0.5, 0.2), (0.7, -1.0, 1.5), (1.0, 0.0, 0.0), (2.0, 2.0, -2.0)]]
    return logits, prompt_mask, counts, tensors(*params, vocab=v)


def test_penalties_match_numpy():
    logits, prompt_mask, counts, t = penalty_case()
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(prompt_mask), jnp.asarray(counts), t)
    want = ref_penalties(logits, prompt_mask, counts, *(np.asarray(a) for a in
                         (t.repetition_penalty, t.presence_penalty, t.frequency_penalty)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_sample_applies_penalties():
    logits = jnp.asarray([[2.0, 1.9, 0.0, -1.0]] * 3)
    t = tensors(SamplingParams(temperature=0, presence_penalty=0.5),
                SamplingParams(temperature=0, repetition_penalty=1.2),
                SamplingParams(temperature=0), vocab=4)
    counts = jnp.asarray([[1, 0, 0, 0]] * 3, jnp.int32)
    tokens, _ = sample(logits, t, 0, None, counts)
    np.testing.assert_array_equal(tokens, [1, 1, 0])           # 2 - 0.5 and 2 / 1.2 < 1.9


def test_prompt_mask_and_output_counts():
    """The penalty rows as production keeps them (tp_jax/serving/penalties.py, read by runner.py's sampler)."""
    from tp_jax.serving.penalties import Penalties, add_sampled
    from tp_jax.serving.request import Request
    pen = Penalties(num_slots=2, vocab_size=5, put=jnp.asarray)
    reqs = [Request(rid, len(p), p + out, SamplingParams(), 4, (0, 0, 0)) for rid, p, out in
            (("a", [3, 1, 3], []), ("b", [2, 2], [1]))]
    loads = [pen.assign(r) for r in reqs]
    assert pen.assign(reqs[0]) == (loads[0][0], None)                  # loaded once while it runs
    for _, load in loads:
        pen.load(*load)
    (ra, _), (rb, _) = loads
    mask, counts = (np.asarray(x) for x in pen.state)
    np.testing.assert_array_equal(mask[[ra, rb]], [[0, 1, 0, 1, 0], [0, 0, 1, 0, 0]])
    np.testing.assert_array_equal(counts[[ra, rb]], [[0, 0, 0, 0, 0], [0, 1, 0, 0, 0]])
    counts = add_sampled(pen.state[1], jnp.asarray([ra, rb]), jnp.asarray([4, 1]))
    counts = add_sampled(counts, jnp.asarray([ra, pen.scratch]), jnp.asarray([4, 2]))    # b's row: padding
    np.testing.assert_array_equal(np.asarray(counts)[[ra, rb]], [[0, 0, 0, 0, 2], [0, 2, 0, 0, 0]])
    pen.release("a")
    assert pen.assign(reqs[0])[1] is not None                          # a new row after a release


# --- logprobs and padding -------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax():
    logits, prompt_mask, counts, t = penalty_case(v=40)
    padded = np.concatenate([logits, np.full((4, 8), F32_MIN, np.float32)], axis=1)
    t = t._replace(temperature=jnp.asarray([0.5, 0.0, 1.3, 1.0]))
    tokens, lp = sample(jnp.asarray(padded), t, 3, jnp.asarray(np.pad(prompt_mask, ((0, 0), (0, 8)))),
                        jnp.asarray(np.pad(counts, ((0, 0), (0, 8)))), num_logprobs=5)
    want = log_softmax(logits)                                 # raw: no penalties, no temperature
    np.testing.assert_allclose(lp.logprob, want[np.arange(4), np.asarray(tokens)], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(lp.top_ids, np.argsort(-want, axis=-1)[:, :5])
    chosen = want[np.arange(4), np.asarray(tokens)]
    np.testing.assert_array_equal(lp.rank, (want >= chosen[:, None]).sum(-1))      # vLLM's rank: tokens at least as likely
    np.testing.assert_allclose(lp.top_logprobs, -np.sort(-want, axis=-1)[:, :5], rtol=1e-5, atol=1e-5)
    _, all_lp = sample(jnp.asarray(padded), t, 3, num_logprobs=48)
    assert np.isneginf(np.asarray(all_lp.top_logprobs)[:, 40:]).all()
    _, none = sample(jnp.asarray(padded), t, 3)
    assert none.top_ids.shape == (4, 0) and none.top_logprobs.shape == (4, 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_padded_vocab_is_never_drawn(dtype):
    v, real = 64, 5
    logits = jnp.full((4, v), jnp.finfo(dtype).min, dtype)
    logits = logits.at[:, :real].set(jnp.asarray([-90.0, -95, -100, -120, -80], dtype))
    logits = logits.at[3].set(-jnp.inf).at[3, 2].set(0.0)     # one live token in the row
    t = tensors(SamplingParams(temperature=50.0), SamplingParams(), SamplingParams(temperature=0),
                SamplingParams(temperature=2.0, top_k=-1), vocab=v)
    tokens = draws(logits, t)
    assert (tokens[:, :3] < real).all() and (tokens[:, 3] == 2).all()
    assert len(set(tokens[:, 0].tolist())) == real             # high temperature: all real ones
    _, lp = sample(logits, t, 0, num_logprobs=real + 1)
    assert np.isneginf(np.asarray(lp.top_logprobs)[:3, real]).all()
    np.testing.assert_allclose(np.asarray(lp.logprob)[3], 0.0, atol=1e-6)
