"""Weights that change under a running engine (vLLM's weight updates and sleep mode).

    update(llm, weights, mapping=None)                  # LLM.update_weights: the two below
    new, moved = placed_weights(llm, weights, mapping)  # a new model holding them, every check done first
    swap(llm, new)                                      # between steps: model, runner and prefix cache at once
    update_from_disk(llm, path)                         # LLM.update_weights_from_disk
    sleep(llm, level) / wake_up(llm)                    # free the KV pool (1), the weights too (2); re-allocate

`weights`: an `nnx.State`, a nested dict or any pytree of arrays whose leaves' paths, joined by ".", are the
checkpoint's tensor names ("model.layers.0.self_attn.q_proj.weight"), or a flat dict of such names;
`mapping` renames a trainer's names to the checkpoint's (a dict, or a function; a name it maps to None is
dropped). The arrays are a *source* (tp_jax/loaders/place.py) for the loader's own name table, bindings and
checks (`bind`, `check_source`: a missing, extra or misshapen tensor is named before anything moves).

Each param's global array is built on device from the layer's one statement (`ShardedParam`: the rows each
tp rank takes, GQA KV replicas and vocab padding included; `Entry` layouts and offsets), in the jnp twin of
`ShardedParam.block`: its tensors `jax.device_put` whole to the engine's devices, then one jitted program per
param (kept for the next update) into the engine's sharding: arrays already on devices never visit the host.
Float methods (float, "bf16", "stored16") take the cast; "int8" methods (weights quantized per device at load)
go through the loader's host path (`place_param`), as a fresh load would. Methods that hold
a file's quantized blocks (GGUF, GPTQ / AWQ / FP8 / compressed-tensors, MXFP4) cannot be refilled from float
arrays: `update_weights_from_disk` reloads them from a checkpoint of the same architecture.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from tp_jax.loaders.bind import Binding, bind, check_source
from tp_jax.loaders.place import fill, place_param
from tp_jax.parallel.layers import ExpertParam, MethodLayer, ShardedParam
from tp_jax.parallel.layers.base import ParallelModule as _Base
from tp_jax.parallel.layers.method import DerivedParam
from tp_jax.parallel.layers.moe import Experts
from tp_jax.parallel.layers.stack import use_layer_loop
from tp_jax.parallel.mesh import TP

class WeightUpdateError(ValueError):
    """Weights that do not fit the engine; nothing was changed, the engine serves its old weights."""


class ArraySource:
    """A dict {checkpoint name: array} as a loader source (`keys()`, `in`, `get`)."""

    def __init__(self, arrays: Mapping[str, object]):
        self.arrays = dict(arrays)

    def keys(self):
        return self.arrays.keys()

    def __contains__(self, name) -> bool:
        return name in self.arrays

    def get(self, name):
        return self.arrays[name]


def named_arrays(weights, mapping: Mapping[str, str | None] | Callable | None = None) -> dict[str, object]:
    """{checkpoint name: array} of an nnx State, a (nested) dict or any pytree; `mapping` renames."""
    if isinstance(weights, nnx.State):
        weights = nnx.to_pure_dict(weights)
    leaves = jax.tree_util.tree_flatten_with_path(weights)[0]
    out = {}
    for path, x in leaves:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        if mapping is not None:
            name = mapping(name) if callable(mapping) else mapping.get(name, name)
            if name is None:
                continue
        if name in out:
            raise WeightUpdateError(f"update_weights: two arrays are named {name!r} (after the mapping); give each "
                                    f"checkpoint tensor once")
        out[name] = x
    return out


# --- on device: the jnp twin of ShardedParam.block ---------------------------------------------------------

def _device_path(b: Binding) -> bool:
    """Whether `b`'s block is the plain statement's (so the jnp twin below builds it): not a method's derived
    param (int8 values, scales) nor experts, and the layer does not build blocks its own way."""
    return (type(b.decl).block is ShardedParam.block and not isinstance(b.decl, (DerivedParam, ExpertParam))
            and type(b.module).load_block is _Base.load_block)


def _view(x, entry, hf_rows: int | None):
    """The stored array seen in the declared layout (jnp: `TensorView`'s index, transpose and row offset)."""
    if entry.index is not None:
        x = x[entry.index]
    if entry.layout == "in_out":
        x = x.T
    if entry.offset is not None:
        x = jax.lax.slice_in_dim(x, entry.offset, entry.offset + hf_rows, axis=0)
    return x


def _take_rows(x, rows: np.ndarray, dim: int):
    """`x` indexed by `rows` along `dim`, zeros where rows == -1 (`take_rows` on device)."""
    valid = rows[rows >= 0]
    if rows.size == x.shape[dim] and np.array_equal(rows, np.arange(rows.size)):
        return x                                                    # the whole dimension: nothing to cut
    if valid.size and rows.size == valid.size and np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)):
        return jax.lax.slice_in_dim(x, int(rows[0]), int(rows[0]) + rows.size, axis=dim)
    out = jnp.take(x, jnp.asarray(np.where(rows >= 0, rows, 0)), axis=dim)
    pad = (rows < 0).reshape([-1 if i == dim else 1 for i in range(x.ndim)])
    return jnp.where(jnp.asarray(pad), jnp.zeros((), x.dtype), out) if pad.any() else out


