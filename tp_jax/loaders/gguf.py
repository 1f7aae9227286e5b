"""GGUF checkpoints (llama.cpp's format) as Hugging Face tensors and config.

Holds:
  * `GGUFError`: every problem with a file (not GGUF, truncated, unsupported
    architecture, quant type or rope scaling), with the file and the fix named.
  * `GGUFSource`: one llama-architecture GGUF file. `hf_config()` builds a
    `transformers.LlamaConfig` from its metadata; `keys()` / `get(hf_name)` give its
    tensors under HF names and in HF layout (Linear weights [out, in]) as lazy tensors.
  * `GGUFTensor`: a lazy tensor; slicing dequantizes only the rows it reads.
  * `load_gguf_tokenizer(path)`: the tokenizer stored in the file, via transformers.

llama.cpp stores q and k rows interleaved per head (its converter permutes them so
its rope can rotate adjacent pairs); `GGUFTensor` undoes that as a row permutation,
so a slice of rows reads only those rows' quant blocks.
"""

from __future__ import annotations

import collections
import mmap
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np

from tp_jax.loaders.dtypes import BY_NAME
from tp_jax.parallel.layers.ggml import KEPT, dequantize_raw

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
FLOAT_TYPES = {QT.F32: BY_NAME["float32"].numpy, QT.F16: BY_NAME["float16"].numpy,
               QT.BF16: BY_NAME["bfloat16"].numpy}
QUANT_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
               QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)   # dequantized to float32
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> HF tensor name; {i} is the layer index.
NAME_TABLE = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
OPTIONAL_TENSORS = {"output.weight"}                  # absent = tied embeddings
ROTATED = ("attn_q", "attn_k")                        # rows permuted per head by llama.cpp
_PATTERNS = [(re.compile(re.escape(g).replace(r"\{i\}", r"(?P<i>\d+)") + "$"), h)
             for g, h in NAME_TABLE.items()]
_CACHE_SIZE = 2  # fully dequantized tensors kept; memory stays near one tensor


class GGUFError(ValueError):
    """A GGUF file that cannot be read or expressed as a HF llama checkpoint."""


