"""Orbax checkpoints of the canonical (Hugging Face) tensors: convert once, restore onto any mesh.

Layout written by `convert_to_orbax(src, out_dir)`:

    out_dir/config.json, generation_config.json, tokenizer files   (as in a HF directory)
    out_dir/orbax/                                                (an Orbax PyTree checkpoint)

The Orbax checkpoint is a flat dict {HF tensor name: array} in HF layout (q, k, v, gate,
up separate; Linear weights [out, in]; no padding, no replication), so one checkpoint
serves every (tp, pp) mesh: `loaders/place.py` cuts each device's block from it exactly
as it does from safetensors. Orbax's own API restores it (`ocp.PyTreeCheckpointer()
.restore(out_dir + "/orbax")`); `OrbaxSource` reads it lazily through tensorstore.

Chunking (zarr v2, no compression, OCDBT): 2-D tensors are chunked `CHUNK` = 64 along the
dimension tensor parallelism slices and whole along the other. That dimension is not kept
in a table here: it is read off the model's own declarations (`tensor_split_dims`: the
split of the param each tensor feeds, through its name-table entry), e.g. HF dim 0 for
column-parallel weights, embeddings and lm_head, dim 1 for o_proj / down_proj. A tp shard
covers whole heads (head_dim is a multiple of 64 in real models), whole 64-row blocks
of a padded vocab, and intermediate/tp rows (a multiple of 64 in real models), so it
reads its own chunks and none of its neighbours'. 1-D tensors (norms, biases) are one
chunk of a few KiB. Compression is off: float weights barely compress and decoding would
slow every load.

Writing goes through Orbax's `PyTreeCheckpointHandler` (its layout, `_METADATA`, atomic
commit) with a type handler for lazy leaves that reads each tensor only when its turn comes
and drops it once written; at most `WRITE_WINDOW_BYTES` (or one tensor, if larger) are in
flight, so memory stays near one tensor whatever the model size.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from tp_jax.loaders.dtypes import BY_NAME, FLOATS
from tp_jax.loaders.sources import ORBAX_SUBDIR, interrupted_orbax, is_orbax_dir, open_checkpoint

CHUNK = 64
WRITE_WINDOW_BYTES = 64 * 2**20     # bytes in flight: OCDBT writes one at a time crawl (~45 MB/s)


class OrbaxCheckpointError(ValueError):
    """An Orbax checkpoint directory that is missing, incomplete or not in our layout."""


def chunk_shape(shape: tuple[int, ...], split: int | None) -> tuple[int, ...]:
    """`CHUNK` along `split` (the dim tp slices; dim 0 when none), whole along the others."""
    if len(shape) != 2:
        return tuple(max(1, d) for d in shape)
    dim = 0 if split is None else split
    return tuple(min(CHUNK, d) if i == dim else d for i, d in enumerate(shape))


# --- writing -------------------------------------------------------------------------------

@dataclasses.dataclass
class _LazyLeaf:
    """A tensor still on its source's disk: read only when Orbax's handler writes it."""
    tensor: object
    shape: tuple[int, ...]
    dtype: np.dtype
    split: int | None = None          # the dim tp slices (chunked along it)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def read(self) -> np.ndarray:
        return np.ascontiguousarray(self.tensor[...], dtype=self.dtype)


class _ByteWindow:
    """At most `limit` bytes in flight (but always at least one tensor, however large)."""

    def __init__(self, limit: int):
        import asyncio
        self.limit, self.used, self._cond = limit, 0, asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


def _handler():
    """A NumpyHandler whose leaves are `_LazyLeaf`s, read one after another and written with our chunks."""
    import asyncio
    import jax
    import orbax.checkpoint as ocp
    import tensorstore as ts

    def write_spec(leaf, info, arg) -> dict:
        ocdbt = bool(info.is_ocdbt_checkpoint)
        spec = ocp.type_handlers.get_json_tspec_write(
            info, use_ocdbt=ocdbt, global_shape=leaf.shape, local_shape=leaf.shape, dtype=leaf.dtype,
            process_index=jax.process_index() if ocdbt else None, arg=arg)
        if "chunks" not in spec.get("metadata", {}):
            raise RuntimeError(f"orbax built no zarr v2 'chunks' for {info.name!r}; this orbax version's "
                               f"spec layout is not supported by {__name__}")
        spec["metadata"]["chunks"] = list(chunk_shape(leaf.shape, leaf.split))
        return spec

    async def write(spec, info, data, window):
        try:
            store = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
            await store.write(data, can_reference_source_data_indefinitely=True)   # no copy: data is ours
        finally:
            await window.release(data.nbytes)

    class OneAtATimeHandler(ocp.type_handlers.NumpyHandler):
        async def serialize(self, values, infos, args=None):
            args = args or [ocp.type_handlers.SaveArgs()] * len(values)
            return [ocp.future.CommitFutureAwaitingContractedSignals(self._write_all(values, infos, args),
                                                                      name="orbax_one_at_a_time")]

        async def _write_all(self, values, infos, args):
            window, writes = _ByteWindow(WRITE_WINDOW_BYTES), []
            for leaf, info, arg in zip(values, infos, args):
                await info.await_path_creation()
                spec = write_spec(leaf, info, arg)
                if jax.process_index() == 0:
                    await window.acquire(leaf.nbytes)
                    writes.append(asyncio.create_task(write(spec, info, leaf.read(), window)))
            await asyncio.gather(*writes)

    return ocp.type_handlers.create_type_handler_registry((_LazyLeaf, OneAtATimeHandler()),
                                                          (jax.Array, ocp.type_handlers.ArrayHandler()))


def write_orbax(source, ckpt_dir: str, dtype: str | None = None, split_dims: dict | None = None) -> None:
    """Every tensor of `source` (keys() / get(name) -> lazy tensor) as an Orbax checkpoint at `ckpt_dir`.

    `dtype` None keeps each tensor's own dtype (a GGUF's quantized tensors come out float32).
    `split_dims`: tensor name -> the dim tp slices (chunked along it; default dim 0).
    """
    import orbax.checkpoint as ocp
    _refuse_existing(ckpt_dir)
    if dtype is not None and dtype not in FLOATS:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {list(FLOATS)} or None (keep)")
    target = None if dtype is None else BY_NAME[dtype].numpy
    tree = {}
    for name in sorted(source.keys()):
        t = source.get(name)
        tree[name] = _LazyLeaf(t, tuple(int(d) for d in t.shape), target or _dtype_of(t),
                               (split_dims or {}).get(name))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=False, use_compression=False,
                                          type_handler_registry=_handler())
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(os.path.abspath(ckpt_dir), args=ocp.args.PyTreeSave(tree))


def _refuse_existing(ckpt_dir: str) -> None:
    if os.path.exists(ckpt_dir):
        raise FileExistsError(f"{ckpt_dir} already exists; delete it (or pass overwrite=True to "
                              f"convert_to_orbax) to write a new checkpoint there")


def _dtype_of(t) -> np.dtype:
    """A lazy tensor's dtype: its `.dtype`, else that of a one-element read (safetensors slices)."""
    if getattr(t, "dtype", None) is not None:
        return np.dtype(t.dtype)
    return np.asarray(t[tuple(slice(0, 1) for _ in t.shape)]).dtype


