"""tp_jax: tensor-parallel LLM inference in JAX, vLLM's model-parallel layers on XLA sharding.

Two ways in:
* the front door, `LLM(path, tensor_parallel_size=...)` with `SamplingParams`, for the
  Hugging Face architectures in `tp_jax.models` (Llama, Mistral, Qwen2 / Qwen3, GPT-2, Gemma 2 / 3,
  Phi-3 / 4, OLMo 2, OLMoE, Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V2 / V3, gpt-oss;
  `tp_jax.models.registry.supported()` names each registered architecture);
* your own Flax NNX model: build it from the parallel layers below, create it under
  `jax.set_mesh(make_mesh(tp=...))`, run its local-shape forward with `shard_module`, and
  load a checkpoint per device through a name table of `Entry`s with `load_state` + `fill`.
  See examples/custom_mlp_model.py and docs/adding_a_model.md.
"""

# --- mesh and collectives -------------------------------------------------------------
from tp_jax.parallel.mesh import AXES, DP, PP, TP, make_mesh
from tp_jax.parallel.collectives import (all_gather, all_reduce, broadcast, reduce_scatter, send_to_next,
                                send_to_prev, set_all_reduce_thresholds)
# --- head planning and parallel layers (RowParallelLinear.over_heads: o_proj under a head plan) ----
from tp_jax.parallel.heads import HeadPlan, plan_heads
from tp_jax.parallel.layers import (ColumnParallelLinear, LayerNorm, LazyTensor, MergedColumnParallelLinear,
                                    ParallelLMHead, ParallelModule, PartRows, QKVParallelLinear, ReplicatedEmbedding,
                                    ReplicatedLinear, RMSNorm, RowParallelLinear, ShardedParam, Stack,
                                    VocabParallelEmbedding, WeightShapeError, contiguous_rows, expand_heads,
                                    padded_vocab_size, replicated_rows)
# --- linear methods: what a layer's weight is in memory and how its GEMM runs (docs/quantization.md) ---
from tp_jax.parallel.layers import (GGUFBlocks, Int8, LinearMethod, QuantizationConfig, QuantizationError,
                                    Unquantized, UnsupportedLayerError, register_quantization)
# --- running a module under shard_map -------------------------------------------------
from tp_jax.parallel.shard import shard_module
# --- loading a checkpoint per device: your name table + the loader ------------------------
from tp_jax.parallel.layers import Entry, WeightTable
from tp_jax.loaders.place import (CheckpointMismatchError, MissingWeightError, NameTableError, NonFiniteWeightError,
                                  bind, fill, load_state)
# --- simulated CPU devices (call before jax starts) -------------------------------------
from tp_jax.multihost.devices import simulate_cpu_devices

# --- the front door (imported on first use: it pulls in transformers) --------------------


def __getattr__(name):
    if name == "LLM":
        from tp_jax.serving.llm import LLM
        return LLM
    if name in ("SamplingParams",):
        from tp_jax.serving.sampling import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from tp_jax.serving.structured import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "LoRARequest":
        from tp_jax.serving.lora import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput", "Logprob", "StreamEvent"):
        from tp_jax.serving import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'tp_jax' has no attribute {name!r}")


__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob",
    "StreamEvent",
    "AXES", "DP", "PP", "TP", "make_mesh",
    "all_gather", "all_reduce", "broadcast", "reduce_scatter", "send_to_next", "send_to_prev",
    "set_all_reduce_thresholds",
    "HeadPlan", "plan_heads",
    "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "ReplicatedLinear",
    "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "ReplicatedEmbedding", "padded_vocab_size",
    "RMSNorm", "LayerNorm", "Stack",
    "ParallelModule", "LazyTensor", "PartRows", "ShardedParam", "WeightShapeError",
    "contiguous_rows", "replicated_rows", "expand_heads",
    "LinearMethod", "Unquantized", "Int8", "GGUFBlocks", "QuantizationConfig", "register_quantization",
    "QuantizationError", "UnsupportedLayerError",
    "shard_module",
    "Entry", "WeightTable", "bind", "fill", "load_state", "MissingWeightError", "NameTableError",
    "CheckpointMismatchError", "NonFiniteWeightError", "simulate_cpu_devices",
]
