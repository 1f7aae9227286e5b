"""Decode throughput with structured outputs: 32 concurrent requests all constrained vs none, same run, one JSON line.

    python scripts/bench_structured.py [--model PATH] [--requests 32] [--tokens 64] [--tp 1 ...] [--simulate-devices N]

Each constrained request has its own JSON schema (an array of objects with enum, bounded integer,
string and nested-array fields; `minItems` large, so no grammar completes inside `--tokens` and
every step is masked); `ignore_eos` and the same `max_tokens` for both sides, so both decode the
same number of tokens. Decode time: `--tokens` engine steps with all requests decoding, timed after
their prefill (matcher creation and compiles are outside), best of `--repeats`, the two sides
alternating which goes first. `grammar_ms_per_step` is the
engine's host time in the matchers (bitmask fills and token advances) per constrained step
(core.stats["grammar_seconds"]); on one process the fills overlap the device's forward.
"""

import argparse
import json
import os
import time

from tp_jax.serving import engine_args


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per side")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--simulate-devices", type=int, default=0)
    ap.add_argument("--prompt", default="Write the inventory as JSON:")
    engine_args.add_cli_arguments(ap)
    return ap.parse_args()


def schema(i: int) -> dict:
    item = {"type": "object", "properties": {
        f"sku{i}": {"type": "integer", "minimum": 0, "maximum": 10 ** (3 + i % 4)},
        "name": {"type": "string", "maxLength": 12 + i % 5},
        "kind": {"enum": ["tool", "part", f"kit{i}", None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": [f"sku{i}", "name", "kind", "tags"], "additionalProperties": False}
    return {"type": "array", "items": item, "minItems": 1000}


def decode_seconds(llm, ids, params: list, n: int, tag: str) -> float:
    """Seconds of `n` decode steps of all requests at once (after their prefill and first token)."""
    engine = llm.engine
    for i, p in enumerate(params):
        engine.add_request(f"{tag}-{i}", ids, p)
    outs = {}
    while len(outs) < len(params):                          # prefill: every request has its first token
        outs.update((o.request_id, o) for o in engine.step())
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    took = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return took


def main():
    args = parse_args()
    if args.simulate_devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(args.simulate_devices)
    import jax
    from tp_jax import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM(**vars(engine_args.from_cli(args, model=args.model, progress=False)))
    ids = llm.get_tokenizer().encode(args.prompt)
    n, core = args.tokens, llm.engine.core
    k = n + 2                                                # max_tokens: no request ends inside the timed steps
    sides = {
        "unconstrained": lambda: [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)] * args.requests,
        "constrained": lambda: [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True,
                                               structured_outputs=StructuredOutputsParams(json=schema(i)))
                                for i in range(args.requests)]}
    for side in sides:                                      # compile every shape and grammar once
        decode_seconds(llm, ids, sides[side](), 2, f"warm-{side}")
    best = {side: float("inf") for side in sides}
    grammar = {"seconds": 0.0, "steps": 0}
    for r in range(args.repeats):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):     # alternate the order
            g0, s0 = core.stats["grammar_seconds"], core.stats["steps"]
            best[side] = min(best[side], decode_seconds(llm, ids, sides[side](), n, f"{side}-{r}"))
            if side == "constrained":
                grammar["seconds"] += core.stats["grammar_seconds"] - g0
                grammar["steps"] += core.stats["steps"] - s0
    tps = {side: args.requests * n / t for side, t in best.items()}
    outs = llm.generate([ids] * args.requests, sides["constrained"]())
    valid_prefix = all(o.outputs[0].text.startswith("[{") for o in outs)
    print(json.dumps({
        "model": os.path.basename(llm.model_path), "platform": jax.default_backend(), "devices": jax.device_count(),
        "tp": args.tensor_parallel_size, "dp": args.data_parallel_size, "pp": args.pipeline_parallel_size, "requests": args.requests, "decode_steps": n,
        "unconstrained_tokens_per_s": round(tps["unconstrained"], 2),
        "constrained_tokens_per_s": round(tps["constrained"], 2),
        "constrained_over_unconstrained": round(tps["constrained"] / tps["unconstrained"], 3),
        "grammar_ms_per_step": round(1e3 * grammar["seconds"] / max(grammar["steps"], 1), 3),
        "outputs_start_as_the_schema_says": valid_prefix}))


if __name__ == "__main__":
    main()
