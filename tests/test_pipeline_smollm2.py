"""The real SmolLM2-135M through pipeline stages with tp and dp: transformers' logits and greedy tokens."""

import numpy as np
import pytest

from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

# mostly running the real model, not compiling it: LLVM -O1 (tests/conftest.py)
pytestmark = pytest.mark.llvm_level(1)


@pytest.fixture(scope="module")
def smollm2_refs(smollm2_path, smollm2_hf):
    """A sentence's ids, transformers' logits for it and its 16 greedy tokens."""
    import torch
    from tp_jax.serving.tokenizer import load_tokenizer
    tok = load_tokenizer(smollm2_path)
    ids = tok.encode("The quick brown fox jumps over the lazy dog because it wanted to see the river.")
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits.numpy()
        greedy = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                     eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
    return ids, ref, greedy


@pytest.mark.slow
# the stage paths once on the real dims (pp beside dp and tp; four stages); every (dp, pp, tp) of 8 devices runs
# on tiny models in tests/test_pipeline.py
@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 2), (1, 4, 2)], ids=lambda v: str(v))
def test_smollm2(smollm2_path, smollm2_refs, dp, pp, tp):
    ids, ref, greedy = smollm2_refs
    llm = LLM(smollm2_path, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              quantization="gguf", progress=False)         # the golden float32 dot
    assert float(np.abs(llm.get_logits([ids]) - ref).max()) <= 1e-3
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy
