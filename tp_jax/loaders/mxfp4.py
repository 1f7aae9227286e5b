"""gpt-oss's published MXFP4 expert weights (`quant_method: mxfp4`) as lazy float tensors.

    mxfp4_view(source, names, name, quant) -> (float name, MXFP4Tensor, stored names consumed) | None
    MXFP4Tensor                             transformers' float `[E, in, out]`: `t[e, i, o]` dequantizes only
                                            the bytes of that slice
    MXFP4Tensor.expert(e) -> MXFP4Rows      expert e as a packed weight `[out, in]` (the packed methods'
                                            `values` / `scales` of loaders/packed.py: FP4 codes and E8M0
                                            exponents as stored), which `quantization="mxfp4"` keeps
    dequantize(blocks, scales)              uint8 [..., G, 16], [..., G] -> float32 [..., G * 32]

The stored layout (OpenAI's; transformers' `integrations/mxfp4.py: convert_moe_packed_tensors` reads it):

    X_blocks  uint8 [E, out, in/32, 16]   a row's inputs in blocks of 32 FP4 (e2m1) codes, two a byte:
                                          input 32g + 2j in the low nibble of byte j of block g, 32g + 2j + 1
                                          in its high nibble
    X_scales  uint8 [E, out, in/32]       the block's E8M0 exponent s: the block's scale is 2^(s - 127)
    X         float [E, in, out]          w[e, i, o] = FP4[code] * 2^(s[e, o, i // 32] - 127): the float
                                          tensor is the transpose of the stored rows (gate_up_proj [E, D, 2F],
                                          gate and up interleaved along 2F; down_proj [E, F, D])

FP4 codes 0..15 are +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (bit 3 the sign). A code times a power of two is exact in
float32 (and in bfloat16: e2m1 has 1 mantissa bit) for every exponent; a slice holding E8M0's NaN code 255 is
scaled by `np.ldexp`, as transformers' `torch.ldexp` does (2^128 times the code: inf, or 2^127 for 0.5).
"""

from __future__ import annotations

import numpy as np

