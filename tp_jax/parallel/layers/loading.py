"""Weight-loading declarations (vLLM's `weight_loader`): full HF tensor -> one tp rank's block.

A layer describes each of its params as a `ShardedParam`: which HF-layout tensors
("parts") feed it, the HF shape each part must have, and, per part, the source rows
of the sharded HF dimension that land on a rank (-1 = a zero padding row). The loader
only calls `ShardedParam.block(rank, parts)`; it never slices on its own.

Parts are *lazy tensors*: anything with `.shape` and numpy-style slicing (a numpy
array, a safetensors slice, a memory map). A rank's block reads one contiguous slab
per part, never the whole tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import numpy as np


class LazyTensor(Protocol):
    shape: tuple[int, ...]

    def __getitem__(self, index) -> np.ndarray: ...


class WeightShapeError(ValueError):
    """An HF tensor whose shape does not match what the layer expects."""


@dataclasses.dataclass(frozen=True)
class PartRows:
    """One HF tensor feeding a param: its expected shape and the rows each rank takes."""
    hf_shape: tuple[int, ...]
    rows: np.ndarray          # [tp, rows_per_rank] source index along `dim`, -1 = zero
    dim: int = 0              # the HF dimension that is sharded


@dataclasses.dataclass(frozen=True)
class ShardedParam:
    """How a param's per-rank block is built from HF tensors.

    The block is the concatenation of each part's taken rows along the sharded dim,
    transposed when `transpose` (HF Linear weights are [out, in], our kernels [in, out]).
    A replicated param has one part whose rows are the same on every rank.
    """
    parts: Mapping[str, PartRows]
    transpose: bool = False

    def block(self, rank: int, tensors: Mapping[str, LazyTensor], names: Mapping[str, str] | None = None,
              ) -> np.ndarray:
        missing = [p for p in self.parts if p not in tensors]
        if missing:
            raise KeyError(f"missing weight part(s) {missing}; this param needs {list(self.parts)}")
        blocks = []
        for part, spec in self.parts.items():
            t = tensors[part]
            name = (names or {}).get(part, part)
            check_shape(name, tuple(t.shape), spec.hf_shape)
            blocks.append(take_rows(t, spec.rows[rank], spec.dim))
        dim = next(iter(self.parts.values())).dim
        out = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=dim)
        return out.T if self.transpose else out


def check_shape(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise WeightShapeError(f"weight {name!r} has shape {tuple(got)}, expected {tuple(expected)} "
                               f"(check that the checkpoint matches its config.json)")


def take_rows(t: LazyTensor, rows: np.ndarray, dim: int) -> np.ndarray:
    """`t` indexed by `rows` along `dim` (zeros where rows == -1), reading one contiguous slab."""
    rows = np.asarray(rows)
    shape = list(t.shape)
    valid = rows[rows >= 0]
    index = [slice(None)] * len(shape)
    if valid.size == 0:
        first = np.asarray(t[tuple(slice(0, 1) if i == dim else slice(None) for i in range(len(shape)))])
        shape[dim] = rows.size
        return np.zeros(shape, first.dtype)
    lo, hi = int(valid.min()), int(valid.max()) + 1
    index[dim] = slice(lo, hi)
    slab = np.asarray(t[tuple(index)])
    if rows.size == hi - lo and np.array_equal(rows, np.arange(lo, hi)):
        return slab
    out = np.take(slab, np.where(rows >= 0, rows - lo, 0), axis=dim)
    pad = (rows < 0).reshape([-1 if i == dim else 1 for i in range(len(shape))])
    return np.where(pad, np.zeros((), slab.dtype), out)


def contiguous_rows(size: int, tp: int, padded: int | None = None) -> np.ndarray:
    """[tp, padded/tp] rows 0..size-1 in order, -1 beyond `size` (vocab padding)."""
    padded = size if padded is None else padded
    rows = np.arange(padded)
    return np.where(rows < size, rows, -1).reshape(tp, padded // tp)


def replicated_rows(size: int, tp: int) -> np.ndarray:
    return np.tile(np.arange(size), (tp, 1))


def expand_heads(heads: np.ndarray, head_dim: int) -> np.ndarray:
    """[tp, n] head indices -> [tp, n*head_dim] row indices (padding stays -1)."""
    rows = heads[:, :, None] * head_dim + np.arange(head_dim)
    return np.where(heads[:, :, None] >= 0, rows, -1).reshape(heads.shape[0], -1)
