"""How many config.json files load_config accepts and build at tp = 8 (abstract: nothing is allocated).

    python scripts/check_configs.py [DIR_OR_FILES ...] [--resave]

Default: tests/data/configs/*.json. `--resave` first rewrites each through the installed
transformers' save_pretrained. Prints each refusal on stderr and one JSON line on stdout:
{"accepted": N, "total": M, "resaved": bool, "refused": {name: message}}.
"""

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=[os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                              "configs")])
    ap.add_argument("--resave", action="store_true", help="round-trip each through transformers' save_pretrained")
    args = ap.parse_args()
    import jax
    from transformers import AutoConfig
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.config import load_config
    from tp_jax.parallel.mesh import make_mesh
    mesh = make_mesh(tp=8, devices=jax.devices()[:8])
    files = sorted(f for p in args.paths for f in (glob.glob(os.path.join(p, "*.json")) if os.path.isdir(p) else [p]))
    refused = {}
    for f in files:
        d = tempfile.mkdtemp()
        shutil.copy(f, os.path.join(d, "config.json"))
        if args.resave:
            AutoConfig.from_pretrained(d).save_pretrained(d)
        try:
            abstract_model(load_config(d), mesh, dtype=jax.numpy.bfloat16)
        except Exception as e:            # noqa: BLE001  (every refusal is reported, whatever its type)
            refused[os.path.basename(f)[:-5]] = f"{type(e).__name__}: {e}"
            print(f"refused {f}: {e}", file=sys.stderr)
        shutil.rmtree(d, ignore_errors=True)
    print(json.dumps({"accepted": len(files) - len(refused), "total": len(files), "resaved": args.resave,
                      "refused": refused}))


if __name__ == "__main__":
    main()
