"""LoRA adapters as PEFT saves them, served several at once (vLLM's vllm/lora/: request.py, peft_helper.py,
models.py, worker_manager.py).

    llm = LLM(base, enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/path/to/adapter"))

* `LoRARequest(lora_name, lora_int_id, lora_path)`: an adapter directory with `adapter_config.json` and
  `adapter_model.safetensors`; the id names it (one path per id).
* `read_adapter`: the config's rank, `lora_alpha`, `use_rslora`, `target_modules` checked against the model
  (the layers its name table maps: q/k/v/o, gate/up/down for the Llama-style families) and against
  `max_lora_rank`; what is not supported (`modules_to_save`, DoRA, biases, per-module ranks, embeddings)
  refused by name. Only the safetensors header is read here.
* `LoRAWeights`: the device side. Per target layer, `max_loras` slots of A and B, each device holding its
  slice (tp_jax/parallel/layers/lora.py says how each layer kind splits); `load(slot, adapter)` reads each
  rank's rows from the file and writes that slot. The runner passes them, with each token's slot, to every
  step (`LoRAStep`); the model's layers are not touched.
* `LoRASlots`: which adapter each device slot holds, for the scheduler: a request runs only while its adapter
  has a slot; a slot no running request uses is reused, least recently used first. `max_cpu_loras` parsed
  adapters stay in host memory (an LRU), so a slot is refilled without reading the file again.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tp_jax.models.registry import architecture
from tp_jax.parallel.layers.linear import ColumnParallelLinear, RowParallelLinear
from tp_jax.parallel.layers.loading import take_rows
from tp_jax.parallel.mesh import PP, TP

STACK, KERNEL = "model.layers.layers.", ".kernel"
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: a name (the server's model name), a positive integer id, the adapter's directory."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name={self.lora_name!r} must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id={self.lora_int_id!r} must be an integer >= 1")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))


@dataclasses.dataclass(frozen=True)
class Target:
    """A layer LoRA can adapt: its key in the layer stack ("self_attn.qkv_proj") and the part a module fills."""
    key: str
    part: str


def lora_targets(model) -> dict[str, Target]:
    """HF module template ("model.layers.{i}.self_attn.q_proj") -> Target, from the model's name table."""
    cfg = model.config
    out = {}
    for e in architecture(cfg.architecture).weights(cfg).entries:
        if (e.stacked and e.hf.endswith(".weight") and e.param.startswith(STACK) and e.param.endswith(KERNEL)
                and e.layout == "out_in" and e.offset is None and e.index is None):
            out[e.hf[:-len(".weight")]] = Target(e.param[len(STACK):-len(KERNEL)], e.part)
    return out


