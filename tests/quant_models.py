"""Quantized tiny checkpoints and their float references, written by the tests.

* `int8_reference(path)` -> `(Q, s)` per weight of a float checkpoint, by numpy: the
  independent reference for `Int8` (per output channel, symmetric, round to nearest).
* `dequantized_copy(src, out, fn)`: a HF checkpoint whose 2-D weights are `fn(weight)`
  (e.g. int8's Q * s) -- transformers then computes what a quantized model should.
* `write_tiny_gguf(root)`: a 2-layer llama GGUF whose linear and vocab weights are Q4_1 /
  Q4_0 / Q8_0 blocks (dimensions chosen so every tp in {1, 2, 3, 4, 8} cuts whole 32-element
  blocks), plus the HF checkpoint of its dequantized weights (the reference).
* `write_truncated_gguf(src, out, layers)`: a published GGUF's first `layers` blocks, every tensor and
  metadata field copied as stored.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType

# hidden 128 = 4 heads of 32, intermediate 768 = 32 * 24: a row-parallel rank's input is whole
# blocks at every tp in {1, 2, 3, 4, 8} (o_proj: whole heads of 32; down_proj: 768 / tp).
GGUF_DIMS = dict(vocab_size=1000, hidden_size=128, intermediate_size=768, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                 max_position_embeddings=128, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                 model_type="llama", bos_token_id=1, eos_token_id=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# HF name suffix -> the GGUF type its tensor is stored in: all three kept types, one per param.
GGUF_TYPES = {"embed_tokens.weight": QT.Q8_0, "lm_head.weight": QT.Q4_0, "q_proj.weight": QT.Q4_1,
              "k_proj.weight": QT.Q4_1, "v_proj.weight": QT.Q4_1, "o_proj.weight": QT.Q4_1,
              "gate_proj.weight": QT.Q4_1, "up_proj.weight": QT.Q4_1, "down_proj.weight": QT.Q8_0}


def int8_reference(w: np.ndarray, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """(Q int8 [out, in], s float32 [out]) with W ~ Q * s[:, None]; an all-zero row gets s = 0, Q = 0.
    `dtype`: the arithmetic of s and W / s. Dequantized GGUF weights lie on a grid, so W / s often lands on
    a rounding tie: float32 arithmetic (the loader's) breaks those ties as the loader does."""
    w = np.asarray(w, dtype)
    s = np.abs(w).max(axis=1) / dtype(127)
    q = np.round(w / np.where(s > 0, s, 1)[:, None])
    return q.astype(np.int8), s.astype(np.float32)


def int8_dequantized(w: np.ndarray, dtype=np.float64) -> np.ndarray:
    q, s = int8_reference(w, dtype)
    return q.astype(np.float32) * s[:, None]


def gguf_dequantized(w: np.ndarray, qtype: QT) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(np.asarray(w, np.float32), qtype), qtype)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update({k: np.asarray(v, np.float32) for k, v in load_file(os.path.join(path, f)).items()})
    return out


def dequantized_copy(src: str, out: str, fn) -> str:
    """`src` (a HF checkpoint directory) with every 2-D weight replaced by `fn(name, weight)`, float32."""
    from safetensors.numpy import save_file
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    tensors = {k: (fn(k, v) if v.ndim == 2 else v).astype(np.float32) for k, v in read_safetensors(src).items()}
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["dtype"] = config["torch_dtype"] = "float32"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def _gguf_type(hf_name: str) -> QT:
    return next(t for suffix, t in GGUF_TYPES.items() if hf_name.endswith(suffix))


def write_tiny_gguf(root: str) -> tuple[str, str, str]:
    """(the quantized .gguf, the HF checkpoint of the float weights it was made from, the HF checkpoint of
    its dequantized weights). Written once under `root`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from tests.test_gguf import llamacpp_permute
    from tests.tiny_models import randomize
    path, float_dir, deq_dir = (os.path.join(root, n) for n in ("tiny.gguf", "tiny_float", "tiny_dequantized"))
    if os.path.isfile(path):
        return path, float_dir, deq_dir
    torch.manual_seed(17)
    randomize(LlamaForCausalLM(LlamaConfig(**GGUF_DIMS)).eval()).save_pretrained(float_dir, safe_serialization=True)
    hf = read_safetensors(float_dir)
    c = GGUF_DIMS
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    from tp_jax.loaders.gguf import NAME_TABLE
    to_gguf = {h.format(i=i): g.format(i=i) for g, h in NAME_TABLE.items() for i in range(c["num_hidden_layers"])}
    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    for name, x in hf.items():
        if x.ndim == 1:
            w.add_tensor(to_gguf[name], x)
            continue
        n_head = next((n for k, n in heads.items() if k in name), None)
        x = x if n_head is None else llamacpp_permute(x, n_head)
        w.add_tensor(to_gguf[name], gguf.quants.quantize(x, _gguf_type(name)), raw_dtype=_gguf_type(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # quantization is row-wise, so it commutes with llama.cpp's q/k row permutation
    dequantized_copy(float_dir, deq_dir, lambda name, x: gguf_dequantized(x, _gguf_type(name)))
    return path, float_dir, deq_dir


def write_truncated_gguf(src: str, out: str, layers: int) -> str:
    """A copy of the GGUF `src` with only its first `layers` blocks: the file's own tensors (bytes, types, dims),
    metadata and tokenizer, its block count set to `layers`."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch)
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue                                         # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == block_count else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return out
