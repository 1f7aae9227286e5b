"""scripts/profile_step.py: the kinds it reads from compiled HLO, and one profiled decode step of the default model."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import USER_XLA_FLAGS

sys.path.insert(0, "scripts")
from profile_step import instruction_kinds  # noqa: E402


def test_instruction_kinds_finds_dots_gathers_scatters_and_loops():
    """A dot, a gather of rows, a scatter of rows and a while loop around a dot, each compiled: every
    instruction gets its kind, fusions the kind of what they hold, the dot its einsum."""
    def f(a, b, idx, upd):
        x = jnp.einsum("ij,jk->ik", a, b)                                   # dot
        rows = jnp.take(a, idx, axis=0)                                    # gather
        a2 = a.at[idx].set(upd)                                            # scatter
        y = jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ b), x)      # while around a dot
        return x.sum() + rows.sum() + a2.sum() + y.sum()
    a = jnp.ones((64, 64))
    hlo = jax.jit(f).lower(a, a, jnp.arange(4), jnp.ones((4, 64))).compile().as_text()
    kinds = instruction_kinds(hlo)
    found = {k for k, _ in kinds.values()}
    assert {"dot", "gather", "scatter", "control"} <= found, kinds
    assert any(k == "dot" and "ij,jk->ik" in w for k, w in kinds.values()), kinds
    assert all(w == "" for k, w in kinds.values() if k != "dot")


def test_bad_arguments_are_usage_errors():
    for args, msg in [(("--batch", "0"), "--batch must be at least 1"),
                      (("--tokens", "1"), "--tokens must be at least 2")]:
        r = subprocess.run([sys.executable, "scripts/profile_step.py", *args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_profiled_decode_step_of_the_default_model():
    """The embedded SmolLM2 at 2 rows: the thunks' kinds add up to their total, the dots are a real share
    (its GEMMs and the LM head), and the top thunks name their einsum."""
    env = {**os.environ, "XLA_FLAGS": USER_XLA_FLAGS}          # the shares of the program a user compiles
    r = subprocess.run([sys.executable, "scripts/profile_step.py", "--batch", "2", "--tokens", "4", "--repeat", "2"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["batch"] == 2 and out["forward_ms"] > 0
    assert abs(sum(out["by_kind_ms"].values()) - out["thunks_ms"]) < 0.05
    assert out["by_kind_share"]["dot"] > 0.2 and out["by_kind_ms"]["gather"] > 0
    assert any(t["kind"] == "dot" and "->" in t["dot"] for t in out["top"])
