"""HF `architectures` name -> model class; later models plug in with `register`."""

from __future__ import annotations

_MODELS: dict[str, type] = {}


def register(*names: str):
    def deco(cls):
        for n in names:
            _MODELS[n] = cls
        return cls
    return deco


def supported() -> list[str]:
    _import_models()
    return sorted(_MODELS)


def model_class(architecture: str) -> type:
    _import_models()
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_MODELS))}")
    return _MODELS[architecture]


def check_architecture(hf) -> str:
    archs = list(getattr(hf, "architectures", None) or [])
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; expected e.g. [\"LlamaForCausalLM\"]")
    model_class(archs[0])
    return archs[0]


def _import_models() -> None:
    from tp_jax.models import llama, mistral, qwen2, qwen3  # noqa: F401  (each registers itself)
