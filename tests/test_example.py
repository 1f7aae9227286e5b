"""examples/custom_mlp_model.py runs as a script: a user-defined model at tp 1, 2, 4, 8 agrees."""

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_custom_mlp_example_runs():
    out = subprocess.run([sys.executable, "examples/custom_mlp_model.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all tp sizes agree" in out.stdout
    shapes = re.findall(r"tp=(\d+): up kernel per device \((\d+), (\d+)\)", out.stdout)
    assert [(int(tp), int(f)) for tp, _, f in shapes] == [(1, 256), (2, 128), (4, 64), (8, 32)]
