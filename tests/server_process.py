"""The real server as a subprocess on a free loopback port, for the server tests (always stopped).

    with ServerProcess([model, "--tp", "2", "--simulate-devices", "2"], log_dir) as srv:
        srv.wait_ready()
        OpenAI(base_url=srv.base, api_key="x").completions.create(...)

`tiny_server` (session) serves the tiny tokenized Llama (SmolLM2's tokenizer) at tp = 2 on
2 simulated devices as model "tiny", with compact constrained JSON (`--structured-outputs-config`) and no
`--tool-call-parser` (tool_choice "auto" reads calls with the parser chosen from the chat template); test
modules share it. Metrics helpers read /metrics.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tp_jax.multihost.launcher import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ARGS = ["--tp", "2", "--simulate-devices", "2", "--served-model-name", "tiny", "--max-model-len", "256",
             "--structured-outputs-config", "{\"disable_any_whitespace\": true}",
             "--max-num-seqs", "32"]
READY_TIMEOUT_S = 600


class ServerProcess:
    def __init__(self, args: list[str], log_dir: str, *, name: str = "server", port: int | None = None,
                 env: dict | None = None):
        self.port = port or free_port()
        self.log_path = os.path.join(log_dir, f"{name}-{self.port}.log")
        cmd = [sys.executable, "-m", "tp_jax.server.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server was not ready within {timeout_s}s:\n{self.log()[-3000:]}")

    def signal_and_wait(self, sig: int, timeout_s: float) -> tuple[int | None, float]:
        """Send `sig`; (exit code or None if still running after timeout_s, seconds until it exited)."""
        t = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - t

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value} (comment lines dropped)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def wait_metrics(url: str, ok, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until ok(m); the last reading (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    m = metrics(url)
    while not ok(m) and time.monotonic() < deadline:
        time.sleep(0.1)
        m = metrics(url)
    return m


def success(m: dict[str, float], reason: str) -> float:
    return m.get(f'tp_jax:request_success_total{{finished_reason="{reason}"}}', 0.0)


def request_log_lines(log: str, request_id: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(rf"request {re.escape(request_id)}\b", line)]


# --- shared fixtures (imported by conftest.py) --------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_path(smollm2_path, tmp_path_factory):
    from tests.tiny_models import make_tokenized_checkpoint
    return make_tokenized_checkpoint(str(tmp_path_factory.mktemp("server_models")), smollm2_path)


@pytest.fixture(scope="session")
def tiny_server(tiny_path, tmp_path_factory):
    with ServerProcess([tiny_path, *TINY_ARGS], str(tmp_path_factory.mktemp("server_logs")), name="tiny") as srv:
        yield srv.wait_ready()


@pytest.fixture(scope="session")
def ref(tiny_path):
    """The tiny server's model in this process (tp = 2): the reference the server tests compare answers with."""
    from tp_jax.serving.llm import LLM
    return LLM(tiny_path, tensor_parallel_size=2, max_model_len=256, max_num_seqs=32, progress=False)


@pytest.fixture(scope="session")
def client(tiny_server):
    """The `openai` client pointed at the tiny server."""
    from openai import OpenAI
    return OpenAI(base_url=tiny_server.base, api_key="unused", max_retries=0, timeout=600)
