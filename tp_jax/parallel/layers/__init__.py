"""vLLM's parallel layers as Flax NNX modules (global params with specs, local forward).

Each layer declares how its params split over tp once (`loading()` -> `ShardedParam`);
the row-map helpers build those declarations, `Stack` scans stacked layers. A linear or
vocab layer's weight is held by a `LinearMethod` (float, `Bfloat16`, `Int8`, `GGUFBlocks`, `ByRows`): the layer
keeps the split and the collectives, the method the representation and the local GEMM.
"""

from tp_jax.parallel.layers.base import MethodLayer, ParallelModule
from tp_jax.parallel.layers.by_rows import ByRows
from tp_jax.parallel.layers.ggml import GGUFBlocks
from tp_jax.parallel.layers.int8 import Int8
from tp_jax.parallel.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear,
                                           RowParallelLinear)
from tp_jax.parallel.layers.loading import (ExpertParam, LazyTensor, PartRows, ShardedParam, WeightShapeError, contiguous_rows,
                                            expand_heads, replicated_rows)
from tp_jax.parallel.layers.method import (Bfloat16, DerivedParam, ExpertMethod, LinearMethod, QuantizationError,
                                           Unquantized, UnsupportedLayerError, WeightParam)
from tp_jax.parallel.layers.moe import Experts, FusedMoE, expert_slots
from tp_jax.parallel.layers.norm import GemmaRMSNorm, LayerNorm, QKNorm, RMSNorm
from tp_jax.parallel.layers.quantization import (QuantizationConfig, apply_methods, quantization_config,
                                                 register_quantization)
from tp_jax.parallel.layers.qkv import QKVParallelLinear
from tp_jax.parallel.layers.stack import Stack
from tp_jax.parallel.layers.table import Entry, WeightTable
from tp_jax.parallel.layers.vocab import ParallelLMHead, ReplicatedEmbedding, VocabParallelEmbedding, padded_vocab_size

__all__ = ["ParallelModule", "ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear",
           "RowParallelLinear", "QKVParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
           "ReplicatedEmbedding", "RMSNorm", "GemmaRMSNorm", "QKNorm", "LayerNorm", "Stack", "padded_vocab_size",
           "LazyTensor", "PartRows", "ShardedParam", "WeightShapeError",
           "contiguous_rows", "replicated_rows", "expand_heads", "Entry", "WeightTable",
           "MethodLayer", "LinearMethod", "Unquantized", "Bfloat16", "Int8", "GGUFBlocks", "ByRows", "DerivedParam", "WeightParam",
           "ExpertMethod", "QuantizationError", "UnsupportedLayerError", "QuantizationConfig", "quantization_config",
           "register_quantization", "apply_methods", "FusedMoE", "Experts", "expert_slots", "ExpertParam"]
