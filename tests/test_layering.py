"""Imports run one way: parallel <- models <- loaders <- serving <- server <- integrations; multihost stands aside.

A module may import its own layer and the layers below it, never one above. `multihost` is
used by serving, the server and scripts, and imports no other part of tp_jax. The package's
`tp_jax/__init__.py` is the public face (it re-exports from every layer) and is not checked
for layers. And no module imports, at module level or inside a function, a module that
imports it back, directly or through others (`test_no_import_cycles`).
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
LAYERS = ["tp_jax.parallel", "tp_jax.models", "tp_jax.loaders", "tp_jax.serving", "tp_jax.server",
          "tp_jax.integrations"]
DIRS = {"tp_jax.parallel": "tp_jax/parallel", "tp_jax.models": "tp_jax/models", "tp_jax.loaders": "tp_jax/loaders",
        "tp_jax.serving": "tp_jax/serving", "tp_jax.server": "tp_jax/server", "tp_jax.multihost": "tp_jax/multihost",
        "tp_jax.integrations": "tp_jax/integrations"}


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


# --- no import cycles -----------------------------------------------------------------------------

def _modules() -> dict[str, str]:
    """Every module of tp_jax (with tp_jax.models and tp_jax.loaders): dotted name -> file."""
    out = {}
    for pkg, d in DIRS.items():
        for dirpath, _, names in os.walk(os.path.join(ROOT, d)):
            for n in names:
                if n.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, n), os.path.join(ROOT, d))[:-3].replace(os.sep, ".")
                    rel = rel.removesuffix("__init__").rstrip(".")
                    out[f"{pkg}.{rel}" if rel else pkg] = os.path.join(dirpath, n)
    out["tp_jax"] = os.path.join(ROOT, "tp_jax", "__init__.py")
    return out


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (module level or in a function);
    `from pkg import name` counts as importing `pkg.name` when that is a module, else `pkg`."""
    graph = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph(_modules())
    assert "tp_jax.loaders.orbax_source" in graph["tp_jax.loaders.sources"]     # module-level imports seen
    assert "tp_jax.serving.llm" in graph["tp_jax.server.command"]                # imports inside functions too


def test_no_import_cycles():
    found = cycles(import_graph(_modules()))
    assert not found, "modules that import each other (directly or through others; move the shared piece " \
        f"into its own module): {found}"
