"""Tiny Llama checkpoints in the published quantized formats, and the float model of their dequantized weights.

    write_quantized(root, fmt) -> (path of the quantized checkpoint, path of its dequantized float32 twin)

Every linear layer of the decoder (q/k/v/o, gate/up/down) is quantized; the embedding and LM head stay
float, as in the published releases. The packing follows the published rules, written here independently
of tp_jax's reader (tp_jax/loaders/packed.py) so a misread layout fails the tests:

* GPTQ (AutoGPTQ / GPTQModel v1 format): qweight int32 [in/p, out], input i at bits b*(i % p) of word i // p;
  qzeros int32 [G, out/p] holding z - 1; scales float16 [G, out]; g_idx int32 [in];
* AWQ (AutoAWQ GEMM): qweight int32 [in, out/8], column 8w + ORDER[k] at bits 4k, ORDER = 0 2 4 6 1 3 5 7;
  qzeros the same over [G, out/8]; scales float16 [G, out];
* compressed-tensors: the `compressed-tensors` package's own `pack_to_int32` (pack-quantized) and the
  int8 / float8 tensors its int- and float-quantized formats store;
* FP8 (`quant_method: fp8`): float8_e4m3fn weights with `weight_scale_inv` per block or a scalar `weight_scale`.

The dequantized twin holds w = (q - z) * s (FP8: q * s) in float32, computed from the integers and scales
this module chose, never from a checkpoint read back.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128,
            tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)

# name -> (writer, its arguments)
FORMATS = {
    "gptq4": ("gptq", dict(bits=4, group_size=32, sym=False, desc_act=False)),
    "gptq4_sym_actorder": ("gptq", dict(bits=4, group_size=32, sym=True, desc_act=True)),
    "gptq8_channel": ("gptq", dict(bits=8, group_size=-1, sym=False, desc_act=False)),
    "awq4": ("awq", dict(group_size=32)),
    "ct_w4a16": ("ct_pack", dict(bits=4, group_size=32, sym=True)),
    "ct_w4a16_asym": ("ct_pack", dict(bits=4, group_size=32, sym=False)),
    "ct_w4a16_actorder": ("ct_pack", dict(bits=4, group_size=32, sym=True, actorder=True)),
    "ct_w8a16": ("ct_pack", dict(bits=8, group_size=None, sym=True)),
    "ct_w8a8": ("ct_int8", {}),
    "ct_fp8_dynamic": ("ct_fp8", {}),
    "ct_fp8_block": ("ct_fp8", dict(block=(32, 32))),
    "fp8_block": ("fp8", dict(block=(32, 32))),
    "fp8_tensor": ("fp8", dict(block=None)),
}


def integer_quantize(w: np.ndarray, bits: int, group: int, sym: bool, perm: np.ndarray | None = None):
    """Round-to-nearest per group of `group` inputs (in `perm` order): (q uint [out, in], scales float16
    [out, G], zeros int [out, G], g_idx [in]) with w ~ (q - z[:, g]) * s[:, g]."""
    out, inp = w.shape
    order = np.arange(inp) if perm is None else perm
    g_idx = np.empty(inp, np.int32)
    g_idx[order] = np.arange(inp) // group
    n = -(-inp // group)
    top = (1 << bits) - 1
    s, z = np.zeros((out, n), np.float16), np.zeros((out, n), np.int64)
    for g in range(n):
        cols = w[:, g_idx == g]
        if sym:
            s[:, g] = np.maximum(np.abs(cols).max(1), 1e-6) / ((1 << (bits - 1)) - 1)
            z[:, g] = 1 << (bits - 1)
        else:
            lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
            s[:, g] = np.maximum(hi - lo, 1e-6) / top
            z[:, g] = np.clip(np.round(-lo / s[:, g].astype(np.float32)), 0, top)
    sf = s.astype(np.float32)[:, g_idx]
    q = np.clip(np.round(w / sf) + z[:, g_idx], 0, top).astype(np.int64)
    return q, s, z, g_idx


def dequantize(q, s, z, g_idx) -> np.ndarray:
    return (q.astype(np.float32) - z[:, g_idx].astype(np.float32)) * s.astype(np.float32)[:, g_idx]


def pack_along(v: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Unsigned values -> int32 words along `axis` (p = 32 / bits per word; value k of a word at bits
    bits * k holds element order[k] of its run)."""
    per = 32 // bits
    v = np.moveaxis(np.asarray(v, np.uint64), axis, -1)
    runs = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        runs = runs[..., list(order)]
    words = (runs << (np.arange(per, dtype=np.uint64) * bits)).sum(-1).astype(np.uint32).view(np.int32)
    return np.moveaxis(words, -1, axis)


