"""The resolve step (tp_jax/serving/resolve.py): every "auto" decided by one rule table, with its reason, from the
arguments, the platform and the checkpoint; the logged configuration for the four cases users meet."""

import logging

import pytest

from tp_jax.serving.engine_args import EngineArgs
from tp_jax.serving.resolve import CheckpointFacts, Platform, resolve

AVX2 = frozenset({"avx", "avx2", "fma"})
AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"})
GGUF = CheckpointFacts("gguf", "LlamaForCausalLM", frozenset({"Q4_1", "Q8_0", "F32"}))
BF16 = CheckpointFacts("safetensors", "LlamaForCausalLM", frozenset({None}), stored_bf16=True)
F32 = CheckpointFacts("safetensors", "LlamaForCausalLM", frozenset({None}))
MOE = CheckpointFacts("safetensors", "DeepseekV3ForCausalLM", frozenset({None}), experts=True)


def setup(platform, checkpoint, **kw):
    return resolve(EngineArgs(**kw), platform, checkpoint, model_limit=8192)


@pytest.mark.parametrize("case,platform,checkpoint,expected", [
    ("cpu+gguf", Platform("cpu", AVX2), GGUF, dict(dtype="float32", layer_loop="switch", quantization="gguf_bf16",
                                                   attention_backend="reference")),
    ("cpu+bf16", Platform("cpu", AVX2), BF16, dict(dtype="float32", layer_loop="switch", quantization="bf16",
                                                   attention_backend="reference")),
    # AMX: bf16 attention is faster but not batch-invariant (a 1e-3 logprob move beside other rows): opt-in only
    ("amx+bf16", Platform("cpu", AMX), BF16, dict(quantization="bf16", attention_backend="reference")),
    ("cpu+float32", Platform("cpu", AVX2), F32, dict(dtype="float32", layer_loop="switch", quantization=None,
                                                     attention_backend="reference")),
    ("cpu x8+bf16", Platform("cpu", AVX2, 8), BF16, dict(layer_loop="scan", quantization=None)),
    ("cpu+moe", Platform("cpu", AVX2), MOE, dict(dtype="float32", layer_loop="scan", quantization=None)),
    ("gpu+gguf", Platform("gpu", num_devices=8), GGUF, dict(dtype="bfloat16", layer_loop="scan", quantization="gguf",
                                                            attention_backend="pallas")),
    ("gpu+bf16", Platform("gpu"), BF16, dict(dtype="bfloat16", layer_loop="scan", quantization=None)),
    ("tpu+bf16", Platform("tpu", num_devices=8), BF16, dict(dtype="bfloat16", attention_backend="pallas")),
])
def test_the_rules_and_the_logged_reasons(case, platform, checkpoint, expected):
    s = setup(platform, checkpoint)
    for name, value in expected.items():
        assert getattr(s, name) == value, (case, name)
        assert s.settings[name].automatic and s.settings[name].why
    text = s.summary()
    print(f"--- {case}\n{text}")                  # the logged configuration, for the record (-s)
    assert text.startswith("Initializing an engine with config:") and "batch_invariant = yes" in text
    for name in ("dtype", "layer_loop", "quantization", "attention_backend"):
        assert f"  {name} = " in text and "(auto: " in text


def test_an_explicit_dtype_is_honoured():
    """dtype="float32" on a quantized GGUF: the blocks kept, dequantized exactly inside float32 dots."""
    s = setup(Platform("cpu", AVX2), GGUF, dtype="float32")
    assert (s.dtype, s.quantization) == ("float32", "gguf") and not s.settings["dtype"].automatic
    s = setup(Platform("cpu", AVX2), BF16, dtype="float32")
    assert (s.dtype, s.quantization) == ("float32", None)      # a bf16 checkpoint in float32: exact upcast
    s = setup(Platform("cpu", AVX2), GGUF, dtype="bfloat16")
    assert (s.dtype, s.quantization) == ("bfloat16", "gguf")


def test_named_choices_win_and_an_opt_in_method_says_it_is_not_batch_invariant():
    s = setup(Platform("cpu", AVX2), GGUF, quantization="w8a8x2_bf16", layer_loop="scan")
    assert (s.quantization, s.layer_loop) == ("w8a8x2_bf16", "scan") and not s.batch_invariant
    assert "batch_invariant = NO: w8a8x2_bf16 picks its dot" in s.summary()
    assert setup(Platform("cpu", AVX2), GGUF, quantization="none").quantization is None


def test_an_llvm_level_below_xlas_default_is_not_batch_invariant():
    """Below -O3 a float32 tp = 2 logprob moved by 1 ulp beside other requests (docs/design.md): the
    configuration says so, whatever the method; the level is the last one XLA_FLAGS names."""
    from tp_jax.serving.resolve import llvm_level
    assert (llvm_level(""), llvm_level("--xla_force_host_platform_device_count=8")) == (3, 3)
    assert llvm_level("--xla_backend_optimization_level=3 --xla_backend_optimization_level=1") == 1
    s = setup(Platform("cpu", AVX2, llvm_level=0), BF16)
    assert not s.batch_invariant and "LLVM -O0" in s.summary()
    assert "batch_invariant = NO: XLA_FLAGS sets --xla_backend_optimization_level=0" in s.summary()
    assert setup(Platform("gpu", llvm_level=0), BF16).batch_invariant        # an XLA:CPU option only


def test_max_model_len_is_resolved_and_checked():
    assert setup(Platform("cpu"), F32).max_model_len == 2048
    with pytest.raises(ValueError, match=r"max_model_len=9000 must be in \[1, 8192\]"):
        setup(Platform("cpu"), F32, max_model_len=9000)


def test_llm_logs_its_configuration_once_and_keeps_it(tmp_path, caplog):
    from tests.quant_models import write_tiny_gguf
    from tp_jax import LLM
    path, _, _ = write_tiny_gguf(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tp_jax.config"):
        llm = LLM(path, progress=False)
    logged = [r.getMessage() for r in caplog.records if r.name == "tp_jax.config"]
    assert len(logged) == 1 and logged[0] == llm.setup.summary() and path in logged[0]
    assert llm.setup.quantization == "gguf_bf16" and llm.quantization.startswith("gguf")
