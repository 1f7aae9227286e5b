"""tp_jax/parallel/invariant.py: a row's result is bit for bit the same whatever rows share the call, and the
plain XLA:CPU operations they replace are not (so the building blocks are needed, and a test of the engine's
batch invariance can fail)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tp_jax.parallel.invariant import ROW_TILE, consistent_jit, row_log_softmax, row_mean, row_softmax, row_sum, row_tiled

ROWS = (1, 2, 3, 8, 24, 32, 48, 64, 96, 256)


def row_results(f, width: int, rows=ROWS):
    """f's output for one probe row placed first, middle and last among `rows` random rows."""
    rng = np.random.default_rng(0)
    probe = rng.standard_normal(width).astype(np.float32)
    out = []
    for m in rows:
        for p in sorted({0, m // 2, m - 1}):
            x = rng.standard_normal((m, width)).astype(np.float32)
            x[p] = probe
            out.append(((m, p), np.asarray(f(jnp.asarray(x)))[p]))
    return out


def differing(results) -> list:
    return [where for where, y in results if not np.array_equal(y, results[0][1])]


@pytest.mark.parametrize("width", [576, 1000, 2880])
def test_row_mean_is_invariant_and_close_to_the_mean(width):
    f = jax.jit(lambda x: x * jax.lax.rsqrt(row_mean(x * x, keepdims=True) + 1e-5))
    assert differing(row_results(f, width)) == []
    x = np.random.default_rng(1).standard_normal((5, width)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(row_sum(jnp.asarray(x))), x.astype(np.float64).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("width", [8, 1000, 49152])
def test_row_softmax_and_log_softmax_are_invariant_and_equal_jax_nn(width):
    """The sampler's logprobs and the MoE router's weights (inside the engine's program, jax.nn.log_softmax moved a
    logprob's last bit with the step's rows: tests/test_batch_invariance.py)."""
    for ours, theirs in [(row_softmax, jax.nn.softmax), (row_log_softmax, jax.nn.log_softmax)]:
        f = consistent_jit(lambda x: ours(4 * x))
        assert differing(row_results(f, width)) == []
        x = 4 * np.random.default_rng(5).standard_normal((3, width)).astype(np.float32)
        x[0, : width // 2] = -np.inf                                                   # masked entries
        np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), np.asarray(theirs(jnp.asarray(x))),
                                   rtol=1e-6, atol=1e-6)


def test_row_tiled_float32_dot_is_invariant():
    w = jnp.asarray(np.random.default_rng(2).standard_normal((576, 1536)).astype(np.float32))
    f = jax.jit(lambda x: row_tiled(lambda a: a @ w, x))
    assert differing(row_results(f, 576)) == []
    x = np.random.default_rng(3).standard_normal((ROW_TILE * 2 + 5, 576)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(x))), x @ np.asarray(w), rtol=2e-4, atol=2e-4)


def test_bf16_dots_are_invariant_as_they_are():
    w = jnp.asarray(np.random.default_rng(4).standard_normal((576, 1536)), jnp.bfloat16)
    f = consistent_jit(lambda x: row_tiled(lambda a: jnp.einsum("md,df->mf", a.astype(jnp.bfloat16), w,  # as the
                                                                preferred_element_type=jnp.float32), x))  # engine
    assert differing(row_results(f, 576)) == []


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernel choice by shape")
def test_the_plain_operations_are_not_invariant_on_this_cpu():
    """What the building blocks are for: XLA:CPU's own mean and float32 dot give a row other bits beside other
    rows (if a future XLA makes them invariant, this test says the building blocks can go)."""
    w = jnp.asarray(np.random.default_rng(2).standard_normal((576, 1536)).astype(np.float32))
    mean = differing(row_results(jax.jit(lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True))), 576))
    dot = differing(row_results(jax.jit(lambda x: x @ w), 576))
    assert mean or dot
