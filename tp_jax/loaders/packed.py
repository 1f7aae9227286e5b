"""Published quantized safetensors checkpoints (GPTQ, AWQ, FP8, compressed-tensors; MXFP4) as lazy weights.

    PackedSource(source, quant)   -> the checkpoint's tensors, each quantized Linear's stored parts
                                     (`qweight`, `qzeros`, `scales`, `g_idx`; `weight_packed`, ...) seen as
                                     one `PackedTensor` under the float weight's name `<module>.weight`;
                                     gpt-oss's MXFP4 experts (`X_blocks`, `X_scales`) as one float
                                     `MXFP4Tensor` under `X` (tp_jax/loaders/mxfp4.py), each expert's
                                     rows a packed weight of kind "fp4" (`MXFP4Tensor.expert`)

A `PackedTensor` is the float `[out, in]` weight as a lazy tensor: `t[rows, cols]` dequantizes only that
slice, exactly (so `quantization=None` and every float path load it as float32). The linear method that
keeps it quantized (tp_jax/parallel/layers/packed.py) reads its fields instead, one device's slice at a
time:

    values(o, i)  [o, i] uint8 integer values q, unsigned (4- or 8-bit), or float8_e4m3fn (FP8)
    scales(o, g)  [o, g] float32, one column per group of inputs (G = 1: per row); `g` a slice of the groups
    zeros(o, g)   [o, g] uint8 zero points z (None for FP8)
    groups(i)     [i] int32: the group of each input column (GPTQ act order: its `g_idx`)

and w[o, i] = (q - z[o, g(i)]) * s[o, g(i)] in float32 (FP8: q * s[o, g(i)]). For 8-bit and smaller
ints with float16 / bfloat16 / float32 scales that product is exact in float32.

The stored layouts (vLLM's and the writers' packing rules):

    GPTQ   qweight int32 [in/p, out], input i at bits b*(i % p) of word i // p (p = 32 / b);
           qzeros int32 [G, out/p] packed the same way along out, v1 format (`checkpoint_format` gptq)
           stores z - 1; scales [G, out]; g_idx int32 [in] (used with desc_act)
    AWQ    qweight int32 [in, out/8] packed along out in AWQ's order: column 8w + AWQ_ORDER[k] at bits 4k;
           qzeros [G, out/8] the same; scales [G, out]
    compressed-tensors pack-quantized
           weight_packed int32 [out, in/p], q + 2^(b-1) at bits b*(i % p); weight_scale [out, G];
           weight_zero_point int32 [out/p, G] packed along out (asymmetric; else z = 2^(b-1)); weight_g_idx
    compressed-tensors int-quantized: weight int8 [out, in] (q + 128 is stored here), weight_scale [out, 1]
    FP8 and compressed-tensors float-quantized: weight float8_e4m3fn [out, in] with weight_scale (a scalar
           or [out, 1]) or weight_scale_inv [out / bo, in / bi] over blocks (a multiplier, despite its name)
"""

from __future__ import annotations

import numpy as np

from tp_jax.loaders.dtypes import BY_NUMPY
from tp_jax.loaders.mxfp4 import mxfp4_view
from tp_jax.loaders.safetensors import CheckpointError
from tp_jax.models.quant_config import CheckpointQuant

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)              # packing position k holds column 8w + AWQ_ORDER[k]
AWQ_POSITION = tuple(np.argsort(AWQ_ORDER))      # column j % 8 sits at position AWQ_POSITION[j % 8]
ACTIVATION_PARTS = ("input_scale", "input_zero_point", "input_global_scale")


def stored_code(t) -> str:
    """A stored tensor's safetensors dtype code ("I32", "F8_E4M3", ...), from a safetensors or an Orbax tensor."""
    return getattr(t, "file_dtype", None) or BY_NUMPY[np.dtype(t.dtype)].safetensors


