"""Weight-loading declarations (vLLM's `weight_loader`): the one statement of how a param splits.

A layer describes each of its params once, as a `ShardedParam`:

* `parts`: the checkpoint tensors ("parts") that feed it, each with the shape it must
  have in the layer's declared layout (Linear weights `[out, in]`, as torch stores them)
  and, when the param is split, the source rows of the split dimension each tp rank
  takes (-1 = a zero padding row);
* `split`: which dimension of those tensors is divided over tp (None: every rank holds
  the whole tensor);
* `transpose`: the param is the transpose of its parts (kernels are `[in, out]`).

Everything else is derived from it: the param's PartitionSpec (`spec()`), its padding
mask, one rank's block (`block()`), and, in the Orbax writer, the dimension a checkpoint
tensor is chunked along. The loader only calls `ShardedParam.block(rank, parts)`; it never
slices on its own.

Parts are *lazy tensors*: anything with `.shape` and numpy-style slicing (a numpy array,
a memory map, the loaders' tensors). A rank's block reads one contiguous slab per part,
never the whole tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from tp_jax.parallel.mesh import TP


class LazyTensor(Protocol):
    """A tensor that reads only what an index selects: `.shape` and `t[slices] -> np.ndarray`."""
    shape: tuple[int, ...]

    def __getitem__(self, index) -> np.ndarray: ...


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not match what the layer expects."""


@dataclasses.dataclass(frozen=True)
class PartRows:
    """One checkpoint tensor feeding a param.

    Args:
      hf_shape: the shape the tensor must have, in the layer's declared layout.
      rows: `[tp, n]` source indices along the param's split dimension that rank r takes
        (`rows[r]`; -1 = a zero padding row), or None when the param is not split (every
        rank takes the whole tensor).
    """
    hf_shape: tuple[int, ...]
    rows: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class ShardedParam:
    """How one param divides over tp and which checkpoint tensors fill it.

    Args:
      parts: part name -> `PartRows`. A fused param has several ("q", "k", "v"); a rank's
        block is the concatenation of each part's rows along `split`.
      split: the dimension of the parts (declared layout) divided over tp, or None for a
        param every rank holds whole (norms, a row-parallel bias).
      transpose: the param is the parts' transpose (HF Linear `[out, in]` -> kernel `[in, out]`).
    """
    parts: Mapping[str, PartRows]
    split: int | None = 0
    transpose: bool = False

    def __post_init__(self):
        for name, p in self.parts.items():
            if (p.rows is None) != (self.split is None):
                raise ValueError(f"part {name!r}: rows must be given exactly when the param is split "
                                 f"(split={self.split})")

    @property
    def ndim(self) -> int:
        return len(next(iter(self.parts.values())).hf_shape)

    @property
    def param_dim(self) -> int | None:
        """The param's dimension divided over tp (the split dim after `transpose`), None if replicated."""
        if self.split is None:
            return None
        return self.ndim - 1 - self.split if self.transpose else self.split

    def spec(self) -> tuple[str | None, ...]:
        """The param's PartitionSpec entries: TP on `param_dim`, None elsewhere."""
        return tuple(TP if i == self.param_dim else None for i in range(self.ndim))

    def padding_mask(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """A mask broadcastable to the global param `shape`, True on padding rows (None: no padding)."""
        if self.split is None:
            return None
        flat = np.concatenate([p.rows for p in self.parts.values()], axis=1).reshape(-1) < 0
        if not flat.any():
            return None
        return flat.reshape([-1 if i == self.param_dim else 1 for i in range(len(shape))])

    def block(self, rank: int, tensors: Mapping[str, LazyTensor], names: Mapping[str, str] | None = None,
              ) -> np.ndarray:
        """Rank `rank`'s block, read from the parts' lazy tensors (`names`: part -> tensor name, for errors)."""
        missing = [p for p in self.parts if p not in tensors]
        if missing:
            raise KeyError(f"missing weight part(s) {missing}; this param needs {list(self.parts)}")
        blocks = []
        for part, spec in self.parts.items():
            t = tensors[part]
            check_shape((names or {}).get(part, part), tuple(t.shape), spec.hf_shape)
            if self.split is None:
                blocks.append(np.asarray(t[tuple(slice(None) for _ in spec.hf_shape)]))
            else:
                blocks.append(take_rows(t, spec.rows[rank], self.split))
        out = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=self.split or 0)
        return out.T if self.transpose else out


