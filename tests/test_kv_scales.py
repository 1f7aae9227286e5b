"""A checkpoint's KV cache scales (vLLM's FP8 checkpoints' `k_scale` / `v_scale`, compressed-tensors'
`kv_cache_scheme`): read by a float8 cache (x / s stored, q * s read back), left alone by "auto". A tiny Llama
written by transformers with scales beside its weights: the pool's bytes equal numpy's float8 of the keys over the
scales, and the prompt's logprobs equal transformers' with its keys and values through the same round trip."""

import json
import logging
import os
import shutil

import numpy as np
import pytest

from tests.tiny_models import make_checkpoint
from tp_jax import LLM, SamplingParams
from tp_jax.loaders.kv_scales import read_kv_scales

SCALES = {0: (0.0004, 0.05), 1: (0.002, 0.01)}   # (k, v) per layer: |k| > 448 * 0.0004 saturates e4m3
PROMPT = [1, 17, 230, 44, 901, 5, 77, 310, 12, 640, 3, 99, 250, 8]
CT_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
KW = dict(progress=False, max_model_len=64, num_gpu_blocks=16)


class Names(dict):
    """A checkpoint source over a dict of arrays (keys, get)."""

    def get(self, name):
        return np.asarray(self[name])


def with_scales(src: str, dst: str, scales=SCALES, quantization_config=None) -> str:
    """A copy of checkpoint `src` with per-layer `k_scale` / `v_scale` tensors (and a quantization_config)."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    for i, (k, v) in scales.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(k, np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(v, np.float32)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**config, "quantization_config": quantization_config}, f)
    return dst


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("kv_scales"))
    plain = make_checkpoint("gqa", root)
    return {"plain": plain, "scaled": with_scales(plain, os.path.join(root, "scaled")),
            "ct": with_scales(plain, os.path.join(root, "ct"), quantization_config={
                "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
                "kv_cache_scheme": CT_SCHEME})}


def fp8_round_trip(x, scale):
    """numpy's float8 e4m3 of x / scale, saturated (vLLM's cast), read back times the scale."""
    import ml_dtypes
    return np.clip(x / np.float32(scale), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * \
        np.float32(scale)


def prompt_logprobs(llm) -> np.ndarray:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))[0]
    return np.array([lp[t].logprob for t, lp in zip(PROMPT[1:], out.prompt_logprobs[1:])])


def hf_prompt_logprobs(path: str, scales=None) -> np.ndarray:
    """transformers' logprobs of PROMPT[1:]; with `scales`, each layer's keys (after RoPE) and values through
    `fp8_round_trip` before attention (what the cache holds)."""
    import torch
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    eager = llama.eager_attention_forward

    def quantized(module, query, key, value, *args, **kwargs):
        k, v = scales[module.layer_idx]
        trip = lambda x, s: torch.from_numpy(fp8_round_trip(x.numpy(), s))        # noqa: E731
        return eager(module, query, trip(key, k), trip(value, v), *args, **kwargs)

    llama.eager_attention_forward = eager if scales is None else quantized
    try:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0].double()
    finally:
        llama.eager_attention_forward = eager
    lp = torch.log_softmax(logits, -1)[:-1].numpy()
    return lp[np.arange(len(PROMPT) - 1), PROMPT[1:]]


def test_read_kv_scales_by_vllms_rule():
    """Both k and v when positive; one scale (kv_scale, or only k) for both; none: 1.0; compressed-tensors'
    older k_proj.output_scale names; a per-head scale or a layer past the model's is refused, naming the fix."""
    p = "model.layers.{}.self_attn."
    source = Names({p.format(0) + "k_scale": 0.5, p.format(0) + "v_scale": 0.25, p.format(1) + "kv_scale": 2.0,
                    p.format(2) + "k_scale": [3.0], p.format(2) + "v_scale": -1.0,
                    p.format(4) + "k_proj.output_scale": 0.125, p.format(4) + "v_proj.output_scale": 4.0,
                    p.format(0) + "q_scale": 9.0, "model.layers.0.mlp.up_proj.weight": np.zeros((2, 2))})
    scales = read_kv_scales(source, 5)
    assert scales.k == (0.5, 2.0, 3.0, 1.0, 0.125) and scales.v == (0.25, 2.0, 3.0, 1.0, 4.0)
    assert scales.per_slot((0, 1, -1, 2, 3, 4, -1, -1)).k == (0.5, 2.0, 1.0, 3.0, 1.0, 0.125, 1.0, 1.0)
    assert read_kv_scales(Names({"model.layers.0.mlp.up_proj.weight": 0}), 2) is None
    with pytest.raises(ValueError, match=r"KV cache scale 'model.layers.0.self_attn.k_scale' has shape \(2,\): only "
                                         r"per-tensor scales .* use kv_cache_dtype='auto'"):
        read_kv_scales(Names({p.format(0) + "k_scale": [1.0, 2.0]}), 2)
    with pytest.raises(ValueError, match=r"names layer 3, but the model has 2 layers"):
        read_kv_scales(Names({p.format(3) + "k_scale": 1.0}), 2)


