"""How many sequences of a given length fit in one GiB of KV pool per device, for published configs.

    python scripts/kv_capacity.py [--models Mistral-7B-v0.1 gpt-oss-120b gemma-3-4b-it] [--tp 8] [--tokens 8192]
                                  [--dcp 1] [--markdown]

Per config (tests/data/configs) at `--tp`, the pool's bytes come from the abstract model's `kv_layout()` (its KV
heads as the head plan places them, bf16; fp8 as `kv_cache_dtype="fp8"` stores them). A sequence of `--tokens`
tokens holds:

* `every_token`: every token's block, in every layer (tp_jax before sliding-window freeing and KV cache groups);
* `now`: what the engine's pool plan (`kv_pool.plan_pool`, the default block size and max_num_batched_tokens,
  kv_cache_groups on) holds for it: under a window every layer shares, the window's blocks plus a step's; with KV
  cache groups (a model mixing sliding and full layers) every full group's blocks and each sliding group's
  window, a block holding one group's S layer slots (`PoolShape.sequence_bytes`, padding included);
* `per_layer`: on paper, a sliding layer its window's blocks and a global layer every token (no group padding).

`--dcp d ...`: each figure also under decode_context_parallel_size d (a latent-attention model only: its cache's
tokens interleaved over d tp ranks, the pool's `PoolShape.bytes_per_token`; a model it does not apply to is refused
with the pool's message). Sequences per GiB = 2^30 / (the sum over layers of bytes per token x tokens held). One
JSON line per config, KV dtype and dcp.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "tests", "data", "configs")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["Mistral-7B-v0.1", "gpt-oss-120b", "gemma-3-4b-it"])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dcp", type=int, nargs="+", default=[1], help="decode_context_parallel_size values")
    ap.add_argument("--markdown", action="store_true")
    return ap.parse_args(argv)


def capacity(name: str, tp: int, tokens: int, dcps=(1,)) -> list[dict]:
    import types

    import jax
    import jax.numpy as jnp
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.attention import FULL_WINDOW
    from tp_jax.models.config import load_config
    from tp_jax.parallel.mesh import make_mesh
    from tp_jax.serving.engine_args import EngineArgs
    from tp_jax.serving.kv_pool import blocks_per_sequence, plan_pool, stored_layout
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(CONFIGS, name + ".json")) as f, open(os.path.join(d, "config.json"), "w") as g:
            g.write(f.read())
        cfg = load_config(d)
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
    model = abstract_model(cfg, mesh, jnp.bfloat16)
    defaults = EngineArgs()
    block, step = defaults.block_size, defaults.max_num_batched_tokens
    held = lambda window: min(tokens, blocks_per_sequence(tokens, block, window, step) * block)   # noqa: E731
    windows = cfg.layer_windows() or (cfg.sliding_window or FULL_WINDOW,) * cfg.num_layers
    rows = []
    for kv_dtype, dcp in ((k, d) for k in ("auto", "fp8") for d in dcps):
        setup = types.SimpleNamespace(kv_cache_dtype=kv_dtype, block_size=block, max_model_len=tokens,
                                      max_num_seqs=1, max_num_batched_tokens=step, kv_cache_memory_bytes=None,
                                      gpu_memory_utilization=defaults.gpu_memory_utilization, kv_cache_groups="on",
                                      decode_context_parallel_size=dcp)
        pool = plan_pool(model.kv_layout(), mesh, setup, num_gpu_blocks=2**20)    # the engine's accounting
        layout = stored_layout(model.kv_layout(), kv_dtype)
        per_token = layout.bytes_per_token(1, tp) // pool.dcp                 # every layer's, on one device
        per_layer = per_token / layout.num_layers                              # one layer's, one token, one device
        seq = {"every_token": per_layer * cfg.num_layers * tokens, "now": pool.sequence_bytes(tokens),
               "per_layer": per_layer * sum(tokens if w == FULL_WINDOW else held(w) for w in windows)}
        groups = pool.layout.groups
        rows.append({"model": name, "tp": tp, "dcp": dcp, "tokens": tokens, "kv_cache_dtype": kv_dtype,
                     "bytes_per_token_per_device": per_token,
                     "windows": sorted({w for w in windows if w != FULL_WINDOW}),
                     "kv_groups": None if groups is None else f"{groups.count} x {groups.slots}",
                     **{f"seqs_per_gib_{k}": round(2**30 / v, 2) for k, v in seq.items()}})
    return rows


def table(rows: list[dict]) -> str:
    head = ["model", "KV dtype", "dcp", "bytes / token / device", "windows", "KV cache groups (groups x layer slots)",
            "every token", "now", "per layer, on paper"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kv_cache_dtype']} | {r['dcp']} | {r['bytes_per_token_per_device']:,} | "
                     f"{', '.join(map(str, r['windows'])) or '-'} | {r['kv_groups'] or '-'} | "
                     f"{r['seqs_per_gib_every_token']} | {r['seqs_per_gib_now']} | {r['seqs_per_gib_per_layer']} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.tp}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    rows = [r for name in args.models for r in capacity(name, args.tp, args.tokens, args.dcp)]
    for r in rows:
        print(json.dumps(r))
    if args.markdown:
        print(table(rows))


if __name__ == "__main__":
    main()
