"""Demo: a column -> row parallel MLP on 8 simulated CPU devices vs numpy.

    python scripts/demo.py [--devices 8] [--tp 8]
"""

import argparse
import json

from tp_jax.multihost.devices import simulate_cpu_devices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    args = ap.parse_args()
    simulate_cpu_devices(args.devices)

    import jax
    import numpy as np
    from flax import nnx
    from tp_jax import ColumnParallelLinear, RowParallelLinear, make_mesh, shard_module

    mesh = make_mesh(tp=args.tp, devices=jax.devices()[:args.tp])
    d, f = 256, 1024
    rng = np.random.default_rng(0)
    w_up, w_down = rng.standard_normal((f, d), np.float32) / 16, rng.standard_normal((d, f), np.float32) / 32
    x = rng.standard_normal((4, d), np.float32)

    class MLP(nnx.Module):
        def __init__(self):
            self.up = ColumnParallelLinear(d, f, tp_size=args.tp, bias=False, rngs=nnx.Rngs(0))
            self.down = RowParallelLinear(f, d, tp_size=args.tp, bias=False, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))          # one all-reduce, inside down

    with jax.set_mesh(mesh):
        mlp = MLP()
    mlp.up.set_params(mlp.up.load_global({"kernel": {"weight": w_up}}))
    mlp.down.set_params(mlp.down.load_global({"kernel": {"weight": w_down}}))
    y = np.asarray(shard_module(mlp, mesh, in_specs=(jax.P(),), out_specs=jax.P())(x))
    h = x @ w_up.T
    ref = (0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))) @ w_down.T
    print(json.dumps({"devices": len(jax.devices()), "tp": args.tp, "shape": list(y.shape),
                      "max_abs_error_vs_numpy": float(np.abs(y - ref).max())}))


if __name__ == "__main__":
    main()
