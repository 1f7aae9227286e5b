"""KV cache groups (tp_jax/models/cache.py KVGroups, block_manager.py): a model mixing sliding and full layers gives
each group of layers of one kind its own block table, a sliding group keeping only its window's blocks. Tiny
Gemma 2 (sliding, full alternating), Gemma 3 (sliding, full, sliding, sliding) and gpt-oss (sliding, full) written
by transformers, window 8 and blocks of 8 tokens, prompts several windows long:

* tokens and logprobs equal today's layout (kv_cache_groups="off": every layer holds every block) bit for bit in
  float32, and tokens equal transformers' greedy ones, with chunked prefill (8-token steps) and a prefix-cache hit
  (a third request sharing a 24-token prefix), at tp 1 and pp 2 x tp 2 (Gemma 3), tp 1 with the Pallas backend
  (gpt-oss, head_dim 16 as the kernel's Triton form takes; Pallas' interpreter on a CPU); Gemma 2 at tp 2 with an
  int8 KV cache and the bf16 backend (split-K decode): equal to today's layout's (tests/test_gemma.py runs both
  Gemmas over ten meshes, groups on);
* every block is free at the end, and a sequence holds fewer blocks than today's;
* a pool too small for full contexts in every layer, refused today, runs a long prompt with transformers' tokens,
  and two requests that preempt each other;
* the groups' layout: Gemma 3's 4 layers are 4 groups of one slot, 3 under pp 2 (its stages hold s, f | s, s).
"""

import os

import numpy as np
import pytest

from tests.flagship_models import _randomize_extras
from tests.tiny_models import randomize, run_counting_blocks
from tp_jax.models.cache import KVGroups
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

WINDOW, BLOCK = 8, 8
BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=WINDOW, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)
MODELS = {   # name: (transformers config class, overrides)
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=8, attn_logit_softcapping=10.0,
                                    final_logit_softcapping=20.0, architectures=["Gemma2ForCausalLM"])),
    "gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=8, architectures=["Gemma3ForCausalLM"],
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                     "sliding_attention"])),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                     initializer_range=0.3, layer_types=["sliding_attention", "full_attention"],
                                     architectures=["GptOssForCausalLM"])),
}
RNG = np.random.default_rng(5)
SHARED = RNG.integers(3, 300, 24).tolist()
PROMPTS = [SHARED + RNG.integers(3, 300, 13).tolist(), RNG.integers(3, 300, 30).tolist(),
           SHARED + RNG.integers(3, 300, 7).tolist()]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
pytestmark = pytest.mark.default_compile          # bit for bit as users compile (tests/conftest.py: -O0 moves an ulp)
SMALL = dict(max_num_batched_tokens=8, block_size=BLOCK, max_model_len=96, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """{name: (checkpoint, transformers' greedy tokens per prompt)}, and a 72-token prompt with its tokens."""
    import torch
    import transformers
    root, out = str(tmp_path_factory.mktemp("groups")), {}
    long = RNG.integers(3, 300, 72).tolist()
    for name, (cls, over) in MODELS.items():
        torch.manual_seed(sum(map(ord, name)))
        cfg = getattr(transformers, cls)(**{**BASE, **over})
        model = _randomize_extras(randomize(transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="eager").eval()))             # gpt-oss: nonzero sinks, the SwiGLU clamp acting
        path = os.path.join(root, name)
        model.save_pretrained(path, safe_serialization=True)

        def greedy(ids, n):
            with torch.no_grad():
                got = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                     eos_token_id=None, pad_token_id=0)
            return got[0, len(ids):].tolist()
        out[name] = (path, [greedy(p, PARAMS.max_tokens) for p in PROMPTS],
                     greedy(long, 8) if name == "gemma3" else None)
    return out, long


def run(llm: LLM):
    """`run_counting_blocks` over PROMPTS; every block free at the end."""
    out = run_counting_blocks(llm, PROMPTS, PARAMS)
    assert llm.engine.core.kv_usage()[0] == 0                      # every block free at the end
    return out


CASES = [("gemma2", dict(tensor_parallel_size=2, kv_cache_dtype="int8", attention_backend="bf16")),
         ("gpt_oss", dict(attention_backend="pallas")), ("gemma3", {}),
         ("gemma3", dict(tensor_parallel_size=2, pipeline_parallel_size=2))]


@pytest.mark.parametrize("name,mesh", CASES, ids=["gemma2-tp2-int8-bf16", "gpt_oss-tp1-pallas", "gemma3-tp1",
                                                  "gemma3-pp2tp2"])
def test_groups_change_nothing_but_the_blocks_held(hybrid, name, mesh):
    path, greedy, _ = hybrid[0][name]
    llm = LLM(path, **SMALL, **mesh)
    pool = llm.engine.core.pool
    assert pool.layout.groups is not None and "KV cache groups" in pool.describe(96)
    got, held, cached = run(llm)
    from tp_jax.server.metrics import kv_groups                     # /metrics' blocks per group
    windows = pool.layout.groups.windows
    assert kv_groups(llm.engine.core) == [("full" if w is None else f"sliding-{w}", n, 0)
                                          for w, n in zip(windows, pool.group_blocks)]
    # a full group: max_model_len's 96 / 8 blocks; a sliding one: its window's 7 keys and an 8-token step, 15
    # positions over at most 3 blocks of 8
    assert {w: n for w, n in zip(windows, pool.group_blocks)} == {None: 12, WINDOW: 3}
    if "kv_cache_dtype" not in mesh:             # int8 keys, bf16 dots: today's numbers, not transformers'
        assert [tokens for tokens, _ in got] == greedy
    assert cached >= 24 - BLOCK                                    # the shared prefix came from the cache
    today = LLM(path, **SMALL, **mesh, kv_cache_groups="off")
    assert today.engine.core.pool.layout.groups is None
    before, held_before, cached_before = run(today)
    assert got == before and cached == cached_before
    assert held * pool.layout.groups.slots < held_before * pool.layout.num_layers     # layer slots held


