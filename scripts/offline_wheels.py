"""Wheels for a GPU host without network: what the device check imports beyond jax, torch and transformers.

    python scripts/offline_wheels.py                         # cp312 manylinux x86-64 wheels into wheels/
    python scripts/offline_wheels.py --python 3.11 --dest D  # for this machine's Python (tests/test_device_check.py)

On the GPU host (jax, jaxlib, a CUDA plugin, torch and transformers already there, no network):

    python scripts/device_check.py --wheels wheels           # installs them offline, then runs the check

Each package is downloaded with `pip download --no-deps --only-binary=:all:` at the version this environment runs
(so the host runs what the suite ran here); `CARRY` is the whole list, checked by a test that runs the dry run in a
venv holding only jax, numpy, torch and transformers plus these wheels. Left out: what the check never imports
(orbax-checkpoint, read only for Orbax checkpoints; the embedded SmolLM2, 93 MB: the check's default-model steps
need it, `--quick` does not: its tokenizer alone, ~2 MB, is saved in wheels/tokenizer for the server step).
`wheels/` is git-ignored. Prints one JSON line: the wheels, the tokenizer and their total size.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The distributions the check imports that a host with jax, torch and transformers lacks (found by running the dry
# run in such a venv until it passed; the test keeps it so).
CARRY = (
    "flax", "optax", "msgpack", "treescope", "etils", "absl-py",     # flax and what it imports
    "gguf", "sentencepiece", "accelerate", "psutil",                                   # checkpoints and tokenizers
    "llguidance", "fastapi", "starlette", "opentelemetry-api", "uvicorn", "prometheus-client", "httpx", "httpcore", "certifi",
    "pytest", "iniconfig", "pluggy",                                                   # the tests' reference helpers
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=os.path.join(ROOT, "wheels"), help="the folder (default: wheels/)")
    ap.add_argument("--python", default="3.12", help="the host's Python version (default 3.12)")
    ap.add_argument("--platform", default="manylinux_2_31_x86_64",
                    help="the host's wheel platform (default manylinux_2_31_x86_64: glibc 2.31 or newer, Ubuntu 20.04 "
                         "on, as llguidance's wheel needs; older manylinux tags match too)")
    return ap.parse_args(argv)


def pins() -> list[str]:
    """`name==version` of each carried package, as this environment has it (an error names one that is missing)."""
    out = []
    for name in CARRY:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            sys.exit(f"error: {name} is not installed here; run `make .venv/.testing` first (its version is the pin)")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.dest, exist_ok=True)
    abi = "cp" + args.python.replace(".", "")
    platforms = [args.platform]
    glibc = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", args.platform)
    if glibc:                                 # pip download matches the tags named: every older glibc's too
        newest, arch = int(glibc.group(1)), glibc.group(2)
        platforms = [f"manylinux_2_{n}_{arch}" for n in range(newest, 4, -1)] + \
                    [f"manylinux{t}_{arch}" for t in ("2014", "2010", "1")]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--dest", args.dest,
           "--python-version", args.python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
           *[a for p in platforms for a in ("--platform", p)], "--platform", "any", *pins()]
    r = subprocess.run(cmd)
    if r.returncode != 0:
        print(f"error: pip download failed (exit {r.returncode}): {' '.join(cmd)}", file=sys.stderr)
        return 1
    from tp_jax.loaders.default import default_model_path
    from tp_jax.serving.tokenizer import load_tokenizer
    load_tokenizer(default_model_path()).save_pretrained(os.path.join(args.dest, "tokenizer"))
    wheels = sorted(f for f in os.listdir(args.dest) if f.endswith(".whl"))
    files = [os.path.join(d, f) for d, _, fs in os.walk(args.dest) if not d.startswith(os.path.join(args.dest, "site"))
             for f in fs]
    size = sum(os.path.getsize(f) for f in files)
    print(json.dumps({"dest": args.dest, "python": args.python, "wheels": wheels, "count": len(wheels),
                      "bytes": size, "mib": round(size / 2**20, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
