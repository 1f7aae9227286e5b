"""Bring your own Flax NNX model: a tiny residual-MLP language model made tensor-parallel with tp_jax.

    h = embed(ids)                                  VocabParallelEmbedding   E[V_pad_tp, D]  (all-reduce)
    2 x  h = h + down(silu(up(norm(h))))            RMSNorm (replicated) -> ColumnParallelLinear W[D, F_tp]
                                                    -> RowParallelLinear W[F_tp, D]           (all-reduce)
    logits = head(h)                                ParallelLMHead W[V_pad_tp, D]            (all-gather)

What the script does:
1. writes random weights to its own safetensors file, under its own tensor names, each
   in the layout its layer declares (Linear weights [out, in], like torch);
2. for tp = 1, 2, 4, 8: builds the model abstractly on a (1, 1, tp) mesh and loads each
   device's block through a user-written name table (`Entry` list) and tp_jax's per-device
   loader (`load_state` + `fill`), reading only that device's slice from the file;
3. runs the forward (local shapes) under `shard_map` with `shard_module` and checks every
   tp against a numpy reference of the same math.

Run:  python examples/custom_mlp_model.py     (8 simulated CPU devices; no GPU needed)
"""

from __future__ import annotations

import os
import sys
import tempfile

from tp_jax import simulate_cpu_devices

simulate_cpu_devices(8)          # before jax starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from tp_jax import (ColumnParallelLinear, Entry, ParallelLMHead, RMSNorm, RowParallelLinear,  # noqa: E402
                    VocabParallelEmbedding, fill, load_state, make_mesh, shard_module)

VOCAB, D, F, EPS = 500, 64, 256, 1e-6     # VOCAB is padded per tp (to a multiple of lcm(64, tp))
BLOCKS = ("block0", "block1")


# --- the model: local-shape forward, global params with specs ------------------------------

class Block(nnx.Module):
    def __init__(self, tp: int, rngs: nnx.Rngs):
        self.norm = RMSNorm(D, eps=EPS, tp_size=tp, rngs=rngs)
        self.up = ColumnParallelLinear(D, F, tp_size=tp, bias=True, rngs=rngs)      # -> [B, T, F/tp]
        self.down = RowParallelLinear(F, D, tp_size=tp, bias=True, rngs=rngs)      # -> [B, T, D], one psum

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jax.nn.silu(self.up(self.norm(h))))


class MLPLanguageModel(nnx.Module):
    """ids[B, T] -> logits[B, T, VOCAB]."""

    def __init__(self, tp: int, rngs: nnx.Rngs):
        self.embed = VocabParallelEmbedding(VOCAB, D, tp_size=tp, rngs=rngs)
        self.block0, self.block1 = Block(tp, rngs), Block(tp, rngs)
        self.head = ParallelLMHead(VOCAB, D, tp_size=tp, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.embed(ids)
        for name in BLOCKS:
            h = getattr(self, name)(h)
        return self.head(h)


# --- the checkpoint: our own tensor names, and the table mapping them to params ------------

def name_table() -> list[Entry]:
    """File tensor -> (param path, the part of the param it fills). Unfused layers have one part,
    named as in the layer's `loading()` declaration: "weight" (and "bias")."""
    table = [Entry("tok_embeddings", "embed.embedding", "weight"), Entry("output", "head.embedding", "weight")]
    for i, block in enumerate(BLOCKS):
        table += [Entry(f"blocks.{i}.norm", f"{block}.norm.weight", "weight")]
        for layer in ("up", "down"):
            table += [Entry(f"blocks.{i}.{layer}.w", f"{block}.{layer}.kernel", "weight"),
                      Entry(f"blocks.{i}.{layer}.b", f"{block}.{layer}.bias", "bias")]
    return table


def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"tok_embeddings": rng.normal(0, 1, (VOCAB, D)), "output": rng.normal(0, D ** -0.5, (VOCAB, D))}
    for i in range(len(BLOCKS)):
        w[f"blocks.{i}.norm"] = 1 + 0.1 * rng.normal(size=D)
        w[f"blocks.{i}.up.w"] = rng.normal(0, D ** -0.5, (F, D))            # [out, in]
        w[f"blocks.{i}.up.b"] = 0.1 * rng.normal(size=F)
        w[f"blocks.{i}.down.w"] = rng.normal(0, F ** -0.5, (D, F))
        w[f"blocks.{i}.down.b"] = 0.1 * rng.normal(size=D)
    return {k: v.astype(np.float32) for k, v in w.items()}


class SafetensorsFile:
    """A weight source over one file: keys(), `in`, get(name) -> lazy tensor (.shape, [slices])."""

    class Tensor:
        def __init__(self, path: str, name: str, shape: tuple[int, ...]):
            self.path, self.name, self.shape = path, name, shape

        def __getitem__(self, index) -> np.ndarray:          # reads only this slice from disk
            with safe_open(self.path, framework="numpy") as f:
                return f.get_slice(self.name)[index]

    def __init__(self, path: str):
        with safe_open(path, framework="numpy") as f:
            self.tensors = {n: self.Tensor(path, n, tuple(f.get_slice(n).get_shape())) for n in f.keys()}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> Tensor:
        return self.tensors[name]


def load(path: str, tp: int) -> tuple[MLPLanguageModel, jax.sharding.Mesh]:
    """The model on a (1, 1, tp) mesh, each device's param blocks read from `path`."""
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: MLPLanguageModel(tp, nnx.Rngs(0)))     # shapes and specs, no memory
    # num_layers=0: no stacked ("{i}") params in this model
    fill(model, load_state(model, mesh, SafetensorsFile(path), name_table(), 0, jnp.float32, progress=False))
    return model, mesh


# --- the reference: the same math in numpy, from the file's tensors ------------------------

def reference(w: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    h = w["tok_embeddings"][ids].astype(np.float64)
    for i in range(len(BLOCKS)):
        x = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * w[f"blocks.{i}.norm"]
        u = x @ w[f"blocks.{i}.up.w"].T + w[f"blocks.{i}.up.b"]
        h = h + (u / (1 + np.exp(-u))) @ w[f"blocks.{i}.down.w"].T + w[f"blocks.{i}.down.b"]
    return h @ w["output"].T


def main(tps=(1, 2, 4, 8)) -> dict[int, float]:
    weights = random_weights()
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 7)).astype(np.int32)
    ref = reference(weights, ids)
    results, first = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mlp_lm.safetensors")
        save_file(weights, path)
        for tp in tps:
            model, mesh = load(path, tp)
            forward = shard_module(model, mesh, in_specs=(jax.P(),), out_specs=jax.P())
            logits = np.asarray(forward(ids))                                # [B, T, VOCAB]
            first = logits if first is None else first
            results[tp] = float(np.abs(logits - ref).max())
            block = model.block0.up.kernel[...].addressable_shards[0].data.shape     # one device's W[D, F/tp]
            print(f"tp={tp}: up kernel per device {block}, logits {logits.shape}, max |diff| vs numpy "
                  f"{results[tp]:.2e}, vs tp={tps[0]} {np.abs(logits - first).max():.2e}")
            assert results[tp] < 1e-4 and np.abs(logits - first).max() < 1e-4, f"tp={tp} disagrees"
    print("all tp sizes agree")
    return results


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (1, 2, 4, 8))
