"""The docs' generated parts match the code that generates them."""

import os
import re

from tp_jax.parallel.heads import plan_tables

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")


def test_head_plan_tables_are_generated():
    text = open(os.path.join(DOCS, "head_plan.md")).read()
    m = re.search(r"<!-- BEGIN GENERATED: plan_tables\(9, 3, \(1, 2, 3, 4, 8\)\) -->\n(.*)<!-- END GENERATED -->",
                  text, re.S)
    assert m, "docs/head_plan.md lost its generated block"
    assert m.group(1) == plan_tables(9, 3, (1, 2, 3, 4, 8)), \
        "docs/head_plan.md is stale; regenerate with python scripts/head_plan.py 9 3 --tp 1 2 3 4 8"


def test_docs_exist_and_link_multihost():
    for name in ("vllm_map.md", "head_plan.md", "adding_a_model.md", "adding_a_loader_source.md", "running.md"):
        assert os.path.isfile(os.path.join(DOCS, name)), name
    assert "docs/multihost.md" in open(os.path.join(DOCS, "running.md")).read()


def test_no_reference_outside_the_repository():
    """The repository stands alone: no file points at a DESIGN.md or a shared folder outside it."""
    import subprocess
    root = os.path.join(DOCS, "..")
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split()
    bad = []
    for name in files:
        if name.endswith((".py", ".md", ".toml", ".txt", ".cfg")) or name == "Makefile":
            text = open(os.path.join(root, name), errors="replace").read()
            bad += [name for pattern in ("DESIGN.md", "../shared", "shared folder") if pattern in text
                    and name != "tests/test_docs.py"]
    assert not bad, f"files pointing outside the repository: {sorted(set(bad))}"


def test_design_doc_sections():
    text = open(os.path.join(DOCS, "design.md")).read()
    for heading in ("## Layout", "## From `LLM(path)` to the `shard_map`", "## Contracts", "## Serving",
                    "## vLLM → tp_jax"):
        assert heading in text, heading


def test_public_api_documents_itself():
    """help() is useful: every public class and function has a docstring, and constructors show
    their arguments (NNX's metaclass would otherwise show `(*args, **kwargs)`)."""
    import inspect
    import tp_jax
    from tp_jax import LLM, HeadPlan, PartRows, ShardedParam, fill
    from tp_jax.parallel.layers import ParallelModule
    assert all(o.__doc__ for o in (LLM, HeadPlan, PartRows, ShardedParam, fill, ParallelModule.loading))
    for name in tp_jax.__all__:
        obj = getattr(tp_jax, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        assert obj.__doc__, f"tp_jax.{name} has no docstring"
        if inspect.isclass(obj) and issubclass(obj, (ParallelModule, tp_jax.Stack)) and obj is not ParallelModule:
            params = inspect.signature(obj).parameters
            assert "rngs" in params and not any(p.kind == p.VAR_POSITIONAL for p in params.values()), name
            assert "Args" in obj.__doc__ or "Args:" in obj.__doc__, f"{name}'s docstring lists no constructor args"
