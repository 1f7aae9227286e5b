"""Multi-LoRA decode steps against the base model's, same run, one JSON line.

    python scripts/bench_lora.py [--model PATH] [--rank 16] [--tokens 32] [--rounds 3]
                                 [--methods masked gather ragged]

The model (default: the embedded SmolLM2 GGUF, loaded as a user gets it) and 8 PEFT adapters of rank
`--rank` on every linear layer (written by peft on the model's float32 copy, random A and B). Engines:
`base` (LLM without LoRA) and, per `--methods`, `LLM(enable_lora=True, max_loras=8,
max_lora_rank=rank)` with the LoRA contribution computed as
* `gather` (tp_jax's, tp_jax/parallel/layers/lora.py): each token's A and B gathered, two batched dots;
* `cond`: per slot, its two dots on the step's rows under a `lax.cond` (skipped when no token uses it),
  masked to its tokens;
* `ragged`: tokens sorted by slot, `jax.lax.ragged_dot` for the shrink and the expand.
Each runs greedy requests (`ignore_eos`) at batch 1 and 8 with no adapter (`none`), one adapter for
every row (`one`) and, at batch 8, a different adapter per row (`eight`). A decode step's time is
(T(N tokens) - T(1 token)) / (N - 1), the best of `--rounds` rounds (this machine is shared); every
figure is also given over the base engine's step at that batch (`over_base`).
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "My favourite food is",
           "In the beginning", "The quick brown fox", "Dear Sir or Madam,", "Three things to do in Rome:"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["gather", "cond", "ragged"],
                    choices=["gather", "cond", "ragged"])
    return ap.parse_args()


def all_slots(delta):
    """A `lora.add` computing the layer's contribution with `delta(rows, slots, A[S, in, P * R], B[S, R, out],
    parts)` (the alternatives to tp_jax's gather)."""

    def add(x, y, lora):
        rows, flat = x.reshape(-1, x.shape[-1]), lora.slots.reshape(-1)
        a, b = lora.a[lora.index], lora.b[lora.index]
        return y + delta(rows, flat, a, b, lora.parts).reshape(y.shape).astype(y.dtype)
    return add


def _by_part(u, b, parts, dot):
    import numpy as np
    import jax.numpy as jnp
    r, cols = b.shape[-2], np.cumsum((0,) + tuple(parts))
    outs = [dot(u[:, p * r:(p + 1) * r], b[..., cols[p]:cols[p + 1]]) for p in range(len(parts))]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)


def delta_cond(rows, flat, a, b, parts):
    """Per slot, under a `lax.cond` (skipped when no token uses it), its two dots on every row, masked."""
    import jax
    import jax.numpy as jnp
    out = jnp.zeros((rows.shape[0], b.shape[-1]), jnp.float32)
    for s in range(a.shape[0]):
        def one(out, s=s):
            u = jnp.where((flat == s)[:, None], rows.astype(jnp.float32) @ a[s].astype(jnp.float32), 0.0)
            return out + _by_part(u, b[s].astype(jnp.float32), parts, jnp.dot)
        out = jax.lax.cond(jnp.any(flat == s), one, lambda out: out, out)
    return out


def delta_ragged(rows, flat, a, b, parts):
    """Tokens sorted by slot (no adapter: an extra zero group), `jax.lax.ragged_dot` twice, unsorted."""
    import jax
    import jax.numpy as jnp
    s = a.shape[0]
    flat = jnp.where(flat < 0, s, flat)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=s + 1).astype(jnp.int32)
    pad = lambda w: jnp.concatenate([w.astype(jnp.float32), jnp.zeros((1, *w.shape[1:]), jnp.float32)])
    u = jax.lax.ragged_dot(rows.astype(jnp.float32)[order], pad(a), sizes)
    out = _by_part(u, pad(b), parts, lambda x, w: jax.lax.ragged_dot(x, w, sizes))
    return jnp.zeros_like(out).at[order].set(out)


def write_adapters(float_dir: str, root: str, rank: int, n: int = 8) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.02 * torch.randn_like(p))
        paths.append(os.path.join(root, f"adapter{i}"))
        model.save_pretrained(paths[-1])
    return paths


def step_ms(llm, prompts, adapters, tokens: int) -> float:
    from tp_jax import SamplingParams
    times = {}
    for n in (1, tokens):
        p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, p, lora_request=adapters)
        times[n] = time.perf_counter() - t
    return 1e3 * (times[tokens] - times[1]) / (tokens - 1)


def main():
    args = parse_args()
    from tp_jax import LLM, LoRARequest, SamplingParams
    from tp_jax.loaders.convert import convert_gguf
    from tp_jax.loaders.default import default_model_path
    from tp_jax.parallel.layers import lora as lora_layers
    model = args.model or default_model_path()
    tmp = tempfile.mkdtemp(prefix="bench_lora_")
    float_dir = model
    if model.endswith(".gguf"):
        float_dir = os.path.join(tmp, "float32")
        convert_gguf(model, float_dir, "float32")
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(write_adapters(float_dir, tmp, args.rank))]
    cases = {1: {"none": [None], "one": [requests[0]]},
             8: {"none": [None] * 8, "one": [requests[0]] * 8, "eight": requests}}
    engines = {"base": LLM(model, progress=False)}
    ours = lora_layers.add
    for method in args.methods:
        lora_layers.add = {"gather": ours, "cond": all_slots(delta_cond), "ragged": all_slots(delta_ragged)}[method]
        engines[method] = LLM(model, enable_lora=True, max_loras=8, max_lora_rank=args.rank, progress=False)
        for batch, by_case in cases.items():                  # compiled now, under this method's `add`
            for adapters in by_case.values():
                for tokens in (1, args.tokens):
                    engines[method].generate(PROMPTS[:batch], SamplingParams(max_tokens=tokens, ignore_eos=True),
                                             lora_request=adapters)
    lora_layers.add = ours
    for batch in cases:
        for tokens in (1, args.tokens):
            engines["base"].generate(PROMPTS[:batch], SamplingParams(max_tokens=tokens, ignore_eos=True))
    best: dict[tuple, float] = {}
    for _ in range(args.rounds):
        for batch, by_case in cases.items():
            key = ("base", batch, "none")
            best[key] = min(best.get(key, 1e9), step_ms(engines["base"], PROMPTS[:batch], None, args.tokens))
            for method in args.methods:
                for case, adapters in by_case.items():
                    key = (method, batch, case)
                    best[key] = min(best.get(key, 1e9), step_ms(engines[method], PROMPTS[:batch], adapters,
                                                                args.tokens))
    results = {}
    for (method, batch, case), ms in sorted(best.items()):
        base = best[("base", batch, "none")]
        results.setdefault(method, {})[f"batch{batch}_{case}"] = {"step_ms": round(ms, 3),
                                                                  "over_base": round(ms / base, 3)}
    from scripts.bench_decode import cpu_description
    print(json.dumps({"bench": "lora", "model": os.path.basename(model), "quantization": engines["base"].quantization,
                      "rank": args.rank, "max_loras": 8, "tokens": args.tokens, "rounds": args.rounds,
                      "cpu": cpu_description(), "results": results}))


if __name__ == "__main__":
    main()
