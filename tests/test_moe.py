"""The MoE block (tp_jax/parallel/layers/moe.py) against transformers' own sparse-MoE blocks on torch CPU.

Mixtral (softmax, top-k renormalized), Qwen2-MoE (no renormalization, a sigmoid-gated shared
expert) and Qwen3-MoE (norm_topk_prob), odd expert counts and top-2 / top-3, in the TP layout
and the EP layout (whole experts on dp x tp, padded with never-routed slots), both dispatches;
the collectives of each layout counted in the compiled HLO.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.conftest import mesh_for
from tests.hlo import count
from tp_jax.parallel.layers.moe import FusedMoE, expert_slots
from tp_jax.parallel.shard import shard_module

D, F, B, T = 16, 8, 4, 3          # hidden, expert width, batch (a multiple of dp), tokens per row
ATOL = 2e-5

# name -> (transformers block class, config class, config kwargs, (renormalize, shared width))
KINDS = {
    "mixtral": ("MixtralSparseMoeBlock", "MixtralConfig",
                dict(num_local_experts=5, num_experts_per_tok=2), (True, None)),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", "Qwen2MoeConfig",
                  dict(num_experts=7, num_experts_per_tok=3, shared_expert_intermediate_size=16,
                       norm_topk_prob=False), (False, 16)),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", "Qwen3MoeConfig",
                  dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=True), (True, None)),
}


def hf_block(kind: str):
    import torch
    import transformers
    from importlib import import_module
    block, config, kw, _ = KINDS[kind]
    module = import_module(f"transformers.models.{kind}.modeling_{kind}")
    cfg = getattr(transformers, config)(hidden_size=D, intermediate_size=F, moe_intermediate_size=F, **kw)
    torch.manual_seed(0)
    m = getattr(module, block)(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m, cfg


def hf_tensors(m) -> dict:
    """The block's weights as our params' parts: per-expert gate / up / down, router, shared expert."""
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    gu, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]
    out = {"gate": {"kernel": {"weight": sd["gate.weight"]}},
           "experts": {"gate_up": {**{f"gate.{e}": gu[e, :F] for e in range(len(gu))},
                                   **{f"up.{e}": gu[e, F:] for e in range(len(gu))}},
                       "down": {f"down.{e}": down[e] for e in range(len(down))}}}
    if "shared_expert_gate.weight" in sd:
        s = "shared_expert."
        out["shared_expert_gate"] = {"kernel": {"weight": sd["shared_expert_gate.weight"]}}
        out["shared_expert.gate_up_proj"] = {"kernel": {"0": sd[s + "gate_proj.weight"], "1": sd[s + "up_proj.weight"]}}
        out["shared_expert.down_proj"] = {"kernel": {"weight": sd[s + "down_proj.weight"]}}
    return out


def build(kind: str, cfg, mesh, ep: bool, dispatch: str = "auto") -> FusedMoE:
    renorm, shared = KINDS[kind][3]
    with jax.set_mesh(mesh):
        return FusedMoE(D, F, cfg.num_local_experts if kind == "mixtral" else cfg.num_experts,
                        cfg.num_experts_per_tok, renormalize=renorm, shared_intermediate_size=shared,
                        tp_size=mesh.shape["tp"], dp_size=mesh.shape["dp"], expert_parallel=ep, dispatch=dispatch,
                        rngs=nnx.Rngs(0))


def fill(block: FusedMoE, tensors: dict, mesh) -> None:
    for path, parts in tensors.items():
        layer = block
        for p in path.split("."):
            layer = getattr(layer, p)
        with jax.set_mesh(mesh):
            layer.set_params(layer.load_global(parts))


@pytest.fixture(scope="module", params=list(KINDS))
def reference(request):
    import torch
    m, cfg = hf_block(request.param)
    x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
    with torch.no_grad():
        y = m(torch.from_numpy(x)).numpy()
    return request.param, cfg, hf_tensors(m), x, y


# (dp, tp): two meshes in the quick run (each with some of the dispatches), the rest marked slow (all of them);
# every mesh on the richest block (Qwen2-MoE: top-3 of 7, a shared expert), the others, whose code differs only
# in the router and the shared expert, on the two quick meshes
QUICK_DISPATCHES = {(2, 2): ("gather", "ragged"), (1, 8): ("dense", "gather")}
GRID_KIND = "qwen2_moe"
CASES = [pytest.param(kind, *m, marks=() if m in QUICK_DISPATCHES else pytest.mark.slow, id=f"{kind}-{m}")
         for kind in KINDS for m in [(2, 2), (1, 8), (1, 1), (1, 2), (4, 2), (2, 4)]
         if kind == GRID_KIND or m in QUICK_DISPATCHES]


@pytest.mark.parametrize("ep", [False, True], ids=["tp_layout", "ep"])
@pytest.mark.parametrize("reference,dp,tp", CASES, indirect=["reference"])
def test_block_matches_transformers(reference, dp, tp, ep):
    kind, cfg, tensors, x, want = reference
    mesh = mesh_for(dp, 1, tp)
    for dispatch in QUICK_DISPATCHES.get((dp, tp), ("gather", "ragged", "dense")):
        block = build(kind, cfg, mesh, ep, dispatch)
        fill(block, tensors, mesh)
        got = shard_module(block, mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0, err_msg=f"{kind} {dispatch}")


@pytest.mark.parametrize("ep", [False, True], ids=["tp_layout", "ep"])
def test_int8_experts_match_the_round_tripped_block(ep):
    """`Experts.use_method(Int8())`: int8 kernels, one scale per expert and output row, built per rank from
    the float parts; every dispatch equals transformers' block whose expert weights are int8 round-tripped."""
    import torch
    from tp_jax.parallel.layers import Int8
    m, cfg = hf_block("qwen2_moe")
    tensors = hf_tensors(m)
    with torch.no_grad():
        for p in (m.experts.gate_up_proj, m.experts.down_proj):          # [E, out, in]: per output row
            s = p.abs().amax(dim=-1, keepdim=True) / 127
            p.copy_(torch.round(p / s).clamp(-127, 127) * s)
        x = np.random.default_rng(2).standard_normal((B, T, D)).astype(np.float32)
        want = m(torch.from_numpy(x)).numpy()
    mesh = mesh_for(2, 1, 2)
    for dispatch in ("gather", "ragged", "dense"):
        block = build("qwen2_moe", cfg, mesh, ep, dispatch)
        with jax.set_mesh(mesh):
            block.experts.use_method(Int8())
        fill(block, tensors, mesh)
        assert block.experts.gate_up[...].dtype == np.int8 and block.experts.down_scale[...].shape[-1] == D
        got = shard_module(block, mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0, err_msg=dispatch)


