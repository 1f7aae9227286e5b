"""Which config fields the reference implementation of an architecture reads: transformers' own source.

    reference_reads(hf, "LlamaForCausalLM") -> frozenset({"hidden_size", "rms_norm_eps", ...}) or None

A field changes what a model computes only if its reference implementation reads it. That
set is not kept here: it is read off transformers' `modeling_<arch>.py` at run time, with
`ast` (nothing is imported, so torch is not needed): every `config.<name>`,
`self.config.<name>` and `getattr(config, "<name>", ...)` in the classes and functions
reachable from the architecture's class (`LlamaForCausalLM` -> `LlamaModel` ->
`LlamaDecoderLayer` -> ...; classification or double-heads classes of the same file are not
reachable), plus the shared modules those call for rotary embeddings and attention masks
(`SHARED_MODULES`). Names go through the config class's `attribute_map`, so GPT-2's
`config.hidden_size` is the stored `n_embd`.

`modeling_utils` (the generic `PreTrainedModel` shell: loading, dtype, placement, weight
init, tying) is not scanned; of what it reads only `tie_word_embeddings` (read by every
model map here) and `quantization_config` (refused by name, tp_jax/models/config.py) change the
result. `None` means the source cannot be found (no such module in this transformers):
callers then fall back to refusing every non-default field.
"""

from __future__ import annotations

import ast
import functools
import importlib.util

# Modules the modeling files call with their config: rotary embeddings (incl. scaling) and masks.
SHARED_MODULES = ("transformers.modeling_rope_utils", "transformers.masking_utils")


def reference_reads(hf, architecture: str) -> frozenset[str] | None:
    """The config fields (stored names) that transformers' implementation of `architecture` reads."""
    cls = type(hf)
    names = _reads(cls.__module__.replace(".configuration_", ".modeling_"), architecture)
    if names is None:
        return None
    aliases = dict(getattr(cls, "attribute_map", {}) or {})
    return frozenset(aliases.get(n, n) for n in names)


def modeling_module(hf) -> str:
    """The module `reference_reads` inspects for `hf`'s class, e.g. 'transformers.models.gpt2.modeling_gpt2'."""
    return type(hf).__module__.replace(".configuration_", ".modeling_")


@functools.lru_cache(maxsize=32)
def _reads(module: str, architecture: str) -> frozenset[str] | None:
    tree = _parse(module)
    if tree is None:
        return None
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    if architecture not in defs:
        return None
    names = set()
    for name in _reachable(defs, architecture):
        names |= _config_reads(defs[name])
    for shared in SHARED_MODULES:
        shared_tree = _parse(shared)
        if shared_tree is not None:
            names |= _config_reads(shared_tree)
    return frozenset(n for n in names if not n.startswith("_"))


def _parse(module: str) -> ast.Module | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=spec.origin)


def _reachable(defs: dict[str, ast.AST], start: str) -> set[str]:
    """Module-level classes and functions named (transitively) from `start`, `start` included."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    return seen


def _is_config(node: ast.AST) -> bool:
    """`config` or `<anything>.config` (self.config, module.config)."""
    return (isinstance(node, ast.Name) and node.id == "config") or (
        isinstance(node, ast.Attribute) and node.attr == "config")


def _config_reads(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_config(node.value):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            out.add(node.args[1].value)
    return out


__all__ = ["reference_reads", "modeling_module", "SHARED_MODULES"]
