"""transformers' own model for a tp_jax model path (a HF directory or a .gguf file): the benchmarks' reference."""

import os


def load_hf_model(path: str, dtype: str = "float32", **kwargs):
    """AutoModelForCausalLM in `dtype` (float32 by default) on torch CPU, eval mode; GGUF files through
    transformers' GGUF reader."""
    import torch
    from transformers import AutoModelForCausalLM
    if path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kwargs).eval()
