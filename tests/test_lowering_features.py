"""Every feature added since tests/test_lowering.py's five cases, its step program lowered for `cuda` and `tpu` on an
abstract mesh of 8 devices, with the configuration the resolve step picks for a GPU and a TPU:

* published packed weights: GPTQ (act-order), AWQ, FP8 blocks, compressed-tensors (W4A16 and W8A8), gpt-oss's MXFP4
  experts (with expert parallelism);
* attention kinds: DeepSeek-V3's latent attention (MLA) with grouped routing, gpt-oss's sinks and alternating
  windows, Gemma 2's soft-capping and sliding layers, Gemma 3's per-layer window and rotary tables;
* LoRA slots (the adapters' weights and each token's slot as step arguments);
* speculative decoding: the verify step (each draft token a query row of its decode row: the decode program at
  4 x (1 + 3) rows) and a draft model's own program;
* the sampler's programs (greedy, random, penalized, each with logit bias) and structured outputs' bitmask.

Each lowers as one program over 8 devices with nothing CPU-only in it (`accelerator_problems`: no custom call but
the partitioner's, no float64); the configuration names no CPU-tuned setting; the layer loop's all-reduces run over
tp groups of consecutive devices (and an expert-parallel block's all-gather / reduce-scatter over the dp groups);
no all-to-all; every param and the KV pool arrive with their declared shardings, the pool donated. A CPU-only kernel
planted in the tp all-reduce every feature calls is named by the check in each of them.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.hlo import count
from tests.test_lowering import (PLATFORMS, TPU_DEVICE, Case, accelerator_problems, accelerator_setup, config_problems,
                                 loop_bodies, main_args, reachable, replica_groups, sdy_axes, step_program)
from tests.test_mxfp4 import gpt_oss_mxfp4  # noqa: F401  (a fixture: the tiny MXFP4 gpt-oss checkpoint)
from tp_jax.serving.batch import MIN_BLOCKS, MIN_TOKENS, StepShape, fine_bucket, prefill_layout

DENSE, MOE = (1, 1, 8), (2, 1, 4)                 # (dp, pp, tp): tp 8; dp 2 x tp 4 with expert parallelism
# name -> (the model, where it comes from, its mesh, the quantization the resolve step must pick on a GPU / TPU)
FEATURES = {
    "gptq_actorder": ("quant:gptq4_sym_actorder", DENSE, "gptq"),
    "awq": ("quant:awq4", DENSE, "awq"),
    "fp8_block": ("quant:fp8_block", DENSE, "fp8"),
    "ct_w4a16": ("quant:ct_w4a16", DENSE, "compressed-tensors"),
    "ct_w8a8": ("quant:ct_w8a8", DENSE, "compressed-tensors"),
    "mxfp4": ("mxfp4", MOE, "mxfp4"),             # the experts kept as stored, dequantized in the GEMM
    "mla_ds3": ("flagship:ds3", MOE, None),
    "sinks_gpt_oss": ("flagship:gpt_oss", MOE, None),
    "gemma2_softcap": ("gemma:gemma2", DENSE, None),
    "gemma3_tables": ("gemma:gemma3", DENSE, None),
    "lora": ("tiny:gqa", DENSE, None),
    "draft": ("tiny:gqa", (2, 1, 4), None),           # a draft model is an engine of its own on the target's mesh
}


def shapes(g: int) -> dict[str, StepShape]:
    """32 decode rows; 8 decode rows beside a 48-token prefill chunk; the verify step of 4 rows with 3 drafts each."""
    return {"decode32": StepShape(g, 32, 32, MIN_BLOCKS, 0, 0, 0, 0, 0),
            "mixed": StepShape(g, fine_bucket(8 + 48, MIN_TOKENS), 8, MIN_BLOCKS, 0, 0, *prefill_layout([[48]]),
                               MIN_BLOCKS),
            "verify": StepShape(g, 16, 16, MIN_BLOCKS, 0, 0, 0, 0, 0)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, gpt_oss_mxfp4):  # noqa: F811
    """source(kind) -> (ModelConfig, source or None, CheckpointFacts): a checkpoint on disk for the packed formats,
    a transformers config alone for a float model (no weights: the program is built abstract)."""
    from tp_jax.models.config import config_from_hf
    from tp_jax.serving.resolve import CheckpointFacts
    root = str(tmp_path_factory.mktemp("lowering_features"))

    @functools.cache
    def source(kind: str):
        family, _, name = kind.partition(":")
        if family in ("quant", "mxfp4"):
            from tests.conftest import mesh_for
            from tests.quantized_checkpoints import write_quantized
            from tp_jax.loaders.sources import open_checkpoint
            from tp_jax.serving.llm import checkpoint_facts
            path = gpt_oss_mxfp4[0] if family == "mxfp4" else write_quantized(os.path.join(root, name), name)[0]
            ckpt = open_checkpoint(path)
            return ckpt.config, ckpt.source, checkpoint_facts(ckpt, mesh_for(1, 1, 1))
        module = {"flagship": "tests.flagship_models", "gemma": "tests.test_gemma", "tiny": "tests.tiny_models"}[family]
        cfg = config_from_hf(__import__(module, fromlist=["hf_config"]).hf_config(name))
        return cfg, None, CheckpointFacts("safetensors", cfg.architecture, frozenset({None}),
                                          experts=hasattr(cfg, "num_experts"))
    return source


def build(sources, feature: str, backend: str):
    """`feature`'s step program as resolved for `backend` ("gpu", "tpu"): a LoRA engine with 2 slots for "lora"."""
    kind, (dp, pp, tp), _ = FEATURES[feature]
    cfg, source, facts = sources(kind)
    case = Case(feature, dp, pp, tp, expert_parallel=facts.experts)
    loras = 2 if feature == "lora" else 0
    named = dict(max_loras=loras, enable_lora=True) if loras else {}
    setup = accelerator_setup(case, backend, facts, cfg.max_position_embeddings, **named)
    return step_program(case, setup, cfg, source, max_loras=loras,
                        abstract_device=TPU_DEVICE if backend == "tpu" else None)


