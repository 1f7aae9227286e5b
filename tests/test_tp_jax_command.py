"""The installed `tp-jax` command: `generate` prints exactly what scripts/generate.py prints (whose behaviour
tests/test_cli.py checks), `serve` has the issue's flags and refuses what it cannot do with one `error:`
line (exit 2, no traceback), a busy port before loading anything."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TP_JAX = os.path.join(os.path.dirname(sys.executable), "tp-jax")


def run(cmd, timeout=600):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_the_command_is_installed():
    assert os.access(TP_JAX, os.X_OK), f"{TP_JAX} missing: reinstall the package (pip install -e .)"
    r = run([TP_JAX, "--help"])
    assert r.returncode == 0 and "serve" in r.stdout and "generate" in r.stdout


def test_serve_has_the_flags_of_vllm_serve():
    r = run([TP_JAX, "serve", "--help"])
    assert r.returncode == 0
    for flag in ("MODEL", "--tensor-parallel-size", "--tp", "--pipeline-parallel-size", "--pp",
                 "--data-parallel-size", "--dp", "--host", "--port", "--max-model-len", "--max-num-seqs", "--dtype",
                 "--served-model-name", "--api-key", "--simulate-devices", "--coordinator-address", "--process-id"):
        assert flag in r.stdout, flag


def test_generate_is_the_script(tiny_path):
    args = ["--model", tiny_path, "--simulate-devices", "2", "--tp", "2", "--prompt", "Hello there", "--prompt",
            "Once upon a time", "--max-tokens", "6", "--ignore-eos", "--json"]
    cli = run([TP_JAX, "generate", *args])
    script = run([sys.executable, "scripts/generate.py", *args])
    assert cli.returncode == 0 and script.returncode == 0, cli.stderr[-2000:] + script.stderr[-2000:]
    lines = cli.stdout.strip().splitlines()
    assert lines == script.stdout.strip().splitlines()
    assert [len(json.loads(line)["token_ids"]) for line in lines] == [6, 6]


@pytest.mark.parametrize("extra,message", [
    (["--tp", "4"], "= 4 devices, but only 2 cpu device(s)"),
    (["--model", "/elsewhere"], "two models given"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout -1.0 must be >= 0"),
], ids=["tp too large", "two models", "negative shutdown timeout"])
def test_serve_refuses_in_one_line(tiny_path, extra, message):
    r = run([TP_JAX, "serve", tiny_path, "--simulate-devices", "2", "--port", "0", *extra])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: " in r.stderr and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_serve_refuses_a_busy_port_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run([TP_JAX, "serve", "/no/such/model", "--port", str(port), "--simulate-devices", "1"])
    assert r.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr


def test_readme_serve_command_parses():
    from tp_jax.server.cli import build_parser
    text = open(os.path.join(ROOT, "README.md")).read().split("## Serve it (OpenAI-compatible)", 1)[1]
    line = text.split("```bash\n", 1)[1].split("\n", 1)[0].split("#")[0].split()
    assert line[:2] == ["tp-jax", "serve"]
    args = build_parser().parse_args(line[1:])
    assert (args.tensor_parallel_size, args.simulate_devices, args.port, args.model_pos) == (8, 8, 8000, None)


# --- one command line: shared engine flags, one LLM, the exits (issue 22) -----------------------------

SERVER_ONLY = {"--model", "--host", "--port", "--served-model-name", "--api-key", "--warmup", "--shutdown-timeout",
               "--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser", "--log-level",
               "--disable-access-log", "--lora-modules", "--allow-runtime-lora-updating"}


def _flags(help_text: str) -> set[str]:
    import re
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text)) - {"--help"}


def test_generate_takes_every_engine_flag_of_serve():
    serve_help, gen_help = run([TP_JAX, "serve", "--help"]), run([TP_JAX, "generate", "--help"])
    assert serve_help.returncode == gen_help.returncode == 0
    serve, gen = _flags(serve_help.stdout), _flags(gen_help.stdout)
    engine = serve - SERVER_ONLY
    assert {"--max-num-seqs", "--max-num-batched-tokens", "--num-gpu-blocks", "--seed", "--tp"} <= engine
    assert engine <= gen, f"engine flags of serve that generate lacks: {sorted(engine - gen)}"


def test_the_engine_flags_are_llm_arguments():
    """`llm_kwargs` maps the shared flags onto LLM(...): every key is one of its arguments and every argument
    but the model, the device list and check_weights has a flag."""
    import inspect
    from tp_jax.server.cli import build_parser
    from tp_jax.server.command import llm_kwargs
    from tp_jax.serving.llm import LLM
    params = set(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
    for command in ("serve", "generate"):
        args = build_parser().parse_args([command, "--max-num-seqs", "3", "--num-gpu-blocks", "7", "--seed", "5",
                                          "--no-enable-prefix-caching", "--block-size", "32"])
        kw = llm_kwargs(args)
        assert set(kw) == params
        assert (kw["max_num_seqs"], kw["num_gpu_blocks"], kw["seed"], kw["enable_prefix_caching"],
                kw["block_size"]) == (3, 7, 5, False, 32)


EXITS = """
import sys
from tp_jax.server.command import run_command
from tp_jax.loaders.bind import MissingWeightError
errors = {"value": ValueError("bad --thing"), "missing": MissingWeightError("the checkpoint lacks 'w'"),
          "file": FileNotFoundError("no such model"), "key": KeyError("a bug"),
          "not_implemented": NotImplementedError("a bug"), "type": TypeError("a bug")}
def fail(args):
    raise errors[sys.argv[1]]
sys.exit(run_command(fail, None))
"""


@pytest.mark.parametrize("kind,user", [("value", True), ("missing", True), ("file", True), ("key", False),
                                       ("not_implemented", False), ("type", False)])
def test_only_user_errors_exit_2(kind, user):
    """The project's user errors: one `error:` line, exit 2; anything else is a bug: its traceback, exit 1."""
    r = run([sys.executable, "-c", EXITS, kind], timeout=120)
    if user:
        assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    else:
        assert r.returncode == 1 and "Traceback" in r.stderr and "a bug" in r.stderr, r.stderr
