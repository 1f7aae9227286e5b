"""The MoE block's dispatches give every token the same bits (float32, CPU), so that "auto", which picks gather or
dense by the step's number of tokens, never changes a token's numbers (the numeric contract, docs/design.md):

* gather (each assignment's expert weights gathered, one matrix-vector product each) and dense (every local expert
  on every token as batched GEMMs) agree to the bit: XLA:CPU's consistent dots give a row the same sum either way,
  and both weight and add a token's k expert outputs alike, in its choice order (`_combine`);
* a token's output alone equals its output among 40 others, under "auto" (gather alone, dense beside them);

on blocks with a shared expert (Qwen2-MoE), with router / expert biases and the clamped SwiGLU (gpt-oss) and with
DeepSeek-V3's grouped sigmoid routing, in the TP layout (tp 1, 2) and with expert parallelism (dp 2 x tp 2). In
bfloat16 the two dispatches differ (the block's dots are bf16 x bf16 there): the resolve step says so.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import mesh_for
from tests.test_moe import D, build, fill, hf_block, hf_tensors
from tp_jax.parallel.invariant import consistent_jit
from tp_jax.parallel.layers.moe import Experts
from tp_jax.parallel.shard import P, shard_module

MESHES = [(1, 1, False), (1, 2, False), (2, 2, True)]          # (dp, tp, expert parallel)


def block_fn(kind: str, mesh_case, dispatch: str):
    dp, tp, ep = mesh_case
    mesh = mesh_for(dp, 1, tp)
    m, cfg = hf_block(kind)
    block = build(kind, cfg, mesh, ep, dispatch)
    fill(block, hf_tensors(m), mesh)
    return consistent_jit(shard_module(block, mesh, in_specs=(P("dp"),), out_specs=P("dp"), jit=False))


@pytest.mark.parametrize("mesh_case", MESHES, ids=[f"dp{d}tp{t}{'-ep' if e else ''}" for d, t, e in MESHES])
@pytest.mark.parametrize("kind", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_gather_and_dense_give_the_same_bits_and_auto_is_batch_invariant(kind, mesh_case):
    dp = mesh_case[0]
    x = np.random.default_rng(7).standard_normal((dp, 41, D)).astype(np.float32)
    gather = np.asarray(block_fn(kind, mesh_case, "gather")(x))
    dense = np.asarray(block_fn(kind, mesh_case, "dense")(x))
    np.testing.assert_array_equal(gather, dense)
    auto = block_fn(kind, mesh_case, "auto")
    many = np.asarray(auto(x))                                   # 41 tokens a replica: dense
    np.testing.assert_array_equal(many, gather)
    for t in (0, 17, 40):                                        # alone (a replica's one token): gather
        one = np.asarray(auto(np.ascontiguousarray(x[:, t:t + 1])))
        np.testing.assert_array_equal(one[:, 0], many[:, t])


def test_in_bfloat16_the_dispatches_differ_and_the_setup_says_so():
    """What makes the float32 equality above a property worth testing: bf16 dots give a row other bits as a
    matrix-vector product than inside a GEMM, so there the choice by the step's size shows (and an MoE run in a
    16-bit dtype on CPU is logged as not batch-invariant)."""
    from flax import nnx
    from tp_jax.serving.engine_args import EngineArgs
    from tp_jax.serving.resolve import CheckpointFacts, Platform, resolve
    with nnx.use_eager_sharding(False):
        ex = Experts(8, 64, 48, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((33, 64)), jnp.bfloat16)
    e, w = rng.integers(0, 8, (33, 2)).astype(np.int32), rng.random((33, 2)).astype(np.float32)
    run = {d: np.asarray(consistent_jit(lambda x, e, w, d=d: ex(x, e, w, d))(x, e, w)) for d in ("gather", "dense")}
    assert not np.array_equal(run["gather"], run["dense"])
    np.testing.assert_allclose(run["gather"], run["dense"], rtol=2e-2, atol=2e-2)
    facts = CheckpointFacts("safetensors", "MixtralForCausalLM", experts=True)
    for dtype, invariant in (("bfloat16", False), ("auto", True), ("float32", True)):
        setup = resolve(EngineArgs(dtype=dtype), Platform("cpu"), facts, 128)
        assert setup.batch_invariant == invariant, setup.summary()
        if not invariant:
            assert "gather and dense dispatches" in setup.not_batch_invariant