@pytest.fixture(scope="module")
def programs(sources):
    return functools.cache(functools.partial(build, sources))


@pytest.fixture(scope="module")
def lowered(programs):
    @functools.cache
    def lower(feature: str, platform: str) -> dict[str, tuple[str, str]]:
        prog = programs(feature, PLATFORMS[platform])
        out = {}
        for name, shape in shapes(prog.case.dp * prog.setup.num_microbatches).items():
            if name == "verify" and feature != "draft":
                continue
            low = prog.lower(platform, shape)
            out[name] = (low.as_text(), low.as_text(dialect="hlo"))
        return out
    return lower


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_feature_lowers_with_nothing_cpu_only(programs, lowered, feature, platform):
    prog = programs(feature, PLATFORMS[platform])
    assert config_problems(prog.setup) == [], prog.setup.summary()
    quant = FEATURES[feature][2]
    assert prog.setup.dtype == "bfloat16"
    assert (prog.setup.quantization or "").split()[:1] == ([quant] if quant else []), prog.setup.summary()
    for name, (text, _) in lowered(feature, platform).items():
        assert accelerator_problems(text) == [], (feature, platform, name)
        assert "mhlo.num_partitions = 8" in text and "xbf16>" in text, (feature, platform, name)
    if feature == "lora":                                # the adapters' A and B arrive as step arguments
        assert len(main_args(lowered(feature, platform)["decode32"][0])) == len(prog.weights) + 3 + \
            2 * len(prog.adapters[0]) + 1


