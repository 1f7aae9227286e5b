"""The real SmolLM2-135M-Instruct (9 query / 3 KV heads) through our GGUF and safetensors paths,
against transformers on the same weights: the GGUF at tp 2 and 4, the safetensors at tp 3 and 8 (each tp once;
the GGUF at tp 1, 3 and 8 in this same configuration: tests/test_quantized_smollm2.py's explicit float32).

The GGUF loads with quantization="gguf", so its Q4_1 / Q8_0 blocks stay quantized and are
dequantized to float32 inside the GEMM: the same weights as transformers' dequantized copy.
The float path of the GGUF and the default (auto: the fast dots): tests/test_quantized_smollm2.py."""

import numpy as np
import pytest

from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

# mostly running the real model, not compiling it: LLVM -O1 (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.llvm_level(1)]

# 9 query / 3 KV heads: 3 divides them, 2 not, 4 and 8 replicate KV (tp 8 on safetensors: transformers' own copy,
# test_transformers_own_save_pretrained_copy)
GGUF_TPS, SAFETENSORS_TPS = [2, 4], [3]
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
        "Within a few decades, printing shops had spread to more than two hundred cities across Europe, "
        "and the cost of books fell sharply, which changed how people learned.")
GREEDY_PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
LIMIT = 1e-3
# greedy tokens per prompt in the tp sweeps: the cached decode path past one 16-token block; the logits of 64
# positions are compared too (decode costs ~0.4 s a step at tp = 8 on 2 cores: 32 tokens doubled it)
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from tp_jax.serving.tokenizer import load_tokenizer
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def prompt64(tok):
    ids = tok.encode(TEXT)
    assert len(ids) >= 64
    return np.array([ids[:64]])


@pytest.fixture(scope="module")
def reference(smollm2_hf, tok, prompt64):
    import torch
    with torch.no_grad():
        logits = smollm2_hf(torch.tensor(prompt64)).logits.numpy()
        greedy = []
        for p in GREEDY_PROMPTS:
            ids = torch.tensor([tok.encode(p)])
            out = smollm2_hf.generate(ids, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=2)
            greedy.append(out[0, ids.shape[1]:].tolist())
    return logits, greedy


def check(llm, tok, prompt64, reference):
    logits, greedy = reference
    got = llm.get_logits(prompt64)
    diff = float(np.abs(got - logits).max())
    assert diff <= LIMIT, f"max abs logit diff {diff:.2e}"
    outs = llm.generate([tok.encode(p) for p in GREEDY_PROMPTS],
                        SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
    for out, ref in zip(outs, greedy):
        assert out.outputs[0].token_ids == ref
    return diff


@pytest.fixture(scope="module")
def gguf_llms(smollm2_path):
    """tp -> the GGUF with its blocks kept (float32 dots), built once for the tests of this file."""
    built = {}

    def get(tp: int) -> LLM:
        if tp not in built:
            built[tp] = LLM(smollm2_path, tensor_parallel_size=tp, quantization="gguf", progress=False)
        return built[tp]
    return get


@pytest.mark.parametrize("tp", GGUF_TPS)
def test_gguf_path(gguf_llms, tok, prompt64, reference, tp):
    llm = gguf_llms(tp)
    diff = check(llm, tok, prompt64, reference)
    print(f"GGUF tp={tp}: max abs logit diff {diff:.2e}")


@pytest.mark.parametrize("tp", SAFETENSORS_TPS)
def test_safetensors_path(smollm2_converted, tok, prompt64, reference, tp):
    llm = LLM(smollm2_converted, tensor_parallel_size=tp, progress=False)
    diff = check(llm, tok, prompt64, reference)
    print(f"safetensors tp={tp}: max abs logit diff {diff:.2e}")


def test_default_model_and_chat(smollm2_path):
    llm = LLM(tensor_parallel_size=2, progress=False)          # no model: the embedded default
    assert llm.model_path == smollm2_path
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2          # ended by <|im_end|>


def test_cached_decode_matches_full_forward(gguf_llms, tok):
    """Each generated token's logprob (prefill + cached decode) == log_softmax of the uncached forward (tp 4)."""
    llm = gguf_llms(4)
    ids = tok.encode(GREEDY_PROMPTS[0])
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1))[0]
    toks = out.outputs[0].token_ids
    full = llm.get_logits([ids + toks[:-1]])[0, len(ids) - 1:].astype(np.float64)
    ref = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    got = np.array([lp[t].logprob for t, lp in zip(toks, out.outputs[0].logprobs)])
    assert np.abs(got - ref[np.arange(len(toks)), toks]).max() <= 1e-4
    assert toks == [int(t) for t in full.argmax(-1)]


def test_readme_run_command(smollm2_hf, tok):
    """`make generate` runs this: SmolLM2 at tp = 8 on 8 simulated devices, greedy, 32 tokens, the default
    quantization ("auto"), whose text is transformers' float32 on the same file: on CPU the default keeps the GGUF's
    blocks and dequantizes them exactly inside bf16 dots ("gguf_bf16"; its bf16 roundings change no greedy token
    here), elsewhere float32 dots."""
    import os
    import subprocess
    import sys
    import torch
    ids = tok.encode("Once upon a time")
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2)
    expected = tok.decode(ref[0, len(ids):], skip_special_tokens=True)
    r = subprocess.run([sys.executable, "scripts/generate.py", "--simulate-devices", "8", "--tp", "8", "--prompt",
                        "Once upon a time", "--max-tokens", "32"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr[-2000:]
    assert expected.strip() in r.stdout
    assert "time to first token" in r.stdout and "tokens/s" in r.stdout


def test_transformers_own_save_pretrained_copy(smollm2_hf, tok, prompt64, reference, tmp_path):
    """SmolLM2 as transformers itself writes it (its GGUF load -> save_pretrained; its config.json carries
    GGUF-derived fields such as unk_token_id) loads and matches at tp = 8."""
    import json
    import torch
    from transformers import LlamaForCausalLM
    plain = LlamaForCausalLM(smollm2_hf.config)         # a GGUF-loaded model refuses save_pretrained itself
    plain.load_state_dict(smollm2_hf.state_dict())
    plain.to(torch.float32).save_pretrained(str(tmp_path), safe_serialization=True)
    tok.save_pretrained(str(tmp_path))
    written = json.load(open(tmp_path / "config.json"))
    assert written["transformers_version"].startswith("5.") and "unk_token_id" in written
    assert written["quantization_config"]["quant_method"] == "gguf"       # written for the dequantized copy
    llm = LLM(str(tmp_path), tensor_parallel_size=8, progress=False)
    diff = check(llm, tok, prompt64, reference)
    print(f"transformers save_pretrained copy tp=8: max abs logit diff {diff:.2e}; fields {sorted(written)}")