@dataclasses.dataclass
class Adapter:
    """A checked PEFT adapter: its rank, the scale folded into B, and module name -> (A name, B name)."""
    request: LoRARequest
    rank: int
    scale: float
    modules: dict[str, tuple[int, Target]]          # "model.layers.3.self_attn.q_proj" -> (layer, Target)
    file: str

    def tensors(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """module -> (A[r, in], B[out, r] * scale), read from the file as float32."""
        from safetensors import safe_open
        out = {}
        with safe_open(self.file, "np") as f:
            for module in self.modules:
                a = np.asarray(f.get_tensor(f"base_model.model.{module}.lora_A.weight"), np.float32)
                b = np.asarray(f.get_tensor(f"base_model.model.{module}.lora_B.weight"), np.float32)
                out[module] = (a, b * np.float32(self.scale))
        return out


def read_adapter(req: LoRARequest, model, max_rank: int) -> Adapter:
    """The adapter at `req.lora_path`, checked against `model` and `max_rank` (only its header read)."""
    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    cfg_path = os.path.join(req.lora_path, "adapter_config.json")
    file = os.path.join(req.lora_path, "adapter_model.safetensors")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{where}: no adapter_config.json there; give the directory PEFT's save_pretrained wrote")
    if not os.path.isfile(file):
        bin_file = os.path.isfile(os.path.join(req.lora_path, "adapter_model.bin"))
        raise ValueError(f"{where}: no adapter_model.safetensors" + (
            " (adapter_model.bin is a pickle, not read: save it again with safe_serialization=True)" if bin_file
            else "; give the directory PEFT's save_pretrained wrote"))
    with open(cfg_path) as f:
        c = json.load(f)
    if c.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {c.get('peft_type')!r}; only LoRA adapters are served")
    for key, off, fix in [("modules_to_save", None, "fully trained modules are not served beside a base model"),
                          ("use_dora", False, "DoRA's magnitude vectors are not supported"),
                          ("bias", "none", "LoRA biases are not supported"),
                          ("rank_pattern", {}, "per-module ranks are not supported"),
                          ("alpha_pattern", {}, "per-module alphas are not supported"),
                          ("fan_in_fan_out", False, "Conv1D-style (fan_in_fan_out) targets are not supported")]:
        if c.get(key) not in (off, None) and not (key == "modules_to_save" and not c.get(key)):
            raise ValueError(f"{where}: {key}={c.get(key)!r}: {fix}")
    rank, alpha = c.get("r"), c.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r={rank!r} in adapter_config.json must be a positive integer")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank={max_rank}; raise max_lora_rank to at least "
                         f"{rank}")
    alpha = rank if alpha is None else alpha
    scale = alpha / math.sqrt(rank) if c.get("use_rslora") else alpha / rank
    targets = lora_targets(model)
    names = {t.rsplit(".", 1)[-1] for t in targets}
    wanted = c.get("target_modules")
    if isinstance(wanted, list):
        missing = sorted(t for t in wanted if t.rsplit(".", 1)[-1] not in names)     # a name or a module path
        if missing:
            raise ValueError(f"{where}: target_modules {missing} are not layers of this "
                             f"{model.config.architecture} that LoRA can adapt ({sorted(names)})")
    num_layers = model.config.num_layers
    concrete = {t.format(i=i): (i, target) for t, target in targets.items() for i in range(num_layers)}
    from safetensors import safe_open
    modules: dict[str, tuple[int, Target]] = {}
    seen: dict[str, set[str]] = collections.defaultdict(set)
    with safe_open(file, "np") as f:
        keys = list(f.keys())
        for name in keys:
            m = _KEY.match(name)
            if m is None or m.group(1) not in concrete:
                raise ValueError(f"{where}: tensor {name!r} adapts no layer this {model.config.architecture} "
                                 f"serves LoRA on ({sorted(names)} of its decoder layers)")
            module, which = m.groups()
            seen[module].add(which)
            shape = tuple(f.get_slice(name).get_shape())
            modules[module] = concrete[module]
            if (shape[0] if which == "A" else shape[1]) != rank:
                raise ValueError(f"{where}: {name} has shape {shape}, not rank {rank} of adapter_config.json")
    half = sorted(m for m, s in seen.items() if s != {"A", "B"})
    if half:
        raise ValueError(f"{where}: {half[0]} has only lora_{''.join(seen[half[0]])}; both A and B are needed")
    if not modules:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA tensor")
    return Adapter(req, rank, float(scale), modules, file)


# --- the device side ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Layer:
    """One target layer of the stack: its kind, parts and each rank's rows, and its two device arrays."""
    key: str
    column: bool
    parts: tuple[str, ...]
    rows: dict[str, np.ndarray]                 # part -> [tp, n] rows (column: out rows; row: in columns)
    in_size: int                                # column: the whole input; row: the HF input
    out_size: int                               # column: the HF output of each part summed; row: the output
    a: jax.Array | None = None
    b: jax.Array | None = None