def test_expert_slots_follow_vllm_expert_map():
    np.testing.assert_array_equal(expert_slots(10, 8), [[0, 1], [2, 3]] + [[e, -1] for e in range(4, 10)])
    np.testing.assert_array_equal(expert_slots(6, 8), [[e] for e in range(6)] + [[-1], [-1]])
    slots = expert_slots(128, 8)
    assert slots.shape == (8, 16) and sorted(slots.reshape(-1)) == list(range(128))


def test_indivisible_expert_width_in_tp_layout_is_refused():
    mesh = mesh_for(1, 1, 3)
    with pytest.raises(ValueError, match=r"moe intermediate_size=8 is not divisible by tp=3.*expert parallelism"):
        with jax.set_mesh(mesh):
            FusedMoE(D, F, 4, 2, renormalize=True, tp_size=3, rngs=nnx.Rngs(0))


def hlo(block, mesh, x) -> str:
    fn = shard_module(block, mesh, in_specs=(P("dp"),), out_specs=P("dp"), jit=False)
    return jax.jit(fn).lower(x).compile().as_text()


@pytest.mark.parametrize("dp,tp", [(1, 1), (1, 4), (2, 4)], ids=lambda v: str(v))
def test_collectives_in_hlo(dp, tp):
    """TP layout: one all-reduce over tp. EP: all-gather + reduce-scatter over dp, one all-reduce over tp."""
    _, cfg = hf_block("mixtral")
    mesh = mesh_for(dp, 1, tp)
    x = np.ones((B, T, D), np.float32)
    text = hlo(build("mixtral", cfg, mesh, ep=False), mesh, x)
    assert (count(text, "all-reduce"), count(text, "all-gather"), count(text, "all-to-all")) == (int(tp > 1), 0, 0)
    text = hlo(build("mixtral", cfg, mesh, ep=True), mesh, x)
    assert count(text, "all-gather") == int(dp > 1)
    assert count(text, "reduce-scatter") + count(text, "all-reduce") == int(dp > 1) + int(tp > 1)
    assert count(text, "all-to-all") == 0
