"""Choosing each layer's linear method for a checkpoint, before any tensor byte is read.

    plan_methods(model, table, source, num_layers, quantization, layer_loop, num_devices)
        -> {module path: LinearMethod}

`quantization`: None or "none" (every weight float, as stored or dequantized), a registered name
("bf16", "int8", "w8a8", "w8a8x2", "gguf", "gguf_bf16", "gguf_int8"; `tp_jax.parallel.layers.quantization`),
or "auto", which picks by checkpoint and platform (`auto_choice`, measured in docs/performance.md):

* a GGUF file whose linear or vocab weights are quantized: on a one-device CPU mesh under the
  switched or unrolled layer loop (where bf16 dots are fast, as below) "w8a8x2_bf16", each weight
  held twice, int8 per output row and bf16 (layers/by_rows.py): a GEMM of at most 4 rows (decode of
  up to 4 requests; 24 on a CPU with AMX-INT8, `int8_max_rows`) runs "w8a8x2"'s int8 x int8 -> int32
  dot of two activation digits, XLA:CPU's fastest there (SmolLM2 +1.5% perplexity against the file's float32 weights), a larger one (8
  requests, a prefill) the bf16 x bf16 -> float32 dot, fastest there. Both forms take 3 bytes a
  weight; where that is over half the host's memory (`LEAN`), "w8a8x2" alone (1 byte) with a
  warning. On several CPU devices or under the scan "w8a8x2"; on accelerators the blocks kept
  with dots in the model's dtype ("gguf");
* a float checkpoint whose weights are all stored in bfloat16 (safetensors / Orbax headers, GGUF BF16
  tensors), on a one-device CPU mesh under the switched or unrolled layer loop (`AUTO_BF16`; "switch" is
  the default there), with the run's dtype "auto": "bf16", the weights as stored and bf16 x bf16 -> float32 dots
  (SmolLM2 from a bf16 copy, tp = 1: decode 1.0-1.9x / 1.4-2.1x float32's tokens/s at
  batch 1 / 8, perplexity +0.02%); under the scan, where XLA:CPU's bf16 dot is slow, and on several
  devices, float32;
* any other checkpoint: None, the float weights in the run's dtype (float32 on CPU, bit for
  bit; bf16 on accelerators). A float32 checkpoint's numbers change only when asked
  ("w8a8x2", "int8", "bf16", ...).

Where "auto" keeps the blocks, a layer that cannot be kept quantized (a type not kept: K-quants, Q5_*; a tp that
cuts its 32-element blocks) loads dequantized to float, with one warning naming those
layers; naming "gguf" explicitly makes each of them an error.

Every problem is found here, from headers only, and reported at once with the param
paths: an unknown name, a GGUF type not kept, mixed types within one param, a method that
cannot hold a layer (e.g. a row split that cuts through 32-element blocks).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.loaders.bind import Binding, as_table, bind
from tp_jax.parallel.layers import Entry, Experts, MethodLayer, WeightTable
from tp_jax.parallel.layers.method import LinearMethod, QuantizationError, Unquantized
from tp_jax.parallel.layers.quantization import AUTO, FLOAT_TYPES, NONE, quantization_config


def plan_methods(model: nnx.Module, table: WeightTable | Sequence[Entry], source, num_layers: int,
                 quantization: str | None, layer_loop: str | None = None,
                 num_devices: int = 1) -> dict[str, LinearMethod]:
    """{dotted module path: method} for the layers `quantization` quantizes (empty: all float).

    `layer_loop` ("scan", "switch", "unrolled") and `num_devices`: the loop the model will run and its
    mesh's size, which "auto" weighs for a bf16 checkpoint (`auto_choice`); layer_loop None: "auto" leaves
    float weights in the run's dtype (LLM passes None when the user names the dtype)."""
    if quantization is None or quantization == NONE:
        return {}
    weights = _weight_bindings(model, table)
    if quantization == AUTO:
        return _auto(weights, source, num_layers, layer_loop, num_devices)
    return _strict(quantization, weights, source, num_layers)


def _weight_bindings(model, table) -> list[Binding]:
    """The bindings of the weights a method holds (a MethodLayer's weight param, one per layer; an MoE
    block's stacked experts, by their `gate_up`); a layer marked `keep_float` (an MoE router: int8 logits
    would change which experts run) stays float."""
    return [b for b in bind(model, as_table(table))
            if isinstance(b.module, (MethodLayer, Experts)) and b.name == b.module.weight_name
            and not getattr(b.module, "keep_float", False)]


def _tensors(b: Binding, source, num_layers: int) -> dict:
    """Checkpoint tensor name -> its lazy view, for every layer and part filling `b` (headers only)."""
    out = {}
    for layer in (range(num_layers) if b.stacked else [None]):
        names = b.tensor_names(layer)
        if all(n in source for n in names.values()):           # missing ones: check_source names them
            out.update({names[p]: v for p, v in b.tensors(source, layer).items()})
    return out


