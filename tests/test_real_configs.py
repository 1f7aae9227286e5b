"""`jax.eval_shape` over real-size Llama configs: the sharding plan without allocating a byte."""

import math

import jax
import pytest
from flax import nnx

from tp_jax.loaders.model import abstract_model
from tp_jax.parallel.mesh import make_mesh
from tp_jax.models.config import config_from_hf

LLAMA3 = dict(vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=8192, architectures=["LlamaForCausalLM"],
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
CONFIGS = {
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8),
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
}


def hf_param_count(hf) -> int:
    """transformers' own parameter count, built on the meta device (no memory)."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    return sum(p.numel() for p in model.parameters())


def per_device_bytes(model, mesh) -> tuple[int, int]:
    """(total elements over the global arrays, bytes on the busiest device)."""
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    total, per_dev = 0, 0
    for (_, var), (_, spec) in zip(nnx.to_flat_state(state), nnx.to_flat_state(specs)):
        x, spec = var.get_value(), spec.get_value()
        total += math.prod(x.shape)
        shards = math.prod(mesh.shape[a] for a in spec if a is not None)
        per_dev += math.prod(x.shape) // shards * x.dtype.itemsize
    return total, per_dev


@pytest.mark.parametrize("name,tp", [("Llama-3-8B", 8), ("Llama-3-70B", 8), ("Llama-3.2-1B", 8), ("Llama-3.2-1B", 1)])
def test_real_size_plan(name, tp):
    from transformers import LlamaConfig
    hf = LlamaConfig(**{**LLAMA3, **CONFIGS[name]})
    cfg = config_from_hf(hf)
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
    model = abstract_model(cfg, mesh, dtype=jax.numpy.bfloat16)
    total, per_dev = per_device_bytes(model, mesh)
    expected = hf_param_count(hf)
    assert total == expected            # these head counts and vocab divide: no padding at all
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2            # replicated, bf16
    assert per_dev == pytest.approx((expected * 2 - norms) / tp + norms, rel=1e-6)
    print(f"{name} tp={tp}: {expected / 1e9:.2f}B params, {per_dev / 2**30:.2f} GiB per device (bf16)")
