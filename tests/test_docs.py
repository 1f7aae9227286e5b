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
