"""The whole stack on an MoE model: `tp-jax generate` and the OpenAI server with expert parallelism.

One tiny random Qwen2-MoE (7 experts, top-3, a shared expert; tests/test_moe_models.py's dims) with
SmolLM2's tokenizer, served at dp 2 x tp 2 on 4 simulated devices with `--enable-expert-parallel`;
the greedy tokens (the server: its text and token count) must equal transformers' greedy generation of
the same prompt ids.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.server_process import ServerProcess
from tests.test_moe_models import BASE, VARIANTS
from tests.tiny_models import hf_greedy, randomize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = ["--dp", "2", "--tp", "2", "--simulate-devices", "4", "--enable-expert-parallel", "--max-model-len", "128"]
PROMPTS = ["Once upon a time", "The capital of France is"]
N = 8


@pytest.fixture(scope="module")
def moe_tokenized(smollm2_path, tmp_path_factory):
    """(path, tokenizer): the tiny Qwen2-MoE with a 49152-token vocabulary and SmolLM2's tokenizer."""
    import torch
    import transformers
    from tp_jax.serving.tokenizer import load_tokenizer
    cls, over = VARIANTS["qwen2_moe"]
    cfg = getattr(transformers, cls)(**{**BASE, **over, "vocab_size": 49152, "architectures": ["Qwen2MoeForCausalLM"]})
    torch.manual_seed(24)
    path = str(tmp_path_factory.mktemp("moe_tokenized"))
    randomize(transformers.AutoModelForCausalLM.from_config(cfg).eval()).save_pretrained(path, safe_serialization=True)
    tok = load_tokenizer(smollm2_path)
    tok.save_pretrained(path)
    return path, tok


def expected(path, tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    out = hf_greedy(path, ids, N)
    assert len(set(out)) > 3, f"degenerate greedy reference {out}"
    return ids, out


def test_generate_with_expert_parallel_matches_transformers(moe_tokenized):
    path, tok = moe_tokenized
    args = ["--model", path, *MESH, "--max-tokens", str(N), "--ignore-eos", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    r = subprocess.run([sys.executable, "scripts/generate.py", *args], capture_output=True, text=True, timeout=900,
                       cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [row["prompt"] for row in rows] == PROMPTS
    for row, p in zip(rows, PROMPTS):
        _, want = expected(path, tok, p)
        assert row["token_ids"] == want, (p, row["token_ids"], want)
        assert row["text"] == tok.decode(want, skip_special_tokens=True)


def test_server_with_expert_parallel_matches_transformers(moe_tokenized, tmp_path):
    from openai import OpenAI
    path, tok = moe_tokenized
    ids, want = expected(path, tok, PROMPTS[1])
    with ServerProcess([path, *MESH, "--served-model-name", "moe"], str(tmp_path), name="moe") as srv:
        srv.wait_ready()
        client = OpenAI(base_url=srv.base, api_key="unused", max_retries=0, timeout=600)
        r = client.completions.create(model="moe", prompt=ids, max_tokens=N, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), N)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
