"""Decode context parallelism (tp_jax/models/dcp.py): a latent (MLA) cache's tokens interleaved over the tp ranks.

Tiny DeepSeek-V2-Lite-style (a full q_proj) and V3-style (q_lora_rank, YaRN, interleaved rotary) checkpoints
(tests/flagship_models.py) run the same workload with decode_context_parallel_size = tp and = 1: chunked prefill,
a prefix-cache hit, preemption (a pool too small for every row) and ngram speculative verify rows; prompt and
sampled logprobs (float32) agree within 2e-5 and greedy tokens are equal, over tp 2, dp 2 x tp 2, pp 2 x tp 2 and
tp 4 with dcp 2 (two groups), and with an int8 KV cache. The pool's bytes per token per device are divided by dcp;
the lowered step program holds two more collectives per layer (q's all-gather, the partials' all-to-all); bad
values are refused.
"""

import functools
import os

import numpy as np
import pytest

from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 3], [9, 9, 9, 9, 9], [299, 3, 77, 150]]   # 9s: ngram drafts
SHARED = PROMPTS[0][:8] + [40, 41]                 # two blocks of 4 shared with PROMPTS[0]: a prefix-cache hit
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
HIT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)   # prompt_logprobs reads no cache
ENGINE = dict(block_size=4, max_num_batched_tokens=8, max_model_len=32, num_gpu_blocks=8, progress=False,
              compile_cache=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                       "prompt_lookup_max": 2, "prompt_lookup_min": 1})