def test_fp8_reads_the_checkpoints_scales(paths):
    """The pool's bytes are numpy's float8 of the keys and values over the checkpoint's scales (layer 0: the same
    keys as the float cache's), and the prompt's logprobs are transformers' with its keys and values through that
    round trip, at pp 2 too; compressed-tensors' kv_cache_scheme reads the same."""
    auto = LLM(paths["plain"], **KW)
    prompt_logprobs(auto)
    fp8 = LLM(paths["scaled"], kv_cache_dtype="fp8", **KW)
    got = prompt_logprobs(fp8)
    assert fp8.engine.core.pool.layout.quant.k_scales == tuple(float(np.float32(SCALES[i][0])) for i in (0, 1))
    import ml_dtypes
    k_auto, v_auto = (np.asarray(x)[0] for x in (auto.engine.core.runner.k, auto.engine.core.runner.v))
    for pool, ref, scale in ((fp8.engine.core.runner.k, k_auto, SCALES[0][0]),
                             (fp8.engine.core.runner.v, v_auto, SCALES[0][1])):
        want = np.clip(ref / np.float32(scale), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        np.testing.assert_array_equal(np.asarray(pool)[0], want)
    assert (np.abs(k_auto) > 448 * SCALES[0][0]).any()                      # saturation happened
    want = hf_prompt_logprobs(paths["plain"], SCALES)
    plain = hf_prompt_logprobs(paths["plain"])
    err, effect = np.abs(got - want).max(), np.abs(plain - want).max()
    print(f"fp8 with checkpoint scales: |ours - transformers' round trip| {err:.2e}, the round trip's own effect "
          f"{effect:.2e}")
    assert err < 1e-4 < effect / 10
    staged = LLM(paths["scaled"], kv_cache_dtype="fp8", pipeline_parallel_size=2, **KW)     # a layer per stage
    assert np.abs(prompt_logprobs(staged) - want).max() < 1e-4              # each stage reads its own layer's scales
    ct = LLM(paths["ct"], kv_cache_dtype="fp8", **KW)
    np.testing.assert_array_equal(prompt_logprobs(ct), got)
    unscaled = LLM(paths["plain"], kv_cache_dtype="fp8", **KW)
    assert unscaled.engine.core.pool.layout.quant.k_scales is None


def test_auto_keeps_the_activations_dtype_beside_scales_and_a_bad_scheme_is_refused(paths, tmp_path, caplog):
    """A checkpoint with scales and kv_cache_dtype "auto" stays auto (the rule table says why), and serves what the
    checkpoint without them serves, bit for bit; int8 logs that it does not read them; a kv_cache_scheme that is not
    per-tensor static float8 is refused when fp8 is named."""
    scaled = LLM(paths["scaled"], **KW)
    setting = scaled.setup.settings["kv_cache_dtype"]
    assert setting.value == "auto" and setting.rule == "the checkpoint holds KV cache scales"
    assert "kv_cache_dtype='fp8' reads the checkpoint's k_scale / v_scale" in scaled.setup.summary()
    assert scaled.kv_scales is None and scaled.engine.core.pool.layout.quant is None
    np.testing.assert_array_equal(prompt_logprobs(scaled), prompt_logprobs(LLM(paths["plain"], **KW)))
    with caplog.at_level(logging.INFO, logger="tp_jax"):
        LLM(paths["scaled"], kv_cache_dtype="int8", **KW)
    assert "kv_cache_dtype=int8: the checkpoint's k_scale / v_scale are not read" in caplog.text
    bad = with_scales(paths["plain"], str(tmp_path / "bad"), quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {**CT_SCHEME,
                                                                                       "strategy": "attn_head"}})
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3': quantization_config.kv_cache_scheme has "
                                         r"strategy='attn_head'; an fp8 KV cache reads only static per-tensor .* use "
                                         r"kv_cache_dtype='auto' or 'int8'"):
        LLM(bad, kv_cache_dtype="fp8", **KW)