class LoRAWeights:
    """`max_loras` adapter slots of every target layer, on the mesh (see the module doc)."""

    def __init__(self, model, mesh: Mesh, max_loras: int, max_rank: int):
        self.mesh, self.slots, self.rank = mesh, max_loras, max_rank
        self.layer_map = tuple(model.layer_map)
        self.dtype = jnp.dtype(model.dtype)
        self.tp = mesh.shape[TP]
        stack = model.model.layers
        layer = stack.layers if stack.slots is None else stack.slots[0]       # the stack's layer (any slot's)
        self.layers: dict[str, _Layer] = {}
        for target in lora_targets(model).values():
            node = _node(layer, target.key)
            if target.key in self.layers or not isinstance(node, (ColumnParallelLinear, RowParallelLinear)):
                continue
            decl = node.statements()["kernel"]
            column = isinstance(node, ColumnParallelLinear)
            parts = tuple(decl.parts)
            self.layers[target.key] = _Layer(
                target.key, column, parts, {p: decl.parts[p].rows for p in parts},
                next(iter(decl.parts.values())).hf_shape[1], sum(decl.parts[p].hf_shape[0] for p in parts))
        for layer in self.layers.values():
            a_shape, b_shape = self._shapes(layer)
            layer.a = jnp.zeros(a_shape, self.dtype, device=self._sharding(layer, "a"))
            layer.b = jnp.zeros(b_shape, self.dtype, device=self._sharding(layer, "b"))
        self._set = jax.jit(lambda x, s, v: x.at[:, s].set(v), donate_argnums=0)

    def _shapes(self, layer: _Layer):
        n, s, r = len(self.layer_map), self.slots, self.rank
        if layer.column:
            return (n, s, layer.in_size, len(layer.parts) * r), (n, s, r, self.tp * sum(self.parts_of(layer)))
        in_local = layer.rows[layer.parts[0]].shape[1]
        return (n, s, self.tp * in_local, r), (n, s, r, layer.out_size)

    def parts_of(self, layer: _Layer) -> tuple[int, ...]:
        """The local output columns of each fused part (a row layer: its whole output)."""
        return tuple(layer.rows[p].shape[1] for p in layer.parts) if layer.column else (layer.out_size,)

    def parts(self) -> dict[str, tuple[int, ...]]:
        return {k: self.parts_of(layer) for k, layer in self.layers.items()}

    def spec(self, layer: _Layer, which: str) -> P:
        split = (TP if which == "b" else None) if layer.column else (TP if which == "a" else None)
        return P(PP, None, split, None) if which == "a" else P(PP, None, None, split)

    def _sharding(self, layer: _Layer, which: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(layer, which))

    def args(self) -> dict[str, tuple[jax.Array, jax.Array]]:
        return {k: (layer.a, layer.b) for k, layer in self.layers.items()}

    def specs(self) -> dict[str, tuple[P, P]]:
        return {k: (self.spec(layer, "a"), self.spec(layer, "b")) for k, layer in self.layers.items()}

    def load(self, slot: int, adapter: Adapter | None, tensors=None) -> None:
        """Write `adapter` (None: zeros) into `slot` of every layer; `tensors`: its `Adapter.tensors()`."""
        tensors = {} if adapter is None else (tensors if tensors is not None else adapter.tensors())
        by_layer = collections.defaultdict(dict)                 # key -> layer index -> {part: (A, B)}
        for module, (i, target) in ({} if adapter is None else adapter.modules).items():
            by_layer[target.key].setdefault(i, {})[target.part] = tensors[module]
        for key, layer in self.layers.items():
            a_shape, b_shape = self._shapes(layer)
            a, b = np.zeros((a_shape[0], *a_shape[2:]), np.float32), np.zeros((b_shape[0], *b_shape[2:]), np.float32)
            for slot_index, hf_layer in enumerate(self.layer_map):
                parts = by_layer[key].get(hf_layer) if hf_layer >= 0 else None
                if parts:
                    self._fill(layer, parts, a[slot_index], b[slot_index])
            layer.a = self._set(layer.a, slot, jax.device_put(a.astype(self.dtype), _drop_slot(layer.a.sharding)))
            layer.b = self._set(layer.b, slot, jax.device_put(b.astype(self.dtype), _drop_slot(layer.b.sharding)))

    def _fill(self, layer: _Layer, parts: dict, a: np.ndarray, b: np.ndarray) -> None:
        """One layer's A [in, P * R] and B [R, out] (global layout: ranks' blocks side by side) from the parts'
        (A[r, in], B[out, r] scaled): part p's A in columns p * R.., its B in the part's output columns."""
        r_max = self.rank
        if not layer.column:
            (pa, pb), = parts.values()
            r, rows = pa.shape[0], layer.rows[layer.parts[0]]
            a[:, :r] = np.concatenate([take_rows(pa, rows[k], 1) for k in range(self.tp)], axis=1).T
            b[:r] = pb.T
            return
        out_local = b.shape[1] // self.tp
        for k in range(self.tp):
            col = k * out_local
            for p, part in enumerate(layer.parts):
                n = layer.rows[part].shape[1]
                if part in parts:
                    pa, pb = parts[part]
                    r = pa.shape[0]
                    a[:, p * r_max:p * r_max + r] = pa.T
                    b[:r, col:col + n] = take_rows(pb, layer.rows[part][k], 0).T
                col += n


