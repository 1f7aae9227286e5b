"""scripts/device_check.py: its dry run end to end on this CPU (`--platform cpu --quick`), its refusal of a machine
without a GPU before any check, and how a run records a failed check."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.server_process import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "device_check.py")


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "check.json"
    r = run("--platform", "cpu", "--quick", "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["ok"] and s["failed"] == [] and s["platform"] == "cpu" and s["quick"]
    assert list(s["checks"]) == ["preflight", "golden", "smollm2", "greedy", "bench", "server"]
    assert all(c["ok"] for c in s["checks"].values()) and s["seconds"] < s["budget_s"]
    assert s["versions"]["jax"] == s["versions"]["jaxlib"] and s["device"]["platform"] == "cpu"
    golden = s["checks"]["golden"]["h9kv3"]
    assert golden["float32"] <= 1e-4 and 0 < golden["bfloat16"] < 0.1        # bf16 is not float32, but close
    assert s["checks"]["smollm2"]["skipped"] == "--quick"
    for name in ("gqa", "h9kv3"):
        assert s["checks"]["greedy"][name] == dict.fromkeys(("batch_equal", "alone_equal", "pallas_equal",
                                                             "reference_equal"), True), name
    bench = s["checks"]["bench"]
    assert list(bench["batches"]) == ["1", "8", "32"] and bench["kv_pool_bytes"] > 0
    assert all(b["tokens_per_s"] > 0 and b["memory"]["host_peak_rss_bytes"] > 0 for b in bench["batches"].values())
    server = s["checks"]["server"]
    assert server["status"] == 200 and server["models"] == ["check"] and server["usage"]["completion_tokens"] > 0
    assert server["text"] == server["expected"]
    for name in ("golden", "greedy", "bench", "server"):
        assert re.search(rf"^  {name}\s+ok\s", r.stdout, re.M), r.stdout
    assert re.search(r"^  smollm2\s+skipped\s", r.stdout, re.M)


def test_no_gpu_fails_before_any_check(tmp_path):
    out = tmp_path / "check.json"
    t = time.monotonic()
    r = run("--platform", "cuda", "--no-install", "--out", str(out), timeout=120)
    assert r.returncode == 2 and time.monotonic() - t < 60, r.stderr[-2000:]
    assert re.match(r"error: (wrong jaxlib: no CUDA plugin|no GPU visible)", r.stderr.strip().splitlines()[-1])
    s = json.loads(out.read_text())
    assert not s["ok"] and list(s["checks"]) == ["preflight"] and not s["checks"]["preflight"]["ok"]


def test_a_missing_output_directory_is_refused(tmp_path):
    r = run("--platform", "cpu", "--out", str(tmp_path / "missing" / "check.json"), timeout=120)
    assert r.returncode == 2 and "does not exist" in r.stderr and not (tmp_path / "missing").exists()


def test_a_failed_check_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    """A check out of its bounds and one that crashes: both recorded with their errors, the next check still run,
    the run's exit code 1 and its summary listing them."""
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)

    def out_of_bounds(ctx):
        raise dc.CheckFailed("float32 max abs logit diff 3e-2 (limit 1e-4)", {"float32": 3e-2})
    monkeypatch.setattr(dc, "CHECKS", {"golden": out_of_bounds, "bench": lambda ctx: 1 / 0,
                                       "server": lambda ctx: {"status": 200}})
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = tmp_path / "check.json"
    assert dc.main(["--platform", "cpu", "--quick", "--out", str(out)]) == 1
    s = json.loads(out.read_text())
    assert s["failed"] == ["golden", "bench"] and not s["ok"]
    assert s["checks"]["golden"] == {"ok": False, "error": "float32 max abs logit diff 3e-2 (limit 1e-4)",
                                     "float32": 3e-2, "seconds": s["checks"]["golden"]["seconds"]}
    assert s["checks"]["bench"]["error"] == "ZeroDivisionError: division by zero"
    assert "1 / 0" in s["checks"]["bench"]["traceback"] and s["checks"]["server"] == {
        "ok": True, "status": 200, "seconds": s["checks"]["server"]["seconds"]}
    assert "FAILED: golden, bench" in capsys.readouterr().out


def test_wheels_without_any_wheel_are_refused(tmp_path):
    r = run("--platform", "cpu", "--wheels", str(tmp_path), "--out", str(tmp_path / "c.json"), timeout=120)
    assert r.returncode == 2 and "no .whl files there" in r.stderr and "offline_wheels.py" in r.stderr


def test_a_jax_outside_pyprojects_range_is_named(monkeypatch):
    """preflight reads jax's range from pyproject.toml and refuses a jax outside it, naming both (exit 2)."""
    import types
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    assert dc.jax_range().startswith(">=")
    import jax
    import jaxlib
    monkeypatch.setattr(jax, "__version__", "0.4.1")
    monkeypatch.setattr(jaxlib, "__version__", "0.4.1")
    with pytest.raises(dc.PreflightError, match=rf"wrong jax: 0\.4\.1 is outside tp_jax's range jax{re.escape(dc.jax_range())}"):
        dc.preflight(types.SimpleNamespace(platform="cpu"))
