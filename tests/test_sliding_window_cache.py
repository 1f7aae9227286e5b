"""A model whose every layer slides (Mistral-style, `sliding_window` with no per-layer types) keeps only the blocks
its window can still reach (tp_jax/serving/block_manager.py `slide`): a tiny Mistral written by transformers, window
16 and blocks of 4 tokens, prompts several windows long.

* tokens equal transformers' greedy ones, and tokens and logprobs equal the engine's without the freeing (today's
  layout: every block kept), bit for bit, at tp 1, tp 2 and pp 2 x tp 2, with chunked prefill (8-token steps) and
  prefix-cache hits (a second request sharing a 40-token prefix);
* while it runs, a sequence never holds more than `blocks_per_sequence` blocks, and every block is free at the end;
* a pool too small for one max_model_len sequence, refused before (the error names the numbers), now runs a
  100-token prompt and gives transformers' tokens.
"""

import os

import numpy as np
import pytest

from tests.tiny_models import randomize, run_counting_blocks
from tp_jax.serving import kv_pool
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

WINDOW, BLOCK = 16, 4
CONFIG = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5, max_position_embeddings=256, sliding_window=WINDOW,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, architectures=["MistralForCausalLM"])
RNG = np.random.default_rng(3)
SHARED = RNG.integers(3, 300, 40).tolist()
PROMPTS = [SHARED + RNG.integers(3, 300, 21).tolist(), RNG.integers(3, 300, 70).tolist(),
           SHARED + RNG.integers(3, 300, 9).tolist()]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
SMALL = dict(max_num_batched_tokens=8, block_size=BLOCK, max_model_len=160)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(checkpoint, transformers' greedy tokens per prompt, and of a 100-token prompt)."""
    import torch
    import transformers
    path = os.path.join(str(tmp_path_factory.mktemp("sliding")), "mistral")
    torch.manual_seed(0)
    model = randomize(transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig(**CONFIG)).eval())
    model.save_pretrained(path, safe_serialization=True)
    long = RNG.integers(3, 300, 100).tolist()

    def greedy(ids, n):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        return out[0, len(ids):].tolist()
    return path, [greedy(p, PARAMS.max_tokens) for p in PROMPTS], long, greedy(long, 16)


def run(llm: LLM):
    """`run_counting_blocks` over PROMPTS."""
    return run_counting_blocks(llm, PROMPTS, PARAMS)


@pytest.mark.parametrize("mesh", [dict(), dict(tensor_parallel_size=2),
                                  dict(tensor_parallel_size=2, pipeline_parallel_size=2)], ids=["tp1", "tp2", "pp2tp2"])
def test_freed_blocks_change_nothing(mistral, mesh, monkeypatch):
    path, greedy, _, _ = mistral
    llm = LLM(path, dtype="float32", **SMALL, **mesh, progress=False)
    assert llm.engine.core.pool.window == WINDOW and "sliding window 16" in llm.engine.core.pool.describe()
    got, held, cached = run(llm)
    assert [tokens for tokens, _ in got] == greedy
    assert cached >= 40 - BLOCK                                    # the shared prefix came from the cache
    per_seq = kv_pool.blocks_per_sequence(160, BLOCK, WINDOW, 8)
    assert held <= per_seq < -(-(70 + 24) // BLOCK)                # fewer than the longest sequence's blocks
    assert llm.engine.core.kv_usage()[0] == 0
    monkeypatch.setattr(kv_pool, "sliding_window", lambda layout, draft: None)    # every block kept
    kept = LLM(path, dtype="float32", **SMALL, **mesh, progress=False)
    assert kept.engine.core.pool.window is None
    before, held_before, _ = run(kept)
    assert got == before and held_before > per_seq


def test_a_pool_too_small_for_full_contexts_runs_a_long_prompt(mistral, monkeypatch):
    path, _, long, greedy = mistral
    small = dict(num_gpu_blocks=14, block_size=BLOCK, max_num_batched_tokens=8, max_model_len=128)
    llm = LLM(path, dtype="float32", progress=False, **small)
    out = llm.generate([long], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy
    monkeypatch.setattr(kv_pool, "sliding_window", lambda layout, draft: None)
    with pytest.raises(ValueError, match=r"holds 56 tokens per replica .* fewer than one sequence of "
                                         r"max_model_len=128; raise num_gpu_blocks to >= 32"):
        LLM(path, dtype="float32", progress=False, **small)
