"""The decode step's bytes per device against the memory floor, on paper (no accelerator needed).

    python scripts/roofline.py [--models Llama-3.1-8B Qwen3-30B-A3B] [--tp 1 8] [--batch 1 32 256]
                               [--context 1024 8192 32768] [--markdown]

For each published config (tests/data/configs), tp, batch and context (the tokens in each row's cache):

* the floor: the weights one device reads once per decode step (an MoE layer's routed experts only: E (1 - (1 -
  k/E)^batch) of its E experts expected to be chosen by `batch` rows of k each) plus the live KV cache read once
  (batch x context x the pool's bytes per token per device), from the abstract model the engine builds;
* the kernel, the default on a GPU or a TPU (`attention_backend="pallas"`, tp_jax/models/paged_kernel.py): the
  weights plus, per layer, the launch's declared CostEstimate for the step as the engine lays it out (each decode
  row split in 512-position chunks, each chunk's pages read once, queries and outputs): `kernel_bytes`;
* the reference attention (tp_jax/models/attention.py `paged_reference`, the CPU's default and an accelerator's
  with `attention_backend="reference"`) reads each row's blocks from the pool into a dense copy per layer
  (`gather_rows`), which the dots then read: the live KV is read, written and read again, 3 x, however well XLA
  fuses the rest (a gather into a dot operand is not fused);
* XLA's own count: the engine's decode program (ModelRunner's forward, configured by the resolve step for a GPU,
  traced as on a GPU, lowered for `cuda` over abstract weights and pool) with one layer at this context and at a
  128-token one: its cost analysis ("bytes accessed" of the module before fusion, loops unrolled) gives the bytes
  the program touches per byte of live KV (`xla_kv_per_kv_byte`). Before fusion every op counts its operands and
  result, so this is an upper bound on the reference; it is not used for the weights (there, each stacked layer's
  slice and reshape count as copies that the compiled program does not make). The same with
  `attention_backend="pallas"` (tp_jax/models/paged_kernel.py: the decode rows' pages read in place) gives
  `xla_kv_per_kv_byte_pallas`: XLA counts a custom call by its operands (the pool, here sized to the live KV) and
  the pool's reshape as a copy; the kernel's declared CostEstimate is its pages read once.

`*_tok_s`: batch / (bytes / 3.35 TB/s), an H100's HBM bandwidth. One JSON line per point; `--markdown` prints the
table docs/performance.md shows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "tests", "data", "configs")
H100_BYTES_PER_S = 3.35e12
H100_MEMORY_BYTES = 80e9
BLOCK_SIZE = 16
MIN_CONTEXT = 128          # the shortest table a step has (MIN_BLOCKS blocks): the KV-free baseline


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["Llama-3.1-8B", "Qwen3-30B-A3B"],
                    help="published configs under tests/data/configs (file names without .json)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--markdown", action="store_true", help="also print the table")
    return ap.parse_args(argv)


def lowered_step(config: dict, layers: int, tp: int, batch: int, context: int, backend: str = "auto"):
    """(the lowered decode program, its abstract model, the resolved setup, the pool's layout) for `config` cut to
    `layers` layers."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.config import load_config
    from tp_jax.models.moe import MoEConfig
    from tp_jax.parallel.layers.stack import use_layer_loop
    from tp_jax.parallel.mesh import make_mesh
    from tp_jax.serving import runner
    from tp_jax.serving.batch import MIN_BLOCKS, StepShape, bucket, packed_layout
    from tp_jax.serving.engine_args import EngineArgs
    from tp_jax.serving.kv_pool import POOL_SPEC, PoolShape
    from tp_jax.serving.llm import as_dtype
    from tp_jax.serving.resolve import CheckpointFacts, Platform, resolve
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**config, "num_hidden_layers": layers}, f)
        cfg = load_config(d)
    facts = CheckpointFacts("safetensors", cfg.architecture, frozenset({None}), stored_bf16=True,
                            experts=isinstance(cfg, MoEConfig))
    setup = resolve(EngineArgs.from_kwargs(model="roofline", tensor_parallel_size=tp, attention_backend=backend),
                    Platform("gpu", num_devices=tp), facts, cfg.max_position_embeddings)
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
    model = abstract_model(cfg, mesh, as_dtype(setup.dtype))
    use_layer_loop(model, mesh, setup.layer_loop)
    abstract = AbstractMesh((1, 1, tp), ("dp", "pp", "tp"), axis_types=(AxisType.Auto,) * 3)
    blocks = bucket(-(-context // BLOCK_SIZE), MIN_BLOCKS)
    pool_shape = PoolShape(model.kv_layout(), batch * blocks, BLOCK_SIZE, (1, 1, tp))
    pool = jax.ShapeDtypeStruct(pool_shape.shape, pool_shape.layout.dtype, sharding=NamedSharding(abstract, POOL_SPEC))
    with mock.patch.object(runner, "new_pool", lambda shape, mesh: (pool, pool)):
        r = runner.ModelRunner(model, abstract, pool_shape, setup.num_microbatches, None, setup.attention_backend)
    specs = jax.tree.leaves(nnx.get_partition_spec(nnx.state(model)), is_leaf=lambda x: isinstance(x, P))
    weights = [jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(abstract, s))
               for w, s in zip(r.weights, specs, strict=True)]
    shape = StepShape(1, batch, batch, blocks, 0, 0, 0, 0, 0)
    n = sum(math.prod(s) for _, s in packed_layout(shape))
    packed = jax.ShapeDtypeStruct((1, n), jnp.int32, sharding=NamedSharding(abstract, P("dp")))
    with unrolled_loops(), mock.patch.object(jax, "default_backend", lambda: "gpu"):
        low = r._forward.trace(weights, packed, pool, pool, shape=shape).lower(lowering_platforms=("cuda",))
    return low, model, setup, pool_shape


@contextlib.contextmanager
def unrolled_loops():
    """Every lax.scan traced fully unrolled: XLA's cost analysis counts a while loop's body once."""
    import jax
    scan = jax.lax.scan

    def unrolled(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
        return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

    with mock.patch.object(jax.lax, "scan", unrolled):
        yield


def weight_floor(model, tp: int, batch: int) -> float:
    """The weight bytes one device reads in a decode step of `batch` rows: every param's local share, a routed
    expert's only if some row chooses it (E (1 - (1 - k/E)^batch) of E expected)."""
    import math
    import jax.numpy as jnp
    from flax import nnx
    from tp_jax.models.moe import MoEConfig
    cfg = model.config
    state = nnx.state(model, nnx.Param)
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    total = 0.0
    for key, var in nnx.to_flat_state(state):
        x, spec = var.get_value(), specs[key].get_value()
        split = tp if any(a == "tp" or (isinstance(a, tuple) and "tp" in a) for a in spec) else 1
        nbytes = math.prod(x.shape) / split * jnp.dtype(x.dtype).itemsize
        if isinstance(cfg, MoEConfig) and "experts" in key:
            e, k = cfg.num_experts, cfg.num_experts_per_tok
            nbytes *= 1 - (1 - k / e) ** batch
        total += nbytes
    return total


def xla_kv_multiplier(config: dict, tp: int, batch: int, context: int, backend: str = "auto") -> float:
    """Bytes XLA's cost analysis counts per byte of live KV, from one-layer programs at `context` and MIN_CONTEXT
    (`backend`: the attention backend; "pallas": the kernel's declared CostEstimate stands for its bytes)."""
    (low, _, _, pool), (low0, _, _, _) = (lowered_step(config, 1, tp, batch, c, backend)
                                          for c in (context, MIN_CONTEXT))
    kv = batch * (context - MIN_CONTEXT) * pool.layout.bytes_per_token(1, tp)      # one layer's pool
    return (low.cost_analysis()["bytes accessed"] - low0.cost_analysis()["bytes accessed"]) / kv


def full_model(config: dict, tp: int):
    """The abstract model of the whole published config."""
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.config import load_config
    import jax.numpy as jnp
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        cfg = load_config(d)
    return abstract_model(cfg, model_mesh(tp), jnp.bfloat16)


def model_mesh(tp: int):
    import jax
    from tp_jax.parallel.mesh import make_mesh
    return make_mesh(tp=tp, devices=jax.devices()[:tp])


def kernel_bytes(model, tp: int, batch: int, context: int) -> float:
    """What the kernel declares it reads and writes in a decode step, all layers: `batch` rows of `context` keys, each
    split in chunks of SPLIT_K_BACKENDS["pallas"] positions (build_batch's layout), one launch per layer."""
    import jax.numpy as jnp
    from tp_jax.models.attention import SPLIT_K_BACKENDS
    from tp_jax.models.paged_kernel import cost
    layout, cfg = model.kv_layout(), model.config
    span = SPLIT_K_BACKENDS["pallas"]
    hkv = layout.kv_heads // tp
    g = cfg.num_heads // tp // hkv
    hv = layout.v_head_dim if layout.v_head_dim is not None else layout.head_dim
    per_layer = cost(batch * -(-context // span), 1, hkv, g, span // BLOCK_SIZE, BLOCK_SIZE, layout.head_dim, hv,
                     jnp.bfloat16, layout.dtype).bytes_accessed
    return layout.num_layers * per_layer


def point(name: str, config: dict, model, tp: int, batch: int, context: int) -> dict:
    from tp_jax.loaders.model import param_bytes_per_device
    weights = weight_floor(model, tp, batch)
    kv = batch * context * model.kv_layout().bytes_per_token(1, tp)
    floor, reference = weights + kv, weights + 3 * kv
    kernel = weights + kernel_bytes(model, tp, batch, context)
    resident = param_bytes_per_device(model, model_mesh(tp)) + kv
    return {"model": name, "tp": tp, "batch": batch, "context": context, "weights_bytes": round(weights),
            "resident_bytes": round(resident), "fits_h100": resident <= H100_MEMORY_BYTES,
            "kv_bytes": round(kv), "floor_bytes": round(floor), "reference_bytes": round(reference),
            "kernel_bytes": round(kernel), "kernel_over_floor": round(kernel / floor, 3),
            "reference_over_floor": round(reference / floor, 3),
            "xla_kv_per_kv_byte": round(xla_kv_multiplier(config, tp, batch, context, "reference"), 2),
            "xla_kv_per_kv_byte_pallas": round(xla_kv_multiplier(config, tp, batch, context, "pallas"), 2),
            "floor_tok_s": round(batch * H100_BYTES_PER_S / floor),
            "kernel_tok_s": round(batch * H100_BYTES_PER_S / kernel),
            "reference_tok_s": round(batch * H100_BYTES_PER_S / reference)}


def table(rows: list[dict]) -> str:
    head = ["model", "tp", "batch", "context", "weights read GB", "live KV GB", "fits 80 GB", "floor tok/s",
            "kernel (default) x floor", "kernel tok/s", "reference x floor", "reference tok/s",
            "XLA bytes per KV byte", "the same, pallas kernel"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tp']} | {r['batch']} | {r['context']} | {r['weights_bytes'] / 1e9:.2f} | "
                     f"{r['kv_bytes'] / 1e9:.3f} | {'yes' if r['fits_h100'] else 'no'} | {r['floor_tok_s']:,} | "
                     f"{r['kernel_over_floor']:.2f} | {r['kernel_tok_s']:,} | {r['reference_over_floor']:.2f} | "
                     f"{r['reference_tok_s']:,} | {r['xla_kv_per_kv_byte']:.1f} | "
                     f"{r['xla_kv_per_kv_byte_pallas']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={max(args.tp)}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    rows = []
    for name in args.models:
        with open(os.path.join(CONFIGS, name + ".json")) as f:
            config = json.load(f)
        for tp in args.tp:
            model = full_model(config, tp)
            for batch in args.batch:
                for context in args.context:
                    rows.append(point(name, config, model, tp, batch, context))
                    print(json.dumps(rows[-1]), flush=True)
    if args.markdown:
        print(table(rows))


if __name__ == "__main__":
    main()
