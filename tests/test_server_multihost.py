"""`tp-jax serve` on two processes (2 simulated devices each, dp = 2 x tp = 2 over both), started by hand
with the same command but --process-id: process 0 binds the port, serves and drives; process 1 follows
its steps and binds nothing. Answers equal one process's `LLM.generate`; SIGTERM to process 0 stops
both (process 1 is released)."""

import signal

import httpx
import pytest
from openai import OpenAI

from tests.server_process import TINY_ARGS, ServerProcess
from tp_jax.multihost.launcher import free_port
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.structured import StructuredOutputsParams

pytestmark = pytest.mark.slow
ENV = {"TP_JAX_INIT_TIMEOUT": "120", "TP_JAX_HEARTBEAT_TIMEOUT": "20"}


def test_two_processes_serve_as_one(tiny_path, tmp_path):
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    args = [tiny_path, *TINY_ARGS, "--dp", "2", "--coordinator-address", coordinator, "--num-processes", "2"]
    with ServerProcess([*args, "--process-id", "1"], str(tmp_path), name="rank1", port=port, env=ENV) as rank1, \
            ServerProcess([*args, "--process-id", "0"], str(tmp_path), name="rank0", port=port, env=ENV) as rank0:
        rank0.wait_ready()
        prompts = ["Hello there", "Once upon a time", "The capital of France is"]
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        ref = LLM(tiny_path, tensor_parallel_size=2, max_model_len=256, progress=False)
        exp = [o.outputs[0].text for o in ref.generate(prompts, sp)]
        client = OpenAI(base_url=rank0.base, api_key="unused", max_retries=0, timeout=600)
        got = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == exp
        # structured outputs: the driver's bitmasks travel in the step plan to process 1
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        exp = [o.outputs[0].text for o in ref.generate(prompts, SamplingParams(max_tokens=24, seed=1,
                                                                                structured_outputs=so))]
        got = client.completions.create(model="tiny", prompt=prompts, max_tokens=24, seed=1,
                                        extra_body={"structured_outputs": {"json": schema}})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == exp
        assert all(c.finish_reason == "stop" for c in got.choices)
        assert "following process 0's engine steps" in rank1.log()
        code, took = rank0.signal_and_wait(signal.SIGTERM, 30)
        assert code == 0, rank0.log()[-3000:]
        assert rank1.proc.wait(120) == 0, rank1.log()[-3000:]
        assert "released by process 0" in rank1.log()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{rank0.url}/health", timeout=5)
