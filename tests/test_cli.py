"""scripts/generate.py as a user runs it: inputs checked before the load, exact output formats, Ctrl-C.

Units of tp_jax/server/generate.py first, then the script in subprocesses (a tiny random model
with SmolLM2's tokenizer; the real SmolLM2 where a run must last long enough to interrupt).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.tiny_models import make_tokenized_checkpoint
from tp_jax.server.generate import OrderedStreams, json_line, read_prompts_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = os.path.join(ROOT, "scripts", "generate.py")


def strict_json(line: str):
    """json.loads that refuses NaN / Infinity, as every other JSON parser does."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


# --- units ---------------------------------------------------------------------------------------

def test_json_line_writes_non_finite_numbers_as_null():
    row = {"text": "é", "logprobs": [{5: float("nan"), 7: -0.5}, {9: np.float32("-inf")}], "cum": np.float64(1.5),
           "ids": [np.int64(3)]}
    line = json_line(row)
    assert strict_json(line) == {"text": "é", "logprobs": [{"5": None, "7": -0.5}, {"9": None}], "cum": 1.5,
                                 "ids": [3]}
    assert "\n" not in line


def test_read_prompts_file(tmp_path):
    good = tmp_path / "good.txt"
    good.write_bytes(b"\xef\xbb\xbffirst\n\n   \nsecond line\r\nthird\n")
    assert read_prompts_file(str(good)) == ["first", "second line", "third"]


def test_ordered_streams_print_one_prompt_after_another():
    out = []
    streams = OrderedStreams(["p0", "p1", "p2"], out.append)
    streams.add(0, "a", False)
    assert out == ["--- prompt 0: 'p0'\n", "a"]                             # prompt 0 is printed as it comes
    for i, text, done in [(1, "x", False), (2, "m", False), (1, "y", True), (0, "b", False), (2, "n", False),
                          (0, "c", True), (2, "o", True)]:
        streams.add(i, text, done)
    assert "".join(out) == "--- prompt 0: 'p0'\nabc\n--- prompt 1: 'p1'\nxy\n--- prompt 2: 'p2'\nmno\n"
    one = []
    single = OrderedStreams(["only"], one.append)
    single.add(0, "he", False)
    single.add(0, "llo", True)
    assert "".join(one) == "hello\n"                                        # one prompt: no header


# --- the script ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, smollm2_path):
    return make_tokenized_checkpoint(str(tmp_path_factory.mktemp("cli")), smollm2_path)


def generate(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, GENERATE, *args], capture_output=True, text=True, timeout=timeout)


BAD_FILES = {                                       # name: (content, the error line; {p} is the path's repr)
    "missing": (None, "error: --prompts-file {p}: no such file"),
    "directory": ("dir", "error: --prompts-file {p} is a directory; pass a text file with one prompt per line"),
    "bad_utf8": (b"fine\nbad \xff byte\n", "error: --prompts-file {p}: line 2 is not valid UTF-8 (byte 0xff at "
                                          "offset 9); save the file as UTF-8"),
    "blank": (b"\n   \n\t\n", "error: --prompts-file {p} has no prompts (it is empty or has only blank lines); "
                              "write one prompt per line"),
    "empty": (b"", "error: --prompts-file {p} has no prompts (it is empty or has only blank lines); write one "
                   "prompt per line"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_prompts_file_is_one_error_line_before_the_model_is_touched(tmp_path, case):
    """The model path does not exist: only a check made before the load can produce this line."""
    content, line = BAD_FILES[case]
    path = tmp_path / case
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    r = generate("--model", str(tmp_path / "no_such_model"), "--prompts-file", str(path))
    assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [line.format(p=repr(str(path)))], ""), r.stderr


def test_json_output_parses_line_by_line(tokenized):
    r = generate("--model", tokenized, "--prompt", "Hello", "--prompt", "Two words", "--max-tokens", "5",
                 "--ignore-eos", "--logprobs", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [strict_json(line) for line in r.stdout.splitlines()]
    assert [row["index"] for row in rows] == [0, 1] and [row["prompt"] for row in rows] == ["Hello", "Two words"]
    assert all(len(row["token_ids"]) == len(row["logprobs"]) == 5 for row in rows)
    assert "decode" in r.stderr                                  # the stats line goes to stderr with --json


def test_stream_prints_each_prompt_after_the_other_and_counts_decode_tokens(tokenized):
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    prompts = ["Hello", "Once upon", "The end"]
    r = generate("--model", tokenized, *[a for p in prompts for a in ("--prompt", p)], "--max-tokens", "6",
                 "--ignore-eos", "--stream")
    assert r.returncode == 0, r.stderr[-2000:]
    texts = [o.outputs[0].text for o in LLM(tokenized, progress=False).generate(
        prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
    expected = "".join(f"--- prompt {i}: {p!r}\n{t}\n" for i, (p, t) in enumerate(zip(prompts, texts)))
    assert r.stdout.startswith(expected), (r.stdout, expected)
    stats = r.stdout[len(expected):].strip()
    assert "decode" in stats and "(15 tokens)" in stats          # 3 prompts x (6 - the first, from prefill)


def interrupt(args: list, wait_for: str, stream: str) -> tuple[int, str, float]:
    """Start generate.py, send SIGINT once `wait_for` shows on `stream`; (code, stderr, seconds to exit)."""
    proc = subprocess.Popen([sys.executable, GENERATE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        watched = proc.stdout if stream == "stdout" else proc.stderr
        seen = b""
        while wait_for.encode() not in seen:
            chunk = os.read(watched.fileno(), 4096)
            assert chunk, f"ended before {wait_for!r}: {seen[-2000:]!r}"
            seen += chunk
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, (seen if stream == "stderr" else b"").decode() + err.decode(), time.monotonic() - t
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("stage,wait_for,stream", [("loading", "loading weights", "stderr"),
                                                   ("generating", " ", "stdout")])
def test_ctrl_c_exits_130_with_one_line(smollm2_path, stage, wait_for, stream):
    code, err, took = interrupt(["--max-tokens", "1000", "--ignore-eos", "--stream"], wait_for, stream)
    assert code == 130, err[-3000:]
    assert err.rstrip("\n").splitlines()[-1] == "interrupted (SIGINT): stopped"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert took < 30
