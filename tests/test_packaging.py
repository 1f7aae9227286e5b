"""Packaging: the build metadata is written without setuptools deprecation warnings."""

import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_license_is_an_spdx_string_and_setuptools_is_new_enough_for_it():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["license"] == "Apache-2.0"              # the table form is deprecated
    assert "setuptools>=77" in project["build-system"]["requires"]     # SPDX strings need setuptools 77


def test_building_the_metadata_prints_no_deprecation_warning(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pip builds with a newer one)")
    code = f"import setuptools.build_meta as b; print(b.prepare_metadata_for_build_wheel({str(tmp_path)!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "deprecat" not in (r.stdout + r.stderr).lower(), r.stderr[-2000:]
    with open(tmp_path / r.stdout.strip().splitlines()[-1] / "METADATA") as f:
        assert "License-Expression: Apache-2.0" in f.read()


def test_the_tunix_integration_names_its_extra_when_tunix_is_missing():
    """Without Tunix, importing tp_jax.integrations.tunix says which extra installs it (Tunix hidden here, so this
    runs whether or not the extra is installed)."""
    code = ("import sys; sys.modules['tunix'] = None\n"
            "try:\n    import tp_jax.integrations.tunix\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "pip install 'tp-jax[tunix]'" in out.stdout, out.stdout + out.stderr
