"""HF `architectures` name -> the model, its config map and its name table: one registration per model.

A model file ends with one statement,

    register("GPT2LMHeadModel", GPT2LMHeadModel, config=gpt2_config, weights=gpt2_weights)

and the registry checks the loader side of the model contract there (see `Architecture`),
raising `ModelContractError` that names what is missing. Nothing else keys on the name, and
no list of models is kept: every module of `tp_jax.models` is imported on first lookup.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable

CONSTRUCTOR_KEYWORDS = ("tp_size", "pp_size", "dtype", "rngs")


class ModelContractError(TypeError):
    """A model class that does not provide what `LLM` and the loader call on it."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A registered model: what `LLM(path)` and the loader use, and nothing else.

    Args:
      name: the HF `architectures[0]` string, e.g. "LlamaForCausalLM".
      model: the `nnx.Module` class. `model(cfg, *, tp_size, pp_size, dtype, rngs)` builds it
        (the loader calls it under `nnx.eval_shape`, so nothing is allocated); the instance
        has `.config` (the cfg it was built with) and `.layer_map` (stacked layer slot -> HF
        layer index, -1 = an identity slot added for pipeline padding).
      config: `config(hf_config, raw) -> ModelConfig`: the model's fields from a
        `transformers.PretrainedConfig` (`raw`: config.json's dict or None), refusing fields it
        does not implement.
      weights: `weights(cfg) -> WeightTable`: checkpoint tensor names -> param parts.
    """
    name: str
    model: type
    config: Callable
    weights: Callable


_MODELS: dict[str, Architecture] = {}


def register(name: str, model: type, *, config: Callable, weights: Callable) -> Architecture:
    """Register `model` under the HF architecture `name`, checking the model contract."""
    check_contract(name, model, config, weights)
    arch = Architecture(name, model, config, weights)
    _MODELS[name] = arch
    return arch


# What the serving engine calls on a model (docs/design.md, contract 8)
ENGINE_METHODS = {
    "hidden_states": "hidden_states(ids, positions, cache=None, *, microbatches=1) -> (h, cache)",
    "logits": "logits(h) -> logits, all-gathered over tp",
    "kv_layout": "kv_layout() -> KVLayout, the paged pool it needs",
}


def check_contract(name: str, model, config, weights) -> None:
    where = f"register({name!r}, {getattr(model, '__qualname__', model)!r})"
    problems = []
    if not isinstance(name, str) or not name:
        problems.append("the architecture name must be a non-empty string (the HF `architectures` entry)")
    if not inspect.isclass(model):
        raise ModelContractError(f"{where}: the model must be a class (an nnx.Module), got {type(model).__name__}")
    params = inspect.signature(model.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    missing = [k for k in CONSTRUCTOR_KEYWORDS if k not in params and not takes_any]
    if missing:
        problems.append(f"its constructor lacks the keyword(s) {missing}; the loader calls "
                        f"model(cfg, tp_size=..., pp_size=..., dtype=..., rngs=...)")
    if not hasattr(model, "layer_map"):
        problems.append("it has no `layer_map` (a property: stacked layer slot -> HF layer index, -1 = identity)")
    for method, sig in ENGINE_METHODS.items():
        if not callable(getattr(model, method, None)):
            problems.append(f"it has no `{method}` method ({sig}); the serving engine calls it")
    for what, fn, sig in (("config", config, "config(hf_config, raw) -> ModelConfig"),
                          ("weights", weights, "weights(cfg) -> WeightTable")):
        if not callable(fn):
            problems.append(f"`{what}=` must be a function {sig}, got {fn!r}")
    if problems:
        raise ModelContractError(f"{where}: " + "; ".join(problems))


def check_instance(model, cfg) -> None:
    """What the registry cannot see on the class: `.config` and a `layer_map` of ints, on a built model."""
    name = type(model).__name__
    if getattr(model, "config", None) != cfg:
        raise ModelContractError(f"{name}(cfg, ...) must keep its config as `self.config = cfg`")
    layer_map = getattr(model, "layer_map", None)
    if not isinstance(layer_map, (tuple, list)) or not all(isinstance(i, int) for i in layer_map):
        raise ModelContractError(f"{name}.layer_map must be a tuple of ints (stacked slot -> HF layer, -1 = "
                                 f"identity), got {layer_map!r}")


def supported() -> list[str]:
    _import_models()
    return sorted(_MODELS)


def architecture(name: str) -> Architecture:
    """The registered architecture `name`, or ValueError listing the supported ones."""
    _import_models()
    if name not in _MODELS:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(sorted(_MODELS))}")
    return _MODELS[name]


def model_class(name: str) -> type:
    return architecture(name).model


def first_architecture(hf) -> str:
    """An HF config's `architectures[0]` (a bare string is read as one name, not a list of letters)."""
    archs = getattr(hf, "architectures", None) or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, (list, tuple)) or not archs or not isinstance(archs[0], str):
        raise ValueError(f"config.json has no usable 'architectures' entry ({archs!r}); expected e.g. "
                         f"[\"LlamaForCausalLM\"]")
    return archs[0]


def architecture_of(hf) -> Architecture:
    """The registered architecture of an HF config."""
    return architecture(first_architecture(hf))


def _import_models() -> None:
    """Import every module of tp_jax.models: each model file registers itself, no list to keep."""
    import tp_jax.models
    for info in pkgutil.iter_modules(tp_jax.models.__path__):
        importlib.import_module(f"tp_jax.models.{info.name}")


__all__ = ["Architecture", "ModelContractError", "register", "architecture", "architecture_of", "first_architecture",
           "model_class",
           "supported", "check_instance"]
