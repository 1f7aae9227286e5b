"""8 simulated CPU devices for every test, set before jax starts (see docs/running.md).

NPROC >= 2 x devices avoids the XLA:CPU collective deadlock on 2-core machines; the
collective timeout turns any remaining hang into a fast failure.
"""

import os

os.environ["NPROC"] = str(max(int(os.environ.get("NPROC", "0") or 0), 16))
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "collective_call_terminate_timeout" not in _flags:
    _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=60"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the KV pools of the many models a session loads: at most 512 MiB each by default (see kv_pool.py)
os.environ.setdefault("TP_JAX_CPU_KV_CACHE_BYTES", str(512 * 2**20))
os.environ.setdefault("TP_JAX_TOKENIZER_CACHE", __import__("tempfile").mkdtemp(prefix="tp_jax_tok_"))
# JAX's persistent compilation cache (on by default in LLM) in a directory of this session, never ~/.cache
os.environ.setdefault("TP_JAX_COMPILE_CACHE", __import__("tempfile").mkdtemp(prefix="tp_jax_xla_"))

import jax  # noqa: E402
import pytest  # noqa: E402

from tp_jax.parallel.mesh import make_mesh  # noqa: E402

# (dp, pp, tp) shapes for layer tests: tp in {1, 2, 4, 8}, and tp = 3 on 6 devices (dp = 2).
TP_MESHES = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 1, 3)]


def mesh_for(dp: int, pp: int, tp: int):
    n = dp * pp * tp
    return make_mesh(dp, pp, tp, devices=jax.devices()[:n])


@pytest.fixture(params=TP_MESHES, ids=lambda s: "dp{}pp{}tp{}".format(*s))
def mesh(request):
    return mesh_for(*request.param)


def machine() -> str:
    from tp_jax.parallel.layers.quantization import cpu_flags
    simd = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    return f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].platform}; cpu: {os.cpu_count()} " \
           f"cores, {simd or 'no AVX'}"


def pytest_report_header(config):
    return machine()


# --- the real SmolLM2-135M-Instruct, shared by the tests that need it ------------------------

@pytest.fixture(scope="session")
def smollm2_path():
    from tp_jax.loaders.default import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not installed ({e})")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own GGUF load of SmolLM2 (its dequantizer and un-permutation), float32."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path),
                                                 gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_converted(smollm2_path, tmp_path_factory):
    """SmolLM2 converted to an HF directory (float32 safetensors + tokenizer) by our converter."""
    from tp_jax.loaders.convert import convert_gguf
    out = str(tmp_path_factory.mktemp("smollm2_hf"))
    convert_gguf(smollm2_path, out, "float32")
    return out


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2_path, tmp_path_factory):
    """SmolLM2 as bf16 safetensors (the GGUF's weights rounded to bf16; HF's own SmolLM2 is stored in bf16)."""
    from tp_jax.loaders.convert import convert_gguf
    out = str(tmp_path_factory.mktemp("smollm2_bf16"))
    convert_gguf(smollm2_path, out, "bfloat16")
    return out


# --- the OpenAI-compatible server as a subprocess (tests/server_process.py), shared by the server tests ----
from tests.server_process import client, ref, tiny_path, tiny_server  # noqa: E402,F401


# --- each test file's time, reported at the end of every run (CI's log) against its budget ---------------
FILE_BUDGET_S = 240            # a file over this is listed as over budget: split it or share its fixtures
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    rows = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"seconds per test file (budget {FILE_BUDGET_S} s each)")
    for path, secs in rows[:15]:
        flag = "  OVER BUDGET" if secs > FILE_BUDGET_S else ""
        terminalreporter.write_line(f"{secs:8.1f} s  {path}{flag}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f} s  in all ({len(rows)} files); {machine()}")
