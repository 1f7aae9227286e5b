"""JAX's persistent compilation cache: on by default, stored where stated, read by a second process, off on request."""

import json
import os
import subprocess
import sys

from tests.tiny_models import make_checkpoint, make_tokenized_checkpoint

PROGRAM = """
import collections, json, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
from tp_jax.serving import compile_cache
directory = compile_cache.enable(min_compile_s=0.0)
from tp_jax import LLM, SamplingParams
llm = LLM(sys.argv[1], progress=False)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids
print(json.dumps({"dir": directory, "hits": events["/jax/compilation_cache/cache_hits"],
                  "misses": events["/jax/compilation_cache/cache_misses"], "tokens": out}))
"""


def run(model: str, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", PROGRAM, model], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.getcwd(), **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_on_by_default_in_the_user_cache_dir_read_by_a_second_process_and_off_on_request(tmp_path):
    model = make_checkpoint("gqa", str(tmp_path))
    first = run(model, {"XDG_CACHE_HOME": str(tmp_path / "home_cache"), "TP_JAX_COMPILE_CACHE": ""})
    cache = str(tmp_path / "home_cache" / "tp_jax" / "xla")
    assert first["dir"] == cache and first["misses"] > 0 and len(os.listdir(cache)) > 0
    second = run(model, {"TP_JAX_COMPILE_CACHE": cache})
    assert second["dir"] == cache and second["hits"] >= first["misses"] - 1 and second["tokens"] == first["tokens"]
    off = run(model, {"TP_JAX_COMPILE_CACHE": "0"})
    assert off["dir"] is None and off["hits"] == 0 and off["tokens"] == first["tokens"]


def test_the_command_line_flag_turns_it_off(tmp_path, smollm2_path):
    model = make_tokenized_checkpoint(str(tmp_path), smollm2_path)
    cache = tmp_path / "xla"
    cmd = [sys.executable, "scripts/generate.py", "--model", model, "--prompt", "hi", "--max-tokens", "2"]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TP_JAX_COMPILE_CACHE": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}          # every program, however fast it compiled
    off = subprocess.run([*cmd, "--no-compile-cache"], capture_output=True, text=True, timeout=600, env=env)
    assert off.returncode == 0, off.stderr[-2000:]
    assert not cache.exists() or not os.listdir(cache)
    on = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert on.returncode == 0, on.stderr[-2000:]
    assert os.listdir(cache)