def layer_collectives(feature: str, ep: bool) -> list[int]:
    """A layer loop's all-reduce, all-gather, reduce-scatter, collective-permute and all-to-all counts: o_proj's and
    the feed-forward's tp all-reduces (LoRA adds none: its B product joins the layer's own before the sum); an
    expert-parallel block's dp all-gather and reduce-scatter; DeepSeek-V3's body holds both feed-forward kinds (its
    dense first layer's MLP and the MoE block, one `lax.switch`), so three all-reduces."""
    return [3 if feature == "mla_ds3" else 2, int(ep), int(ep), 0, 0]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_collectives_and_shardings(programs, lowered, feature):
    """The HLO lowered for cuda (tpu's has the same collective counts): every all-reduce in a layer loop over the
    tp groups (consecutive devices); with expert parallelism an all-gather and a reduce-scatter over the dp groups (the
    same tp rank of each replica); no all-to-all; @main's params with their declared specs, the pool (pp, tp, dp),
    bfloat16, donated."""
    prog = programs(feature, "gpu")
    dp, tp, ep = prog.case.dp, prog.case.tp, prog.case.expert_parallel
    tp_groups = [list(range(s, s + tp)) for s in range(0, 8, tp)]
    dp_groups = [list(range(r, 8, tp)) for r in range(tp)]
    ops = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
    for name, (text, hlo) in lowered(feature, "cuda").items():
        loops = [reachable(hlo, [b]) for b in loop_bodies(hlo)]
        layer_loops = [b for b in loops if count(b, "all-reduce")]
        assert len(layer_loops) == 1, name
        body = layer_loops[0]
        assert [count(body, op) for op in ops] == layer_collectives(feature, ep), name
        assert count(hlo, "all-to-all") == 0, name
        assert all(g == tp_groups for g in replica_groups(body, "all-reduce")), name
        gathers = replica_groups(body, "all-gather") + replica_groups(body, "reduce-scatter")
        assert all(g == dp_groups for g in gathers) and (len(gathers) > 0) == ep, name
        tpu = lowered(feature, "tpu")[name][1]
        assert [count(tpu, op) for op in ops] == [count(hlo, op) for op in ops], name
        args = main_args(text)
        for path, w, spec, (_, axes, donated) in zip(prog.paths, prog.weights, prog.specs, args):
            assert axes == sdy_axes(spec, w.ndim) and not donated, path
        for tensor, axes, donated in args[len(prog.weights) + 1:len(prog.weights) + 3]:
            assert axes == [("pp",), ("tp",), ("dp",), (), ()] and donated and tensor.endswith("xbf16>"), tensor


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_sampler_and_the_grammar_mask_lower(platform):
    """The sampler's programs on a step's logits [dp, rows, vocab] sharded on dp, as ModelRunner.execute calls them:
    greedy, random (per-row keys), penalized (the penalty state donated), each with a logit bias; structured outputs'
    bitmask applied to the logits. Nothing CPU-only in any of them."""
    from jax.sharding import AbstractMesh, AxisType
    from tp_jax.serving import runner, structured
    from tp_jax.serving.sampling import ROW_FLOATS
    mesh = AbstractMesh((2, 1, 4), ("dp", "pp", "tp"), axis_types=(AxisType.Auto,) * 3)
    g, r, v = 2, 8, 384
    on_dp = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("dp")))
    logits, bias = on_dp((g, r, v), jnp.float32), on_dp((g, r, v), jnp.float32)
    floats, ints = on_dp((g, r, len(ROW_FLOATS)), jnp.float32), on_dp((g, r, 6), jnp.int32)   # StepPlan's
    replicated = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    mask, counts = replicated((2 * r + 1, v), jnp.bool_), replicated((2 * r + 1, v), jnp.int32)   # Penalties.state
    bitmask = on_dp((g, r, -(-v // 32)), jnp.int32)
    programs = {"greedy": runner._greedy.trace(logits, bias, num_logprobs=4),
                "random": runner._sample.trace(logits, floats, ints, bias, num_logprobs=4),
                "penalized": runner._sample_penalized.trace(logits, floats, ints, mask, counts, bias, num_logprobs=4),
                "bitmask": structured.apply_bitmask.trace(logits, bitmask)}
    for name, traced in programs.items():
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert accelerator_problems(text) == [], (platform, name)
        assert np.all([d in text for d in ("stablehlo",)]), name


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_planted_cpu_only_kernel_is_caught_in_every_feature(sources, monkeypatch, feature):
    """Every tp all-reduce's result passed through an FFI kernel registered for XLA:CPU only (planted in
    `collectives.all_reduce`, which each feature's layers call): the program still lowers, and the check names it."""
    from tp_jax.parallel import collectives
    real = collectives.all_reduce

    def planted(x, *args, **kwargs):
        y = real(x, *args, **kwargs)
        return jax.ffi.ffi_call("tp_jax_cpu_reduce", jax.ShapeDtypeStruct(y.shape, y.dtype))(y)

    monkeypatch.setattr(collectives, "all_reduce", planted)
    prog = build(sources, feature, "gpu")
    text = prog.lower("cuda", shapes(prog.case.dp * prog.setup.num_microbatches)["decode32"]).as_text()
    assert accelerator_problems(text) == ["custom call 'tp_jax_cpu_reduce': a kernel XLA's accelerator backends "
                                          "may not have"]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_default_attention_on_an_accelerator_is_one_pallas_kernel(programs, platform):
    """Resolved for a GPU or a TPU, "auto" attention is the ragged Pallas kernel (tp_jax/models/paged_kernel.py): the
    tp 8 Llama's decode step and its mixed decode + prefill step each hold one kernel in the layer loop (Triton for
    cuda, Mosaic exported for a TPU v6e), decode rows and prefill chunks in the same launch, and nothing CPU-only."""
    prog = programs("lora", PLATFORMS[platform])
    assert prog.setup.attention_backend == "pallas" and prog.setup.settings["attention_backend"].automatic
    call = {"cuda": '"__gpu$xla.gpu.triton"', "tpu": '"tpu_custom_call"'}[platform]
    for name in ("decode32", "mixed"):
        low = prog.lower(platform, shapes(prog.case.dp * prog.setup.num_microbatches)[name])
        text, hlo = low.as_text(), low.as_text(dialect="hlo")
        assert accelerator_problems(text) == [] and "tp_jax_paged_attention" in text, name
        body = "".join(reachable(hlo, [b]) for b in loop_bodies(hlo))
        assert body.count(f"custom_call_target={call}") == 1, name
