"""Each layer's linear method for a checkpoint, before any tensor byte is read.

    weight_facts(model, table, source, num_layers) -> (GGUF types of the weights, all stored in bfloat16?)
    plan_methods(model, table, source, num_layers, quantization, strict=True) -> {module path: LinearMethod}

`quantization`: None or "none" (every weight float, as stored or dequantized), or a registered name
("bf16", "int8", "w8a8", "w8a8x2", "w8a8x2_bf16", "gguf", "gguf_bf16";
`tp_jax.parallel.layers.quantization`). Which one "auto" means is decided by the engine's resolve
step (tp_jax/serving/resolve.py) from `weight_facts`; here the name is only applied.

`strict` (a name the user gave): every problem is an error, all listed at once with the param
paths: a GGUF type not kept, mixed types within one param, a method that cannot hold a layer
(e.g. a row split that cuts through 32-element blocks). Not strict (the resolve step's own choice):
such a layer loads dequantized to float, with one warning naming those layers.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from tp_jax.loaders.bind import Binding, as_table, bind
from tp_jax.parallel.layers import Entry, Experts, MethodLayer, WeightTable
from tp_jax.parallel.layers.method import LinearMethod, QuantizationError
from tp_jax.parallel.layers.quantization import AUTO, NONE, quantization_config


def plan_methods(model: nnx.Module, table: WeightTable | Sequence[Entry], source, num_layers: int,
                 quantization: str | None, strict: bool = True) -> dict[str, LinearMethod]:
    """{dotted module path: method} for the layers `quantization` quantizes (empty: all float)."""
    if quantization is None or quantization == NONE:
        return {}
    if quantization == AUTO:
        raise ValueError("plan_methods: 'auto' is decided by the engine's resolve step "
                         "(tp_jax/serving/resolve.py); pass the name it chose")
    weights = _weight_bindings(model, table)
    plan, problems = _plan(quantization, weights, source, num_layers)
    if problems and strict:
        raise QuantizationError(f"quantization={quantization!r} cannot load this checkpoint ({_count(problems)}):"
                                f"{_listing(problems)}")
    if problems:
        warnings.warn(f"quantization={quantization!r} (auto): {_count(problems)} loaded dequantized to float "
                      f"instead of kept quantized:{_listing(problems)}", stacklevel=3)
    return plan


def weight_facts(model: nnx.Module, table: WeightTable | Sequence[Entry], source,
                 num_layers: int) -> tuple[frozenset, bool]:
    """(the GGUF quant types of the weights a linear method would hold, None for a non-GGUF tensor;
    whether every one of them is stored in bfloat16), from the headers."""
    views = [t for b in _weight_bindings(model, table) for t in _tensors(b, source, num_layers).values()]
    types = frozenset(getattr(t, "quant_type", None) for t in views)
    return types, bool(views) and all(getattr(t, "stored_dtype", None) == jnp.bfloat16 for t in views)


def _weight_bindings(model, table) -> list[Binding]:
    """The bindings of the weights a method holds (a MethodLayer's weight param, one per layer; an MoE
    block's stacked experts, by their `gate_up`); a layer marked `keep_float` (an MoE router: int8 logits
    would change which experts run) stays float."""
    return [b for b in bind(model, as_table(table))
            if isinstance(b.module, (MethodLayer, Experts)) and b.name == b.module.weight_name
            and not (isinstance(b.module, MethodLayer) and b.module.keep_float)]


def _tensors(b: Binding, source, num_layers: int) -> dict:
    """Checkpoint tensor name -> its lazy view, for every layer and part filling `b` (headers only)."""
    out = {}
    for layer in b.layers(num_layers):
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
            if method is not None and not method.float_weight:
                method.check(b.module, b.module.statements()[b.module.weight_name])
                plan[module_path] = method
        except QuantizationError as e:
            problems.append(f"{b.path}: {e}")
    return plan, problems


def _count(problems: list[str]) -> str:
    return f"{len(problems)} param{'s' * (len(problems) > 1)}"


def _listing(problems: list[str], shown: int = 5) -> str:
    more = f"\n  ... and {len(problems) - shown} more" if len(problems) > shown else ""
    return "\n  " + "\n  ".join(problems[:shown]) + more


def describe_methods(model: nnx.Module) -> str:
    """How a loaded model holds its weights: "gguf Q4_1, gguf Q8_0", "int8", or "none" (all float)."""
    labels = {node.method.label for _, node in nnx.iter_graph(model)
              if isinstance(node, (MethodLayer, Experts)) and not node.method.float_weight}
    return ", ".join(sorted(labels)) or "none"