class RawTensors:
    """A source's stored tensors as they are, whatever their dtype (what an Orbax conversion of a packed
    checkpoint writes: its words, scales and zero points, so the copy stays packed)."""

    def __init__(self, source):
        self.source = source

    def keys(self) -> list[str]:
        return self.source.keys()

    def get(self, name: str):
        return self.source.raw(name)


def unpack(words: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """int32 words -> uint8 values, `axis` grown 32 / bits times: value k of a word at bits bits * k
    (`order`: value k of a word holds element order[k] of its run)."""
    per, axis = 32 // bits, axis % np.ndim(words)
    w = np.expand_dims(np.ascontiguousarray(words).view(np.uint32), axis + 1)
    shifts = (np.arange(per, dtype=np.uint32) * bits).reshape([-1 if d == axis + 1 else 1 for d in range(w.ndim)])
    v = (w >> shifts) & np.uint32((1 << bits) - 1)
    if order is not None:
        v = np.take(v, np.argsort(order), axis=axis + 1)
    shape = list(words.shape)
    shape[axis] *= per
    return v.reshape(shape).astype(np.uint8)


def _range(sl: slice, size: int) -> tuple[int, int]:
    start, stop, step = sl.indices(size)
    if step != 1:
        raise IndexError(f"a packed weight reads contiguous slices only, not step {step}")
    return start, max(start, stop)


def _words(lo: int, hi: int, per: int) -> tuple[slice, int]:
    """The words holding elements [lo, hi) and the offset of element lo in their unpacked run."""
    return slice(lo // per, -(-hi // per)), lo - lo // per * per


class PackedTensor:
    """A quantized Linear weight as its float `[out, in]` (module docstring). Subclasses read one layout."""
    kind = "int4"                       # "int4", "int8", "fp8": what `values` holds
    dtype = np.dtype(np.float32)        # what slicing returns
    scale_dtype = np.dtype(np.float32)  # what the checkpoint stores its scales in (`scales` returns float32)
    zero_point = None                   # a symmetric scheme's one zero point (`zeros` then holds only it)

    def __init__(self, method: str, module: str, shape: tuple[int, int], group_size: int, act_order: bool):
        self.quant_type, self.module, self.shape = method, module, tuple(shape)
        self.group_size, self.act_order = group_size, act_order
        self.num_groups = -(-self.shape[1] // group_size)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.module!r}, {self.quant_type} {self.kind}, shape={self.shape}, "
                f"group_size={self.group_size}{', act order' if self.act_order else ''})")

    @property
    def bits(self) -> int:
        return 4 if self.kind == "int4" else 8

    def values(self, o: slice, i: slice) -> np.ndarray:
        raise NotImplementedError

    def scales(self, o: slice, g: slice = slice(None)) -> np.ndarray:
        """[o, groups g] float32 (reads only those rows and groups)."""
        raise NotImplementedError

    def zeros(self, o: slice, g: slice = slice(None)) -> np.ndarray | None:
        raise NotImplementedError

    def groups(self, i: slice) -> np.ndarray:
        lo, hi = _range(i, self.shape[1])
        return np.arange(lo, hi, dtype=np.int32) // self.group_size

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if index == (Ellipsis,):
            index = (slice(None), slice(None))
        if len(index) > 2 or not all(isinstance(s, slice) for s in index):
            raise IndexError(f"{self!r} takes [rows, cols] slices, not {index!r}")
        o, i = (*index, slice(None))[:2]
        g = self.groups(i)
        s = self.scales(o)[:, g]
        q = self.values(o, i).astype(np.float32)
        z = self.zeros(o)
        return q * s if z is None else (q - z[:, g].astype(np.float32)) * s


def _scale_rows(t) -> np.ndarray:
    return np.asarray(t[...], dtype=np.float32) if t.shape == () else np.asarray(t[:], dtype=np.float32)


class GPTQTensor(PackedTensor):
    def __init__(self, source, module: str, quant: CheckpointQuant):
        self._t = {k: source.raw(f"{module}.{k}") for k in ("qweight", "qzeros", "scales")}
        self._gidx = source.raw(f"{module}.g_idx") if f"{module}.g_idx" in source else None
        qweight, scales = self._t["qweight"], self._t["scales"]
        self.per, self.offset = 32 // quant.bits, quant.zero_offset
        shape = (qweight.shape[1], qweight.shape[0] * self.per)
        super().__init__("gptq", module, shape, quant.group_size or shape[1], quant.desc_act)
        self.kind, self.scale_dtype = f"int{quant.bits}", scales.dtype
        self.zero_point = 1 << (quant.bits - 1) if quant.sym else None
        if scales.shape != (self.num_groups, shape[0]) and not self.act_order:
            raise CheckpointError(f"GPTQ weight {module!r}: scales {scales.shape}, expected {(self.num_groups, shape[0])} "
                             f"for group_size {self.group_size} (check quantization_config.group_size)")
        if self.act_order:
            if self._gidx is None:
                raise CheckpointError(f"GPTQ weight {module!r} has desc_act but no g_idx tensor")
            self.num_groups = scales.shape[0]

    def values(self, o, i):
        lo, hi = _range(i, self.shape[1])
        words, skip = _words(lo, hi, self.per)
        return unpack(self._t["qweight"][words, o], self.bits, 0)[skip:skip + hi - lo].T

    def scales(self, o, g=slice(None)):
        return np.asarray(self._t["scales"][g, o], np.float32).T

    def zeros(self, o, g=slice(None)):
        lo, hi = _range(o, self.shape[0])
        words, skip = _words(lo, hi, self.per)
        z = unpack(self._t["qzeros"][g, words], self.bits, 1)[:, skip:skip + hi - lo]
        return (z.astype(np.int32) + self.offset).astype(np.uint8).T

    def groups(self, i):
        if not self.act_order:
            return super().groups(i)
        return np.asarray(self._gidx[i], np.int32)


class AWQTensor(PackedTensor):
    def __init__(self, source, module: str, quant: CheckpointQuant):
        self._t = {k: source.raw(f"{module}.{k}") for k in ("qweight", "qzeros", "scales")}
        qweight = self._t["qweight"]
        shape = (qweight.shape[1] * 8, qweight.shape[0])
        super().__init__("awq", module, shape, quant.group_size or shape[1], False)
        self.scale_dtype = self._t["scales"].dtype
        if self._t["scales"].shape != (self.num_groups, shape[0]):
            raise CheckpointError(f"AWQ weight {module!r}: scales {self._t['scales'].shape}, expected "
                             f"{(self.num_groups, shape[0])} for group_size {self.group_size}")

    def _columns(self, name: str, rows, o: slice) -> np.ndarray:
        lo, hi = _range(o, self.shape[0])
        words, skip = _words(lo, hi, 8)
        return unpack(self._t[name][rows, words], 4, 1, AWQ_ORDER)[:, skip:skip + hi - lo]

    def values(self, o, i):
        return self._columns("qweight", i, o).T

    def scales(self, o, g=slice(None)):
        return np.asarray(self._t["scales"][g, o], np.float32).T

    def zeros(self, o, g=slice(None)):
        return self._columns("qzeros", g, o).T


class CompressedTensor(PackedTensor):
    """compressed-tensors: pack-quantized (int4 / int8 words), int-quantized (int8) or float-quantized (FP8)."""

    def __init__(self, source, module: str, quant: CheckpointQuant):
        name = lambda k: f"{module}.{k}"                                      # noqa: E731
        self._packed = source.raw(name("weight_packed")) if name("weight_packed") in source else None
        self._weight = None if self._packed is not None else source.raw(name("weight"))
        self._scale = source.raw(name("weight_scale"))
        self._zero = source.raw(name("weight_zero_point")) if name("weight_zero_point") in source else None
        self._gidx = source.raw(name("weight_g_idx")) if name("weight_g_idx") in source else None
        if self._packed is not None:
            shape_t = name("weight_shape")
            out, inp = (tuple(int(v) for v in np.asarray(source.raw(shape_t)[:])) if shape_t in source
                        else (self._packed.shape[0], None))
            bits = self._packed.shape[1] * 32 // inp if inp else quant.bits
            if bits not in (4, 8) or self._packed.shape[1] * 32 != inp * bits:
                raise CheckpointError(f"compressed-tensors weight {module!r}: weight_packed {self._packed.shape} does not "
                                 f"hold {inp} inputs at 4 or 8 bits (weight_shape {out, inp})")
            kind = f"int{bits}"
        else:
            out, inp = self._weight.shape
            code = stored_code(self._weight)
            kind = "fp8" if code.startswith("F8") else "int8"
            if code not in ("F8_E4M3", "I8"):
                raise CheckpointError(f"compressed-tensors weight {module!r} is {code}; "
                                 f"expected int8 or float8_e4m3fn values")
        scale_cols = 1 if self._scale.shape in ((), (1,)) else self._scale.shape[-1]
        self.block_rows = 1
        if len(self._scale.shape) == 2 and self._scale.shape[0] != out:                   # blocks of rows
            self.block_rows = -(-out // self._scale.shape[0])
        group = -(-inp // scale_cols)
        super().__init__("compressed-tensors", module, (out, inp), group, self._gidx is not None)
        self.kind, self.scale_dtype = kind, self._scale.dtype
        self.num_groups = scale_cols
        self.offset = 0 if kind == "fp8" else 1 << (self.bits - 1)
        self.zero_point = self.offset if self._zero is None and kind != "fp8" else None

    def values(self, o, i):
        if self._packed is None:
            v = np.asarray(self._weight[o, i])
            return v if self.kind == "fp8" else (v.astype(np.int16) + self.offset).astype(np.uint8)
        lo, hi = _range(i, self.shape[1])
        per = 32 // self.bits
        words, skip = _words(lo, hi, per)
        return unpack(self._packed[o, words], self.bits, 1)[:, skip:skip + hi - lo]

    def scales(self, o, g=slice(None)):
        lo, hi = _range(o, self.shape[0])
        if self._scale.shape in ((), (1,)):
            return np.full((hi - lo, 1), _scale_rows(self._scale).reshape(-1)[0], np.float32)[:, g]
        if self.block_rows > 1:
            rows = slice(lo // self.block_rows, (hi - 1) // self.block_rows + 1)
            blocks = np.asarray(self._scale[rows, g], np.float32)
            return blocks[np.arange(lo, hi) // self.block_rows - rows.start]
        return np.asarray(self._scale[o], np.float32).reshape(hi - lo, -1)[:, g]

    def zeros(self, o, g=slice(None)):
        if self.kind == "fp8":
            return None
        lo, hi = _range(o, self.shape[0])
        if self._zero is None:
            return np.full((hi - lo, self.num_groups), self.offset, np.uint8)[:, g]
        if self._packed is None:                                               # int8 [out, 1]
            z = np.asarray(self._zero[o]).reshape(hi - lo, -1)[:, g]
            return (z.astype(np.int16) + self.offset).astype(np.uint8)
        words, skip = _words(lo, hi, 32 // self.bits)
        return unpack(self._zero[words, g], self.bits, 0)[skip:skip + hi - lo]

    def groups(self, i):
        if self._gidx is None:
            return super().groups(i)
        return np.asarray(self._gidx[i], np.int32)


class FP8Tensor(CompressedTensor):
    """`quant_method: fp8` (transformers' and DeepSeek's layout): the weight in float8_e4m3fn with
    `weight_scale_inv` over `weight_block_size` blocks, or a per-tensor `weight_scale`."""

    def __init__(self, source, module: str, quant: CheckpointQuant):
        name = lambda k: f"{module}.{k}"                                      # noqa: E731
        self._packed, self._zero, self._gidx = None, None, None
        self._weight = source.raw(name("weight"))
        out, inp = self._weight.shape
        scale_name = name("weight_scale_inv") if name("weight_scale_inv") in source else name("weight_scale")
        self._scale = source.raw(scale_name)
        bo, bi = quant.block or (out, inp)
        expect = (-(-out // bo), -(-inp // bi)) if quant.block else None
        if expect and tuple(self._scale.shape) != expect:
            raise CheckpointError(f"FP8 weight {module!r}: {scale_name.rsplit('.', 1)[-1]} {self._scale.shape}, expected "
                             f"{expect} for weight_block_size {list(quant.block)}")
        PackedTensor.__init__(self, "fp8", module, (out, inp), bi, False)
        self.kind, self.offset, self.scale_dtype = "fp8", 0, self._scale.dtype
        self.block_rows = bo if quant.block else 1
        self.num_groups = expect[1] if expect else 1


STORED = {                         # method -> (the leaf that marks a quantized module, the leaves it consumes)
    "gptq": ("qweight", ("qweight", "qzeros", "scales", "g_idx")),
    "awq": ("qweight", ("qweight", "qzeros", "scales")),
}
CT_LEAVES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "weight")
FP8_LEAVES = ("weight", "weight_scale", "weight_scale_inv")


class PackedSource:
    """A safetensors source whose quantized modules read as `PackedTensor`s under `<module>.weight` (MXFP4: each
    `X_blocks` + `X_scales` pair as one `MXFP4Tensor` under `X`, loaders/mxfp4.py)."""

    def __init__(self, source, quant: CheckpointQuant):
        self.source, self.quant = source, quant
        self.model_dir = getattr(source, "model_dir", None)
        self._views: dict[str, PackedTensor] = {}
        hidden: set[str] = set()
        names = set(source.keys())
        for name in sorted(names):
            found = self._view(source, names, name)
            if found is not None:
                target, view, consumed = found
                self._views[target] = view
                hidden |= set(consumed) & names
        self._keys = [n for n in source.keys() if n not in hidden or n in self._views] + \
            [n for n in self._views if n not in names]
        self._names = set(self._keys)

    def _view(self, source, names, name: str):
        """(the float name it shows, its lazy view, the stored names it consumes) when `name` marks a quantized
        weight, else None."""
        q = self.quant
        if q.method == "mxfp4":
            return mxfp4_view(source, names, name, q)
        module, _, leaf = name.rpartition(".")
        view, leaves = self._linear(source, names, module, leaf)
        return None if view is None else \
            (f"{module}.weight", view, [f"{module}.{k}" for k in (*leaves, *ACTIVATION_PARTS)])

    def _linear(self, source, names, module: str, leaf: str):
        q = self.quant
        if q.method in STORED and leaf == STORED[q.method][0]:
            return (GPTQTensor if q.method == "gptq" else AWQTensor)(source, module, q), STORED[q.method][1]
        has_scale = f"{module}.weight_scale" in names or f"{module}.weight_scale_inv" in names
        if q.method == "compressed-tensors" and (leaf == "weight_packed" or (
                leaf == "weight" and has_scale and stored_code(source.raw(f"{module}.weight")) in ("F8_E4M3", "I8"))):
            return CompressedTensor(source, module, q), CT_LEAVES
        if q.method == "fp8" and leaf == "weight" and stored_code(source.raw(f"{module}.weight")) == "F8_E4M3":
            if not has_scale:
                raise CheckpointError(f"FP8 weight {module}.weight has no weight_scale or weight_scale_inv")
            return FP8Tensor(source, module, q), FP8_LEAVES
        return None, ()

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str):
        return self._views[name] if name in self._views else self.source.get(name)

