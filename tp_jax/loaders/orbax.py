"""Orbax checkpoints of the canonical (Hugging Face) tensors: convert once, restore onto any mesh.

Layout written by `convert_to_orbax(src, out_dir)`:

    out_dir/config.json, generation_config.json, tokenizer files   (as in a HF directory)
    out_dir/orbax/                                                (an Orbax PyTree checkpoint)

The Orbax checkpoint is a flat dict {HF tensor name: array} in HF layout (q, k, v, gate,
up separate; Linear weights [out, in]; no padding, no replication), so one checkpoint
serves every (tp, pp) mesh: `tp_jax/loaders/place.py` cuts each device's block from it exactly
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
import json
import os
import shutil

import numpy as np

from tp_jax.loaders.convert import write_config_and_tokenizer
from tp_jax.loaders.dtypes import BY_NAME, FLOATS
from tp_jax.loaders.model import tensor_split_dims
from tp_jax.loaders.orbax_source import (ORBAX_SUBDIR, OrbaxCheckpointError, OrbaxSource, OrbaxTensor,
                                         interrupted_orbax, is_orbax_dir)
from tp_jax.loaders.packed import PackedSource, RawTensors
from tp_jax.loaders.sources import open_checkpoint

CHUNK = 64
WRITE_WINDOW_BYTES = 64 * 2**20     # bytes in flight: OCDBT writes one at a time crawl (docs/performance.md)


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
    """A lazy tensor's dtype: its `.dtype`, else that of a one-element read (a source that does not say)."""
    if getattr(t, "dtype", None) is not None:
        return np.dtype(t.dtype)
    return np.asarray(t[tuple(slice(0, 1) for _ in t.shape)]).dtype


def drop_quantization_config(out_dir: str) -> None:
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def convert_to_orbax(src: str, out_dir: str, dtype: str | None = None, overwrite: bool = False) -> str:
    """`src` (HF directory, .gguf file, or Orbax directory) -> `out_dir` with config, tokenizer, orbax/.

    A GPTQ / AWQ / FP8 / compressed-tensors checkpoint stays packed (its stored tensors and its
    quantization_config, loaded as the safetensors are); with `dtype` it is written dequantized, as float.

    Returns the path of the Orbax checkpoint (`out_dir/orbax`).
    """
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
    source = checkpoint.source
    if isinstance(source, PackedSource):
        if dtype is None:                   # kept packed: the stored words, scales and zero points as they are
            source = RawTensors(source.source)
        else:                               # converted to a float dtype: dequantized, and said so in config.json
            drop_quantization_config(out_dir)
    try:
        write_orbax(source, ckpt, dtype, tensor_split_dims(checkpoint.config))
    except BaseException:                               # Ctrl-C or a failed write: leave no half checkpoint
        for left in interrupted_orbax(out_dir):
            shutil.rmtree(left, ignore_errors=True)
        raise
    return ckpt


__all__ = ["OrbaxSource", "OrbaxTensor", "OrbaxCheckpointError", "convert_to_orbax", "write_orbax",
           "chunk_shape", "is_orbax_dir", "ORBAX_SUBDIR", "CHUNK"]
