"""The Mixture-of-Experts feed-forward part (`feed_forward="moe"`) and what the MoE models share.

    mlp(x) = sum_k w_k expert_k(x) (+ [sigmoid(x W_s)] shared(x))    tp_jax/parallel/layers/moe.py
    k, w_k: the top-k of softmax or sigmoid scores (+ a selection-only correction bias), optionally within the
            best groups; w_k renormalized or not, times routed_scaling_factor (Mixtral, Qwen, DeepSeek, gpt-oss)
    expert_k: SwiGLU, or gpt-oss's clamped one, with or without biases, gate/up as halves or interleaved

* `MoEConfig`: `DecoderConfig` plus the router's and experts' sizes and the parallel layout
  (`enable_expert_parallel`, from `LLM(enable_expert_parallel=...)`; `data_parallel_size`, set by
  the loader from the mesh, since EP places whole experts on the dp x tp devices of a stage).
* `moe_extend(...)`: the Llama-family config map's MoE fields. Qwen's heterogeneous stacks
  (`mlp_only_layers`, `decoder_sparse_step` > 1: some layers dense) set `ff_kinds`: the model then holds
  its dense and its MoE feed-forwards in a stack each (tp_jax/models/causal_lm.py, `FeedForwardPlan`).
* `moe_weights(...)`: Llama's name table with the feed-forward entries replaced by the router (its bias,
  a correction bias), one entry per expert and projection (per-expert tensors, as `save_pretrained` writes
  them) and the shared expert (gated or not). `fused_expert_weights(...)`: the same table for
  transformers 5's fused `experts.gate_up_proj [E, 2F, D]` / `experts.down_proj [E, D, F]`
  (`save_original_format=False`), a variant the loader picks when the checkpoint holds those names.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from tp_jax.models.config import REQUIRED, UnsupportedConfigError
from tp_jax.models.decoder import DecoderConfig
from tp_jax.models.llama import llama_weights
from tp_jax.parallel.layers import Entry, WeightTable
from tp_jax.parallel.layers.moe import ACTIVATIONS, DISPATCHES, SCORINGS, FusedMoE, routing_problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(DecoderConfig):
    """DecoderConfig plus a routed-experts feed-forward.

    Args (besides DecoderConfig's): num_experts E, num_experts_per_tok k, moe_intermediate_size
    (one expert's width), norm_topk_prob (renormalize the top-k weights), shared_expert_intermediate_size
    (a shared expert, None: none; DeepSeek: moe_intermediate_size * n_shared_experts), shared_gate (the shared
    expert gated by sigmoid(x W_s), Qwen2-MoE; False: added as is, DeepSeek), enable_expert_parallel (whole
    experts on the dp x tp devices), data_parallel_size (the mesh's dp, set by the loader), moe_dispatch
    (`DISPATCHES`: "auto", "gather", "ragged", "dense").
    Routing: scoring_func ("softmax", "sigmoid": DeepSeek-V3), router_bias (gpt-oss), correction_bias (a
    selection-only `e_score_correction_bias`, DeepSeek-V3), n_group / topk_group / group_score (group-limited
    selection, None: off; "max": DeepSeek-V2's group_limited_greedy, "top2_sum": V3), routed_scaling_factor.
    Experts: expert_bias, expert_act ("silu", "swigluoai": gpt-oss's clamped SwiGLU with swiglu_alpha,
    swiglu_limit), interleaved_gate_up (gate and up are the even and odd rows of one fused tensor, gpt-oss).
    """
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int | None = None
    shared_gate: bool = True
    scoring_func: str = "softmax"
    router_bias: bool = False
    correction_bias: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    expert_bias: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    interleaved_gate_up: bool = False
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    moe_dispatch: str = "auto"
    feed_forward: str = "moe"

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "data_parallel_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {field}={value!r} must be a positive integer.")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{name}: num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts="
                             f"{self.num_experts}.")
        if self.moe_dispatch not in DISPATCHES:
            raise ValueError(f"{name}: moe_dispatch={self.moe_dispatch!r}; choose one of {DISPATCHES}")
        if self.scoring_func not in SCORINGS:
            raise ValueError(f"{name}: scoring_func={self.scoring_func!r}; choose one of {SCORINGS}")
        if self.expert_act not in ACTIVATIONS:
            raise ValueError(f"{name}: expert_act={self.expert_act!r}; choose one of {ACTIVATIONS}")
        problem = routing_problem(self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group,
                                  self.group_score)
        if problem:
            raise ValueError(f"{name}: {problem.replace('top_k=', 'num_experts_per_tok=')}.")
        for field in ("routed_scaling_factor", "swiglu_alpha", "swiglu_limit"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}: {field}={value!r} must be a positive number.")


def make_moe(cfg: MoEConfig, tp: int, dtype, rngs: nnx.Rngs) -> FusedMoE:
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"feed_forward='moe' needs an MoEConfig (experts, top-k, widths); got {type(cfg).__name__}")
    return FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                    renormalize=cfg.norm_topk_prob, scoring=cfg.scoring_func, router_bias=cfg.router_bias,
                    correction_bias=cfg.correction_bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                    group_score=cfg.group_score, routed_scaling_factor=cfg.routed_scaling_factor,
                    shared_intermediate_size=cfg.shared_expert_intermediate_size, shared_gate=cfg.shared_gate,
                    expert_bias=cfg.expert_bias, activation=cfg.expert_act, swiglu_alpha=cfg.swiglu_alpha,
                    swiglu_limit=cfg.swiglu_limit, interleaved_gate_up=cfg.interleaved_gate_up,
                    tp_size=tp, dp_size=cfg.data_parallel_size, expert_parallel=cfg.enable_expert_parallel,
                    dispatch=cfg.moe_dispatch, dtype=dtype, rngs=rngs)


# Read by transformers only for the training loss or in training mode: accepted, never used.
TRAINING_ONLY_MOE = {"output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}
# Qwen: which layers are sparse (HF: layer i is MoE iff i not in mlp_only_layers and (i + 1) % step == 0).
SPARSE_LAYER_FIELDS = {"decoder_sparse_step": 1, "mlp_only_layers": None}


def moe_fields(experts: str, *, qwen: bool = False, shared: bool = False, sparse_layers: bool = False) -> dict:
    """The HF fields an MoE architecture reads besides Llama's. `experts`: the expert-count field as
    the config object stores it (Qwen3-MoE maps config.json's `num_experts` to `num_local_experts`,
    so it is checked in `moe_extend`, not as REQUIRED); `qwen`: `moe_intermediate_size` and
    `norm_topk_prob` (Mixtral: experts are `intermediate_size` wide, always renormalized)."""
    fields = {experts: None, "num_experts_per_tok": REQUIRED, **TRAINING_ONLY_MOE}
    if qwen:
        fields.update(moe_intermediate_size=REQUIRED, norm_topk_prob=False)
    if shared:
        fields["shared_expert_intermediate_size"] = REQUIRED
    if sparse_layers:
        fields.update(SPARSE_LAYER_FIELDS)
    return fields


def moe_extend(experts: str, *, renormalize: bool | None = None, shared: bool = False):
    """`extend` for `llama_config`: (MoEConfig, its MoE arguments) from the read fields."""
    def extend(f: dict, arch: str):
        if not f[experts]:
            raise UnsupportedConfigError(f"the config of {arch} lacks the expert count ({experts!r}: "
                                         f"config.json's num_experts / num_local_experts)")
        return MoEConfig, dict(
            num_experts=int(f[experts]), num_experts_per_tok=int(f["num_experts_per_tok"]),
            moe_intermediate_size=int(f.get("moe_intermediate_size") or f["intermediate_size"]),
            norm_topk_prob=bool(f["norm_topk_prob"]) if renormalize is None else renormalize,
            shared_expert_intermediate_size=int(f["shared_expert_intermediate_size"]) if shared else None,
            ff_kinds=_feed_forward_kinds(f, arch))
    return extend


def _feed_forward_kinds(f: dict, arch: str) -> tuple[str, ...] | None:
    """Qwen's sparse layers: layer i is MoE iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    (transformers' rule), dense otherwise; None when every layer is MoE."""
    step, dense = f.get("decoder_sparse_step"), list(f.get("mlp_only_layers") or [])
    step = 1 if step is None else step
    n = f["num_hidden_layers"]
    if not isinstance(step, int) or step < 1:
        raise UnsupportedConfigError(f"config field decoder_sparse_step={step!r} must be a positive integer")
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise UnsupportedConfigError(f"config field mlp_only_layers={dense} names layers {bad} outside {arch}'s "
                                     f"{n} layers (num_hidden_layers)")
    kinds = tuple("moe" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(n))
    return None if set(kinds) == {"moe"} else kinds


def moe_weights(cfg: MoEConfig, *, prefix: str = "mlp", names=("gate_proj", "up_proj", "down_proj"),
                router: str = "gate", shared: str = "shared_expert") -> WeightTable:
    """Llama's table with the MLP entries replaced by the router, per-expert tensors and the shared expert.

    `prefix`: the HF module of the block ("mlp"; Mixtral: "block_sparse_moe"); `names`: the gate,
    up and down projections of an expert (Mixtral: w1, w3, w2); `router`: the router's module, whose
    "bias" (router_bias) and "e_score_correction_bias" (correction_bias) it also names; `shared`: the shared
    expert's module (DeepSeek: "shared_experts"). Experts with biases or interleaved gate/up (gpt-oss) are
    stored otherwise: such a model writes its own expert entries."""
    if cfg.expert_bias or cfg.interleaved_gate_up:
        raise ValueError("moe_weights names per-expert gate / up / down weights without biases; a model with "
                         "expert_bias or interleaved_gate_up (gpt-oss) declares its own expert entries "
                         "(params experts.gate_up, experts.down, experts.gate_up_bias, experts.down_bias)")
    base = llama_weights(cfg)
    hf, ours = f"model.layers.{{i}}.{prefix}", "model.layers.layers.mlp"
    entries = [e for e in base.entries if not e.param.startswith(ours + ".")]
    entries.append(Entry(f"{hf}.{router}.weight", f"{ours}.gate.kernel", "weight"))
    if cfg.router_bias:
        entries.append(Entry(f"{hf}.{router}.bias", f"{ours}.gate.bias", "bias"))
    if cfg.correction_bias:
        entries.append(Entry(f"{hf}.{router}.e_score_correction_bias", f"{ours}.e_score_correction_bias", "weight"))
    for e in range(cfg.num_experts):
        for part, name in zip(("gate", "up", "down"), names):
            param = "down" if part == "down" else "gate_up"
            entries.append(Entry(f"{hf}.experts.{e}.{name}.weight", f"{ours}.experts.{param}", f"{part}.{e}"))
    entries += _shared_entries(cfg, hf, ours, shared)
    if cfg.ff_kinds is None:
        return WeightTable(entries, base.ignored, variants=(fused_expert_weights(cfg, entries, prefix),))
    dense = _to_stack([e for e in base.entries if e.param.startswith(ours + ".")], ours, "dense")   # Llama's MLP
    fused = fused_expert_weights(cfg, entries, prefix).entries
    return WeightTable(_to_stack(entries, ours, "moe") + dense, base.ignored,
                       variants=(WeightTable(_to_stack(fused, ours, "moe") + dense, base.ignored),))


def _to_stack(entries, ours: str, kind: str) -> list[Entry]:
    """`entries` with the feed-forward params (under `ours`) moved to the model's stack of `kind` feed-forwards."""
    return [dataclasses.replace(e, param=f"model.ff_stacks.{kind}.layers." + e.param[len(ours) + 1:])
            if e.param.startswith(ours + ".") else e for e in entries]


def _shared_entries(cfg: MoEConfig, hf: str, ours: str, shared: str) -> list[Entry]:
    if not cfg.shared_expert_intermediate_size:
        return []
    s = f"{hf}.{shared}"
    entries = [Entry(f"{s}.gate_proj.weight", f"{ours}.shared_expert.gate_up_proj.kernel", "0"),
               Entry(f"{s}.up_proj.weight", f"{ours}.shared_expert.gate_up_proj.kernel", "1"),
               Entry(f"{s}.down_proj.weight", f"{ours}.shared_expert.down_proj.kernel", "weight")]
    if cfg.shared_gate:
        entries.append(Entry(f"{hf}.shared_expert_gate.weight", f"{ours}.shared_expert_gate.kernel", "weight"))
    return entries


def fused_expert_weights(cfg: MoEConfig, entries: list[Entry], prefix: str) -> WeightTable:
    """The per-expert table rewritten for transformers 5's fused tensors under `mlp.experts` (every model)."""
    hf, ours, f = "model.layers.{i}.mlp", "model.layers.layers.mlp", cfg.moe_intermediate_size
    old = f"model.layers.{{i}}.{prefix}."
    out = [dataclasses.replace(e, hf=hf + "." + e.hf[len(old):]) if e.hf.startswith(old) else e
           for e in entries if ".experts." not in e.hf]
    for e in range(cfg.num_experts):
        out += [Entry(f"{hf}.experts.gate_up_proj", f"{ours}.experts.gate_up", f"gate.{e}", index=e, offset=0),
                Entry(f"{hf}.experts.gate_up_proj", f"{ours}.experts.gate_up", f"up.{e}", index=e, offset=f),
                Entry(f"{hf}.experts.down_proj", f"{ours}.experts.down", f"down.{e}", index=e)]
    return WeightTable(out, llama_weights(cfg).ignored)


__all__ = ["MoEConfig", "make_moe", "moe_fields", "moe_extend", "moe_weights", "fused_expert_weights"]
