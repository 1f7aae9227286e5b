"""The head plan: exact attention for any (num_heads, num_kv_heads, tp)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tp_jax.parallel.heads import plan_heads


def check_plan(heads, kv, tp):
    plan = plan_heads(heads, kv, tp)
    q, k = plan.q_heads, plan.kv_heads
    assert q.shape == (tp, plan.q_local) and k.shape == (tp, plan.kv_local)
    assert plan.q_local % plan.kv_local == 0
    real_q = np.sort(q[q >= 0])
    np.testing.assert_array_equal(real_q, np.arange(heads))          # every query head exactly once
    assert set(k[k >= 0].tolist()) == set(range(kv))                  # every KV head somewhere
    group = heads // kv
    for r in range(tp):                                               # no rank lacks a KV head it needs
        for s, h in enumerate(q[r]):
            if h >= 0:
                assert k[r, s // plan.group_local] == h // group, (r, s, h)
    return plan


def attention_sharded(plan, qs, ks, vs):
    """Per-rank GQA on the plan's slots (zeros for padding), summed like o_proj's all-reduce."""
    out = np.zeros((plan.num_heads,) + qs.shape[1:])
    for r in range(plan.tp):
        for s, h in enumerate(plan.q_heads[r]):
            kvh = plan.kv_heads[r, s // plan.group_local]
            q = qs[h] if h >= 0 else np.zeros_like(qs[0])
            k = ks[kvh] if kvh >= 0 else np.zeros_like(ks[0])
            v = vs[kvh] if kvh >= 0 else np.zeros_like(vs[0])
            w = np.exp(q @ k.T)
            o = (w / w.sum(-1, keepdims=True)) @ v
            if h >= 0:            # o_proj rows of padded slots are zero
                out[h] += o
    return out


@settings(max_examples=300, deadline=None)
@given(kv=st.integers(1, 16), group=st.integers(1, 8), tp=st.integers(1, 16))
def test_plan_is_exact(kv, group, tp):
    heads = kv * group
    plan = check_plan(heads, kv, tp)
    rng = np.random.default_rng(heads * 100 + tp)
    qs, ks, vs = rng.standard_normal((3, max(heads, kv), 3, 2))
    ref = np.stack([(lambda w: (w / w.sum(-1, keepdims=True)) @ vs[h // group])(np.exp(qs[h] @ ks[h // group].T))
                    for h in range(heads)])
    np.testing.assert_allclose(attention_sharded(plan, qs, ks, vs), ref, rtol=1e-12)


@pytest.mark.parametrize("tp,q_local,kv_local,q_pad,kv_pad", [
    (1, 9, 3, 9, 3), (2, 6, 2, 12, 4), (3, 3, 1, 9, 3), (4, 3, 1, 12, 4), (8, 2, 1, 16, 8)])
def test_smollm2_heads(tp, q_local, kv_local, q_pad, kv_pad):
    plan = check_plan(9, 3, tp)
    assert (plan.q_local, plan.kv_local, plan.padded_q_heads, plan.padded_kv_heads) == \
        (q_local, kv_local, q_pad, kv_pad)
    assert plan.q_overhead() == pytest.approx(q_pad / 9 - 1)
    assert "9q/3kv" in plan.describe()


def test_vllm_layout_when_tp_divides():
    plan = plan_heads(32, 8, 16)                      # vLLM: kv_rank = tp_rank // replicas
    np.testing.assert_array_equal(plan.kv_heads[:, 0], np.arange(16) // 2)
    assert plan.kv_replicas == 2 and plan.q_overhead() == 0
    plan = plan_heads(32, 8, 4)
    assert plan.kv_local == 2 and plan.q_local == 8 and plan.kv_overhead() == 0


@pytest.mark.parametrize("args,msg", [((10, 4, 2), "num_heads=10 is not a multiple of num_kv_heads=4"),
                                      ((8, 0, 2), "num_kv_heads=0"), ((8, 2, 0), "tp=0")])
def test_bad_input(args, msg):
    with pytest.raises(ValueError, match=msg):
        plan_heads(*args)
