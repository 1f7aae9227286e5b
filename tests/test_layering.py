"""Imports run one way: parallel <- models <- loaders <- serving <- server; multihost stands aside.

A module may import its own layer and the layers below it, never one above. `multihost` is
used by serving, the server and scripts, and imports no other part of tp_jax. The package's
`tp_jax/__init__.py` is the public face (it re-exports from every layer) and is not checked.
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
LAYERS = ["tp_jax.parallel", "tp_jax.models", "tp_jax.loaders", "tp_jax.serving", "tp_jax.server"]
DIRS = {"tp_jax.parallel": "tp_jax/parallel", "tp_jax.models": "models", "tp_jax.loaders": "loaders",
        "tp_jax.serving": "tp_jax/serving", "tp_jax.server": "tp_jax/server", "tp_jax.multihost": "tp_jax/multihost"}


def _package(module: str) -> str | None:
    for name in DIRS:
        if module == name or module.startswith(name + "."):
            return name
    return None


def _tp_jax_imports(path: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names if node.module == "tp_jax"]
    return [m for m in out if m.split(".")[0] == "tp_jax"]


def _files():
    for pkg, d in DIRS.items():
        full = os.path.join(ROOT, d)
        for dirpath, _, names in os.walk(full):
            for n in names:
                if n.endswith(".py"):
                    yield pkg, os.path.relpath(os.path.join(dirpath, n), ROOT)


@pytest.mark.parametrize("pkg,path", sorted(_files()), ids=lambda x: x if "/" in str(x) else "")
def test_imports_point_down(pkg, path):
    for mod in _tp_jax_imports(os.path.join(ROOT, path)):
        target = _package(mod)
        assert target is not None, f"{path} imports {mod!r}, which belongs to no layer (import from a subpackage)"
        if pkg == "tp_jax.multihost":
            assert target == pkg, f"{path} imports {mod!r}: multihost imports no other part of tp_jax"
        elif target == "tp_jax.multihost":
            assert pkg in ("tp_jax.serving", "tp_jax.server"), f"{path} imports {mod!r}: only serving and the " \
                f"server use multihost"
        else:
            assert LAYERS.index(target) <= LAYERS.index(pkg), \
                f"{path} ({pkg}) imports {mod!r} ({target}), a higher layer; move the shared piece down"


def test_every_layer_has_files():
    pkgs = {pkg for pkg, _ in _files()}
    assert {"tp_jax.parallel", "tp_jax.models", "tp_jax.loaders", "tp_jax.serving", "tp_jax.multihost"} <= pkgs