@dataclasses.dataclass(frozen=True)
class ExpertParam(ShardedParam):
    """Stacked experts `[E_slots, ...]`: each expert declared like a 2-D param, the expert dim split over `axes`.

    Parts are per expert, named "<part>.<e>" (`expert_parts`), each with the shape and tp rows of
    one expert's tensor. Two layouts:

    * `slots=None`: every rank holds every expert and tp splits each (`split`, `rows` as for a
      dense layer); the block of tp rank r is `[E, ...]`.
    * `slots[ranks, E_local]`: rank r of the expert group (`axes`, e.g. ("dp", "tp") flattened)
      holds whole experts `slots[r]` (-1: a never-routed zero slot); its block is `[E_local, ...]`
      and reads only those experts' tensors.
    """
    slots: tuple[tuple[int, ...], ...] | None = None
    axes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()

    @classmethod
    def build(cls, per_expert: Mapping[str, PartRows], num_experts: int, *, split: int | None, transpose: bool,
              slots: np.ndarray | None = None, axes: tuple[str, ...] = ()) -> ExpertParam:
        parts = {f"{n}.{e}": p for e in range(num_experts) for n, p in per_expert.items()}
        slots = None if slots is None else tuple(map(tuple, np.asarray(slots).tolist()))
        return cls(parts, split=split, transpose=transpose, slots=slots, axes=tuple(axes), names=tuple(per_expert))

    @property
    def ndim(self) -> int:
        return 1 + len(next(iter(self.parts.values())).hf_shape)

    def _expert(self) -> ShardedParam:
        return ShardedParam({n: self.parts[f"{n}.0"] for n in self.names}, split=self.split, transpose=self.transpose)

    @property
    def param_dim(self) -> int | None:
        if self.slots is not None:
            return 0
        inner = self._expert().param_dim
        return None if inner is None else inner + 1

    def spec(self) -> tuple:
        lead = None if not self.axes else (self.axes[0] if len(self.axes) == 1 else self.axes)
        return (lead, *self._expert().spec())

    def padding_mask(self, shape):
        return None

    def block(self, rank: int, tensors: Mapping[str, LazyTensor], names: Mapping[str, str] | None = None,
              ) -> np.ndarray:
        """Rank `rank`'s experts, stacked: `[E or E_local, ...]`; padding slots are zeros, nothing read for them."""
        one, names = self._expert(), names or {}
        experts = range(len(self.parts) // len(self.names)) if self.slots is None else self.slots[rank]
        inner_rank = rank if self.slots is None else 0
        out = []
        for e in experts:
            if e < 0:
                out.append(None)
                continue
            keys = {n: f"{n}.{e}" for n in self.names}
            missing = [k for k in keys.values() if k not in tensors]
            if missing:
                raise KeyError(f"missing weight part(s) {missing}")
            out.append(one.block(inner_rank, {n: tensors[k] for n, k in keys.items()},
                                 {n: names.get(k, k) for n, k in keys.items()}))
        shape = self._expert_shape(inner_rank)
        dtype = next((b.dtype for b in out if b is not None), np.float32)
        return np.stack([np.zeros(shape, dtype) if b is None else b for b in out]) if out else \
            np.zeros((0, *shape), dtype)

    def _expert_shape(self, rank: int) -> tuple[int, ...]:
        parts = [self.parts[f"{n}.0"] for n in self.names]
        shape = list(parts[0].hf_shape)
        if self.split is not None:
            shape[self.split] = sum(len(p.rows[rank]) for p in parts)
        elif len(parts) > 1:
            shape[0] = sum(p.hf_shape[0] for p in parts)
        return tuple(shape[::-1]) if self.transpose else tuple(shape)


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


# --- row maps: which source rows each rank takes -------------------------------------------

def contiguous_rows(size: int, tp: int, padded: int | None = None) -> np.ndarray:
    """[tp, padded/tp]: rows 0..size-1 in order, -1 beyond `size` (vocab padding). Rank r takes run r."""
    padded = size if padded is None else padded
    rows = np.arange(padded)
    return np.where(rows < size, rows, -1).reshape(tp, padded // tp)


def replicated_rows(size: int, tp: int) -> np.ndarray:
    """[tp, size]: every rank takes every row (a param held whole but declared per rank)."""
    return np.tile(np.arange(size), (tp, 1))


def expand_heads(heads: np.ndarray, head_dim: int) -> np.ndarray:
    """[tp, n] head indices -> [tp, n*head_dim] row indices (padding stays -1), e.g. from a head plan."""
    rows = heads[:, :, None] * head_dim + np.arange(head_dim)
    return np.where(heads[:, :, None] >= 0, rows, -1).reshape(heads.shape[0], -1)