def _global_on_device(b: Binding, tensors: Mapping[str, jax.Array], layer: int | None, tp: int) -> jax.Array:
    """The param's global value for one checkpoint layer: every tp rank's block, concatenated (contract 1)."""
    decl = b.decl
    parts = {p: _view(tensors[e.name(layer)], e, decl.parts[p].hf_shape[0]) for p, e in b.entries.items()}
    if decl.split is None:
        blocks = [parts[p] for p in decl.parts]
        out = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=0)
        return out.T if decl.transpose else out
    ranks = [jnp.concatenate([_take_rows(parts[p], spec.rows[r], decl.split) for p, spec in decl.parts.items()],
                             axis=decl.split) for r in range(tp)]
    out = ranks[0] if tp == 1 else jnp.concatenate(ranks, axis=decl.split)
    return out.T if decl.transpose else out


def _layers(b: Binding, layer_map) -> list[int | None]:
    return list(layer_map) if b.stacked else [None]


def _program(b: Binding, abstract, sharding: NamedSharding, layer_map, names: list[str], inputs: list):
    """One jitted program building the param from its tensors (`names`, in order; `inputs` their shapes and
    dtypes) into `sharding`."""
    tp = sharding.mesh.shape[TP] if b.decl.split is not None else 1
    dtype, shape = jnp.dtype(abstract.dtype), tuple(abstract.shape)

    def build(*arrays):
        tensors = dict(zip(names, arrays))
        one = lambda layer: _global_on_device(b, tensors, layer, tp).astype(dtype)     # noqa: E731
        if not b.stacked:
            return one(None)
        return jnp.stack([one(layer) if layer >= 0 else jnp.zeros(shape[1:], dtype) for layer in layer_map])

    out = jax.eval_shape(build, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs))
    if tuple(out.shape) != shape:
        raise WeightUpdateError(f"update_weights: param {b.path!r} came out {tuple(out.shape)}, expected {shape}")
    return jax.jit(build, out_shardings=sharding)


def _place_on_device(b: Binding, abstract, sharding: NamedSharding, source, layer_map, programs: dict) -> jax.Array:
    """The param on the engine's devices: its tensors copied whole to them (device to device, from any mesh),
    then cut, cast and stacked by one jitted program (kept in `programs` for the next update)."""
    names = [e.name(layer) for layer in _layers(b, layer_map) if layer is None or layer >= 0
             for e in b.entries.values()]
    names = list(dict.fromkeys(names))                              # a fused tensor feeding several parts: once
    whole = NamedSharding(sharding.mesh, jax.P())
    arrays = [jax.device_put(source.get(n), whole) for n in names]
    key = (b.path, sharding, tuple(layer_map), tuple((a.shape, a.dtype) for a in arrays))
    if key not in programs:
        programs[key] = _program(b, abstract, sharding, layer_map, names, arrays)
    return programs[key](*arrays)


# --- the update -----------------------------------------------------------------------------------------------

