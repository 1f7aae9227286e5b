"""Where one engine step's time goes: `jax.profiler` per-thunk times of the jitted forward, one JSON line.

    python scripts/profile_step.py [--model PATH] [--quantization auto] [--batch 8] [--tokens 64]
                                   [--prompt-tokens 0] [--repeat 5] [--top 10]

The step is bench_decode.py's: the engine's decode batch of `--batch` rows at a context of the
prompt + tokens / 2, writing nothing (`--prompt-tokens N`: prompts of N tokens instead of its
short prompt, for long contexts). The forward runs `--repeat` times under the profiler; each thunk
(an HLO instruction of the compiled step) is put in a kind read from the compiled HLO: "dot" (a
dot, or a fusion holding one: the GEMMs and the attention's batched dots), "gather" (the KV pool
read), "scatter" (its write), "other" (a loop or conditional is counted through its body).
Reported per forward: the wall time, the thunks' summed time (threads run some side by side), each
kind's time and the `--top` thunks with their kind.
"""

import argparse
import collections
import glob
import json
import re
import tempfile
import time

from tp_jax.serving import engine_args

KINDS = ("dot", "gather", "scatter")
CONTROL = ("conditional", "while", "call")     # their thunks' time is their body's: not counted twice


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=10)
    engine_args.add_cli_arguments(ap)
    args = ap.parse_args(argv)
    for name in ("batch", "tokens", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.tokens < 2:
        ap.error(f"--tokens must be at least 2 (the step's context is the prompt + tokens / 2), got {args.tokens}")
    return args


def instruction_kinds(hlo: str) -> dict[str, tuple[str, str]]:
    """Each instruction name of a compiled HLO module -> (kind, what): its kind (KINDS, "control" or
    "other"; a fusion takes the first of KINDS its computation, or one it calls, holds) and, for a dot,
    the dot's result type and the op that made it (the einsum's equation or the jnp call)."""
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            current = comps.setdefault(head.group(1), [])
            continue
        m = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][a-z\-]*)\(", line)
        if m and current is not None:
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
            branches = re.findall(r"branch_computations=\{([^}]*)\}", line)
            calls += [c.strip(" %") for cs in branches for c in cs.split(",")]
            op_name = re.search(r'op_name="([^"]*)"', line)
            what = f"{m.group(2).split('{')[0]} {'/'.join(op_name.group(1).split('/')[-2:])}" if op_name else m.group(2)
            current.append((m.group(1), m.group(3), calls, what))

    def holds(comp: str, seen: set) -> dict[str, str]:
        if comp in seen or comp not in comps:
            return {}
        seen.add(comp)
        out = {}
        for _, op, calls, what in comps[comp]:
            if op in KINDS:
                out.setdefault(op, what)
            for c in calls:
                for k, w in holds(c, seen).items():
                    out.setdefault(k, w)
        return out

    kinds = {}
    for comp in comps.values():
        for name, op, calls, what in comp:
            if op in CONTROL:
                kinds[name] = ("control", "")
                continue
            found = {op: what} if op in KINDS else {}
            if op == "fusion":
                seen: set = set()
                for c in calls:
                    for k, w in holds(c, seen).items():
                        found.setdefault(k, w)
            kind = next((k for k in KINDS if k in found), "other")
            kinds[name] = (kind, found.get("dot", ""))
    return kinds


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    from jax.profiler import ProfileData
    from bench_decode import decode_step
    from tp_jax import LLM
    llm = LLM(**vars(engine_args.from_cli(args, model=args.model, progress=False)))
    ids = (list(range(100, 100 + args.prompt_tokens)) if args.prompt_tokens
           else llm.get_tokenizer().encode("Once upon a time"))
    step = decode_step(llm, ids, args.batch, args.tokens)
    runner = llm.engine.core.runner
    forward = lambda: jax.block_until_ready(runner.forward(step))
    forward()
    packed = runner.put(step.packed())
    hlo = runner._forward.lower(runner.weights, packed, runner.k, runner.v, shape=step.shape).compile().as_text()
    kinds = instruction_kinds(hlo)
    walls = []
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.repeat):
                t = time.perf_counter()
                forward()
                walls.append(time.perf_counter() - t)
        data = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    per_thunk = collections.Counter()
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for e in line.events:
                if kinds.get(e.name, ("control",))[0] != "control":
                    per_thunk[e.name] += e.duration_ns / 1e6 / args.repeat
    by_kind = collections.Counter()
    for name, ms in per_thunk.items():
        by_kind[kinds[name][0]] += ms
    total = sum(per_thunk.values())
    print(json.dumps({
        "model": llm.model_path.rsplit("/", 1)[-1], "quantization": llm.quantization,
        "attention_backend": llm.setup.attention_backend, "batch": args.batch,
        "context": len(ids) + args.tokens // 2, "shape": list(step.shape.__dict__.values()),
        "forward_ms": round(min(walls) * 1e3, 2), "thunks_ms": round(total, 2),
        "by_kind_ms": {k: round(by_kind[k], 2) for k in (*KINDS, "other")},
        "by_kind_share": {k: round(by_kind[k] / total, 3) for k in (*KINDS, "other")} if total else {},
        "top": [{"thunk": n, "kind": kinds[n][0], "ms": round(ms, 3), **({"dot": kinds[n][1]} if kinds[n][1] else {})}
                for n, ms in per_thunk.most_common(args.top)]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