def convert_to_orbax(src: str, out_dir: str, dtype: str | None = None, overwrite: bool = False) -> str:
    """`src` (HF directory, .gguf file, or Orbax directory) -> `out_dir` with config, tokenizer, orbax/.

    Returns the path of the Orbax checkpoint (`out_dir/orbax`).
    """
    import shutil
    from tp_jax.loaders.convert import write_config_and_tokenizer
    from tp_jax.loaders.model import tensor_split_dims
    if os.path.abspath(src) == os.path.abspath(out_dir):
        raise ValueError(f"convert_to_orbax: source and output are the same directory {out_dir!r}; "
                         f"write to a new directory")
    ckpt = os.path.join(out_dir, ORBAX_SUBDIR)
    if overwrite:
        for old in ([ckpt] if os.path.exists(ckpt) else []) + interrupted_orbax(out_dir):
            shutil.rmtree(old)
    checkpoint = open_checkpoint(src)
    _refuse_existing(ckpt)                              # before writing config or tokenizer files
    os.makedirs(out_dir, exist_ok=True)
    write_config_and_tokenizer(src, out_dir, dtype)
    try:
        write_orbax(checkpoint.source, ckpt, dtype, tensor_split_dims(checkpoint.config))
    except BaseException:                               # Ctrl-C or a failed write: leave no half checkpoint
        for left in interrupted_orbax(out_dir):
            shutil.rmtree(left, ignore_errors=True)
        raise
    return ckpt