def _gptq(w, bits, group_size, sym, desc_act, rng):
    gs = w.shape[1] if group_size == -1 else group_size
    perm = rng.permutation(w.shape[1]) if desc_act else None    # rng: one stream per input (q/k/v share one)
    q, s, z, g = integer_quantize(w, bits, gs, sym, perm)
    stored = {"qweight": pack_along(q.T, bits, 0), "qzeros": pack_along((z - 1).T, bits, 1),
              "scales": np.ascontiguousarray(s.T), "g_idx": g}
    return stored, dequantize(q, s, z, g)


def _awq(w, group_size, rng):
    q, s, z, g = integer_quantize(w, 4, group_size, False)
    stored = {"qweight": pack_along(q.T, 4, 1, AWQ_ORDER), "qzeros": pack_along(z.T, 4, 1, AWQ_ORDER),
              "scales": np.ascontiguousarray(s.T)}
    return stored, dequantize(q, s, z, g)


def _ct_pack(w, bits, group_size, sym, rng, actorder=False):
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    perm = rng.permutation(w.shape[1]) if actorder else None
    q, s, z, g = integer_quantize(w, bits, group_size or w.shape[1], sym, perm)
    off = 1 << (bits - 1)
    signed = lambda a: torch.tensor((a - off).astype(np.int8))            # noqa: E731  (the package's int8 form)
    stored = {"weight_packed": pack_to_int32(signed(q), bits).numpy(),
              "weight_scale": s,
              "weight_shape": np.array(w.shape, np.int64)}
    if not sym:
        stored["weight_zero_point"] = pack_to_int32(signed(z), bits, packed_dim=0).numpy()
    if actorder:
        stored["weight_g_idx"] = g
    return stored, dequantize(q, s, z, g)


def _ct_int8(w, rng):
    q, s, z, g = integer_quantize(w, 8, w.shape[1], True)
    return {"weight": (q - 128).astype(np.int8), "weight_scale": s.astype(np.float32)}, dequantize(q, s, z, g)


def _fp8_values(w, scale_of):
    s = scale_of(w).astype(np.float32)
    q = (w / s).astype(ml_dtypes.float8_e4m3fn)
    return q, q.astype(np.float32) * s


def _ct_fp8(w, rng, block=None):
    if block is not None:                       # the block strategy: weight_scale [out / bo, in / bi]
        stored, deq = _fp8(w, block, rng)
        return {"weight": stored["weight"], "weight_scale": stored["weight_scale_inv"]}, deq
    s = np.abs(w).max(1, keepdims=True) / 448
    q, deq = _fp8_values(w, lambda _: s)
    return {"weight": q, "weight_scale": s.astype(np.float32)}, deq