def _plan(name: str, weights: list[Binding], source, num_layers: int) -> tuple[dict[str, LinearMethod], list[str]]:
    """({module path: method}, problems): each problem names a param the configuration cannot hold, and why."""
    config = quantization_config(name)
    plan, problems = {}, []
    for b in weights:
        module_path = b.path.rsplit(".", 1)[0]
        try:
            method = config.method_for(b.module, _tensors(b, source, num_layers))
            if method is not None and not isinstance(method, Unquantized):
                method.check(b.module, b.module.statements()[b.module.weight_name])
                plan[module_path] = method
        except QuantizationError as e:
            problems.append(f"{b.path}: {e}")
    return plan, problems


def _strict(name: str, weights: list[Binding], source, num_layers: int) -> dict[str, LinearMethod]:
    """A named quantization: every problem is an error, all of them listed in one message."""
    plan, problems = _plan(name, weights, source, num_layers)
    if problems:
        raise QuantizationError(f"quantization={name!r} cannot load this checkpoint ({_count(problems)}):"
                                f"{_listing(problems)}")
    return plan


AUTO_GGUF = {"cpu": ("w8a8x2_bf16", "w8a8x2")}   # platform -> what "auto" picks for a quantized GGUF: (where
                                                 # bf16 dots are fast, as for AUTO_BF16; elsewhere); others: "gguf"
LEAN = {"w8a8x2_bf16": ("w8a8x2", 3)}       # a choice -> (the one "auto" takes instead, the choice's bytes a weight)
HOST_MEMORY_SHARE = 0.5                      # ... when those bytes are over this share of the host's memory
AUTO_BF16 = {"cpu": ("switch", "unrolled")}  # platform -> the layer loops where "auto" gives a bf16 checkpoint "bf16"
                                             # on a one-device mesh


def auto_choice(quant_types: set[str | None], platform: str, stored_bf16: bool = False,
                layer_loop: str | None = None, num_devices: int = 1) -> str | None:
    """The configuration "auto" picks for a checkpoint whose weights have GGUF types `quant_types` (None: not a
    GGUF tensor) on `platform` (jax's backend name). Where bf16 dots are fast (`layer_loop` one of
    `AUTO_BF16[platform]`, a one-device mesh; slower under the scan and, at batch 1, on 8 simulated devices:
    docs/performance.md): for quantized GGUF weights `AUTO_GGUF`'s first choice, for weights all stored in
    bfloat16 (`stored_bf16`) "bf16"; elsewhere `AUTO_GGUF`'s second, and None (float) for the rest."""
    bf16_fast = num_devices == 1 and layer_loop in AUTO_BF16.get(platform, ())
    if any(q not in (None, *FLOAT_TYPES) for q in quant_types):
        fast, other = AUTO_GGUF.get(platform, ("gguf", "gguf"))
        return fast if bf16_fast else other
    return "bf16" if stored_bf16 and bf16_fast else None


def _auto(weights: list[Binding], source, num_layers: int, layer_loop: str | None,
          num_devices: int) -> dict[str, LinearMethod]:
    """`auto_choice`'s configuration for this checkpoint (None: {}); a GGUF layer it cannot keep loads
    dequantized to float, with one warning naming those layers and why."""
    views = [t for b in weights for t in _tensors(b, source, num_layers).values()]
    types = {t.quant_type for t in views}
    stored_bf16 = bool(views) and all(t.stored_dtype == jnp.bfloat16 for t in views)
    name = auto_choice(types, jax.default_backend(), stored_bf16, layer_loop, num_devices)
    if name is None:
        return {}
    name = _lean(name, sum(int(np.prod(t.shape)) for t in views))
    plan, problems = _plan(name, weights, source, num_layers)
    if problems:
        warnings.warn(f"quantization='auto': {_count(problems)} loaded dequantized to float instead of kept "
                      f"quantized:{_listing(problems)}", stacklevel=3)
    return plan


def _lean(name: str, num_weights: int, memory: int | None = None) -> str:
    """`name`, or its `LEAN` alternative when `name`'s bytes for `num_weights` weights are over
    `HOST_MEMORY_SHARE` of `memory` (default: this host's physical memory), with a warning saying so."""
    if name not in LEAN:
        return name
    lean, per_weight = LEAN[name]
    memory = memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = per_weight * num_weights
    if need <= HOST_MEMORY_SHARE * memory:
        return name
    warnings.warn(f"quantization='auto': {name!r} would hold these weights in {need / 2**30:.1f} GiB, over "
                  f"{HOST_MEMORY_SHARE:.0%} of this host's {memory / 2**30:.1f} GiB; holding them as {lean!r} instead "
                  f"(larger batches and prefills run slower; name quantization={name!r} to insist)", stacklevel=4)
    return lean


def _count(problems: list[str]) -> str:
    return f"{len(problems)} param{'s' * (len(problems) > 1)}"


def _listing(problems: list[str], shown: int = 5) -> str:
    more = f"\n  ... and {len(problems) - shown} more" if len(problems) > shown else ""
    return "\n  " + "\n  ".join(problems[:shown]) + more


def describe_methods(model: nnx.Module) -> str:
    """How a loaded model holds its weights: "gguf Q4_1, gguf Q8_0", "int8", or "none" (all float)."""
    labels = {node.method.label for _, node in nnx.iter_graph(model)
              if isinstance(node, MethodLayer) and not isinstance(node.method, Unquantized)}
    return ", ".join(sorted(labels)) or "none"
