"""MoE decode-step cost: a tiny-but-wide MoE model vs a dense model with the same active params, one JSON line.

    python scripts/bench_moe.py [--simulate-devices 8] [--experts 32] [--top-k 2] [--hidden 1024]

Both models are the shared causal-LM shell (random weights, float32, 2 layers); the dense one's
MLP is top_k x the expert width, so both have the same *active* feed-forward params per token. A
step is one token per row through every layer (the attention of a one-token forward is the same
in both models, so the difference is the feed-forward). Measured, same run, medians:
* `single`: one device, each `--batch` (1, 8: decode; 64, 256: prefill-sized steps): dense, MoE with dispatch
  "auto" (what runs by default),
  "gather", "ragged" and "dense" (tp_jax/parallel/layers/moe.py), and their ratios to dense;
* `layouts`: batch 8 on dp x tp = 8 simulated devices: the TP layout (each expert split over tp)
  vs the EP layout (whole experts on dp x tp ranks, tokens gathered over dp), per mesh.
"""

import argparse
import json
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate-devices", type=int, default=8, help="N simulated CPU devices (0: real devices)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256],
                    help="tokens of a one-token-per-row step (64, 256: prefill-sized steps)")
    return ap.parse_args()


def configs(args):
    from tp_jax.models.decoder import DecoderConfig
    from tp_jax.models.moe import MoEConfig
    common = dict(architecture="bench", vocab_size=1024, hidden_size=args.hidden, num_layers=args.layers,
                  num_heads=8, num_kv_heads=8, head_dim=args.hidden // 8, max_position_embeddings=64,
                  tie_word_embeddings=True)
    dense = DecoderConfig(intermediate_size=args.top_k * args.expert_width, **common)
    moe = MoEConfig(intermediate_size=args.expert_width, num_experts=args.experts, num_experts_per_tok=args.top_k,
                    moe_intermediate_size=args.expert_width, norm_topk_prob=True, **common)
    return dense, moe


def step_time(cfg, mesh, batch: int, iters: int) -> float:
    """Median seconds of a jitted one-token forward of `cfg`'s model at `batch` rows on `mesh`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tp_jax.models.causal_lm import CausalLM
    from tp_jax.parallel.mesh import DP, PP, TP
    from tp_jax.parallel.shard import shard_module
    with jax.set_mesh(mesh):
        model = CausalLM(cfg, tp_size=mesh.shape[TP], pp_size=mesh.shape[PP], rngs=nnx.Rngs(0))
    fn = shard_module(model, mesh, in_specs=(jax.P(DP), jax.P(DP)), out_specs=jax.P(DP),
                      method=lambda m, ids, pos: m(ids, pos)[0])
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
    pos = jnp.zeros((batch, 1), jnp.int32)
    fn(ids, pos).block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(ids, pos).block_until_ready()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main():
    args = parse_args()
    if args.simulate_devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(args.simulate_devices)
    import dataclasses
    import jax
    from tp_jax.parallel.mesh import make_mesh
    dense, moe = configs(args)
    one = make_mesh(devices=jax.devices()[:1])
    single = {}
    for batch in args.batch:
        row = {"dense_ms": step_time(dense, one, batch, args.iters) * 1e3}
        for dispatch in ("auto", "gather", "ragged", "dense"):
            row[f"moe_{dispatch}_ms"] = step_time(dataclasses.replace(moe, moe_dispatch=dispatch), one, batch,
                                                  args.iters) * 1e3
            row[f"moe_{dispatch}_over_dense"] = row[f"moe_{dispatch}_ms"] / row["dense_ms"]
        single[f"batch{batch}"] = {k: round(v, 3) for k, v in row.items()}
    layouts = {}
    n = len(jax.devices())
    for dp, tp in [(1, n), (2, n // 2), (n, 1)] if n >= 8 else [(1, n)]:
        mesh = make_mesh(dp=dp, tp=tp, devices=jax.devices()[:dp * tp])
        cfg = dataclasses.replace(moe, data_parallel_size=dp)
        row = {"tp_layout_ms": step_time(cfg, mesh, 8, args.iters) * 1e3 if args.expert_width % tp == 0 else None,
               "ep_ms": step_time(dataclasses.replace(cfg, enable_expert_parallel=True), mesh, 8, args.iters) * 1e3}
        layouts[f"dp{dp}tp{tp}"] = {k: (round(v, 3) if v is not None else None) for k, v in row.items()}
    from bench_decode import cpu_description
    print(json.dumps({"cpu": cpu_description(), "platform": jax.default_backend(), "devices": n, "experts": args.experts, "top_k": args.top_k,
                      "hidden": args.hidden, "expert_width": args.expert_width, "layers": args.layers,
                      "dense_intermediate": dense.intermediate_size, "single_device": single,
                      "batch8_layouts": layouts}))


if __name__ == "__main__":
    main()