def _check_arrays(bindings: list[Binding], source, num_layers: int) -> None:
    """Float arrays only: an int or bool tensor is not a weight of a float layer (named, with the fix)."""
    for b in bindings:
        for layer in b.layers(num_layers):
            for e in b.entries.values():
                name = e.name(layer)
                dtype = np.dtype(getattr(source.get(name), "dtype", np.float32))
                if not np.issubdtype(dtype, np.floating) and dtype != jnp.bfloat16:
                    raise WeightUpdateError(f"update_weights: tensor {name!r} (param {b.path!r}) has dtype {dtype}; "
                                            f"weights are floating point (float32, bfloat16, float16): cast it "
                                            f"before the update")


def _check_methods(model) -> None:
    held = sorted({type(n.method).__name__ for _, n in nnx.iter_graph(model)
                   if isinstance(n, (MethodLayer, Experts)) and n.method.file_blocks})
    if held:
        raise WeightUpdateError(f"update_weights: this engine holds a checkpoint's quantized blocks "
                                f"({', '.join(held)}), "
                                f"which float arrays cannot refill; reload them with update_weights_from_disk(path) "
                                f"(a checkpoint of the same architecture), or start the engine with "
                                f"quantization=None, 'bf16' or 'int8' to take arrays")


def placed_weights(llm, weights, mapping=None, *, check_finite: bool = True) -> tuple[nnx.Module, dict]:
    """A new model holding `weights` in the engine's layout and methods, built beside the old one (which is not
    touched), and what was moved: {"device_bytes", "host_bytes", "params"}. Raises WeightUpdateError (or the
    loader's MissingWeightError / CheckpointMismatchError / WeightShapeError) naming the tensor."""
    from tp_jax.loaders.model import plan_model
    from tp_jax.loaders.sources import open_checkpoint
    source = ArraySource(named_arrays(weights, mapping))
    cfg, mesh = llm.config, llm.mesh
    if llm._stored_source is None:                                 # headers only: the methods the load chose
        llm._stored_source = open_checkpoint(llm.model_path).source
    stored = llm._stored_source
    model, _ = plan_model(cfg, stored, mesh, llm.dtype, quantization=llm.setup.quantization,
                          strict=llm.setup.named("quantization"))
    _check_methods(model)
    from tp_jax.models.registry import architecture
    table = architecture(cfg.architecture).weights(cfg).for_names(source.keys())
    bindings = bind(model, table)
    try:
        check_source(bindings, source, table, cfg.num_layers)
    except (KeyError, ValueError) as e:
        raise type(e)(f"update_weights: {e}; nothing was changed, the engine serves its old weights") from None
    _check_arrays(bindings, source, cfg.num_layers)
    layer_map = tuple(model.layer_map)
    state = nnx.state(model, nnx.Param)
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    abstract = dict(nnx.to_flat_state(state))
    loaded, moved, finite = {}, {"device_bytes": 0, "host_bytes": 0, "params": len(bindings)}, []
    programs = llm._update_programs                                # jitted per param, reused by the next update
    for b in bindings:
        value, spec = abstract[b.key].get_value(), specs[b.key].get_value()
        sharding = NamedSharding(mesh, spec)
        if _device_path(b):
            loaded[b.key] = _place_on_device(b, value, sharding, source, b.layer_map or layer_map, programs)
            moved["device_bytes"] += loaded[b.key].nbytes
            if check_finite and jnp.issubdtype(loaded[b.key].dtype, jnp.floating):
                finite.append((b, jnp.isfinite(loaded[b.key]).all()))
        else:                                           # the loader's host path (int8: quantized per device)
            loaded[b.key] = place_param(b, value, spec, mesh, _HostSource(source), llm.dtype,
                                        b.layer_map or layer_map, check_finite)
            moved["host_bytes"] += loaded[b.key].nbytes
    bad = [b.path for b, ok in finite if not bool(ok)]
    if bad:
        raise WeightUpdateError(f"update_weights: param(s) {bad[:5]} hold NaN or infinity (or overflow "
                                f"{llm.dtype}); nothing was changed, the engine serves its old weights")
    fill(model, loaded)
    use_layer_loop(model, mesh, llm.setup.layer_loop)
    return model, moved


class _HostSource(ArraySource):
    """An ArraySource whose tensors read to host numpy (the loader's host path slices them)."""

    def __init__(self, source: ArraySource):
        super().__init__(source.arrays)

    def get(self, name):
        return np.asarray(jax.device_get(self.arrays[name]))


