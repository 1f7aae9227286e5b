"""`--api-key` (401 without the bearer token, /health and /metrics open) and SIGTERM / SIGINT: the server
stops accepting, lets the in-flight stream finish within --shutdown-timeout or ends it with
finish_reason "abort" and [DONE], and exits 0 within 10 s. Each test starts
its own tiny server (tp = 2, 2 simulated devices) as a subprocess."""

import signal
import threading

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server_process import TINY_ARGS, ServerProcess, request_log_lines

KEY = "sk-test-4242"
EXIT_BOUND_S = 10.0


class InFlight(threading.Thread):
    """A long streaming completion read in the background; `started` is set at its first chunk."""

    def __init__(self, base: str, api_key: str):
        super().__init__(daemon=True)
        self.client = OpenAI(base_url=base, api_key=api_key, max_retries=0, timeout=120)
        self.started, self.chunks, self.finish, self.error, self.id = threading.Event(), 0, None, None, None

    def run(self):
        try:
            stream = self.client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=230,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            for ch in stream:
                self.id = ch.id
                self.chunks += 1
                self.finish = ch.choices[0].finish_reason or self.finish
                self.started.set()
        except Exception as e:                        # the server cut the stream while stopping
            self.error = e
        finally:
            self.started.set()


def stop_with(srv: ServerProcess, sig: int, flight: InFlight) -> None:
    assert flight.started.wait(120) and flight.error is None, flight.error
    code, took = srv.signal_and_wait(sig, EXIT_BOUND_S)
    assert code == 0 and took < EXIT_BOUND_S, f"exit {code} after {took:.1f}s:\n{srv.log()[-3000:]}"
    flight.join(30)
    assert not flight.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health", timeout=5)


def test_api_key_and_sigterm(tiny_path, tmp_path):
    with ServerProcess([tiny_path, *TINY_ARGS, "--api-key", KEY], str(tmp_path), name="sigterm") as srv:
        srv.wait_ready()
        no_key = httpx.post(f"{srv.base}/completions", json={"prompt": "Hi"}, timeout=30)
        assert no_key.status_code == 401
        assert no_key.json()["error"]["type"] == "authentication_error"
        assert "no API key was given" in no_key.json()["error"]["message"]
        assert "Authorization: Bearer" in no_key.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError, match="the API key is wrong"):
            OpenAI(base_url=srv.base, api_key="sk-wrong", max_retries=0).models.list()
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{srv.url}/metrics", timeout=30).status_code == 200
        good = OpenAI(base_url=srv.base, api_key=KEY, max_retries=0, timeout=120)
        assert good.completions.create(model="tiny", prompt="Hi", max_tokens=3).usage.completion_tokens <= 3

        flight = InFlight(srv.base, KEY)
        flight.start()
        stop_with(srv, signal.SIGTERM, flight)
        log = srv.log()
        assert "Shutting down" in log
        lines = request_log_lines(log, flight.id)
        assert len(lines) == 1, log[-3000:]
        assert flight.finish in ("length", "abort")    # finished within the grace period, or aborted after it
        assert f"finish {flight.finish}" in lines[0]
        if flight.finish == "length":
            assert flight.chunks == 230


def test_sigint_aborts_in_flight_requests(tiny_path, tmp_path):
    args = [tiny_path, *TINY_ARGS, "--shutdown-timeout", "0"]
    with ServerProcess(args, str(tmp_path), name="sigint") as srv:
        srv.wait_ready()
        flight = InFlight(srv.base, "unused")
        flight.start()
        stop_with(srv, signal.SIGINT, flight)
        assert flight.finish == "abort" and flight.chunks < 230     # a last chunk, then [DONE]: no cut stream
        lines = request_log_lines(srv.log(), flight.id)
        assert len(lines) == 1 and "finish abort" in lines[0], srv.log()[-3000:]
        assert "aborted 1 request(s) still running after the 0.0 s grace period" in srv.log()