from tp_jax.loaders.safetensors import CheckpointError

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32                          # inputs per scale
BLOCK_BYTES = BLOCK // 2            # two codes a byte
EXPONENT_BIAS = 127
NAN_SCALE = 255                     # E8M0's NaN code
# byte b -> its two values (low nibble first): one lookup per byte, not one per nibble
BYTE_VALUES = np.stack([np.tile(FP4_VALUES, 16), np.repeat(FP4_VALUES, 16)], axis=-1)
POWERS = np.ldexp(np.float32(1), np.arange(NAN_SCALE, dtype=np.int32) - EXPONENT_BIAS)   # 2^(s - 127), s < 255


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 blocks [..., G, 16] and E8M0 scales [..., G] -> float32 [..., G * 32], inputs in order."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    values = BYTE_VALUES[blocks].reshape(*blocks.shape[:-1], BLOCK)           # [..., G, 32]
    with np.errstate(over="ignore"):                                          # 6 * 2^127 is inf, as in torch
        if (scales == NAN_SCALE).any():                                       # 2^128 is no float32: ldexp's way
            values = np.ldexp(values, scales.astype(np.int32)[..., None] - EXPONENT_BIAS)
        else:                                                                 # 2^(s - 127) exact in float32
            values *= POWERS[scales][..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def _bounds(index, shape: tuple[int, ...]) -> tuple[list[tuple[int, int]], tuple]:
    """A numpy index of ints and contiguous slices (or Ellipsis) -> ([lo, hi) per dimension, the index that
    then drops the dimensions an int selected)."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1:
        raise IndexError(f"an index can have a single ellipsis, got {index!r}")
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(shape) - len(index) + 1) + index[k + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape):
        raise IndexError(f"too many indices {index!r} for shape {shape}")
    bounds, drop = [], []
    for i, n in zip(index, shape):
        if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(f"index {i} is out of bounds for a dimension of size {n}")
            bounds.append((j, j + 1))
            drop.append(0)
        elif isinstance(i, slice) and i.step in (None, 1):
            lo, hi, _ = i.indices(n)
            bounds.append((lo, max(lo, hi)))
            drop.append(slice(None))
        else:
            raise IndexError(f"an MXFP4 tensor takes ints and contiguous slices, got {i!r} in {index!r}")
    return bounds, tuple(drop)


class MXFP4Tensor:
    """An `X_blocks` + `X_scales` pair as transformers' float `X` `[E, in, out]` (module docstring).

    `t[e, i, o]` reads the blocks and scales of experts e, output rows o and the 32-input blocks covering
    inputs i, nothing else, and returns float32 exactly (so `quantization=None` and every float path hold
    the checkpoint's weights in the run's dtype). `expert(e)` is expert e's stored rows as a packed weight.
    """
    dtype = np.dtype(np.float32)        # what slicing returns
    ndim = 3
    quant_type = "mxfp4"                # the packed methods' name for the format (layers/quantization.py)

    def __init__(self, name: str, blocks, scales):
        self.name, self._blocks, self._scales = name, blocks, scales
        b, s = tuple(blocks.shape), tuple(scales.shape)
        if len(b) != 4 or b[-1] != BLOCK_BYTES or s != b[:-1]:
            raise CheckpointError(f"MXFP4 weight {name!r}: {name}_blocks {b} and {name}_scales {s} are not "
                                  f"[E, out, in/32, {BLOCK_BYTES}] and [E, out, in/32]")
        for part, t in (("blocks", blocks), ("scales", scales)):
            if np.dtype(getattr(t, "dtype", np.uint8)) != np.uint8:
                raise CheckpointError(f"MXFP4 weight {name!r}: {name}_{part} is {np.dtype(t.dtype)}, not uint8")
        experts, out, groups, _ = b
        self.shape = (experts, groups * BLOCK, out)

    def __repr__(self) -> str:
        return f"MXFP4Tensor({self.name!r}, shape={self.shape})"

    @property
    def stored_bytes(self) -> int:
        """The bytes of its blocks and scales in the checkpoint."""
        return int(np.prod(self._blocks.shape)) + int(np.prod(self._scales.shape))

    def __getitem__(self, index) -> np.ndarray:
        ((e0, e1), (i0, i1), (o0, o1)), drop = _bounds(index, self.shape)
        if e1 == e0 or i1 == i0 or o1 == o0:
            return np.zeros((e1 - e0, i1 - i0, o1 - o0), self.dtype)[drop]
        g0, g1 = i0 // BLOCK, -(-i1 // BLOCK)
        blocks = np.asarray(self._blocks[e0:e1, o0:o1, g0:g1])                    # [e, o, g, 16]
        scales = np.asarray(self._scales[e0:e1, o0:o1, g0:g1])                    # [e, o, g]
        rows = dequantize(blocks, scales)[..., i0 - g0 * BLOCK:i1 - g0 * BLOCK]   # [e, o, i]
        return np.ascontiguousarray(rows.transpose(0, 2, 1))[drop]                 # [e, i, o]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    def expert(self, e: int) -> MXFP4Rows:
        """Expert e's stored rows `[out, in]` as a packed weight (the float `t[e]` transposed)."""
        if not 0 <= e < self.shape[0]:
            raise IndexError(f"{self!r} has {self.shape[0]} experts, not expert {e}")
        return MXFP4Rows(self, e)


class MXFP4Rows:
    """One expert of an `MXFP4Tensor` as the packed methods read a quantized `[out, in]` weight
    (loaders/packed.py's `PackedTensor` fields; layers/packed.py keeps it):

        values(o, i)  uint8 [o, i] the FP4 (e2m1) codes, one a byte (the method packs them two a byte again, in
                      the stored order: byte j of a row holds inputs 2j (low nibble) and 2j + 1)
        scales(o, g)  uint8 [o, g] the E8M0 exponents s of the 32-input groups g, as stored
        zeros         None (a code is signed); groups(i) = i // 32

    w[o, i] = FP4[values[o, i]] * 2^(scales[o, i // 32] - 127); `r[o, i]` is that float32 slice.
    """
    kind = "fp4"
    quant_type = "mxfp4"
    scale_dtype = np.dtype(np.uint8)    # E8M0: the exponent byte is the scale
    zero_point = None
    group_size = BLOCK
    act_order = False

    def __init__(self, tensor: MXFP4Tensor, e: int):
        self.tensor, self.e = tensor, e
        self.module = f"{tensor.name}[{e}]"
        self.shape = (tensor.shape[2], tensor.shape[1])
        self.num_groups = tensor.shape[1] // BLOCK

    def __repr__(self) -> str:
        return f"MXFP4Rows({self.tensor.name!r}, expert {self.e}, shape={self.shape})"

    @property
    def bits(self) -> int:
        return 4

    def values(self, o: slice, i: slice) -> np.ndarray:
        (o0, o1), (i0, i1) = _bounds((o, i), self.shape)[0]
        g0, g1 = i0 // BLOCK, -(-i1 // BLOCK)
        blocks = np.asarray(self.tensor._blocks[self.e, o0:o1, g0:g1])             # [o, g, 16]
        codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(o1 - o0, -1)
        return codes[:, i0 - g0 * BLOCK:i1 - g0 * BLOCK]

    def scales(self, o: slice, g: slice = slice(None)) -> np.ndarray:
        (o0, o1), (g0, g1) = _bounds((o, g), (self.shape[0], self.num_groups))[0]
        return np.asarray(self.tensor._scales[self.e, o0:o1, g0:g1], np.uint8)

    def zeros(self, o: slice, g: slice = slice(None)) -> None:
        return None

    def groups(self, i: slice) -> np.ndarray:
        (i0, i1), = _bounds((slice(None), i), self.shape)[0][1:]
        return np.arange(i0, i1, dtype=np.int32) // BLOCK

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = (slice(None), slice(None)) if index == (Ellipsis,) else (*index, slice(None))[:2]
        return self.tensor[(self.e, index[1], index[0])].T


def mxfp4_view(source, names: set[str], name: str, quant) -> tuple[str, MXFP4Tensor, tuple[str, str]] | None:
    """For a stored `X_blocks`: ("X", its lazy float tensor, the two stored names it consumes); None for any
    other name. A pair under a module `quantization_config.modules_to_not_convert` names, a missing
    `X_scales`, or a float `X` beside the pair is a CheckpointError naming the tensors."""
    if not name.endswith("_blocks"):
        return None
    base = name.removesuffix("_blocks")
    module = base.rpartition(".")[0]
    if base + "_scales" not in names:
        raise CheckpointError(f"MXFP4 tensor {name!r} has no {base + '_scales'!r} beside it")
    if base in names:
        raise CheckpointError(f"the checkpoint holds {base!r} both float and as MXFP4 ({name!r}); keep one")
    if quant.keeps_float(module):
        raise CheckpointError(f"{name!r} is stored MXFP4, but quantization_config.modules_to_not_convert "
                              f"{list(quant.keep_float)} says module {module!r} is float")
    return base, MXFP4Tensor(base, source.raw(name), source.raw(base + "_scales")), (name, base + "_scales")
