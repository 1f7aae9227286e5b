"""The MoE block (tp_jax/parallel/layers/moe.py) against transformers' own sparse-MoE blocks on torch CPU.

Mixtral (softmax, top-k renormalized), Qwen2-MoE (no renormalization, a sigmoid-gated shared
expert), Qwen3-MoE (norm_topk_prob), DeepSeek-V2 (group_limited_greedy: groups by their max score,
routed_scaling_factor, an ungated shared expert of 2 experts' width), DeepSeek-V3 (sigmoid scores, a
selection-only e_score_correction_bias, groups by their top-2 sum, norm_topk_prob, scaling) and gpt-oss
(router bias, expert biases, interleaved gate/up, clamped SwiGLU), odd expert counts and top-2 / top-3,
in the TP layout and the EP layout (whole experts on dp x tp, padded with never-routed slots), every
dispatch; the collectives of each layout counted in the compiled HLO.
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
HEADS = dict(num_attention_heads=4, num_key_value_heads=4)      # configs check hidden_size against them

# name -> (transformers block class, config class, config kwargs, FusedMoE kwargs)
KINDS = {
    "mixtral": ("MixtralSparseMoeBlock", "MixtralConfig",
                dict(num_local_experts=5, num_experts_per_tok=2), dict(renormalize=True)),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", "Qwen2MoeConfig",
                  dict(num_experts=7, num_experts_per_tok=3, shared_expert_intermediate_size=16,
                       norm_topk_prob=False), dict(renormalize=False, shared_intermediate_size=16)),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", "Qwen3MoeConfig",
                  dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=True), dict(renormalize=True)),
    "deepseek_v2": ("DeepseekV2Moe", "DeepseekV2Config",
                    dict(n_routed_experts=10, num_experts_per_tok=3, n_group=5, topk_group=2,
                         topk_method="group_limited_greedy", routed_scaling_factor=2.5, n_shared_experts=2, **HEADS),
                    dict(renormalize=False, n_group=5, topk_group=2, group_score="max", routed_scaling_factor=2.5,
                         shared_intermediate_size=2 * F, shared_gate=False)),
    "deepseek_v3": ("DeepseekV3MoE", "DeepseekV3Config",
                    dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5, n_shared_experts=1, **HEADS),
                    dict(renormalize=True, scoring="sigmoid", correction_bias=True, n_group=4, topk_group=2,
                         group_score="top2_sum", routed_scaling_factor=2.5, shared_intermediate_size=F,
                         shared_gate=False)),
    "gpt_oss": ("GptOssMLP", "GptOssConfig", dict(num_local_experts=5, num_experts_per_tok=2, **HEADS),
                dict(renormalize=True, router_bias=True, expert_bias=True, activation="swigluoai",
                     interleaved_gate_up=True)),
}


def num_experts(cfg) -> int:
    return getattr(cfg, "num_local_experts", None) or cfg.num_experts


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
        if kind == "deepseek_v3":                       # a zero buffer in HF: large enough to move selections
            m.gate.e_score_correction_bias.normal_(0, 0.5)
        if kind == "gpt_oss":                           # pre-activations past the clamp, a moderate output
            m.experts.gate_up_proj_bias.normal_(0, 4.0)
            m.experts.down_proj.normal_(0, 0.05)
    return m, cfg


def hf_tensors(m) -> dict:
    """The block's weights as our params' parts, keyed by module path ("": the block's own params): router,
    per-expert gate / up / down (gpt-oss: interleaved gate_up, biases), correction bias, shared expert."""
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    if "router.weight" in sd:                                               # gpt-oss: [E, D, 2F], [E, F, D]
        gu, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]
        gub, downb = sd["experts.gate_up_proj_bias"], sd["experts.down_proj_bias"]
        n = range(len(gu))
        return {"gate": {"kernel": {"weight": sd["router.weight"]}, "bias": {"bias": sd["router.bias"]}},
                "experts": {"gate_up": {f"gate_up.{e}": gu[e].T for e in n},
                            "down": {f"down.{e}": down[e].T for e in n},
                            "gate_up_bias": {f"gate_up.{e}": gub[e] for e in n},
                            "down_bias": {f"down.{e}": downb[e] for e in n}}}
    gu, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]                # [E, 2F, D], [E, D, F]
    out = {"gate": {"kernel": {"weight": sd["gate.weight"]}},
           "experts": {"gate_up": {**{f"gate.{e}": gu[e, :F] for e in range(len(gu))},
                                   **{f"up.{e}": gu[e, F:] for e in range(len(gu))}},
                       "down": {f"down.{e}": down[e] for e in range(len(down))}}}
    if "gate.e_score_correction_bias" in sd:
        out[""] = {"e_score_correction_bias": {"weight": sd["gate.e_score_correction_bias"]}}
    if "shared_expert_gate.weight" in sd:
        out["shared_expert_gate"] = {"kernel": {"weight": sd["shared_expert_gate.weight"]}}
    for s in ("shared_expert.", "shared_experts."):
        if s + "gate_proj.weight" in sd:
            out["shared_expert.gate_up_proj"] = {"kernel": {"0": sd[s + "gate_proj.weight"],
                                                            "1": sd[s + "up_proj.weight"]}}
            out["shared_expert.down_proj"] = {"kernel": {"weight": sd[s + "down_proj.weight"]}}
    return out


def build(kind: str, cfg, mesh, ep: bool, dispatch: str = "auto") -> FusedMoE:
    with jax.set_mesh(mesh):
        return FusedMoE(D, F, num_experts(cfg), cfg.num_experts_per_tok, **KINDS[kind][3],
                        tp_size=mesh.shape["tp"], dp_size=mesh.shape["dp"], expert_parallel=ep, dispatch=dispatch,
                        rngs=nnx.Rngs(0))


def fill(block: FusedMoE, tensors: dict, mesh) -> None:
    for path, parts in tensors.items():
        layer = block
        for p in filter(None, path.split(".")):
            layer = getattr(layer, p)
        with jax.set_mesh(mesh):
            layer.set_params(layer.load_global(parts))


@pytest.fixture(scope="module", params=list(KINDS))
def reference(request):
    import torch
    m, cfg = hf_block(request.param)
    x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
    with torch.no_grad():
        y = m(torch.from_numpy(x))
    y = (y[0] if isinstance(y, tuple) else y).numpy()                     # gpt-oss: (y, router scores)
    return request.param, cfg, hf_tensors(m), x, y


# (dp, tp): two meshes in the quick run (each with some of the dispatches), the rest marked slow (all of them);
# every mesh on the richest block (Qwen2-MoE: top-3 of 7, a shared expert), dp = 4 also on gpt-oss's (every
# expert option), the others on the two quick meshes. The later kinds run quick on one mesh (`QUICK_CASE`):
# gpt-oss with every dispatch, DeepSeek's, whose code differs only in the router and the shared expert, with one
MESHES = [(2, 2), (1, 8), (1, 1), (1, 2), (4, 2), (2, 4)]
ALL_DISPATCHES = ("gather", "ragged", "dense")
QUICK_DISPATCHES = {(2, 2): ("gather", "ragged"), (1, 8): ("dense", "gather")}
QUICK_CASE = {"deepseek_v2": ((2, 2), ("gather",)), "deepseek_v3": ((2, 2), ("dense",)),
              "gpt_oss": ((2, 2), ALL_DISPATCHES)}
KIND_MESHES = {"qwen2_moe": MESHES, "gpt_oss": [(2, 2), (1, 8), (4, 2)]}       # the others: the quick meshes


def dispatches(kind: str, mesh: tuple[int, int]) -> tuple[tuple[str, ...], bool]:
    """(the dispatches a case runs, whether it is quick)."""
    if kind in QUICK_CASE:
        quick_mesh, quick_dispatches = QUICK_CASE[kind]
        return (quick_dispatches, True) if mesh == quick_mesh else (ALL_DISPATCHES, False)
    return QUICK_DISPATCHES.get(mesh, ALL_DISPATCHES), mesh in QUICK_DISPATCHES


CASES = [pytest.param(kind, *m, marks=() if dispatches(kind, m)[1] else pytest.mark.slow, id=f"{kind}-{m}")
         for kind in KINDS for m in KIND_MESHES.get(kind, list(QUICK_DISPATCHES))]


@pytest.mark.parametrize("ep", [False, True], ids=["tp_layout", "ep"])
@pytest.mark.parametrize("reference,dp,tp", CASES, indirect=["reference"])
def test_block_matches_transformers(reference, dp, tp, ep):
    kind, cfg, tensors, x, want = reference
    mesh = mesh_for(dp, 1, tp)
    for dispatch in dispatches(kind, (dp, tp))[0]:
        block = build(kind, cfg, mesh, ep, dispatch)
        fill(block, tensors, mesh)
        got = shard_module(block, mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0, err_msg=f"{kind} {dispatch}")


def routed(m, x: np.ndarray) -> np.ndarray:
    """transformers' choice of experts [M, k], sorted per token."""
    import torch
    router = m.router if hasattr(m, "router") else m.gate
    with torch.no_grad():
        return np.sort(router(torch.from_numpy(x.reshape(-1, D)))[2].numpy(), axis=-1)


@pytest.mark.parametrize("reference", ["deepseek_v2", "deepseek_v3", "gpt_oss"], indirect=True)
def test_the_references_exercise_the_new_options(reference):
    """The blocks above test what they claim: DeepSeek's groups (and V3's correction bias) change some token's
    experts against a plain top-k (an unbiased one); gpt-oss's routed pre-activations pass its clamp."""
    import torch
    kind, cfg, _, x, _ = reference
    m, _ = hf_block(kind)
    got = routed(m, x)
    scores = torch.from_numpy(x.reshape(-1, D)) @ m.gate.weight.T if kind != "gpt_oss" else None
    if kind == "deepseek_v2":
        plain = np.sort(torch.topk(scores.softmax(-1), cfg.num_experts_per_tok)[1].numpy(), axis=-1)
        assert (plain != got).any(axis=-1).sum() > 0, "group_limited_greedy chose as greedy would"
    if kind == "deepseek_v3":
        plain = np.sort(torch.topk(scores.sigmoid(), cfg.num_experts_per_tok)[1].numpy(), axis=-1)
        assert (plain != got).any(axis=-1).sum() > 0, "groups and correction bias chose as a plain top-k would"
        with torch.no_grad():
            m.gate.e_score_correction_bias.zero_()
        assert (routed(m, x) != got).any(axis=-1).sum() > 0, "the correction bias changed no selection"
    if kind == "gpt_oss":
        t = x.reshape(-1, D)
        tok = np.repeat(np.arange(len(t)), cfg.num_experts_per_tok)
        e = got.reshape(-1)
        with torch.no_grad():
            h = np.einsum("ad,adf->af", t[tok], m.experts.gate_up_proj.numpy()[e]) + \
                m.experts.gate_up_proj_bias.numpy()[e]
        limit = cfg.swiglu_limit
        assert (h[:, 0::2] > limit).any() and (np.abs(h[:, 1::2]) > limit).any(), "the clamp is never active"
        assert (h[:, 0::2] < limit).any() and (np.abs(h[:, 1::2]) < limit).any()


@pytest.mark.parametrize("kind,ep", [("qwen2_moe", False), ("qwen2_moe", True), ("gpt_oss", False),
                                     pytest.param("gpt_oss", True, marks=pytest.mark.slow)],
                         ids=["qwen2_moe-tp_layout", "qwen2_moe-ep", "gpt_oss-tp_layout", "gpt_oss-ep"])
def test_int8_experts_match_the_round_tripped_block(kind, ep):
    """`Experts.use_method(Int8())`: int8 kernels, one scale per expert and output row, built per rank from
    the float parts; every dispatch equals transformers' block whose expert weights are int8 round-tripped
    (gpt-oss: its float biases added after the scaled dots, its interleaved gate/up rows scaled each)."""
    import torch
    from tp_jax.parallel.layers import Int8
    m, cfg = hf_block(kind)
    tensors = hf_tensors(m)
    out_dim = -2 if kind == "gpt_oss" else -1                          # the input dim: [E, in, out] / [E, out, in]
    with torch.no_grad():
        for p in (m.experts.gate_up_proj, m.experts.down_proj):          # per expert and output row
            s = p.abs().amax(dim=out_dim, keepdim=True) / 127
            p.copy_(torch.round(p / s).clamp(-127, 127) * s)
        x = np.random.default_rng(2).standard_normal((B, T, D)).astype(np.float32)
        want = m(torch.from_numpy(x))
        want = (want[0] if isinstance(want, tuple) else want).numpy()
    mesh = mesh_for(2, 1, 2)
    for dispatch in ("gather", "ragged", "dense"):
        block = build(kind, cfg, mesh, ep, dispatch)
        with jax.set_mesh(mesh):
            block.experts.use_method(Int8())
        fill(block, tensors, mesh)
        assert block.experts.gate_up[...].dtype == np.int8 and block.experts.down_scale[...].shape[-1] == D
        got = shard_module(block, mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0, err_msg=dispatch)


def test_experts_refuse_a_method_without_the_expert_interface():
    """Experts call their method only through `ExpertMethod`: a method that is none is refused by name when it is
    given to the experts, and a method listing EXPERTS without implementing it fails when its class is defined."""
    import dataclasses
    from typing import ClassVar
    from tp_jax.parallel.layers import Bfloat16, LinearMethod, UnsupportedLayerError
    from tp_jax.parallel.layers.method import EXPERTS
    with jax.set_mesh(mesh_for(1, 1, 1)):
        block = FusedMoE(D, F, 4, 2, renormalize=True, rngs=nnx.Rngs(0))
        with pytest.raises(UnsupportedLayerError, match=r"'bf16' cannot hold stacked experts.*leave the experts float"):
            block.experts.use_method(Bfloat16())
    with pytest.raises(TypeError, match=r"Half lists 'experts' in kinds but is no ExpertMethod: implement expert_params"):
        @dataclasses.dataclass(frozen=True)
        class Half(LinearMethod):
            kinds: ClassVar[tuple[str, ...]] = (EXPERTS,)


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


def test_indivisible_interleaved_width_names_whole_pairs():
    with pytest.raises(ValueError, match=r"not divisible by tp=3.*whole \(gate, up\) pairs.*expert parallelism"):
        with jax.set_mesh(mesh_for(1, 1, 3)):
            FusedMoE(D, F, 4, 2, renormalize=True, interleaved_gate_up=True, tp_size=3, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_group=3), r"n_group=3 must be a positive integer dividing num_experts=8"),
    (dict(n_group=4, topk_group=5), r"topk_group=5 must be an integer between 1 and n_group=4"),
    (dict(n_group=4), r"topk_group=None must be an integer"),
    (dict(topk_group=2), r"topk_group=2 needs n_group"),
    (dict(n_group=4, topk_group=1), r"top_k=3 exceeds the 2 experts of the topk_group=1 kept groups"),
    (dict(n_group=8, topk_group=3, group_score="top2_sum"), r"'top2_sum' needs groups of at least 2 experts"),
    (dict(n_group=4, topk_group=2, group_score="mean"), r"group_score='mean'"),
    (dict(scoring="relu"), r"scoring='relu'"),
    (dict(activation="gelu"), r"activation='gelu'"),
], ids=lambda v: str(v)[:40])
def test_bad_routing_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedMoE(D, F, 8, 3, renormalize=True, **kwargs, rngs=nnx.Rngs(0))


