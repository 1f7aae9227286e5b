"""Latency of each all-reduce strategy over message sizes, one JSON line per point.

    python scripts/bench_collectives.py [--simulate-devices 8] [--min-kib 1] [--max-mib 64]

The last line proposes the "auto" thresholds (largest size at which one_shot, then
two_shot, was fastest); apply them with tp_jax.set_all_reduce_thresholds(...).
"""

import argparse
import json
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate-devices", type=int, default=0, help="N simulated CPU devices (0: real devices)")
    ap.add_argument("--tp", type=int, default=0, help="all-reduce group size (default: all devices)")
    ap.add_argument("--min-kib", type=int, default=1)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    return ap.parse_args()


def time_call(fn, x, iters):
    fn(x).block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main():
    args = parse_args()
    if args.simulate_devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(args.simulate_devices)
    import jax
    import jax.numpy as jnp
    from tp_jax import all_reduce, make_mesh

    tp = args.tp or jax.device_count()
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
    strategies = ("psum", "one_shot", "two_shot")
    fns = {s: jax.jit(jax.shard_map(lambda b, s=s: all_reduce(b, "tp", s), mesh=mesh, in_specs=jax.P("tp"),
                                    out_specs=jax.P("tp"), check_vma=False)) for s in strategies}
    size, best = args.min_kib * 1024, []
    while size <= args.max_mib * 1024 * 1024:
        x = jax.device_put(jnp.ones((tp, size // 4), jnp.float32), jax.NamedSharding(mesh, jax.P("tp")))
        lat = {s: time_call(fns[s], x, args.iters) for s in strategies}
        for s, t in lat.items():
            print(json.dumps({"bytes": size, "strategy": s, "tp": tp, "platform": jax.default_backend(),
                              "latency_us": round(t * 1e6, 1), "GBps_algbw": round(size / t / 1e9, 3)}))
        best.append((size, min(lat, key=lat.get)))
        size *= 4
    one = max([b for b, s in best if s == "one_shot"], default=0)
    two = max([b for b, s in best if s == "two_shot"], default=one)
    print(json.dumps({"recommended_thresholds": {"one_shot_max_bytes": one, "two_shot_max_bytes": max(one, two)},
                      "fastest": {str(b): s for b, s in best}}))


if __name__ == "__main__":
    main()