def test_a_pool_too_small_for_full_contexts_in_every_layer_runs_a_long_prompt(hybrid):
    """Gemma 3: 4 groups of one layer slot, so a block is a quarter of today's; 20 blocks hold the 80 tokens of
    the full group and the sliding groups' windows (19 blocks), where the same bytes hold 5 blocks of today's layout
    (four layers' keys each), 40 tokens. Two requests then preempt each other (admission and preemption count the
    blocks of every group) and still give transformers' tokens."""
    (path, greedy, long_greedy), long = hybrid[0]["gemma3"], hybrid[1]
    small = dict(SMALL, max_model_len=80, kv_cache_memory_bytes=20 * BLOCK * 2 * 2 * 8 * 4)   # 20 one-slot blocks
    llm = LLM(path, **small)
    assert llm.engine.core.pool.num_blocks == 20
    out = llm.generate([long], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == long_greedy and llm.engine.core.kv_usage()[0] == 0
    got, _, _ = run(llm)
    assert [tokens for tokens, _ in got] == greedy and llm.engine.core.stats["preemptions"] > 0
    with pytest.raises(ValueError, match=r"holds 40 tokens per replica .* fewer than one sequence of "
                                         r"max_model_len=80"):
        LLM(path, **small, kv_cache_groups="off")


def test_the_groups_of_each_layout():
    s, f = WINDOW, None
    g = KVGroups.of((s, f, s, s))
    assert (g.slots, g.windows, g.group, g.slot) == (1, (f, s, s, s), (1, 0, 2, 3), (0, 0, 0, 0))
    g = KVGroups.of((s, f, s, s), pp=2)                         # stages: s f | s s
    assert (g.slots, g.windows, g.group, g.slot) == (1, (f, s, s), (1, 0, 1, 2), (0, 0, 0, 0))
    g = KVGroups.of((s, s, s, s, s, f) * 2)                     # Gemma 3's 5:1: 2 slots, 1 full + 5 sliding groups
    assert (g.slots, g.windows.count(f), g.windows.count(s)) == (2, 1, 5)
    g = KVGroups.of((s, f) * 12)                                # gpt-oss: 2 groups of 12 slots
    assert (g.slots, g.windows) == (12, (f, s))
    assert KVGroups.of((s,) * 4) is None and KVGroups.of((f,) * 4) is None


def test_prefix_hits_need_every_group():
    """A hit of n blocks: a full group's blocks 0 .. n - 1, a sliding group's within its window of n * block_size;
    blocks outside a sliding group's window stay NULL_BLOCK and are never referenced."""
    from tp_jax.serving.block_manager import NULL_BLOCK, BlockManager
    from tp_jax.serving.request import Request
    bm = BlockManager(64, 4, windows=(None, WINDOW))
    first = Request("a", 30, list(range(3, 33)), PARAMS, 4, (0, 0, 0), 0.0)
    assert bm.allocate(first, 30, bm.computed_blocks(first))
    first.num_computed_tokens = 30
    bm.register_full_blocks(first)
    bm.slide(first)                                   # sliding group: blocks 0 .. 4 out of reach of position 30
    assert bm.group_tables[1]["a"][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in bm.group_tables[0]["a"]
    bm.free(first)
    second = Request("b", 26, list(range(3, 29)), PARAMS, 4, (0, 0, 0), 0.0)
    hits = bm.computed_blocks(second)                 # 6 whole blocks before its last token; the window's are cached
    assert [len(h) for h in hits] == [6, 6] and hits[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in hits[1][4:]
    assert bm.allocate(second, 26, hits)
    assert bm.num_used == 7 + 3                       # 7 full-group blocks, the sliding group's 2 hits and a new one
    bm.free(second)
    assert bm.num_free == 64


def test_a_draft_model_turns_groups_off():
    """`auto` is off with a draft model (it writes through the target's one table), on otherwise; `on` with one is
    refused naming the fix."""
    from tp_jax.models.cache import KVLayout
    from tp_jax.serving.engine_args import EngineArgs
    from tp_jax.serving.kv_pool import grouped_layout
    from tp_jax.serving.resolve import CheckpointFacts, Platform, resolve
    chosen = [resolve(EngineArgs(model="x", speculative_config=spec), Platform("cpu"), CheckpointFacts("safetensors"),
                      128).kv_cache_groups for spec in (None, {"model": "draft", "num_speculative_tokens": 2},
                                                        {"method": "ngram", "num_speculative_tokens": 2})]
    assert chosen == ["on", "off", "on"]
    layout = KVLayout(4, 2, 8, np.float32, layer_windows=(WINDOW, None, WINDOW, WINDOW))
    assert grouped_layout(layout, "on", 1).groups.count == 4 and grouped_layout(layout, "off", 1).groups is None
    with pytest.raises(ValueError, match="kv_cache_groups='on' with a speculative draft model.*'off'"):
        grouped_layout(layout, "on", 1, draft_layout=layout)
