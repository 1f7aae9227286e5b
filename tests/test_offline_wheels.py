"""scripts/offline_wheels.py and the device check's `--wheels`: the way onto an air-gapped GPU host, tried on this
CPU in a venv holding only what such a host has."""

import json
import os
import subprocess
import sys

import pytest

from tests.server_process import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "device_check.py")

@pytest.mark.slow
def test_an_air_gapped_host_runs_the_dry_run_from_carried_wheels(tmp_path):
    """A venv holding only jax, numpy, torch and transformers (what the GPU host has) plus the wheels
    scripts/offline_wheels.py carries, installed offline by the check itself (`--wheels`): the dry run passes."""
    import importlib.metadata as md
    venv, wheels = tmp_path / "venv", tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    pins = [f"{name}=={md.version(name).split('+')[0]}" for name in ("jax", "jaxlib", "numpy", "torch", "transformers")]
    r = subprocess.run([python, "-m", "pip", "install", "-q", *pins], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "offline_wheels.py"), "--python", here,
                        "--dest", str(wheels)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    carried = json.loads(r.stdout.strip().splitlines()[-1])
    assert carried["count"] >= 20 and carried["bytes"] < 64 * 2**20          # the device tool carries 64 MiB in all
    lacking = subprocess.run([python, "-c", "import flax"], capture_output=True, text=True, timeout=120)
    assert lacking.returncode != 0 and "No module named 'flax'" in lacking.stderr   # the venv is bare
    out = tmp_path / "check.json"
    r = subprocess.run([python, SCRIPT, "--platform", "cpu", "--quick", "--wheels", str(wheels), "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["ok"] and s["wheels"] == str(wheels / "site") and s["checks"]["server"]["text"] == \
        s["checks"]["server"]["expected"]

