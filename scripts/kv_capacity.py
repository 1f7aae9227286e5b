"""How many sequences of a given length fit in one GiB of KV pool per device, for published configs.

    python scripts/kv_capacity.py [--models Mistral-7B-v0.1 gpt-oss-120b gemma-3-4b-it] [--tp 8] [--tokens 8192]
                                  [--dcp 1] [--markdown]

Per config (tests/data/configs) at `--tp`, the pool's bytes per token per device come from the abstract model's
`kv_layout()` (its KV heads as the head plan places them, bf16; fp8 as `kv_cache_dtype="fp8"` stores them). A
sequence of `--tokens` tokens holds, in each layer:

* `every_token`: every token's block, in every layer (tp_jax before sliding-window freeing);
* `now`: under a window every layer shares (Mistral-style, `KVLayout.window`), the blocks of the window plus a
  step's tokens (`kv_pool.blocks_per_sequence`, the default max_num_batched_tokens); otherwise every token;
* `kv_groups`: a sliding layer its window's blocks, a global layer every token (vLLM's hybrid KV cache manager,
  per-layer groups; not built in tp_jax: the figure is what it would give).

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
    import jax
    import jax.numpy as jnp
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.attention import FULL_WINDOW
    from tp_jax.models.config import load_config
    from tp_jax.parallel.mesh import make_mesh
    from tp_jax.serving.engine_args import EngineArgs
    from tp_jax.serving.kv_pool import PoolShape, blocks_per_sequence, check_dcp, stored_layout
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(CONFIGS, name + ".json")) as f, open(os.path.join(d, "config.json"), "w") as g:
            g.write(f.read())
        cfg = load_config(d)
    model = abstract_model(cfg, make_mesh(tp=tp, devices=jax.devices()[:tp]), jnp.bfloat16)
    defaults = EngineArgs()
    block, step = defaults.block_size, defaults.max_num_batched_tokens
    held = lambda window: min(tokens, blocks_per_sequence(tokens, block, window, step) * block)   # noqa: E731
    windows = cfg.layer_windows() or (cfg.sliding_window or FULL_WINDOW,) * cfg.num_layers
    rows = []
    for kv_dtype, dcp in ((k, d) for k in ("auto", "fp8") for d in dcps):
        layout = stored_layout(model.kv_layout(), kv_dtype)
        pool = PoolShape(layout, 1, block, (1, 1, tp), dcp=check_dcp(layout, None, dcp, tp, block))
        per_layer = pool.bytes_per_token / layout.num_layers                    # one layer's, one token, one device
        window = layout.window
        seq = {"every_token": per_layer * cfg.num_layers * tokens,
               "now": per_layer * cfg.num_layers * (tokens if window is None else held(window)),
               "kv_groups": per_layer * sum(tokens if w == FULL_WINDOW else held(w) for w in windows)}
        rows.append({"model": name, "tp": tp, "dcp": dcp, "tokens": tokens, "kv_cache_dtype": kv_dtype,
                     "bytes_per_token_per_device": pool.bytes_per_token,
                     "windows": sorted({w for w in windows if w != FULL_WINDOW}),
                     **{f"seqs_per_gib_{k}": round(2**30 / v, 2) for k, v in seq.items()}})
    return rows


def table(rows: list[dict]) -> str:
    head = ["model", "KV dtype", "dcp", "bytes / token / device", "windows", "every token", "now", "with KV groups"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kv_cache_dtype']} | {r['dcp']} | {r['bytes_per_token_per_device']:,} | "
                     f"{', '.join(map(str, r['windows'])) or '-'} | {r['seqs_per_gib_every_token']} | "
                     f"{r['seqs_per_gib_now']} | {r['seqs_per_gib_kv_groups']} |")
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
