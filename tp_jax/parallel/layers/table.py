"""Name tables: which checkpoint tensor fills which part of which param, and how it is stored.

A model's `WeightTable` is a list of `Entry`s (vLLM's `stacked_params_mapping` plus its
name remapping, as data) and the checkpoint tensors it deliberately leaves unused.
An entry may declare two storage facts, so no layer has to be subclassed for them:

* `layout="in_out"`: the checkpoint stores a 2-D weight `[in, out]` (GPT-2's Conv1D)
  where the layers declare torch's `[out, in]`. A non-square weight in the wrong
  orientation fails the shape check (the message says so); a *square* one cannot be
  caught by shape, so declare the layout on every entry of a checkpoint that uses it.
* `offset=k`: the part is rows `[k, k + n)` (n = the part's declared size) of a larger
  fused tensor, e.g. GPT-2's `c_attn` holding q | k | v.
* `index=e`: the part is entry e of the stored tensor's leading dimension (one expert of a
  fused `[E, ...]` expert tensor); layout and offset then apply to that entry.

A table may carry `variants`: the same model's table for another way checkpoints store it
(fused experts); the loader uses the first whose tensors the checkpoint holds.

`TensorView` presents a stored tensor in the declared layout, lazily: a rank's slab of
the view reads only the matching slab of the stored tensor.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

LAYOUTS = ("out_in", "in_out")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint tensor (or a run of its rows) filling one part of one param.

    Args:
      hf: the checkpoint tensor name; `{i}` stands for the layer index of a stacked param
        (one built by `Stack`), e.g. "model.layers.{i}.self_attn.q_proj.weight".
      param: the param's path in the model, e.g. "model.layers.layers.self_attn.qkv_proj.kernel".
      part: the part of the param's declaration (`loading()`) it fills: "weight", "bias",
        "q" / "k" / "v" (QKVParallelLinear), "0" / "1" (MergedColumnParallelLinear).
      layout: "out_in" (default: torch `nn.Linear`, the layers' declared layout) or
        "in_out" (stored transposed, GPT-2's Conv1D); only for 2-D tensors.
      offset: None when the whole tensor is the part; k when the part is rows [k, k + n)
        of the tensor's first dimension (in the declared layout).
      index: None, or e: the part is `tensor[e]` (a fused `[E, ...]` tensor of experts).
    """
    hf: str
    param: str
    part: str
    layout: str = "out_in"
    offset: int | None = None
    index: int | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self}: layout must be one of {LAYOUTS}")
        if self.offset is not None and (not isinstance(self.offset, int) or self.offset < 0):
            raise ValueError(f"{self}: offset must be None or a non-negative int")

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    def name(self, layer: int | None) -> str:
        """The checkpoint tensor name, for `layer` when stacked."""
        return self.hf.format(i=layer) if self.stacked else self.hf


@dataclasses.dataclass(frozen=True)
class WeightTable:
    """A model's name table: its entries and the checkpoint tensors it leaves unused on purpose.

    Args:
      entries: every `Entry`; each must match a param, and every param must be filled.
      ignored: checkpoint tensor names (`{i}` = any layer; a final `*`: every name with that prefix) that carry
        nothing the model needs, e.g. a tied "lm_head.weight", old "rotary_emb.inv_freq" buffers, or a
        multimodal checkpoint's "vision_tower.*". Any other tensor that no entry takes makes loading fail (the
        checkpoint does not match).
    """
    entries: tuple[Entry, ...]
    ignored: tuple[str, ...] = ()
    variants: tuple[WeightTable, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "entries", tuple(self.entries))
        object.__setattr__(self, "ignored", tuple(self.ignored))
        object.__setattr__(self, "variants", tuple(self.variants))

    def for_names(self, names) -> WeightTable:
        """This table, or the first variant whose layer-0 / unstacked tensor names all appear in `names`
        (a checkpoint's keys) when this one's do not."""
        names = set(names)
        for table in (self, *self.variants):
            if all(e.name(0) in names for e in table.entries):
                return table
        return self

    def is_ignored(self, name: str) -> bool:
        return any(name.startswith(t[:-1]) if t.endswith("*") else template_regex(t).fullmatch(name)
                   for t in self.ignored)


def template_regex(template: str) -> re.Pattern:
    """A regex matching `template` with `{i}` as any layer index (group "i")."""
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)"))


class PackedRows:
    """A packed quantized weight's rows [offset, offset + rows): its methods with the output slice shifted."""

    def __init__(self, tensor, offset: int, rows: int):
        self.tensor, self.offset = tensor, offset
        self.shape = (rows, tensor.shape[1])

    def __getattr__(self, name):
        return getattr(self.tensor, name)

    def _rows(self, o: slice) -> slice:
        lo, hi, _ = o.indices(self.shape[0])
        return slice(lo + self.offset, hi + self.offset)

    def values(self, o: slice, i: slice):
        return self.tensor.values(self._rows(o), i)

    def scales(self, o: slice, g: slice = slice(None)):
        return self.tensor.scales(self._rows(o), g)

    def zeros(self, o: slice, g: slice = slice(None)):
        return self.tensor.zeros(self._rows(o), g)


