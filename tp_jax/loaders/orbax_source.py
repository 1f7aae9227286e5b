"""Reading an Orbax checkpoint of the canonical (Hugging Face) tensors: `OrbaxSource`, lazily.

`model_dir/orbax/` holds a flat PyTree {HF tensor name: array} in HF layout (written by
`convert_to_orbax`, tp_jax/loaders/orbax.py); `OrbaxSource` opens each tensor through tensorstore
only when it is read, and reads only the slice a device needs. Also here: how such a
directory is recognized (`is_orbax_dir`) and what an interrupted conversion leaves behind
(`interrupted_orbax`), which the source dispatcher (tp_jax/loaders/sources.py) asks.
"""

from __future__ import annotations

import functools
import glob
import os

import numpy as np

ORBAX_SUBDIR = "orbax"
ORBAX_TMP = ".orbax-checkpoint-tmp"      # orbax writes `<dir>.orbax-checkpoint-tmp*` and renames it at the end


class OrbaxCheckpointError(ValueError):
    """An Orbax checkpoint directory that is missing, incomplete or not in our layout."""


def is_orbax_dir(path: str) -> bool:
    """True for a model directory holding an `orbax/` checkpoint next to its config.json."""
    return os.path.isdir(os.path.join(path, ORBAX_SUBDIR))


def interrupted_orbax(path: str) -> list[str]:
    """Temporary directories an interrupted Orbax conversion left in `path`."""
    return sorted(glob.glob(os.path.join(glob.escape(path), ORBAX_SUBDIR + ORBAX_TMP + "*")))


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

    raw = get          # a packed checkpoint's stored tensors (loaders/packed.py) read as they are

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


__all__ = ["OrbaxSource", "OrbaxTensor", "OrbaxCheckpointError", "is_orbax_dir", "interrupted_orbax",
           "ORBAX_SUBDIR"]
