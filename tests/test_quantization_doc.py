"""docs/quantization.md's worked example (a weight-only fp8 method) runs as written and is right:
a tiny Llama in fp8 matches transformers on the fp8 weights at tp 1, 3 and 8; the doc is linked."""

import os
import re

import numpy as np
import pytest

from tests.quant_models import dequantized_copy
from tests.tiny_models import hf_logits, make_checkpoint
from tp_jax.parallel.layers import quantization

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "quantization.md")


def example_code() -> str:
    text = open(DOC).read().split("## Adding a method", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.fixture
def fp8(monkeypatch):
    """The doc's code executed, its registration undone after the test."""
    monkeypatch.setattr(quantization, "QUANTIZATIONS", dict(quantization.QUANTIZATIONS))
    namespace = {"__name__": "fp8_example"}
    exec(compile(example_code(), DOC, "exec"), namespace)
    return namespace


def test_fp8_example_matches_transformers_on_its_weights(fp8, tmp_path):
    from tp_jax.serving.llm import LLM
    path = make_checkpoint("h9kv3", str(tmp_path))
    to_fp8 = fp8["fp8_rows"]
    ref_dir = dequantized_copy(path, str(tmp_path / "fp8"),
                               lambda _, w: (lambda v, s: v.astype(np.float32) * s[:, None])(*to_fp8(w)))
    ids = np.random.default_rng(0).integers(0, 1000, size=(3, 13))
    ref, ref_float = hf_logits(ref_dir, ids), hf_logits(path, ids)
    gap = float(np.abs(ref - ref_float).max())
    for tp, dp in [(1, 1), (3, 2), (8, 1)]:
        llm = LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, quantization="fp8_weights", progress=False)
        assert llm.quantization == "fp8_weights"
        err = float(np.abs(llm.get_logits(ids) - ref).max())
        assert err <= 1e-4 and err * 50 < gap, f"tp={tp}: {err:.2e} (float gap {gap:.2e})"


def test_quantization_doc_is_linked():
    assert "docs/quantization.md" in open(os.path.join(ROOT, "README.md")).read()
    assert "docs/quantization.md" in open(os.path.join(ROOT, "docs", "design.md")).read()
    text = open(DOC).read()
    for heading in ("## The interface", "## Adding a method", "## What a GPU or TPU run would want next"):
        assert heading in text, heading