def swap(llm, new: nnx.Module) -> None:
    """Put `new`'s values into the engine's model, the runner's flat weights and the full forward, together
    (between steps: the caller holds the engine); the prefix cache is dropped (its blocks were computed with the
    old weights). The old arrays are freed with their last reference."""
    nnx.update(llm.model, nnx.state(new))
    llm._forward = None                                             # get_logits' snapshot of the params
    if llm._engine is not None:
        core = llm._engine.core
        core.runner.weights = jax.tree.leaves(nnx.split(llm.model)[1])
        core.reset_prefix_cache()


def check_idle(llm, what: str) -> None:
    """The engine must have no request in flight (they would see two sets of weights)."""
    if llm._engine is not None and llm._engine.core.has_unfinished():
        ids = sorted(llm._engine.core.requests)[:5]
        raise RuntimeError(f"{what}: requests {ids} are still running; let them finish (or abort them) first: an "
                           f"update never lands between a request's steps")


def update(llm, weights, mapping=None) -> dict:
    """`LLM.update_weights`: checks, places, swaps; returns the transfer figures and the seconds it took."""
    check_idle(llm, "update_weights")
    start = time.perf_counter()
    new, moved = placed_weights(llm, weights, mapping)
    jax.block_until_ready(jax.tree.leaves(nnx.state(new)))
    swap(llm, new)
    _set_level(llm, min(llm._asleep, 1))                            # weights are back after a level-2 sleep
    return {**moved, "seconds": time.perf_counter() - start}


def update_from_disk(llm, path: str) -> dict:
    """`LLM.update_weights_from_disk`: a checkpoint of the same architecture, loaded per device like the first."""
    from tp_jax.loaders.model import load_from_source
    from tp_jax.loaders.sources import open_checkpoint
    check_idle(llm, "update_weights_from_disk")
    start = time.perf_counter()
    checkpoint = open_checkpoint(path)
    if checkpoint.config.architecture != llm.config.architecture:
        raise WeightUpdateError(f"update_weights_from_disk: {path!r} is a {checkpoint.config.architecture}; this "
                                f"engine serves a {llm.config.architecture} (start a new LLM for another architecture)")
    new = load_from_source(llm.config, checkpoint.source, llm.mesh, llm.dtype, False,
                           quantization=llm.setup.quantization, strict=llm.setup.named("quantization"))
    use_layer_loop(new, llm.mesh, llm.setup.layer_loop)
    swap(llm, new)
    _set_level(llm, min(llm._asleep, 1))
    return {"seconds": time.perf_counter() - start}


# --- sleep mode -------------------------------------------------------------------------------------------------

def sleep(llm, level: int) -> None:
    """Level 1: free the KV pool (the prefix cache with it). Level 2: the weights too. Compiled programs stay."""
    if level not in (1, 2):
        raise ValueError(f"sleep: level must be 1 (free the KV pool) or 2 (the weights too), got {level!r}")
    check_idle(llm, "sleep")
    if llm._engine is not None:
        runner = llm._engine.core.runner
        for x in (runner.k, runner.v):
            if x is not None:
                x.delete()
        runner.k = runner.v = None
        llm._engine.core.reset_prefix_cache()
    if level == 2:
        for x in jax.tree.leaves(nnx.state(llm.model)):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        llm._forward = None
    _set_level(llm, max(llm._asleep, level))


def wake_up(llm) -> None:
    """Re-allocate the KV pool (zeros); after level 2 without an update since, reload the weights from the
    model's own checkpoint."""
    from tp_jax.serving.kv_pool import new_pool
    if llm._asleep == 2:
        update_from_disk(llm, llm.model_path)
    if llm._engine is not None and llm._engine.core.runner.k is None:
        runner = llm._engine.core.runner
        runner.k, runner.v = new_pool(runner.pool, runner.mesh)
    _set_level(llm, 0)


def _set_level(llm, level: int) -> None:
    """The sleep level, said to the LLM (generate, get_logits) and its engine core (requests from the server)."""
    llm._asleep = level
    if llm._engine is not None:
        llm._engine.core.sleeping = level


__all__ = ["ArraySource", "WeightUpdateError", "named_arrays", "placed_weights", "swap", "update",
           "update_from_disk", "sleep", "wake_up"]
