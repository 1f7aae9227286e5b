"""Collectives over the tp and pp axes vs numpy, and what they compile to."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.hlo import count
from tp_jax.parallel import collectives as C
from tests.conftest import mesh_for


def run(mesh, fn, x, in_spec=P("tp"), out_spec=P("tp")):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(in_spec,), out_specs=out_spec, check_vma=False))
    return np.asarray(f(x)), f.lower(x).compile().as_text()



@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("strategy", ["ordered", "psum", "one_shot", "two_shot", "auto", None])
def test_all_reduce_strategies_equal_sum(tp, strategy):
    mesh = mesh_for(1, 1, tp)
    x = np.random.default_rng(tp).standard_normal((tp, 5, 7)).astype(np.float32)  # 35 % tp != 0
    y, hlo = run(mesh, lambda b: C.all_reduce(b, "tp", strategy), x)
    np.testing.assert_allclose(y, np.broadcast_to(x.sum(0, keepdims=True), x.shape), rtol=1e-5, atol=1e-5)
    if tp == 1:
        assert not re.search(r"all-reduce|all-gather|reduce-scatter", hlo)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_ordered_sums_are_rank_order_and_one_process_psums_bit_for_bit(tp, monkeypatch):
    """"ordered" (the default of a multi-process CPU run) adds in rank order, ((x_0 + x_1) + x_2) + ...; XLA:CPU's
    in-process all-reduce and reduce-scatter (a one-process run's default) give the same bits: so 2 processes x 4
    devices give what 1 process x 8 gives (tests/test_multihost.py). Values of mixed magnitudes, so that the order
    shows in the last bits."""
    mesh = mesh_for(1, 1, tp)
    rng = np.random.default_rng(tp)
    x = (rng.standard_normal((tp, 4, 2 * tp)) * 10.0 ** rng.integers(-3, 4, (tp, 4, 2 * tp))).astype(np.float32)
    fold = x[0]
    for part in x[1:]:
        fold = fold + part
    assert not np.array_equal(fold, x[::-1].sum(0, dtype=np.float32)) or tp == 2   # the order matters here
    ordered, hlo = run(mesh, lambda b: C.all_reduce(b[0], "tp", "ordered")[None], x)
    psum, _ = run(mesh, lambda b: C.all_reduce(b[0], "tp", "psum")[None], x)
    np.testing.assert_array_equal(ordered, np.broadcast_to(fold, x.shape))
    np.testing.assert_array_equal(psum, ordered)
    assert count(hlo, "all-gather") == 1 and count(hlo, "all-reduce") == 0
    one_process, _ = run(mesh, lambda b: C.reduce_scatter(b[0], "tp", dim=-1)[None], x)
    monkeypatch.setattr(C, "default_strategy", lambda: "ordered")
    many, hlo = run(mesh, lambda b: C.reduce_scatter(b[0], "tp", dim=-1)[None], x)
    np.testing.assert_array_equal(many, fold.reshape(4, tp, 2).transpose(1, 0, 2))
    np.testing.assert_array_equal(one_process, many)
    assert count(hlo, "all-to-all") == 1 and count(hlo, "reduce-scatter") == 0


def test_default_strategy_is_ordered_only_across_processes(monkeypatch):
    assert C.default_strategy() == "psum"                    # this process: 1 of 1
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert C.default_strategy() == "ordered"


def test_auto_follows_thresholds(monkeypatch):
    monkeypatch.setattr(C, "THRESHOLDS", C.AllReduceThresholds(100, 1000))
    assert [C.choose_strategy(n) for n in (100, 101, 1000, 1001)] == ["one_shot", "two_shot", "two_shot", "psum"]
    with pytest.raises(ValueError, match="one_shot_max_bytes"):
        C.set_all_reduce_thresholds(10, 5)


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy 'nccl'"):
        run(mesh_for(1, 1, 2), lambda b: C.all_reduce(b, "tp", "nccl"), np.ones((2, 3), np.float32))


def test_all_gather_and_reduce_scatter():
    mesh = mesh_for(1, 1, 4)
    x = np.arange(4 * 2 * 8, dtype=np.float32).reshape(4, 2, 8)
    g, hlo = run(mesh, lambda b: C.all_gather(b, "tp", dim=0), x, out_spec=P())
    np.testing.assert_array_equal(g, x)
    assert count(hlo, "all-gather") == 1
    rs, _ = run(mesh, lambda b: C.reduce_scatter(b[0], "tp", dim=-1)[None], x)
    np.testing.assert_array_equal(rs, x.sum(0).reshape(2, 4, 2).transpose(1, 0, 2))
    with pytest.raises(ValueError, match="does not split into 4"):
        run(mesh, lambda b: C.reduce_scatter(b[:, :, :3], "tp"), x)


@pytest.mark.parametrize("src", [0, 3])
def test_broadcast(src):
    mesh = mesh_for(1, 1, 4)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    y, _ = run(mesh, lambda b: C.broadcast(b, src, "tp"), x)
    np.testing.assert_array_equal(y, np.broadcast_to(x[src], x.shape))
    with pytest.raises(ValueError, match="src=4 is outside axis 'tp' of size 4"):
        run(mesh, lambda b: C.broadcast(b, 4, "tp"), x)


def test_send_to_next_and_prev_along_pp():
    mesh = mesh_for(1, 4, 2)
    x = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) + 1
    nxt, hlo = run(mesh, lambda b: C.send_to_next(b), x, P("pp"), P("pp"))
    np.testing.assert_array_equal(nxt, np.concatenate([np.zeros((1, 3)), x[:-1]]))
    assert count(hlo, "collective-permute") == 1
    prv, _ = run(mesh, lambda b: C.send_to_prev(b), x, P("pp"), P("pp"))
    np.testing.assert_array_equal(prv, np.concatenate([x[1:], np.zeros((1, 3))]))


def test_size_one_axis_emits_nothing():
    mesh = mesh_for(1, 1, 1)
    x = np.ones((1, 4), np.float32)
    for fn in (C.all_gather, C.reduce_scatter, C.send_to_next, C.send_to_prev,
               lambda b: C.broadcast(b, 0), lambda b: C.all_reduce(b, "tp", "two_shot")):
        y, hlo = run(mesh, fn, x)
        np.testing.assert_array_equal(y, x)
        assert not re.search(r"all-reduce\(|all-gather\(|reduce-scatter\(|collective-permute\(", hlo)