def gguf_to_hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor name, or None if the table does not map it."""
    for pattern, hf in _PATTERNS:
        if m := pattern.match(name):
            return hf.format(**m.groupdict())
    return None


def unrotate_rows(n_rows: int, n_head: int) -> np.ndarray:
    """perm with hf_w = gguf_w[perm]: llama.cpp's per-head q/k row permutation undone."""
    hd = n_rows // n_head
    return np.arange(n_rows).reshape(n_head, hd // 2, 2).swapaxes(1, 2).reshape(-1)


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that checks every tensor's type and byte range before mapping it."""

    def __init__(self, path: str):
        self._path = path
        super().__init__(path)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        """Arrays (a tokenizer's 49k tokens, scores, types and merges) parsed in one pass over plain numpy
        views: the same parts as GGUFReader's, which builds memmap views per element (slow: docs/performance.md)."""
        if raw_type != VT.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        buf, u64 = self.data.view(np.ndarray), np.dtype(np.uint64).newbyteorder(self.byte_order)
        scalar = self.gguf_scalar_to_np.get(_value_type(int(raw_itype[0])))
        if scalar is not None:
            itemsize, start = np.dtype(scalar).itemsize, orig_offs + 12
            if start + int(alen[0]) * itemsize > len(buf):
                raise ValueError(f"array at byte {orig_offs} runs past the end of the file")
            values = buf[start:start + int(alen[0]) * itemsize].view(np.dtype(scalar).newbyteorder(self.byte_order))
            types = [VT.ARRAY, VT(int(raw_itype[0]))] if alen[0] else [VT.ARRAY]
            return 12 + values.nbytes, [raw_itype, alen, *(values[i:i + 1] for i in range(len(values)))], \
                list(range(2, 2 + len(values))), types
        if raw_itype[0] != VT.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        fmt, offs = ("<Q" if (sys.byteorder == "little") == (self.byte_order == "I") else ">Q"), orig_offs + 12
        parts: list = [raw_itype, alen]
        for _ in range(int(alen[0])):
            if offs + 8 > len(buf):
                raise ValueError(f"string array at byte {orig_offs} runs past the end of the file")
            (n,) = struct.unpack_from(fmt, buf, offs)
            if offs + 8 + n > len(buf):
                raise ValueError(f"a {n}-byte string at byte {offs} runs past the end of the file")
            parts += [buf[offs:offs + 8].view(u64), buf[offs + 8:offs + 8 + n]]
            offs += 8 + n
        types = [VT.ARRAY, VT.STRING] if alen[0] else [VT.ARRAY]
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), types

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        """Tensor data must lie where llama.cpp puts it: in header order, each at the running sum of
        the previous tensors' sizes padded to the alignment, the last ending at the end of the file.
        So a corrupt offset, shape or type fails here instead of reading another tensor's bytes."""
        size, expected, end = len(self.data), 0, start_offs
        for field in fields:
            name = bytes(field.parts[1]).decode("utf-8", "replace")
            raw_type, offset = int(field.parts[4][0]), int(field.parts[5][0])
            sizes = gguf.GGML_QUANT_SIZES.get(_ggml_type(raw_type))
            if sizes is None:
                raise GGUFError(f"{self._path}: tensor {name!r} has unknown ggml type id {raw_type} "
                                f"(newer than gguf {_gguf_version()}? try `pip install -U gguf`)")
            block, type_size = sizes
            count = int(np.prod(field.parts[3].astype(object)))
            if count % block or (field.parts[3].size and int(field.parts[3][0]) % block):
                raise GGUFError(f"{self._path} is corrupt: tensor {name!r} has {count} elements, not whole "
                                f"{block}-element blocks of its type")
            if offset != expected:
                raise GGUFError(f"{self._path} is corrupt: tensor {name!r} starts at data offset {offset}, "
                                f"expected {expected} (re-download or re-convert it)")
            nbytes = count * type_size // block
            end = start_offs + offset + nbytes
            if end > size:
                raise GGUFError(f"{self._path} is truncated: tensor {name!r} needs bytes up to {end} "
                                f"but the file has {size} (re-download or re-convert it)")
            expected = offset + -(-nbytes // self.alignment) * self.alignment
        if fields and size > start_offs + expected:
            raise GGUFError(f"{self._path} is corrupt: {size - start_offs - expected} bytes after the last "
                            f"tensor's data (a tensor's shape or type does not match the file)")
        super()._build_tensors(start_offs, fields)


def _ggml_type(raw: int) -> QT | None:
    try:
        return QT(raw)
    except ValueError:
        return None


def _value_type(raw: int):
    try:
        return VT(raw)
    except ValueError:
        return None


def _gguf_version() -> str:
    from importlib.metadata import version
    return version("gguf")


def open_reader(path: str) -> gguf.GGUFReader:
    """A GGUFReader for `path`, or GGUFError naming the file and what is wrong with it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return _CheckedReader(path)
    except GGUFError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path} is truncated or corrupt: its header cannot be parsed "
                        f"(file has {size} bytes; {type(e).__name__}: {e})") from None


class GGUFTensor:
    """One HF-layout tensor of a GGUF file; `t[index]` dequantizes only the rows it needs.

    `.dtype` is the dtype slices come back in: float32 for quantized tensors, the file's
    own dtype for F32/F16/BF16.
    """

    def __init__(self, source: GGUFSource, hf_name: str, info: Any, perm: np.ndarray | None):
        self.name, self._source, self._info, self._perm = hf_name, source, info, perm
        self.shape = tuple(int(d) for d in reversed(info.shape.tolist()))
        self.dtype = FLOAT_TYPES.get(info.tensor_type, np.dtype(np.float32))
        self.ndim = len(self.shape)

    def __repr__(self) -> str:
        return (f"GGUFTensor({self.name!r}, shape={self.shape}, "
                f"{self._info.tensor_type.name} -> {self.dtype.name})")

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        full = self[...]
        return full if dtype is None else full.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else Ellipsis
        all_rows = first is Ellipsis or first is None or (isinstance(first, slice) and first == slice(None))
        cols = self._block_columns(index[1]) if self.ndim == 2 and len(index) == 2 and first is not None else None
        if cols is not None:                       # a run of whole blocks (a row-parallel rank's input columns)
            rows = None if all_rows else np.arange(self.shape[0])[first]
            block = self.read_rows(None if rows is None else rows.reshape(-1), cols)
            return block if rows is None else block.reshape(rows.shape + block.shape[1:])
        if self.ndim == 1 or all_rows:
            return self._source._full(self)[index]
        rows = np.arange(self.shape[0])[first]
        block = self.read_rows(rows.reshape(-1)).reshape(rows.shape + self.shape[1:])
        return block[(slice(None),) * rows.ndim + index[1:]]

    def _block_columns(self, index) -> slice | None:
        """`index` as a slice of whole quant blocks of a quantized tensor's columns, else None."""
        if self._info.tensor_type in FLOAT_TYPES or not isinstance(index, slice) or index.step not in (None, 1):
            return None
        start, stop, _ = index.indices(self.shape[1])
        block = gguf.GGML_QUANT_SIZES[self._info.tensor_type][0]
        if (start, stop) == (0, self.shape[1]) or start % block or stop % block or stop <= start:
            return None
        return slice(start, stop)

    def read_rows(self, rows: np.ndarray | None, cols: slice | None = None) -> np.ndarray:
        """Rows `rows` (all when None) of the HF-layout tensor, dequantized; `cols`: only those columns,
        a run of whole quant blocks (only those blocks are read and dequantized)."""
        return self._source.copied(self._info, self._read_rows(rows, cols))

    def _read_rows(self, rows: np.ndarray | None, cols: slice | None) -> np.ndarray:
        data = self._info.data
        src = rows if self._perm is None else (self._perm if rows is None else self._perm[rows])
        raw = data if src is None else data[src]
        qtype = self._info.tensor_type
        if qtype == QT.BF16:
            return np.ascontiguousarray(raw).view(ml_dtypes.bfloat16)
        if qtype in FLOAT_TYPES:
            return np.asarray(raw)
        if cols is not None:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = raw[:, cols.start // block * size:cols.stop // block * size]
        if qtype.name in KEPT and raw.ndim == 2:            # Q8_0 / Q4_0 / Q4_1: all rows in one numpy pass
            return dequantize_raw(raw, qtype.name)
        return gguf.quants.dequantize(np.asarray(raw), qtype)

    @property
    def quant_type(self) -> str:
        """The tensor's GGUF type name: "F32", "F16", "BF16", "Q8_0", "Q4_1", ..."""
        return self._info.tensor_type.name

    def blocks(self) -> RawBlocks:
        """The raw quant blocks `[rows, in/32, bytes]` (uint8, HF row order), read lazily from the memory map."""
        return RawBlocks(self)

    @property
    def reads_file_directly(self) -> bool:
        """True when reads come straight from the memory map (no dequant, no permutation)."""
        return self._perm is None and self._info.tensor_type in (QT.F32, QT.F16)


class RawBlocks:
    """A quantized GGUFTensor's blocks, not dequantized: shape `[rows, blocks per row, bytes per block]`.

    `blocks[rows, blocks, bytes]` (contiguous slices) reads only those rows from the memory
    map, un-rotating q/k rows like the float reads (the permutation moves whole rows).
    """

    def __init__(self, tensor: GGUFTensor):
        block, size = gguf.GGML_QUANT_SIZES[tensor._info.tensor_type]
        self._tensor = tensor
        self.shape = (tensor.shape[0], tensor.shape[1] // block, size)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (3 - len(index))
        rows = np.arange(self.shape[0])[index[0]]
        t = self._tensor
        src = rows if t._perm is None else t._perm[rows]
        raw = np.asarray(t._info.data[src]).reshape(len(rows), *self.shape[1:])
        return t._source.copied(t._info, raw[:, index[1], index[2]])


class GGUFSource:
    """A llama GGUF file seen as a HF checkpoint: `hf_config()`, `keys()`, `get(hf_name)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._reader = open_reader(self.path)
        self.metadata = _read_metadata(self._reader, self.path)
        arch = self.metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {arch!r} is not supported; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self._infos = self._map_tensors()
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()

    def __repr__(self) -> str:
        return f"GGUFSource({self.path!r}, {len(self._infos)} tensors)"

    def _map_tensors(self) -> dict[str, Any]:
        infos, unmapped = {}, []
        for t in self._reader.tensors:
            hf = gguf_to_hf_name(t.name)
            if hf is None:
                unmapped.append(t.name)
                continue
            if t.tensor_type not in FLOAT_TYPES and t.tensor_type not in QUANT_TYPES:
                supported = ", ".join(q.name for q in (*FLOAT_TYPES, *QUANT_TYPES))
                raise GGUFError(f"{self.path}: tensor {t.name!r} has quant type {t.tensor_type.name}, "
                                f"which is not supported; supported: {supported} "
                                f"(re-quantize the model with llama.cpp to one of these)")
            infos[hf] = t
        if "rope_freqs.weight" in unmapped:
            raise GGUFError(f"{self.path}: has a 'rope_freqs.weight' tensor (llama3-style rope "
                            f"scaling), which this loader cannot express; convert the original HF "
                            f"checkpoint instead")
        if unmapped:
            raise GGUFError(f"{self.path}: tensors {unmapped[:5]} are not part of a llama model "
                            f"this loader maps (see NAME_TABLE in {__name__})")
        self._check_complete(infos)
        return infos

    def _check_complete(self, infos: dict[str, Any]) -> None:
        n_layers = self._arch("block_count")
        if not isinstance(n_layers, int) or not 0 <= n_layers <= len(infos):
            raise GGUFError(f"{self.path} is corrupt: block_count = {n_layers!r} layers, but the file holds "
                            f"{len(infos)} tensors")
        expected = [h.format(i=i) for g, h in NAME_TABLE.items() if g not in OPTIONAL_TENSORS
                    for i in (range(n_layers) if "{i}" in h else [0])]
        missing = [n for n in dict.fromkeys(expected) if n not in infos]
        if missing:
            raise GGUFError(f"{self.path}: is missing tensors {missing[:5]} (HF names) for "
                            f"{n_layers} layers; the file is incomplete or not a llama model")

    def _arch(self, key: str, default: Any = GGUFError) -> Any:
        full = f"{self.metadata['general.architecture']}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is GGUFError:
            raise GGUFError(f"{self.path}: metadata key {full!r} is missing; the file is incomplete")
        return default

    # --- tensors --------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, hf_name: str) -> bool:
        return hf_name in self._infos

    def __iter__(self):
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def get(self, hf_name: str) -> GGUFTensor:
        """The lazy HF-layout tensor `hf_name`; KeyError if the file has no such tensor."""
        if hf_name not in self._infos:
            raise KeyError(f"{hf_name!r} is not a tensor of {self.path} "
                           f"(HF names such as {self.keys()[:2]}; see .keys())")
        info = self._infos[hf_name]
        kind = info.name.split(".")[-2] if info.name.startswith("blk.") else ""
        perm = None
        if kind in ROTATED:
            n_rows, n_head = int(info.shape[-1]), self._n_heads()[kind]
            self._check_heads(info.name, n_rows, n_head)
            perm = unrotate_rows(n_rows, n_head)
        return GGUFTensor(self, hf_name, info, perm)

    def copied(self, info: Any, out: np.ndarray) -> np.ndarray:
        """`out`; when it is a copy, the file pages of `info`'s data are dropped from this process's
        memory (madvise DONTNEED on the read-only map: the OS page cache keeps them, a later read maps
        them again), so a load's RSS does not grow by the whole file as its tensors are read."""
        mm = getattr(self._reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED") or np.may_share_memory(out, info.data):
            return out
        start = int(info.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(mm), int(info.data_offset) + int(info.n_bytes))
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        return out

    def _n_heads(self) -> dict[str, int]:
        heads = self._arch("attention.head_count")
        return {"attn_q": heads, "attn_k": self._arch("attention.head_count_kv", heads)}

    def _check_heads(self, name: str, n_rows: int, n_head) -> None:
        """llama.cpp's q/k row permutation needs whole heads of an even size."""
        if not isinstance(n_head, int) or n_head < 1 or n_rows % n_head or (n_rows // n_head) % 2:
            raise GGUFError(f"{self.path} is corrupt: tensor {name!r} has {n_rows} rows, which {n_head!r} heads "
                            f"(its head-count metadata) do not split into whole heads of an even size")

    __getitem__ = get

    def _full(self, tensor: GGUFTensor) -> np.ndarray:
        if tensor.reads_file_directly:
            return tensor.read_rows(None)
        if tensor.name not in self._cache:
            full = tensor.read_rows(None)
            full.setflags(write=False)  # shared by every later read: callers must copy to edit
            self._cache[tensor.name] = full
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(tensor.name)
        return self._cache[tensor.name]

    # --- config ---------------------------------------------------------------------

    def hf_config(self):
        """A `transformers.LlamaConfig` equal to the one of the checkpoint this came from."""
        from transformers import LlamaConfig
        try:
            return LlamaConfig(**self._config_fields())
        except (ValueError, TypeError, KeyError, ZeroDivisionError) as e:
            raise GGUFError(f"{self.path}: its metadata does not make a valid llama config "
                            f"({type(e).__name__}: {e})") from None

    def _config_fields(self) -> dict:
        hidden, heads = self._arch("embedding_length"), self._arch("attention.head_count")
        head_dim = self._arch("attention.key_length", hidden // heads)
        self._check_head_dim(head_dim)
        meta = self.metadata
        return dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=self.get_shape("model.embed_tokens.weight")[0],
            hidden_size=hidden, intermediate_size=self._arch("feed_forward_length"),
            num_hidden_layers=self._arch("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=self._arch("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=_nice_float(self._arch("attention.layer_norm_rms_epsilon")),
            rope_parameters=self._rope_parameters(),
            max_position_embeddings=self._arch("context_length"),
            tie_word_embeddings="lm_head.weight" not in self._infos,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        )

    def get_shape(self, hf_name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._infos[hf_name].shape.tolist()))

    def _check_head_dim(self, head_dim: int) -> None:
        for key in ("attention.value_length", "rope.dimension_count"):
            value = self._arch(key, head_dim)
            if value != head_dim:
                raise GGUFError(f"{self.path}: {key} = {value} differs from head_dim {head_dim}; "
                                f"a llama model needs them equal")

    def _rope_parameters(self) -> dict:
        theta = _nice_float(self._arch("rope.freq_base", 10000.0))
        kind = self._arch("rope.scaling.type", None)
        factor = self._arch("rope.scaling.factor", None)
        if kind is None and self._arch("rope.scale_linear", 1.0) != 1.0:  # pre-2024 spelling
            kind, factor = "linear", self._arch("rope.scale_linear")
        kind = kind or "none"
        extra = sorted(k for k in self.metadata if ".rope.scaling." in k and k.rsplit(".", 1)[-1]
                       not in ("type", "factor", "original_context_length", "finetuned"))
        if kind == "none":
            return {"rope_type": "default", "rope_theta": theta}
        if kind == "linear" and not extra:
            return {"rope_type": "linear", "rope_theta": theta, "factor": _nice_float(factor)}
        if kind == "yarn" and not extra:
            return {"rope_type": "yarn", "rope_theta": theta, "factor": _nice_float(factor),
                    "original_max_position_embeddings": self._arch("rope.scaling.original_context_length")}
        raise GGUFError(f"{self.path}: rope scaling type {kind!r} (with keys {extra}) cannot be "
                        f"expressed in a LlamaConfig; supported: none, linear, yarn without extra keys")


def _read_metadata(reader: gguf.GGUFReader, path: str) -> dict[str, Any]:
    """The file's key/value metadata (vocabulary arrays left out), or GGUFError naming a corrupt field."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or _is_vocab_field(key):
            continue
        try:
            out[key] = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError, TypeError) as e:
            raise GGUFError(f"{path} is corrupt: metadata field {key!r} cannot be read ({e})") from None
    return out


def _is_vocab_field(key: str) -> bool:
    return key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in (
        "tokens", "scores", "token_type", "merges")


def _nice_float(x):
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not 9.99e-06)."""
    return None if x is None else float(str(np.float32(x)))


def load_gguf_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer stored in a GGUF file, with the file's own special tokens.

    Special tokens and the chat template come from the file's metadata
    (`tokenizer.ggml.*_token_id`, `tokenizer.chat_template`), not from transformers'
    guesses, so e.g. SmolLM2's end of turn is `<|im_end|>`. None when the file stores no
    tokenizer (no `tokenizer.ggml.model`), as for a directory without tokenizer files.
    """
    from transformers import AutoTokenizer
    source = GGUFSource(path)
    if "tokenizer.ggml.model" not in source.metadata:
        return None
    p = Path(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except ModuleNotFoundError as e:
        import importlib.util
        if importlib.util.find_spec("torch") is not None:
            raise
        raise GGUFError(f"{path}: reading a GGUF file's tokenizer needs torch (transformers' GGUF reader imports "
                        f"it); install its CPU build, e.g. `pip install torch==2.13.0 --index-url "
                        f"https://download.pytorch.org/whl/cpu`, or pass token ids instead of text") from e
    meta = source.metadata
    for role in ("bos", "eos", "unk", "pad"):
        key = "padding" if role == "pad" else role
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(int(token_id)))
    if "tokenizer.chat_template" in meta:
        tok.chat_template = meta["tokenizer.chat_template"]
    return tok
