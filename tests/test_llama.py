"""Llama on the parallel layers vs transformers (torch CPU, float32), at tp in {1, 2, 3, 4, 8}."""

import jax
import numpy as np
import pytest

from tests.hlo import count, loop_bodies
from tests.tiny_models import VARIANTS, hf_logits, make_checkpoint
from tp_jax.serving.llm import LLM

TPS = [(1, 1), (2, 1), (4, 1), (8, 1), (3, 2)]          # (tp, dp); tp = 3 runs on 6 devices
WORST = {}                                             # variant -> worst max-abs diff seen


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="module")
def references(ckpt_root):
    rng = np.random.default_rng(0)
    out = {}
    for name in VARIANTS:
        path = make_checkpoint(name, ckpt_root)
        vocab = 1001 if name == "h9kv3" else 1000
        ids = rng.integers(0, vocab, size=(3, 13))
        out[name] = (path, ids, hf_logits(path, ids))
    return out


@pytest.mark.parametrize("tp,dp", TPS, ids=lambda v: str(v))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(references, variant, tp, dp):
    path, ids, ref = references[variant]
    # the float path: on one CPU device "auto" gives a bf16 checkpoint bf16 dots (tests/test_fast_dots.py)
    quantization = "none" if variant == "bf16sharded" else "auto"
    llm = LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, progress=False, quantization=quantization)
    got = llm.get_logits(ids)
    assert got.shape == ref.shape and got.dtype == np.float32
    diff = float(np.abs(got - ref).max())
    WORST[variant] = max(WORST.get(variant, 0.0), diff)
    assert diff <= 1e-4, f"{variant} tp={tp}: max abs logit diff {diff:.2e}"
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_repeated_calls_reuse_the_compiled_program(references):
    path, ids, ref = references["gqa"]
    llm = LLM(path, tensor_parallel_size=2, progress=False)
    llm.get_logits(ids)
    fn = llm._logits_fn()
    llm.get_logits(ids[:, :5] * 0 + ids[:, :5])
    llm.get_logits(ids)
    assert llm._logits_fn() is fn


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_hlo_two_all_reduces_per_layer(references, tp):
    path, ids, _ = references["h9kv3"]
    llm = LLM(path, tensor_parallel_size=tp, progress=False)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    fn = llm._logits_fn()
    hlo = jax.jit(lambda i, p: fn(i, p)).lower(ids.astype(np.int32), pos.astype(np.int32)).compile().as_text()
    bodies = loop_bodies(hlo)
    assert bodies, "the decoder layers should run as one scanned (while) loop"
    assert sum(count(b, "all-reduce") for b in bodies) == (2 if tp > 1 else 0)     # o_proj and down_proj
    assert count(hlo, "all-to-all") == 0
    assert count(hlo, "all-reduce") == (3 if tp > 1 else 0)   # + the vocab-parallel embedding
