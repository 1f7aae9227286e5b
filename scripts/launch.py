"""Run one program as N jax.distributed processes on this machine (simulated CPU devices per process).

    python scripts/launch.py --num-processes 2 --devices-per-process 4 -- scripts/generate.py --tp 4

Every rank's output is prefixed with `[rank i]`; only rank 0 (the driver) prints generations.
If a rank fails the others are stopped and the launcher exits non-zero naming it. Real
multi-host runs start one process per host by hand: see docs/multihost.md.
"""

import argparse
import sys

from tp_jax.multihost.launcher import launch


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: launch.py [options] -- program.py [args...]  (the `--` is required)", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-processes", "-n", type=int, default=2)
    ap.add_argument("--devices-per-process", type=int, default=4, help="simulated CPU devices (0: real devices)")
    ap.add_argument("--timeout", type=float, default=0, help="stop everything after this many seconds (0: never)")
    ap.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    args = ap.parse_args(argv[:split])
    try:
        return launch(argv[split + 1:], args.num_processes, args.devices_per_process, timeout_s=args.timeout,
                      grace_s=args.grace, port=args.port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