def _node(module, key: str):
    for name in key.split("."):
        module = getattr(module, name, None)
    return module


def _drop_slot(sharding: NamedSharding) -> NamedSharding:
    spec = tuple(sharding.spec) + (None,) * 4
    return NamedSharding(sharding.mesh, P(spec[0], *spec[2:4]))


# --- the host side: which adapter each slot holds -------------------------------------------------------------

class LoRASlots:
    """Device slots -> adapter ids for the scheduler, plus the parsed adapters (an LRU of `max_cpu_loras`)."""

    def __init__(self, max_loras: int, max_cpu_loras: int):
        self.held: list[int | None] = [None] * max_loras      # the adapter id each slot is assigned
        self.used: collections.OrderedDict[int, None] = collections.OrderedDict()    # slots, least recent first
        self.known: dict[int, Adapter] = {}                     # every adapter a request named (checked)
        self.cpu: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self.max_cpu = max_cpu_loras

    def register(self, adapter: Adapter) -> None:
        """Remember a checked adapter; the same id with another path is refused."""
        old = self.known.get(adapter.request.lora_int_id)
        if old is not None and os.path.abspath(old.request.lora_path) != os.path.abspath(adapter.request.lora_path):
            raise ValueError(f"lora_int_id {adapter.request.lora_int_id} already names {old.request.lora_path!r}; "
                             f"give {adapter.request.lora_path!r} another id")
        self.known[adapter.request.lora_int_id] = adapter

    def slot_for(self, lora_id: int, in_use: set[int]) -> int | None:
        """The slot holding `lora_id`, else a free one (unused first, then least recently used), else None."""
        if lora_id in self.held:
            return self.held.index(lora_id)
        free = [s for s in range(len(self.held)) if s not in in_use]
        if not free:
            return None
        empty = [s for s in free if self.held[s] is None]
        if empty:
            return empty[0]
        return next(s for s in self.used if s in free)

    def assign(self, slot: int, lora_id: int) -> None:
        self.held[slot] = lora_id
        self.used.pop(slot, None)
        self.used[slot] = None

    def tensors(self, lora_id: int) -> dict:
        """The adapter's tensors from host memory, read from its file on a miss (evicting the LRU one)."""
        if lora_id in self.cpu:
            self.cpu.move_to_end(lora_id)
        else:
            self.cpu[lora_id] = self.known[lora_id].tensors()
            while len(self.cpu) > self.max_cpu:
                self.cpu.popitem(last=False)
        return self.cpu[lora_id]