TOL = 2e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: path}: the tiny DeepSeek-V2 (no q_lora_rank) and V3 checkpoints, written by transformers."""
    import torch
    from transformers import AutoModelForCausalLM
    from tests.flagship_models import _randomize_extras, hf_config
    from tests.tiny_models import randomize
    root, out = tmp_path_factory.mktemp("dcp"), {}
    for name in ("ds2", "ds3"):
        torch.manual_seed(sum(map(ord, name)))
        model = _randomize_extras(randomize(AutoModelForCausalLM.from_config(hf_config(name)).eval()))
        out[name] = os.path.join(root, name)
        model.save_pretrained(out[name], safe_serialization=True)
    return out


def run(path, **mesh):
    """(logprobs of every prompt and sampled token, greedy tokens, num_cached_tokens, preemptions, the pool, the
    verified drafts)."""
    llm = LLM(path, **ENGINE, **mesh)
    outs = llm.generate(PROMPTS, PARAMS) + llm.generate([SHARED], HIT)
    logprobs = [[lp[t].logprob for lp, t in zip((o.prompt_logprobs or [])[1:], o.prompt_token_ids[1:])] +
                [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    core = llm.engine.core
    return (np.concatenate(logprobs), [o.outputs[0].token_ids for o in outs], outs[-1].num_cached_tokens,
            core.stats["preemptions"], core.pool, core.spec.drafts)


@functools.cache
def reference(path):
    return run(path, tensor_parallel_size=2)


@pytest.mark.parametrize("name,dp,pp,tp,dcp", [("ds2", 1, 1, 2, 2), ("ds2", 2, 1, 2, 2), ("ds3", 1, 2, 2, 2),
                                               ("ds3", 1, 1, 4, 2)])
def test_dcp_matches_dcp_1(checkpoints, name, dp, pp, tp, dcp):
    ref_logprobs, ref_tokens, ref_cached, _, ref_pool, _ = reference(checkpoints[name])
    logprobs, tokens, cached, preempted, pool, drafts = run(checkpoints[name], tensor_parallel_size=tp,
                                                            data_parallel_size=dp, pipeline_parallel_size=pp,
                                                            decode_context_parallel_size=dcp)
    assert tokens == ref_tokens
    assert np.abs(logprobs - ref_logprobs).max() <= TOL
    assert cached == ref_cached == 8                                   # SHARED's two blocks from the prefix cache
    assert preempted > 0 or dp > 1                                     # 8 blocks a replica: too few for 3 rows
    assert drafts > 0                                                  # verify rows: a query row per draft token
    assert (pool.dcp, pool.device_block_size, pool.shape[3]) == (dcp, 4 // dcp, 4 // dcp)
    assert pool.bytes_per_token * dcp * pp == ref_pool.bytes_per_token * (ref_pool.mesh_shape[1])
    assert pool.bytes_per_device * dcp == pool.num_blocks * 4 * pool.layout.bytes_per_token(pp, tp)
    assert f"{pool.bytes_per_token} bytes per token per device" in pool.describe()          # the start-up log
    assert f"decode context parallel over {dcp} tp ranks: each holds {4 // dcp} of a block's 4 tokens" in \
        pool.describe()


def test_an_int8_kv_cache_splits_alike(checkpoints):
    """A quantized pool (int8 rows with their float16 scale) split over 2 ranks reads back what dcp 1 reads."""
    (ref, ref_tokens, *_), (got, tokens, *_) = (run(checkpoints["ds2"], tensor_parallel_size=2, kv_cache_dtype="int8",
                                                    decode_context_parallel_size=d) for d in (1, 2))
    assert tokens == ref_tokens and np.abs(got - ref).max() <= TOL


@pytest.mark.parametrize("backend,platform", [("gpu", "cuda"), ("tpu", "tpu")])
@pytest.mark.parametrize("dcp", [4, 2])
def test_lowered_program_adds_two_collectives_per_layer(dcp, backend, platform):
    """DeepSeek-V3 at dp 2 x tp 4 with expert parallelism (tests/test_lowering_features.py's mla_ds3), lowered for
    cuda and tpu on an abstract mesh of 8: the layer loop's body holds, beside dcp 1's three tp all-reduces and the
    expert block's dp all-gather and reduce-scatter, one all-gather of q and one all-to-all of the partials, both over
    the dcp groups (dcp consecutive devices: the tp groups at dcp 4, their halves at dcp 2); no other all-to-all."""
    from tests.flagship_models import hf_config
    from tests.hlo import count
    from tests.test_lowering import (Case, accelerator_setup, loop_bodies, reachable, replica_groups, step_program)
    from tests.test_lowering_features import shapes
    from tp_jax.models.config import config_from_hf
    from tp_jax.serving.resolve import CheckpointFacts
    cfg = config_from_hf(hf_config("ds3"))
    case = Case("mla_ds3_dcp", 2, 1, 4, expert_parallel=True)
    facts = CheckpointFacts("safetensors", cfg.architecture, frozenset({None}), experts=True)
    setup = accelerator_setup(case, backend, facts, cfg.max_position_embeddings, decode_context_parallel_size=dcp)
    assert setup.decode_context_parallel_size == dcp and not setup.settings["decode_context_parallel_size"].automatic
    prog = step_program(case, setup, cfg, None)
    assert prog.pool.shape[3] == 16 // dcp
    hlo = prog.lower(platform, shapes(2)["mixed"]).as_text(dialect="hlo")
    bodies = [b for b in (reachable(hlo, [name]) for name in loop_bodies(hlo)) if count(b, "all-reduce")]
    assert len(bodies) == 1
    ops = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
    assert [count(bodies[0], op) for op in ops] == [3, 1 + 1, 1, 0, 1]
    assert count(hlo, "all-to-all") == 1
    dcp_groups = [list(range(s, s + dcp)) for s in range(0, 8, dcp)]
    dp_groups = [list(range(r, 8, 4)) for r in range(4)]
    assert replica_groups(bodies[0], "all-to-all") == [dcp_groups]
    assert sorted(replica_groups(bodies[0], "all-gather")) == sorted([dcp_groups, dp_groups])    # q's, the experts'


def test_bad_values_are_refused_with_the_fix(checkpoints):
    from tp_jax.serving.engine_args import EngineArgs
    with pytest.raises(ValueError, match=r"decode_context_parallel_size=4 must divide tensor_parallel_size=2 .*"
                                         r"choose one of \[1, 2\]"):
        EngineArgs(tensor_parallel_size=2, decode_context_parallel_size=4)
    with pytest.raises(ValueError, match=r"decode_context_parallel_size=2 must divide block_size=5 .*choose one of "
                                         r"\[1\]"):
        EngineArgs(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=5)
    with pytest.raises(ValueError, match=r"decode_context_parallel_size=0 .*"):
        EngineArgs(decode_context_parallel_size=0)
    from tests.tiny_models import make_checkpoint
    llama = make_checkpoint("gqa", os.path.dirname(checkpoints["ds2"]))
    with pytest.raises(ValueError, match=r"decode_context_parallel_size=2 splits a latent-attention \(MLA: "
                                         r"DeepSeek-V2/V3\) cache; .* use decode_context_parallel_size=1"):
        LLM(llama, tensor_parallel_size=2, decode_context_parallel_size=2, progress=False)


def test_deepseek_v3_bytes_per_token_at_tp_8(tmp_path):
    """The published DeepSeek-V3 config (tests/data/configs) at tp 8, bf16: 61 layers x (512 + 64) x 2 bytes = 70,272
    bytes per token on every device at dcp 1 (the latent replicated), 8,784 at dcp 8 (scripts/kv_capacity.py --dcp)."""
    import shutil
    import jax
    import jax.numpy as jnp
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.config import load_config
    from tp_jax.parallel.mesh import make_mesh
    from tp_jax.serving.kv_pool import PoolShape
    shutil.copy(os.path.join(os.path.dirname(__file__), "data", "configs", "DeepSeek-V3.json"),
                tmp_path / "config.json")
    layout = abstract_model(load_config(str(tmp_path)), make_mesh(tp=8, devices=jax.devices()[:8]),
                            jnp.bfloat16).kv_layout()
    per_token = {d: PoolShape(layout, 1, 16, (1, 1, 8), dcp=d).bytes_per_token for d in (1, 8)}
    assert per_token == {1: 61 * 576 * 2, 8: 61 * 576 * 2 // 8} == {1: 70272, 8: 8784}
