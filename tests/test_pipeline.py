"""Pipeline and data parallelism in one SPMD program: every (dp, pp, tp) factorization of 8 devices."""

import re

import jax
from flax import nnx
import numpy as np
import pytest

from tests.hlo import count, loop_bodies
from tests.tiny_models import hf_greedy, hf_logits, make_checkpoint
from tests.workload import compact_workload, run_workload
from tp_jax.serving.llm import LLM
from tp_jax.parallel.pipeline import bubble_fraction, choose_microbatches, stage_layer_map
from tp_jax.serving.batch import StepBatch
from tp_jax.serving.sampling import SamplingParams

MESHES = [(1, 1, 1), (1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2),
          (4, 2, 1), (8, 1, 1)]
# continuous batching runs on these: dp alone, pp with tp, all three together (tp alone: test_serving.py)
WORKLOAD_MESHES = {(1, 4, 2), (2, 2, 2), (8, 1, 1)}
PROMPTS = [[5, 17, 300, 42, 9], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 200, 300], [999, 3]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_stage_layer_map():
    assert stage_layer_map(30, 4) == (*range(8), *range(8, 16), *range(16, 23), -1, *range(23, 30), -1)
    assert stage_layer_map(10, 8) == (0, 1, 2, 3, 4, -1, 5, -1, 6, -1, 7, -1, 8, -1, 9, -1)
    assert stage_layer_map(4, 2) == (0, 1, 2, 3)
    for layers, pp in [(30, 4), (10, 8), (7, 3), (1, 1)]:
        m = stage_layer_map(layers, pp)
        assert sorted(x for x in m if x >= 0) == list(range(layers))
        real = [sum(x >= 0 for x in m[s * len(m) // pp:(s + 1) * len(m) // pp]) for s in range(pp)]
        assert max(real) - min(real) <= 1
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=5 exceeds the model's 4 layers"):
        stage_layer_map(4, 5)


def test_microbatches_and_bubble():
    assert choose_microbatches(8, 4) == 4 and choose_microbatches(6, 4) == 3 and choose_microbatches(1, 4) == 1
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7) and bubble_fraction(1, 1) == 0
    with pytest.raises(ValueError, match=r"num_microbatches=0 must be >= 1"):
        choose_microbatches(4, 0)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    path = make_checkpoint("deep", str(tmp_path_factory.mktemp("deep")))
    ids = np.random.default_rng(1).integers(0, 1000, size=(4, 9))
    return path, ids, hf_logits(path, ids), [hf_greedy(path, p, 8) for p in PROMPTS]


@pytest.fixture(scope="module")
def workload_refs(deep):
    """The compact workload's greedy requests by transformers; every request run alone, on one device."""
    path = deep[0]
    work = compact_workload()
    greedy = {rid: hf_greedy(path, p, sp.max_tokens) for rid, p, sp, _ in work if sp.greedy}
    llm = LLM(path, progress=False)
    alone = {rid: llm.generate([p], sp)[0].outputs[0].token_ids for rid, p, sp, _ in work}
    return work, greedy, alone


@pytest.mark.parametrize("dp,pp,tp", MESHES, ids=lambda v: str(v))
def test_every_factorization(deep, workload_refs, dp, pp, tp):
    path, ids, ref, greedy = deep
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, progress=False)
    diff = float(np.abs(llm.get_logits(ids) - ref).max())
    assert diff <= 1e-4, diff
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == greedy      # == transformers == (1, 1, 1)
    if (dp, pp, tp) not in WORKLOAD_MESHES:
        return
    # continuous batching: requests join while others run and finish, greedy and seeded sampling mixed, in few
    # step shapes (each costs a compile at each mesh; the richer mixed_workload runs in test_serving.py)
    work, hf, alone = workload_refs
    got = run_workload(llm.engine, work)
    assert got == alone                                           # == each request alone on one device
    assert {rid: got[rid] for rid in hf} == hf                    # greedy == transformers
    assert llm.engine.core.kv_usage()[0] == 0


def test_odd_batch_is_padded_for_dp(deep):
    path, ids, ref, greedy = deep
    llm = LLM(path, data_parallel_size=4, pipeline_parallel_size=2, progress=False)
    np.testing.assert_allclose(llm.get_logits(ids[:3]), ref[:3], atol=1e-4)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy


def test_hlo_pp_handoff_is_neighbour_collective_permute(deep):
    path, ids, _, _ = deep
    for dp, pp, tp in [(1, 2, 4), (1, 4, 2)]:
        llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, progress=False)
        fn = llm._logits_fn()
        pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int32)
        hlo = jax.jit(lambda i, p: fn(i, p)).lower(ids.astype(np.int32), pos).compile().as_text()
        assert count(hlo, "all-to-all") == 0
        pairs = [(int(a), int(b)) for p in re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", hlo)
                 for a, b in re.findall(r"\{(\d+),(\d+)\}", p)]
        assert pairs, "the stage hand-off must be a collective-permute"
        assert all(dst - src == tp for src, dst in pairs)    # to the next stage, same tp rank: neighbours only
        assert {src // tp for src, _ in pairs} == set(range(pp - 1))
        reduces = [count(body, "all-reduce") for body in loop_bodies(hlo)]
        assert 2 in reduces and set(reduces) <= {0, 2}    # each layer loop: 2 tp all-reduces; row tiles' loops: none


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (1, 2, 2)], ids=lambda v: str(v))
def test_switched_layers_match(deep, workload_refs, dp, pp, tp):
    """LLM(layer_loop="switch", the default on one CPU device): per-slot arrays in a layer loop, each GEMM a lax.switch over
    the slots' own weights: the scanned stack's numbers and transformers', the same greedy tokens, a loop per
    stage kept, and no layer's weight matrix sliced out of a stack."""
    path, ids, ref, greedy = deep
    kw = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, progress=False)
    scanned, llm = LLM(path, layer_loop="scan", **kw), LLM(path, layer_loop="switch", **kw)
    auto = "switch" if dp * pp * tp == 1 else "scan"            # "auto": switch on one CPU device only
    assert (scanned.layer_loop, llm.layer_loop, LLM(path, **kw).layer_loop) == ("scan", "switch", auto)
    if dp * pp * tp > 1:                             # continuous batching on the switched stack, pp and tp
        work, _, alone = workload_refs
        assert run_workload(llm.engine, work) == alone
    logits = llm.get_logits(ids)
    assert float(np.abs(logits - scanned.get_logits(ids)).max()) <= 1e-6
    assert float(np.abs(logits - ref).max()) <= 1e-4
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy
    hlo = step_hlo(llm)
    assert loop_bodies(hlo) != []
    matrices = {(1, *x.addressable_shards[0].data.shape[1:])
                for x in jax.tree.leaves(nnx.state(scanned.model.model.layers, nnx.Param)) if x.ndim == 3}
    sliced = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"f32\[([\d,]+)\][^ ]* dynamic-slice\(", hlo)}
    assert not matrices & sliced


def step_hlo(llm) -> str:
    """The compiled HLO of the engine's step (a decode shape), as served."""
    runner = llm.engine.core.runner
    batch = StepBatch.empty(llm.engine.core.warmup_shapes()[0])
    return runner._forward.lower(runner.weights, runner.put(batch.packed()), runner.k, runner.v,
                                 shape=batch.shape).compile().as_text()


def test_bad_input(deep):
    path = deep[0]
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=8 exceeds the model's 2 layers"):
        LLM(make_checkpoint("gqa", str(__import__("tempfile").mkdtemp())), pipeline_parallel_size=8, progress=False)
    with pytest.raises(ValueError, match=r"num_microbatches=0 must be >= 1"):
        LLM(path, pipeline_parallel_size=2, num_microbatches=0, progress=False)
