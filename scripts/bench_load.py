"""Time to a ready model and peak RSS, SmolLM2 loaded from GGUF, safetensors and Orbax; one JSON line each.

    python scripts/bench_load.py [--tp 8] [--simulate-devices 8] [--model X.gguf] [--work-dir DIR] [--repeat 2]
                                 [--quantization none gguf int8]

The safetensors copy (tp_jax/loaders/convert.py `convert_gguf`, float32) and the Orbax copy
(tp_jax/loaders/orbax.py `convert_to_orbax`) are written first, each conversion in its own
process (reported as "step": "convert"). Then every load runs in a fresh process, so
peak RSS is that source's alone: `load_s` is `LLM(path, tensor_parallel_size=tp)` until
every param is on its device (for GGUF this includes dequantizing on the fly); `cpu_s`
is the CPU time of that step (all threads), steadier than wall time on a shared machine;
`warm_load_s` is a second load in the same process, without jax's one-time costs (tracing
the model's shapes), so closer to the source's own cost. Peak RSS is taken before it.
`baseline_rss_mib` is RSS after imports and jax start, transformers' config module (and torch,
which it imports when installed) included: `imports_mib` is what those two added, a fixed cost
of the libraries whatever the checkpoint's size. `placed_mib` is the bytes of the placed params
(on CPU the simulated devices live in host memory, so these are in RSS too).

Quantized rows (`--quantization`, default `none gguf int8`): "none" loads every source in
float32 (the GGUF dequantized per device slice); "gguf" keeps the GGUF file's Q4_1 / Q8_0
blocks (what `LLM(path)` does by default for a quantized .gguf); "int8" quantizes each
device's slice at load, from the float32 safetensors and from the GGUF. `transient_mib` =
peak - baseline - placed: what loading held beyond the params themselves.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def rss_mib(key: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status (Linux only)")


def cpu_s() -> float:
    """User + system CPU seconds of this process, all threads (less sensitive to a busy machine)."""
    t = os.times()
    return t.user + t.system


def child_load(path: str, quantization: str, tp: int, devices: int) -> dict:
    if devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(devices)
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tp_jax.serving.llm import LLM
    jax.block_until_ready(jnp.ones(8))
    before_imports = rss_mib("VmRSS")
    import transformers.configuration_utils  # noqa: F401  (what LLM() imports for a config: torch too, if installed)
    imports = rss_mib("VmRSS") - before_imports

    def load():
        t, cpu = time.perf_counter(), cpu_s()
        llm = LLM(path, tensor_parallel_size=tp, progress=False, quantization=quantization)
        leaves = jax.tree.leaves(nnx.state(llm.model, nnx.Param))
        jax.block_until_ready(leaves)
        return time.perf_counter() - t, cpu_s() - cpu, leaves, llm.quantization

    base = rss_mib("VmRSS")
    load_s, cpu, leaves, weights = load()
    peak = rss_mib("VmHWM")
    placed = sum(s.data.nbytes for x in leaves for s in x.addressable_shards) / 2**20
    del leaves
    warm_s, _, _, _ = load()
    return {"weights": weights, "load_s": round(load_s, 2), "cpu_s": round(cpu, 2), "warm_load_s": round(warm_s, 2),
            "peak_rss_mib": round(peak), "baseline_rss_mib": round(base), "imports_mib": round(imports),
            "placed_mib": round(placed), "transient_mib": round(peak - base - placed)}


def child_convert(kind: str, src: str, out: str) -> dict:
    t, cpu = time.perf_counter(), cpu_s()
    if kind == "orbax":
        from tp_jax.loaders.orbax import convert_to_orbax
        convert_to_orbax(src, out, overwrite=True)
    else:
        from tp_jax.loaders.convert import convert_gguf
        convert_gguf(src, out, "float32")
    return {"seconds": round(time.perf_counter() - t, 2), "cpu_s": round(cpu_s() - cpu, 2),
            "peak_rss_mib": round(rss_mib("VmHWM"))}


def run_child(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def du_mib(path: str) -> int:
    if os.path.isfile(path):
        return round(os.path.getsize(path) / 2**20)
    return round(sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs) / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a llama .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--simulate-devices", type=int, default=8, help="0: use the real devices")
    ap.add_argument("--work-dir", default=None, help="where the converted copies go (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=1, help="loads per source (one process each)")
    ap.add_argument("--quantization", nargs="+", default=["none", "gguf", "int8"], choices=["none", "gguf", "int8"],
                    help="rows to measure: float32, the GGUF's blocks kept, int8 at load")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        res = child_load(*rest, args.tp, args.simulate_devices) if kind == "load" else child_convert(kind, *rest)
        print(json.dumps(res))
        return
    from tp_jax.loaders.default import default_model_path
    gguf = args.model or default_model_path()
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_load_")
    paths = {"gguf": gguf, "safetensors": os.path.join(work, "safetensors"), "orbax": os.path.join(work, "orbax")}
    for kind in ("safetensors", "orbax"):
        res = run_child(["--child", kind, gguf, paths[kind]])
        print(json.dumps({"step": "convert", "to": kind, **res, "disk_mib": du_mib(paths[kind])}), flush=True)
    rows = [(kind, q) for q in args.quantization for kind in paths
            if q == "none" or (q == "gguf" and kind == "gguf") or (q == "int8" and kind != "orbax")]
    for _ in range(args.repeat):
        for kind, q in rows:
            res = run_child(["--child", "load", paths[kind], q, "--tp", str(args.tp),
                             "--simulate-devices", str(args.simulate_devices)])
            print(json.dumps({"step": "load", "source": kind, "quantization": q, "tp": args.tp, **res}), flush=True)


if __name__ == "__main__":
    main()