# --- reading -------------------------------------------------------------------------------

class OrbaxTensor:
    """One tensor of an Orbax checkpoint: `.shape`, `.dtype`, and `[index]` reading only that slice."""

    def __init__(self, source: OrbaxSource, name: str, shape: tuple[int, ...], dtype: np.dtype):
        self._source, self.name, self.shape, self.dtype = source, name, shape, dtype
        self.ndim = len(shape)

    def __repr__(self) -> str:
        return f"OrbaxTensor({self.name!r}, shape={self.shape}, dtype={self.dtype})"

    @functools.cached_property
    def _store(self):
        return self._source._open(self.name)

    def __getitem__(self, index) -> np.ndarray:
        return self._store[index].read().result()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        full = self[...]
        return full if dtype is None else full.astype(dtype)


class OrbaxSource:
    """The tensors of `model_dir/orbax` (written by `convert_to_orbax`) as a lazy name -> tensor table."""

    def __init__(self, model_dir: str):
        import orbax.checkpoint as ocp
        self.model_dir = model_dir
        self.ckpt_dir = os.path.abspath(os.path.join(model_dir, ORBAX_SUBDIR))
        _check_complete(self.ckpt_dir)
        meta = ocp.PyTreeCheckpointer().metadata(self.ckpt_dir).item_metadata
        self._use_zarr3 = bool(getattr(meta, "use_zarr3", False))
        self._ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(self.ckpt_dir)
        self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self._ocdbt)
        self._tensors: dict[str, OrbaxTensor] = {}
        self._stored: dict[str, str] = {}
        for key, m in _flatten(meta.tree).items():
            if not hasattr(m, "shape"):
                continue                                 # scalars and strings carry no weights
            self._stored[key] = m.name
            self._tensors[key] = OrbaxTensor(self, key, tuple(m.shape), np.dtype(m.dtype))

    def __repr__(self) -> str:
        return f"OrbaxSource({self.model_dir!r}, {len(self._tensors)} tensors)"

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, name: str) -> OrbaxTensor:
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} is missing from the Orbax checkpoint {self.ckpt_dir!r}")
        return self._tensors[name]

    def _open(self, name: str):
        """A tensorstore handle on `name` (opening reads only its zarr metadata)."""
        import orbax.checkpoint as ocp
        import tensorstore as ts
        from etils import epath
        info = ocp.type_handlers.ParamInfo(name=self._stored[name], parent_dir=epath.Path(self.ckpt_dir),
                                           is_ocdbt_checkpoint=self._ocdbt, use_zarr3=self._use_zarr3,
                                           ts_context=self._context)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
        try:
            return ts.open(ts.Spec(spec), open=True, read=True, context=self._context).result()
        except ValueError as e:
            raise OrbaxCheckpointError(f"cannot read tensor {name!r} from {self.ckpt_dir}: {e}; the "
                                       f"checkpoint is damaged, re-run scripts/convert.py SRC OUT --to orbax"
                                       ) from e


def _check_complete(ckpt_dir: str) -> None:
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"no Orbax checkpoint at {ckpt_dir}; write one with "
                                f"`python scripts/convert.py SRC OUT --to orbax`")
    if not os.path.isfile(os.path.join(ckpt_dir, "_METADATA")):
        raise OrbaxCheckpointError(f"{ckpt_dir} is not a complete Orbax PyTree checkpoint (no _METADATA file; "
                                   f"was the conversion interrupted?); delete it and re-run "
                                   f"`python scripts/convert.py SRC OUT --to orbax`")


def _flatten(tree, prefix: str = "") -> dict:
    """A nested dict of leaves as {"a.b.c": leaf} (our checkpoints are already flat)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


__all__ = ["OrbaxSource", "OrbaxTensor", "OrbaxCheckpointError", "convert_to_orbax", "write_orbax",
           "chunk_shape", "is_orbax_dir", "ORBAX_SUBDIR", "CHUNK"]
