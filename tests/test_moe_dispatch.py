"""The MoE block's "auto" dispatch under the numeric contract (docs/design.md; the engine-level check is
tests/test_batch_invariance_models.py): on CPU it is "gather" for every step, whatever its size, gathered in tiles of a
fixed number of assignments; every dispatch computes the same block (Qwen2-MoE's shared expert, gpt-oss's biases and
clamped SwiGLU, DeepSeek-V3's grouped sigmoid routing; TP layout at tp 1 and 2, expert parallelism at dp 2 x tp 2).

"auto" once chose gather for a step of at most E_local / k assignments and dense above: the two give a token other
bits, so a decode row's logprobs moved with the number of rows beside it (5 of the 8 engine-level cases failed).
"""

import numpy as np
import pytest

from tests.conftest import mesh_for
from tests.test_moe import ATOL, D, build, fill, hf_block, hf_tensors
from tp_jax.parallel.invariant import consistent_jit
from tp_jax.parallel.layers import moe
from tp_jax.parallel.shard import P, shard_module

MESHES = [(1, 1, False), (1, 2, False), (2, 2, True)]          # (dp, tp, expert parallel)


def block_fn(kind: str, mesh_case, dispatch: str):
    """The block compiled as the engine compiles its steps (`consistent_jit`), x[dp, M, D] -> [dp, M, D]."""
    dp, tp, ep = mesh_case
    mesh = mesh_for(dp, 1, tp)
    m, cfg = hf_block(kind)
    block = build(kind, cfg, mesh, ep, dispatch)
    fill(block, hf_tensors(m), mesh)
    return consistent_jit(shard_module(block, mesh, in_specs=(P("dp"),), out_specs=P("dp"), jit=False)), block


@pytest.mark.parametrize("mesh_case", MESHES, ids=[f"dp{d}tp{t}{'-ep' if e else ''}" for d, t, e in MESHES])
@pytest.mark.parametrize("kind", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_auto_is_gather_at_every_size_and_its_tiles_change_nothing(kind, mesh_case, monkeypatch):
    dp = mesh_case[0]
    x = np.random.default_rng(7).standard_normal((dp, 41, D)).astype(np.float32)
    one = np.ascontiguousarray(x[:, :1])
    gather, block = block_fn(kind, mesh_case, "gather")
    auto, _ = block_fn(kind, mesh_case, "auto")
    for rows in (one, x):                                        # 1 token a replica and 41: the same dispatch
        np.testing.assert_array_equal(np.asarray(auto(rows)), np.asarray(gather(rows)))
    dense, _ = block_fn(kind, mesh_case, "dense")
    np.testing.assert_allclose(np.asarray(dense(x)), np.asarray(gather(x)), rtol=0, atol=ATOL)
    assert block.experts.gather_tile() > 41 * block.top_k          # one tile here; now force tiles of 5
    per_assignment = moe.GATHER_TILE_BYTES // block.experts.gather_tile()
    monkeypatch.setattr(moe, "GATHER_TILE_BYTES", 5 * per_assignment + 1)
    tiled, block = block_fn(kind, mesh_case, "auto")
    assert block.experts.gather_tile() == 5
    np.testing.assert_array_equal(np.asarray(tiled(x)), np.asarray(gather(x)))