def _fp8(w, block, rng):
    if block is None:
        s = np.float32(np.abs(w).max() / 448)
        q, deq = _fp8_values(w, lambda _: np.full(w.shape, s))
        return {"weight": q, "weight_scale": np.array(s, np.float32)}, deq
    bo, bi = block
    blocks = np.abs(w).reshape(w.shape[0] // bo, bo, w.shape[1] // bi, bi).max((1, 3)) / 448
    full = np.repeat(np.repeat(blocks, bo, 0), bi, 1)
    q, deq = _fp8_values(w, lambda _: full)
    return {"weight": q, "weight_scale_inv": blocks.astype(np.float32)}, deq


WRITERS = {"gptq": _gptq, "awq": _awq, "ct_pack": _ct_pack, "ct_int8": _ct_int8, "ct_fp8": _ct_fp8, "fp8": _fp8}


def quantization_config(fmt: str) -> dict:
    writer, kw = FORMATS[fmt]
    if writer == "gptq":
        return {"quant_method": "gptq", "bits": kw["bits"], "group_size": kw["group_size"], "sym": kw["sym"],
                "desc_act": kw["desc_act"], "checkpoint_format": "gptq", "damp_percent": 0.01}
    if writer == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": kw["group_size"], "version": "gemm",
                "zero_point": True, "modules_to_not_convert": None}
    if writer == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(kw["block"]) if kw["block"] else None}
    weights = {"ct_pack": dict(num_bits=kw.get("bits"), type="int", symmetric=kw.get("sym"),
                               strategy="group" if kw.get("group_size") else "channel",
                               group_size=kw.get("group_size"), actorder="group" if kw.get("actorder") else None),
               "ct_int8": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
               "ct_fp8": dict(num_bits=8, type="float", symmetric=True, strategy="block" if kw.get("block") else
                              "channel", block_structure=list(kw["block"]) if kw.get("block") else None)}[writer]
    acts = {"ct_int8": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
            "ct_fp8": dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)}.get(writer)
    fmt_name = {"ct_pack": "pack-quantized", "ct_int8": "int-quantized", "ct_fp8": "float-quantized"}[writer]
    return {"quant_method": "compressed-tensors", "format": fmt_name, "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**weights, "dynamic": False},
                                          "input_activations": acts, "format": fmt_name}}}


def write_quantized(root: str, fmt: str, seed: int = 0, config=None) -> tuple[str, str]:
    """Write a tiny model (`config`: a transformers config; default the tiny Llama of BASE) quantized as `fmt`
    (a key of FORMATS), and its dequantized float twin, once. transformers saves the float model (MoE experts
    as per-expert tensors, as published checkpoints hold them); each decoder linear weight is then quantized
    and replaced in the twin by its dequantized values."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from tests.tiny_models import randomize
    path, twin = os.path.join(root, fmt), os.path.join(root, fmt + "_dequantized")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, twin
    torch.manual_seed(seed)
    cfg = config or LlamaConfig(**BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    randomize(AutoModelForCausalLM.from_config(cfg).eval()).save_pretrained(twin, safe_serialization=True)
    quantize_dir(twin, path, fmt, seed, dequantized=twin)
    return path, twin


def quantize_dir(src: str, dst: str, fmt: str, seed: int = 0, dequantized: str | None = None) -> str:
    """A float Hugging Face checkpoint directory `src` (one model.safetensors) quantized as `fmt` into `dst`
    (config.json with its quantization_config, the other files copied: tokenizer, generation config);
    `dequantized`: a directory to write the dequantized float weights to (may be `src`)."""
    import shutil
    from safetensors.numpy import load_file, save_file
    floats = load_file(os.path.join(src, "model.safetensors"))
    writer, kw = FORMATS[fmt]
    shared_input = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}
    tensors, twin_tensors = {}, {}
    for name, w in floats.items():
        module, leaf = name.rsplit(".", 1)
        kind = module.rsplit(".", 1)[-1]
        if leaf != "weight" or kind not in LINEARS:
            tensors[name] = twin_tensors[name] = w
            continue
        key = f"{module.rsplit('.', 1)[0]}.{shared_input.get(kind, kind)}"   # GPTQ's act order follows the input's
        rng = np.random.default_rng([seed, *map(ord, key)])                   # Hessian: one order per shared input
        stored, deq = WRITERS[writer](w.astype(np.float32), rng=rng, **kw)
        tensors.update({f"{module}.{k}": np.ascontiguousarray(v) for k, v in stored.items()})
        twin_tensors[name] = deq.astype(np.float32)
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    if dequantized is not None:
        os.makedirs(dequantized, exist_ok=True)
        save_file(twin_tensors, os.path.join(dequantized, "model.safetensors"), metadata={"format": "pt"})
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    hf["quantization_config"] = quantization_config(fmt)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    return dst
