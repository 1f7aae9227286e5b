"""VocabParallelEmbedding and ParallelLMHead (vllm/model_executor/layers/vocab_parallel_embedding.py).

The vocabulary is padded to a multiple of lcm(64, tp) and split in equal runs of rows:
rank i holds rows [i*V_local, (i+1)*V_local) of E[V_pad, D]. Embedding: ids outside a
rank's run are masked to zero, then the ranks' rows are summed (one all-reduce).
LM head: logits_local = h E_i^T with padded rows set to the dtype's minimum, so a padded
id never wins an argmax or gets probability; `gather_output` all-gathers the vocab and
drops the padding. The table is held by the layer's `method` (layers/method.py), which
also does the lookup (`embed`) and the logits GEMM (`apply`), e.g. on int8 rows or GGUF blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from tp_jax.parallel import collectives
from tp_jax.parallel.layers.base import MethodLayer, ParallelModule, check_tp_size, declared_param
from tp_jax.parallel.layers.loading import PartRows, ShardedParam, contiguous_rows
from tp_jax.parallel.layers.method import EMBEDDING, LinearMethod
from tp_jax.parallel.mesh import TP

VOCAB_PAD = 64


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """`vocab_size` rounded up to a multiple of lcm(64, tp): equal vocab runs per rank."""
    multiple = math.lcm(VOCAB_PAD, tp_size)
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(MethodLayer):
    """ids[...] -> E[ids] of shape [..., D]; E[V_pad, D] sharded on the vocab rows (one all-reduce).

    Args: `num_embeddings` V (padded to a multiple of lcm(64, tp)), `features` D, `tp_size`,
    `dtype`, `rngs`, `embedding_init` (default normal(0.02)), `method` (the table's
    `LinearMethod`; None: float). Checkpoint part: "weight" `[V, D]`. `attend(h)` gives
    tied-head logits.
    """
    weight_name, weight_kind, weight_transposed = "embedding", EMBEDDING, False
    switched = False                             # a lookup reads the table directly

    def __init__(self, num_embeddings: int, features: int, *, tp_size: int = 1, dtype=jnp.float32,
                 rngs: nnx.Rngs, embedding_init=None, method: LinearMethod | None = None):
        check_tp_size(tp_size, type(self).__name__)
        if num_embeddings < 1 or features < 1:
            raise ValueError(f"{type(self).__name__}: num_embeddings={num_embeddings} and "
                             f"features={features} must be >= 1.")
        self.num_embeddings, self.features, self.tp_size = num_embeddings, features, tp_size
        self.padded_size = padded_vocab_size(num_embeddings, tp_size)
        self.local_size = self.padded_size // tp_size
        self.init_weight(method, dtype, rngs, embedding_init or nnx.initializers.normal(0.02))

    def weight_shape(self) -> tuple[int, int]:
        return self.padded_size, self.features

    def statements(self):
        rows = contiguous_rows(self.num_embeddings, self.tp_size, self.padded_size)
        return {"embedding": ShardedParam({"weight": PartRows((self.num_embeddings, self.features), rows)}, split=0)}

    def _start(self) -> jax.Array | int:
        return collectives.axis_index(TP) * self.local_size if self.tp_size > 1 else 0

    def __call__(self, ids: jax.Array) -> jax.Array:
        local = ids - self._start()                              # rows of this rank's table E_i[V_local, D]
        inside = (local >= 0) & (local < self.local_size)
        rows = self.method.embed(self, jnp.where(inside, local, 0))  # [..., D]
        rows = jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype))
        return collectives.all_reduce(rows, TP)

    def attend(self, h: jax.Array, gather_output: bool = True) -> jax.Array:
        """Logits h[..., D] -> [..., V] (gathered) or [..., V_local] with padding at the minimum."""
        logits = self.method.apply(self, h)                      # [..., V_local]
        ids = self._start() + jnp.arange(self.local_size)
        logits = jnp.where(ids < self.num_embeddings, logits, jnp.finfo(logits.dtype).min)
        if not gather_output:
            return logits
        return collectives.all_gather(logits, TP, dim=-1)[..., :self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection W[V_pad, D] (HF `lm_head.weight` [V, D]); `__call__(h)` gives logits.

    Args: `num_embeddings` V, `features` D, `tp_size`, `gather_output` (all-gather the vocab:
    [..., V]; else [..., V_pad/tp] with padding at the dtype's minimum), `dtype`, `rngs`, `method`.
    """

    def __init__(self, num_embeddings: int, features: int, *, tp_size: int = 1, gather_output: bool = True,
                 dtype=jnp.float32, rngs: nnx.Rngs, method: LinearMethod | None = None):
        self.gather_output = gather_output
        super().__init__(num_embeddings, features, tp_size=tp_size, dtype=dtype, rngs=rngs,
                         embedding_init=nnx.initializers.lecun_normal(), method=method)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.attend(h, self.gather_output)


class ReplicatedEmbedding(ParallelModule):
    """ids[...] -> E[ids] of shape [..., D] with the whole table E[N, D] on every rank (no collective).

    For small tables such as GPT-2's learned positions (`wpe`). Args: `num_embeddings` N,
    `features` D, `tp_size`, `dtype`, `rngs`, `embedding_init`. Checkpoint part: "weight" `[N, D]`.
    """

    def __init__(self, num_embeddings: int, features: int, *, tp_size: int = 1, dtype=jnp.float32,
                 rngs: nnx.Rngs, embedding_init=None):
        check_tp_size(tp_size, type(self).__name__)
        self.num_embeddings, self.features, self.tp_size = num_embeddings, features, tp_size
        init = embedding_init or nnx.initializers.normal(0.02)
        self.embedding = declared_param(rngs, self.loading()["embedding"], (num_embeddings, features), dtype, init)

    def loading(self):
        return {"embedding": ShardedParam({"weight": PartRows((self.num_embeddings, self.features))}, split=None)}

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)
