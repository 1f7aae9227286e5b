"""`--quantization` on the command line: `tp-jax generate` (== scripts/generate.py) and `tp-jax serve`
reach `LLM(quantization=...)`; a bad name or a method the checkpoint cannot take ends in one `error:` line."""

import json
import sys

import numpy as np

from tests.test_tp_jax_command import TP_JAX, run
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

PROMPTS = ["Hello there", "Once upon a time"]


def logprobs_of(lines: list[str]) -> list[list[float]]:
    rows = [json.loads(line) for line in lines]
    return [[lp[str(t)]["logprob"] for t, lp in zip(r["token_ids"], r["logprobs"])] for r in rows]


def test_generate_int8_is_the_script_and_the_library(tiny_path):
    args = ["--model", tiny_path, "--simulate-devices", "2", "--tp", "2", "--quantization", "int8", "--max-tokens",
            "5", "--ignore-eos", "--logprobs", "1", "--json"] + [a for p in PROMPTS for a in ("--prompt", p)]
    cli = run([TP_JAX, "generate", *args])
    script = run([sys.executable, "scripts/generate.py", *args])
    assert cli.returncode == 0 and script.returncode == 0, cli.stderr[-2000:] + script.stderr[-2000:]
    lines = cli.stdout.strip().splitlines()
    assert lines == script.stdout.strip().splitlines()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    expected = {}
    for q in ("int8", None):
        outs = LLM(tiny_path, tensor_parallel_size=2, quantization=q, progress=False).generate(PROMPTS, params)
        expected[q] = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    got = np.array(logprobs_of(lines))
    np.testing.assert_allclose(got, np.array(expected["int8"]), rtol=0, atol=1e-5)
    assert np.abs(got - np.array(expected[None])).max() > 1e-4          # float32 weights give other numbers


def test_bad_quantization_name_is_refused_by_both_commands():
    for command in ("generate", "serve"):
        r = run([TP_JAX, command, "--quantization", "int4"])
        assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr and "int8" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_serve_refuses_gguf_blocks_of_a_float_checkpoint_in_one_line(tiny_path):
    r = run([TP_JAX, "serve", tiny_path, "--simulate-devices", "2", "--port", "0", "--quantization", "gguf"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: quantization='gguf' cannot load this checkpoint" in r.stderr and "not a GGUF tensor" in r.stderr
    assert "Traceback" not in r.stderr
