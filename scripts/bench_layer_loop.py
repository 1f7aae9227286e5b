"""Loop structures for a deep layer stack on XLA:CPU: compile time and run time side by side, one JSON line.

    python scripts/bench_layer_loop.py [--rows 1] [--layers 30] [--option KEY=VALUE ...]

A SmolLM2-sized float32 layer (hidden 576, intermediate 1536: a fused qkv dot, the output dot, a fused
gate/up dot and the down dot, with RMS norms and gating between them, no attention) repeated `--layers`
times, four ways, in one process so the figures compare:

* `scan`: weights stacked on a leading layer axis, one `lax.scan` (the `Stack` default). XLA:CPU copies
  each layer's slice of every weight (a dynamic-slice fusion) before its dot.
* `unrolled`: one array per layer, a Python loop (the switch loop's slots without the loop): weights read in place;
  the program holds every layer's fusions and dots.
* `switch_dot`: one array per layer, a `fori_loop` whose body holds one layer; each weight's dot is a
  `lax.switch` over the layers with one branch per layer, each branch a single dot on a whole weight
  buffer (so the dot reads it in place and the layer's other fusions exist once): `LLM(layer_loop="switch")`,
  the default on CPU.
* `switch_layer`: the same loop, the whole layer switched (each branch a full layer).

`compile_s` is `jit(...).lower(...).compile()`; `run_ms_min` / `run_ms_median` over `--repeats` calls
after a warm one; `max_abs_diff` against `scan`'s output (0.0: the same bits). `--option` passes
XLA compile options (per program, e.g. `xla_backend_optimization_level=0`). The machine is shared:
compare the variants of one line, not lines of different runs.
"""

import argparse
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

HIDDEN, INTER = 576, 1536
SHAPES = {"qkv": (HIDDEN, 960), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN)}


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)


def layer(dot, x):
    """One layer; `dot(name, a)` multiplies by this layer's weight `name`."""
    h = dot("qkv", rms(x))
    x = x + dot("o", jnp.tanh(h[:, :HIDDEN]) * h[:, HIDDEN:HIDDEN + 1])
    gu = dot("gate_up", rms(x))
    return x + dot("down", jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:])


def scan(stacked, x):
    def body(x, w):
        return layer(lambda k, a: a @ w[k], x), None
    return jax.lax.scan(body, x, stacked)[0]


def unrolled(slots, x):
    for w in slots:
        x = layer(lambda k, a, w=w: a @ w[k], x)
    return x


def switch_dot(slots, x):
    def body(i, x):
        def dot(k, a):
            return jax.lax.switch(i, [partial(lambda w, a: a @ w, w[k]) for w in slots], a)
        return layer(dot, x)
    return jax.lax.fori_loop(0, len(slots), body, x)


def switch_layer(slots, x):
    def one(w, x):
        return layer(lambda k, a: a @ w[k], x)
    return jax.lax.fori_loop(0, len(slots), lambda i, x: jax.lax.switch(i, [partial(one, w) for w in slots], x), x)


VARIANTS = {"scan": scan, "unrolled": unrolled, "switch_dot": switch_dot, "switch_layer": switch_layer}


def parse_option(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--option {text!r}: expected KEY=VALUE, e.g. xla_backend_optimization_level=0")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


def measure(fn, weights, x, options, repeats):
    t = time.perf_counter()
    compiled = jax.jit(fn, compiler_options=options or None).lower(weights, x).compile()
    compile_s = time.perf_counter() - t
    y = compiled(weights, x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        compiled(weights, x).block_until_ready()
        times.append(time.perf_counter() - t)
    return y, {"compile_s": round(compile_s, 3), "run_ms_min": round(min(times) * 1e3, 2),
               "run_ms_median": round(float(np.median(times)) * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1, help="activation rows (M of every dot)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--option", action="append", default=[], help="XLA compile option KEY=VALUE (repeatable)")
    args = ap.parse_args()
    if args.rows < 1 or args.layers < 1 or args.repeats < 1:
        raise SystemExit("--rows, --layers and --repeats must be >= 1")
    options = dict(parse_option(o) for o in args.option)
    rng = np.random.default_rng(0)
    stacked = {k: jnp.asarray(rng.standard_normal((args.layers, *s), dtype=np.float32) * 0.02)
               for k, s in SHAPES.items()}
    slots = [{k: jnp.array(v[j]) for k, v in stacked.items()} for j in range(args.layers)]
    x = jnp.asarray(rng.standard_normal((args.rows, HIDDEN), dtype=np.float32))
    out, reference = {}, None
    for name in ["scan"] + [v for v in args.variants if v != "scan"]:
        y, out[name] = measure(VARIANTS[name], stacked if name == "scan" else slots, x, options, args.repeats)
        reference = y if reference is None else reference
        out[name]["max_abs_diff"] = float(jnp.max(jnp.abs(y - reference)))
    for name in out:
        out[name]["compile_over_scan"] = round(out[name]["compile_s"] / out["scan"]["compile_s"], 2)
        out[name]["run_over_scan"] = round(out[name]["run_ms_min"] / out["scan"]["run_ms_min"], 2)
    print(json.dumps({"rows": args.rows, "layers": args.layers, "options": options, **out}))


if __name__ == "__main__":
    main()
