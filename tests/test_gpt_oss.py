"""gpt-oss vs transformers (sinks, sliding and full layers alternating, biases, the clamped SwiGLU, YaRN) over the
meshes; a prompt longer than the window through chunked prefill and the prefix cache; Orbax round trip."""

import numpy as np
import pytest

from tests.flagship_models import COMMON, GREEDY, check, mesh_cases, write_references
from tp_jax.serving.llm import LLM


@pytest.fixture(scope="session")
def gpt_oss_references(tmp_path_factory):
    return write_references(str(tmp_path_factory.mktemp("gpt_oss")), ("gpt_oss",))


@pytest.mark.parametrize("name,dp,pp,tp,ep", mesh_cases(("gpt_oss",)))
def test_gpt_oss_matches_transformers(gpt_oss_references, name, dp, pp, tp, ep):
    check(gpt_oss_references, name, dp, pp, tp, ep)


def test_prompt_longer_than_the_window_with_chunked_prefill_and_prefix_cache(gpt_oss_references):
    """Window 4 on the sliding layer: prompts of 41 tokens prefilled 8 tokens a step, the second sharing the first's
    32-token prefix from the cache, give transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    ckpt = gpt_oss_references["gpt_oss"][0]
    rng = np.random.default_rng(3)
    first = rng.integers(3, COMMON["vocab_size"], size=41).tolist()
    second = first[:32] + rng.integers(3, COMMON["vocab_size"], size=9).tolist()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in (first, second)]
    llm = LLM(ckpt, tensor_parallel_size=2, max_num_batched_tokens=8, block_size=4, enable_prefix_caching=True,
              progress=False, compile_cache=False)
    outs = [llm.generate([p], GREEDY)[0] for p in (first, second)]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert outs[1].num_cached_tokens >= 28                   # the shared 32 tokens' whole blocks came from the cache


def test_orbax_convert_and_restore(gpt_oss_references, tmp_path):
    """Converted to Orbax, the sinks, the router's bias and the biased interleaved experts round-trip."""
    from tp_jax.loaders.orbax import convert_to_orbax
    out = str(tmp_path / "orbax")
    convert_to_orbax(gpt_oss_references["gpt_oss"][0], out)
    check(gpt_oss_references, "gpt_oss", 1, 1, 2, False, path=out)