def tiny_config(**moe):
    from tp_jax.models.moe import MoEConfig
    return MoEConfig(architecture="tiny", vocab_size=64, hidden_size=D, num_layers=2, num_heads=4, num_kv_heads=4,
                     head_dim=4, intermediate_size=F, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=F,
                     **moe)


DEEPSEEK_V3_LIKE = dict(scoring_func="sigmoid", correction_bias=True, n_group=4, topk_group=2, group_score="top2_sum",
                        routed_scaling_factor=2.5, shared_expert_intermediate_size=2 * F, shared_gate=False)
GPT_OSS_LIKE = dict(router_bias=True, expert_bias=True, expert_act="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0,
                    interleaved_gate_up=True)


def test_moe_config_refuses_bad_options():
    with pytest.raises(ValueError, match=r"num_experts_per_tok=3 exceeds the 2 experts of the topk_group=1"):
        tiny_config(n_group=4, topk_group=1)
    for field, value in (("scoring_func", "tanh"), ("expert_act", "gelu"), ("routed_scaling_factor", 0.0)):
        with pytest.raises(ValueError, match=f"{field}="):
            tiny_config(**{field: value})


def test_make_moe_builds_the_options_in_a_stacked_model():
    """MoEConfig -> make_moe -> FusedMoE in a layer Stack: the new params with their stacked shapes and specs,
    `moe_weights` naming DeepSeek-V3's (router bias, correction bias, an ungated `shared_experts`), a traced forward."""
    from tp_jax.loaders.bind import bind
    from tp_jax.models.causal_lm import CausalLM
    from tp_jax.models.moe import moe_weights
    mesh = mesh_for(1, 1, 2)
    cfg = tiny_config(**DEEPSEEK_V3_LIKE, router_bias=True)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: CausalLM(cfg, tp_size=2, rngs=nnx.Rngs(0)))
    mlp = model.model.layers.layers.mlp
    bias = mlp.e_score_correction_bias.get_value()
    assert bias.shape == (2, 8) and bias.dtype == np.float32 and mlp.e_score_correction_bias.get_metadata()[
        "out_sharding"][1:] == (None,)
    assert mlp.gate.bias.get_value().shape == (2, 8) and mlp.shared_expert_gate is None
    assert (mlp.n_group, mlp.topk_group, mlp.group_score, mlp.scoring) == (4, 2, "top2_sum", "sigmoid")
    table = moe_weights(cfg, shared="shared_experts")
    names = {b.path: {p: e.hf for p, e in b.entries.items()} for b in bind(model, table)}
    assert names["model.layers.layers.mlp.e_score_correction_bias"] == {
        "weight": "model.layers.{i}.mlp.gate.e_score_correction_bias"}
    assert names["model.layers.layers.mlp.shared_expert.down_proj.kernel"] == {
        "weight": "model.layers.{i}.mlp.shared_experts.down_proj.weight"}
    with pytest.raises(ValueError, match="declares its own expert entries"):
        moe_weights(tiny_config(**GPT_OSS_LIKE))

    cfg = tiny_config(**GPT_OSS_LIKE, enable_expert_parallel=True)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: CausalLM(cfg, tp_size=2, rngs=nnx.Rngs(0)))
    experts = model.model.layers.layers.mlp.experts
    assert experts.gate_up_bias.get_value().shape == (2, 8, 2 * F) and experts.down_bias.get_value().shape == (2, 8, D)
    assert experts.gate_up_bias.get_metadata()["out_sharding"][1:] == (("dp", "tp"), None)
    fn = shard_module(model, mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp"), jit=False,
                      method=lambda m, ids, pos: m(ids, pos)[0])
    ids = jax.ShapeDtypeStruct((2, 3), np.int32)
    assert jax.eval_shape(fn, ids, ids).shape == (2, 3, 64)                # traced through the layer scan


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