class TensorView:
    """A stored lazy tensor seen in the declared layout: transposed (`in_out`) and/or a run of rows.

    `shape` is the view's; `view[slices]` reads only the matching slab of the stored tensor.
    """

    def __init__(self, tensor, layout: str = "out_in", offset: int = 0, rows: int | None = None,
                 index: int | None = None):
        if index is not None:
            tensor = _Indexed(tensor, index)
        self.tensor, self.transposed, self.offset = tensor, layout == "in_out", offset
        shape = tuple(tensor.shape)
        shape = shape[::-1] if self.transposed else shape
        n = shape[0] - offset if rows is None else rows
        self.shape = (n, *shape[1:])

    def __getitem__(self, index) -> np.ndarray:
        sl = _slices(index, self.shape)
        first = sl[0].indices(self.shape[0])
        sl[0] = slice(first[0] + self.offset, first[1] + self.offset)
        if not self.transposed:
            return np.asarray(self.tensor[tuple(sl)])
        return np.asarray(self.tensor[tuple(sl[::-1])]).T

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    @property
    def quant_type(self) -> str | None:
        """The stored tensor's GGUF type ("Q4_1", "F32", ...), None for a plain float tensor."""
        return getattr(self.tensor, "quant_type", None)

    @property
    def stored_dtype(self) -> np.dtype | None:
        """The stored tensor's dtype as its header says (a quantized GGUF tensor: float32, what it dequantizes
        to), None where the source does not say."""
        dtype = getattr(self.tensor, "dtype", None)
        return None if dtype is None else np.dtype(dtype)

    @property
    def is_packed(self) -> bool:
        """Whether `packed()` has a quantized weight to give (a published format's, loaders/packed.py)."""
        return hasattr(self.transposed_rows() if self.transposed else self.tensor, "values")

    def transposed_rows(self):
        """For a view of a float `[in, out]` whose stored bytes are rows `[out, in]` (MXFP4's experts,
        loaders/mxfp4.py): those packed rows; else None."""
        rows = getattr(self.tensor, "stored_rows", None)
        return rows() if rows is not None else None

    def packed(self) -> PackedRows:
        """The stored quantized weight (a published format's `values`, `scales`, `zeros`, `groups`: loaders/packed.py)
        over the same rows as this view."""
        tensor = self.transposed_rows() if self.transposed else self.tensor
        if not hasattr(tensor, "values"):
            raise ValueError(f"{self.tensor!r} is not a packed quantized weight"
                             + (" stored [out, in] (a packed weight is read in that layout)" if self.transposed
                                else ""))
        return PackedRows(tensor, self.offset, self.shape[0])

    def blocks(self) -> TensorView:
        """The stored tensor's raw quant blocks `[rows, in/32, bytes]`, over the same rows as this view."""
        if self.transposed:
            raise ValueError("a tensor stored [in, out] has no row blocks: its quant blocks run along the output")
        return TensorView(self.tensor.blocks(), "out_in", self.offset, self.shape[0])


class _Indexed:
    """`tensor[index]` of a lazy tensor, itself lazy: slicing reads only that entry's slab."""

    def __init__(self, tensor, index: int):
        self.tensor, self.index, self.shape = tensor, index, tuple(tensor.shape)[1:]
        self.dtype = getattr(tensor, "dtype", None)
        # a format that packs each expert's rows (MXFP4) names itself; any other entry of a fused tensor reads as float
        self.quant_type = getattr(tensor, "quant_type", None) if hasattr(tensor, "expert") else None

    def stored_rows(self):
        """Entry `index` of a fused tensor of experts whose float `[E, in, out]` stores each expert's rows packed
        (`MXFP4Tensor.expert`), else None."""
        expert = getattr(self.tensor, "expert", None)
        return expert(self.index) if expert is not None else None

    def __getitem__(self, sl) -> np.ndarray:
        sl = _slices(sl, self.shape)
        return np.asarray(self.tensor[(slice(self.index, self.index + 1), *sl)])[0]


def _slices(index, shape: tuple[int, ...]) -> list[slice]:
    """A numpy index of contiguous slices (or Ellipsis) as one slice per dimension."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(shape) - len(index) + 1) + index[k + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape) or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
        raise IndexError(f"a tensor view takes one contiguous slice per dimension, got {index!r}")
    return list(index)


class ShapedSlice:
    """Adapts an object with `get_shape()` and slicing (a safetensors `get_slice` handle) to a lazy tensor."""

    def __init__(self, handle):
        self.handle, self.shape = handle, tuple(handle.get_shape())

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self.handle[index])


def as_lazy(tensor, name: str):
    """`tensor` as a lazy tensor (`.shape` + slicing), or TypeError naming the tensor."""
    if hasattr(tensor, "shape") and hasattr(tensor, "__getitem__"):
        return tensor
    if hasattr(tensor, "get_shape") and hasattr(tensor, "__getitem__"):
        return ShapedSlice(tensor)
    raise TypeError(f"the source returned {type(tensor).__name__} for tensor {name!r}; a lazy tensor needs "
                    f"`.shape` and numpy-style slicing (a numpy array, a memory map, a safetensors slice)")
