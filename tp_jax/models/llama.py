"""LlamaForCausalLM: the config map (HF fields -> `DecoderConfig`), the HF name table and the registration.

The graph is the shared one (tp_jax/models/causal_lm.py, tp_jax/models/decoder.py): RMSNorm, rotary
embedding, a SwiGLU MLP, biases per `attention_bias` / `mlp_bias`. Qwen2, Qwen3 and Mistral are
this map and this table with other arguments (tp_jax/models/qwen2.py, qwen3.py, mistral.py).
"""

from __future__ import annotations

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.config import REQUIRED, UnsupportedConfigError, eos_ids, only_silu, read_fields
from tp_jax.models.decoder import DecoderConfig, DecoderLayer
from tp_jax.models.registry import first_architecture, register
from tp_jax.models.rope import ROPE_FIELDS, rope_from_hf
from tp_jax.parallel.layers import Entry, WeightTable


class LlamaForCausalLM(CausalLM):
    """The shared causal-LM shell; everything Llama-specific is in `llama_config`."""


# --- config: the HF fields the Llama family reads ----------------------------------------------

# HF config field -> default when the config lacks it (REQUIRED: config.json must state it).
LLAMA_FIELDS = {
    "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
    "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED, "rms_norm_eps": REQUIRED,
    "num_key_value_heads": None,          # None: num_attention_heads (multi-head attention)
    "head_dim": None,                     # None: hidden_size // num_attention_heads
    "hidden_act": "silu", "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "sliding_window": None,
    "bos_token_id": None, "eos_token_id": None,
    **{f: None for f in ROPE_FIELDS},     # None: default rope, theta 10000 (tp_jax/models/rope.py)
}
# Qwen2/3: a window only on the layers HF marks "sliding_attention" (a per-layer table when some do not).
PER_LAYER_WINDOW_FIELDS = {"use_sliding_window": False, "max_window_layers": 0, "layer_types": None}
WINDOW_MODES = ("none", "all", "per_layer")


def llama_config(hf, raw=None, *, window: str = "none", qk_norm: bool = False, qkv_bias: bool | None = None,
                 o_bias: bool | None = None, extra_fields=None, extend=None) -> DecoderConfig:
    """DecoderConfig from an HF config of the Llama family. `window`: how the architecture reads
    `sliding_window` ("none": must be unset; "all": every layer slides, Mistral; "per_layer":
    Qwen2/3, the layers `layer_types` / `max_window_layers` mark). `qk_norm`: the architecture has q/k norms (Qwen3).
    `qkv_bias` / `o_bias`: the architecture's own biases (Qwen2); None: `attention_bias`.
    `extra_fields` / `extend`: more HF fields the architecture reads, and `extend(fields, arch)
    -> (config class, its extra arguments)` (the MoE models, tp_jax/models/moe.py)."""
    if window not in WINDOW_MODES:
        raise ValueError(f"llama_config: window={window!r}; choose one of {WINDOW_MODES}")
    arch = first_architecture(hf)
    fields = {**LLAMA_FIELDS, **(PER_LAYER_WINDOW_FIELDS if window == "per_layer" else {}), **(extra_fields or {})}
    f = read_fields(hf, fields, arch, raw)
    cls, more = extend(f, arch) if extend else (DecoderConfig, {})
    only_silu(f["hidden_act"], arch)
    heads, bias = f["num_attention_heads"], bool(f["attention_bias"])
    windows = _sliding_window(f, arch, window)
    return cls(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"], num_layers=f["num_hidden_layers"], num_heads=heads,
        num_kv_heads=f["num_key_value_heads"] or heads, head_dim=f["head_dim"] or f["hidden_size"] // heads,
        norm_eps=float(f["rms_norm_eps"]), rope=rope_from_hf(hf),
        max_position_embeddings=int(f["max_position_embeddings"]),
        tie_word_embeddings=bool(f["tie_word_embeddings"]),
        qkv_bias=bias if qkv_bias is None else qkv_bias, o_bias=bias if o_bias is None else o_bias,
        mlp_bias=bool(f["mlp_bias"]), hidden_act="silu", qk_norm=qk_norm,
        sliding_window=windows[0], layer_types=windows[1],
        bos_token_id=f["bos_token_id"], eos_token_ids=eos_ids(f["eos_token_id"]), **more)


def _sliding_window(f: dict, arch: str, mode: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(the window, each layer's type or None when every layer is alike), or UnsupportedConfigError naming the
    field. "per_layer" (Qwen2/3): the layers `layer_types` (or max_window_layers) marks "sliding_attention"
    slide, the others see every key."""
    window = f["sliding_window"]
    if window is None or mode == "all":
        return (None if window is None else int(window)), None
    if mode == "per_layer":
        if not f["use_sliding_window"]:
            return None, None
        first = int(f["max_window_layers"] or 0)
        types = tuple(f["layer_types"] or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(f["num_hidden_layers"])])
        if "sliding_attention" not in types:
            return None, None
        return int(window), (types if len(set(types)) > 1 else None)
    raise UnsupportedConfigError(f"config field sliding_window={window} (an active sliding window) is not "
                                 f"supported for {arch}; set it to null for full attention")


# --- weights: HF tensor names -> params ---------------------------------------------------------

def llama_weights(cfg: DecoderConfig, *, norms: tuple[str, ...] = DecoderLayer.norms) -> WeightTable:
    """HF Llama names -> param parts; bias and q/k norm entries follow the config, `norms` are the layer's
    (a family's layer may have others: Gemma, OLMo 2)."""
    hf, ours = "model.layers.{i}", "model.layers.layers"
    entries = [Entry("model.embed_tokens.weight", "model.embed_tokens.embedding", "weight"),
               Entry("model.norm.weight", "model.norm.weight", "weight")]
    entries += [Entry(f"{hf}.{n}.weight", f"{ours}.{n}.weight", "weight") for n in norms]
    if not cfg.tie_word_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.embedding", "weight"))
    linears = [(f"{hf}.self_attn.{p}_proj", f"{ours}.self_attn.qkv_proj", p, cfg.qkv_bias) for p in "qkv"]
    linears += [(f"{hf}.self_attn.o_proj", f"{ours}.self_attn.o_proj", None, cfg.o_bias),
                (f"{hf}.mlp.gate_proj", f"{ours}.mlp.gate_up_proj", "0", cfg.mlp_bias),
                (f"{hf}.mlp.up_proj", f"{ours}.mlp.gate_up_proj", "1", cfg.mlp_bias),
                (f"{hf}.mlp.down_proj", f"{ours}.mlp.down_proj", None, cfg.mlp_bias)]
    for name, module, part, bias in linears:
        entries.append(Entry(f"{name}.weight", f"{module}.kernel", part or "weight"))
        if bias:
            entries.append(Entry(f"{name}.bias", f"{module}.bias", part or "bias"))
    if cfg.qk_norm:
        entries += [Entry(f"{hf}.self_attn.{n}.weight", f"{ours}.self_attn.{n}.weight", "weight")
                    for n in ("q_norm", "k_norm")]
    ignored = [f"{hf}.self_attn.rotary_emb.inv_freq"] + (["lm_head.weight"] if cfg.tie_word_embeddings else [])
    return WeightTable(entries, ignored)


register("LlamaForCausalLM", LlamaForCausalLM, config=llama_config, weights=llama_weights)
