"""vLLM's parallel layers as Flax NNX modules (global params with specs, local forward)."""

from tp_jax.parallel.layers.base import ParallelModule
from tp_jax.parallel.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear,
                                  RowParallelLinear)
from tp_jax.parallel.layers.loading import LazyTensor, PartRows, ShardedParam, WeightShapeError
from tp_jax.parallel.layers.qkv import QKVParallelLinear
from tp_jax.parallel.layers.vocab import ParallelLMHead, VocabParallelEmbedding, padded_vocab_size

__all__ = ["ParallelModule", "ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear",
           "RowParallelLinear", "QKVParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
           "padded_vocab_size", "LazyTensor", "PartRows", "ShardedParam", "WeightShapeError"]
