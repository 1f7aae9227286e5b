"""Every ```python block of README.md runs as written, in a fresh process on 8 simulated CPU devices (the
`openai`, Responses and LangChain samples need a server: tests/test_server_smollm2.py runs them against one)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
BLOCKS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md")).read(), re.S)


def run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NPROC": "16", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


FRONT_DOOR, OWN_MODEL, ROLLOUTS = (next(b for b in BLOCKS if key in b)
                                   for key in ("LLM(None, tensor", "shard_module", "update_weights"))


def test_readme_has_the_six_samples():
    assert len(BLOCKS) == 6 and sum("from openai import OpenAI" in b for b in BLOCKS) == 2


def test_own_model_sample():
    out = run(OWN_MODEL)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "(4, 512)"


@pytest.mark.slow
def test_front_door_sample(smollm2_path):
    out = run(FRONT_DOOR)
    assert out.returncode == 0, out.stderr[-3000:]
    text, reason = out.stdout.splitlines()[0].rsplit(" ", 1)         # print(text, finish_reason)
    assert reason in ("stop", "length") and text.strip(), out.stdout


@pytest.mark.slow
def test_rollouts_sample(smollm2_path):
    out = run(ROLLOUTS)
    assert out.returncode == 0, out.stderr[-3000:]
    moved, last = out.stdout.strip().splitlines()[-2:]
    assert int(moved) > 0 and last.startswith("False [")
