"""The device check: what has only run on CPUs, run on one NVIDIA GPU in under 8 minutes, one JSON summary.

    python scripts/device_check.py                          # a GPU host: installs the [cuda12] extra if needed
    python scripts/device_check.py --wheels wheels          # an air-gapped GPU host (scripts/offline_wheels.py)
    python scripts/device_check.py --platform cpu --quick   # the dry run on CPU (tests/test_device_check.py)

Before anything else (fail loudly and early, exit 2, one `error:` line): with `--wheels DIR`, the wheels there
(made by scripts/offline_wheels.py: the runtime packages a host with jax, torch and transformers lacks) are
installed offline (`pip install --no-index --no-deps --target DIR/site`) and put on the path, this process's and
its children's. The jax found is used when jax, jaxlib and a CUDA plugin (cuda12 or cuda13) are one version inside
pyproject.toml's range; with `--platform cuda` and no plugin at all, the [cuda12] extra is installed from the
network (`pip install -e ".[cuda12]"`, not counted in the 8 minutes; `--no-install` or `--wheels` refuse instead).
`preflight` then checks that jax sees the platform's device (no GPU visible: exit 2) and the versions (a wrong
jaxlib: exit 2). Then the checks, each timed; a failed one is recorded and the others still run:

  golden    tiny Llama variants (one with --quick) vs transformers (torch CPU, float32): logits within 1e-4 and
            argmax equal in float32 (jax's float32 matmul precision; its default precision recorded beside it:
            TF32 on recent GPUs), and bfloat16's difference recorded
  smollm2   the embedded SmolLM2-135M GGUF vs transformers' float32 load of it: dtype float32 (blocks kept, float32
            dots) logits within 1e-3 and greedy tokens equal; the accelerator default (auto: bfloat16) perplexity
            within 3% of float32's and greedy agreement >= 0.75 (skipped by --quick)
  greedy    the engine's greedy tokens == transformers' (tiny models, a batch of prompts and one alone, float32)
            at float32 matmul precision, with the default attention (on a GPU the ragged Pallas kernel, Triton),
            with attention_backend="pallas" named (its interpreter in the CPU dry run) and with "reference"
  bench     decode tokens/s at batch 1, 8 and 32 (SmolLM2 with the default configuration; the tiny model with
            --quick), device memory after each (peak bytes where the device reports them)
  server    `tp-jax serve` as a subprocess: /health, /v1/models, a greedy completion equal to the engine's text

The summary (--out, default device_check.json) is rewritten after every check, so a crash leaves what was done:
{"ok", "platform", "quick", "seconds", "budget_s", "versions", "device", "checks": {name: {"ok", "seconds", ...}}}.
Exit codes: 0 every check passed within the budget, 1 a check failed or the run took longer than --budget-s,
2 preflight or the command line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                     # the tests' reference helpers (tests/tiny_models.py, ...)
CUDA_MAJORS = (12, 13)                       # jax's CUDA plugins: jax-cuda{N}-plugin and jax-cuda{N}-pjrt
BATCHES = (1, 8, 32)
KV_BYTES = 2**30                             # each LLM's pool: bounded, so several fit on one device
ENGINE = dict(progress=False, max_num_seqs=max(BATCHES), kv_cache_memory_bytes=KV_BYTES)


class PreflightError(Exception):
    """The machine is not what the check needs: exit 2 before any check runs."""


class CheckFailed(Exception):
    """A check's numbers are outside its bounds (the message says which); its details are kept."""

    def __init__(self, message: str, details: dict):
        super().__init__(message)
        self.details = details


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: the GPU run; cpu: the dry run of the same steps on this machine's CPU")
    ap.add_argument("--quick", action="store_true", help="tiny models only (no SmolLM2), a short benchmark")
    ap.add_argument("--out", default="device_check.json", help="the JSON summary's path")
    ap.add_argument("--no-install", action="store_true", help="never pip-install the [cuda12] extra")
    ap.add_argument("--wheels", default=None, help="an air-gapped host: install the wheels in this folder offline "
                    "first (scripts/offline_wheels.py makes them)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the time the checks must fit in (default 8 min)")
    args = ap.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        ap.error(f"--out {args.out!r}: the directory {out_dir!r} does not exist")
    if args.budget_s <= 0:
        ap.error(f"--budget-s {args.budget_s} must be > 0")
    if args.wheels is not None and not (os.path.isdir(args.wheels) and
                                        any(f.endswith(".whl") for f in os.listdir(args.wheels))):
        ap.error(f"--wheels {args.wheels!r}: no .whl files there; make them with scripts/offline_wheels.py")
    return args


# --- before jax starts: the [cuda12] extra, the platform ---------------------------------------------------

def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_packages() -> tuple[str, ...]:
    """The CUDA plugin's two packages jax would load (cuda13 first, then cuda12); () when neither is whole."""
    for major in sorted(CUDA_MAJORS, reverse=True):
        names = (f"jax-cuda{major}-plugin", f"jax-cuda{major}-pjrt")
        if all(installed(n) for n in names):
            return names
    return ()


def jax_range() -> str:
    """pyproject.toml's requirement on jax (e.g. ">=0.10.2,<0.13")."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return next(d for d in deps if d.startswith("jax")).removeprefix("jax").strip()


def install_wheels(folder: str) -> str:
    """The wheels in `folder` installed offline into folder/site, on this process's path and its children's."""
    site = os.path.join(os.path.abspath(folder), "site")
    wheels = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                        "--target", site, *wheels], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise PreflightError(f"installing the wheels of {folder} offline failed (exit {r.returncode}): "
                             f"{r.stderr.strip()[-500:]}; remake them with scripts/offline_wheels.py for this "
                             f"host's Python ({sys.version.split()[0]})")
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, ROOT, os.environ.get("PYTHONPATH")) if p)
    return site


def install_cuda_extra() -> None:
    """`pip install -e ".[cuda12]"`, then this script again (jax finds its plugins when it is first imported)."""
    print("installing the [cuda12] extra (no jax CUDA plugin installed) ...", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{ROOT}[cuda12]"], timeout=1200)
    if r.returncode != 0:
        raise PreflightError(f"pip install -e '.[cuda12]' failed (exit {r.returncode}); install jax[cuda12] "
                             f"by hand, then run with --no-install")
    os.execv(sys.executable, [sys.executable, *sys.argv, "--no-install"])


def preflight(args) -> dict:
    """jax's platform and versions, or PreflightError naming what is wrong."""
    plugin = cuda_packages() if args.platform == "cuda" else ()
    if args.platform == "cuda" and not plugin:
        raise PreflightError("wrong jaxlib: no CUDA plugin (neither jax-cuda12-plugin + jax-cuda12-pjrt nor the "
                             "cuda13 pair is installed); pip install -e '.[cuda12]' (or run without --no-install)")
    try:
        import jax
        import jaxlib
    except (ImportError, RuntimeError) as e:                  # jax refuses a jaxlib it was not released with
        raise PreflightError(f"wrong jaxlib: import jax failed ({e})") from None
    try:
        devices = jax.devices()
    except RuntimeError as e:
        raise PreflightError(f"no GPU visible: jax could not start its {args.platform} backend ({e})") from None
    want = "gpu" if args.platform == "cuda" else "cpu"
    if devices[0].platform != want:
        raise PreflightError(f"no GPU visible: jax's devices are {devices[0].platform} ({devices})")
    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": sys.version.split()[0]}
    versions.update({name: installed(name) for name in plugin})
    release = lambda v: v.split("+")[0].split(".")[:3]                               # noqa: E731
    wrong = {k: v for k, v in versions.items() if k != "python" and release(v) != release(jax.__version__)}
    if wrong:
        raise PreflightError(f"wrong jaxlib: jax {jax.__version__} with {wrong}; install matching versions "
                             f"(pip install -e '.[cuda12]')")
    from packaging.specifiers import SpecifierSet
    if jax.__version__ not in SpecifierSet(jax_range()):
        raise PreflightError(f"wrong jax: {jax.__version__} is outside tp_jax's range jax{jax_range()} "
                             f"(pyproject.toml); install a jax in it")
    d = devices[0]
    device = {"platform": d.platform, "kind": d.device_kind, "count": len(devices),
              "memory_bytes": (d.memory_stats() or {}).get("bytes_limit")}
    if args.platform == "cuda" and shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        device["nvidia_smi"] = r.stdout.strip() if r.returncode == 0 else None
    return {"versions": versions, "device": device}


# --- the checks ------------------------------------------------------------------------------------------

def llm(path, **kw):
    import jax
    from tp_jax.serving.llm import LLM
    return LLM(path, devices=jax.devices()[:1], **{**ENGINE, **kw})


def max_diff(a, b) -> float:
    import numpy as np
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def check_golden(ctx) -> dict:
    """Tiny Llamas vs transformers: float32 within 1e-4 (argmax equal) at float32 matmul precision; jax's default
    precision and bfloat16 recorded."""
    import jax
    import numpy as np
    from tests.tiny_models import hf_logits, make_checkpoint
    out, bad = {}, []
    for name in ("h9kv3",) if ctx.quick else ("gqa", "h9kv3", "tied", "bias"):      # h9kv3: padded, replicated heads
        path = make_checkpoint(name, ctx.tmp)
        ids = np.random.default_rng(0).integers(0, 1000, size=(3, 13))
        ref = hf_logits(path, ids)
        model = llm(path, dtype="float32")
        with jax.default_matmul_precision("float32"):
            f32 = model.get_logits(ids)
        default = model.get_logits(ids)
        bf16 = llm(path, dtype="bfloat16").get_logits(ids)
        out[name] = {"float32": max_diff(f32, ref), "float32_default_precision": max_diff(default, ref),
                     "bfloat16": max_diff(bf16, ref),
                     "bfloat16_argmax_agreement": float((bf16.argmax(-1) == ref.argmax(-1)).mean())}
        if not (out[name]["float32"] <= 1e-4 and (f32.argmax(-1) == ref.argmax(-1)).all()):
            bad.append(f"{name}: float32 max abs logit diff {out[name]['float32']:.2e} (limit 1e-4) or argmax differs")
        if not np.isfinite(bf16).all():
            bad.append(f"{name}: bfloat16 logits not finite")
    if bad:
        raise CheckFailed("; ".join(bad), out)
    return out


def check_smollm2(ctx) -> dict:
    """The embedded SmolLM2 GGUF: float32 vs transformers' float32 (1e-3, greedy equal); the default (bf16 on an
    accelerator): perplexity and greedy agreement against float32."""
    if ctx.quick:
        return {"skipped": "--quick"}
    import jax
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from tests.test_quantized_models import agreement, perplexity
    from tests.test_smollm2 import GREEDY_PROMPTS, TEXT
    from tp_jax.loaders.default import default_model_path
    from tp_jax.serving.sampling import SamplingParams
    from tp_jax.serving.tokenizer import load_tokenizer
    path = default_model_path()
    tok = load_tokenizer(path)
    ids = np.array([tok.encode(TEXT)[:64]])
    prompts = [tok.encode(p) for p in GREEDY_PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
        ref_tokens = [hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                  eos_token_id=None, pad_token_id=2)[0, len(p):].tolist() for p in prompts]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with jax.default_matmul_precision("float32"):
        f32 = llm(path, dtype="float32")
        f32_logits = f32.get_logits(ids)
        f32_tokens = [o.outputs[0].token_ids for o in f32.generate(prompts, greedy)]
    del f32
    auto = llm(path)
    auto_logits = auto.get_logits(ids)
    auto_tokens = [o.outputs[0].token_ids for o in auto.generate(prompts, greedy)]
    out = {"float32": {"max_abs_logit_diff": max_diff(f32_logits, ref), "greedy_equal": f32_tokens == ref_tokens},
           "default": {"config": auto.setup.as_dict(), "quantization": auto.quantization,
                       "perplexity_ratio": perplexity(auto_logits, ids) / perplexity(ref, ids),
                       "greedy_agreement": agreement(auto_tokens, ref_tokens),
                       "max_abs_logit_diff": max_diff(auto_logits, ref)}}
    bad = []
    if not (out["float32"]["max_abs_logit_diff"] <= 1e-3 and out["float32"]["greedy_equal"]):
        bad.append("float32: logits beyond 1e-3 of transformers' or greedy tokens differ")
    if not (abs(out["default"]["perplexity_ratio"] - 1) <= 0.03 and out["default"]["greedy_agreement"] >= 0.75):
        bad.append("default: perplexity beyond 3% of transformers' float32 or greedy agreement < 0.75")
    if bad:
        raise CheckFailed("; ".join(bad), out)
    return out


def check_greedy(ctx) -> dict:
    """The engine's greedy tokens (paged prefill and decode) == transformers' generate, in a batch and alone."""
    import jax
    from tests.test_engine import PROMPTS
    from tests.tiny_models import hf_greedy, make_checkpoint
    from tp_jax.serving.sampling import SamplingParams
    params = SamplingParams(max_tokens=12, temperature=0.0)
    out, bad = {}, []
    for name in ("gqa", "h9kv3"):        # gqa: head_dim 16, the kernel's; h9kv3: head_dim 8, the reference's
        path = make_checkpoint(name, ctx.tmp)
        refs = [hf_greedy(path, p, 12) for p in PROMPTS]
        with jax.default_matmul_precision("float32"):
            model = llm(path, dtype="float32")
            batch = [o.outputs[0].token_ids for o in model.generate(PROMPTS, params)]
            alone = model.generate(PROMPTS[1], params)[0].outputs[0].token_ids
            del model
            kernel, reference = ([o.outputs[0].token_ids for o in llm(path, dtype="float32", attention_backend=b)
                                  .generate(PROMPTS, params)] for b in ("pallas", "reference"))
        out[name] = {"batch_equal": batch == refs, "alone_equal": alone == refs[1], "pallas_equal": kernel == refs,
                     "reference_equal": reference == refs}
        if batch != refs or alone != refs[1]:
            bad.append(f"{name}: greedy tokens differ from transformers' ({batch} vs {refs})")
        for backend, tokens in (("pallas", kernel), ("reference", reference)):
            if tokens != refs:
                bad.append(f"{name}: attention_backend={backend!r} greedy tokens differ from transformers' ({tokens})")
    if bad:
        raise CheckFailed("; ".join(bad), out)
    return out


def device_memory() -> dict:
    """The device's bytes in use, peak and limit (None where it reports none: CPU) and this process's peak RSS."""
    import resource
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return {**{k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")},
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def check_bench(ctx) -> dict:
    """Decode tokens/s at each batch: (T(n tokens) - T(1 token)) / (n - 1) per step, best of two, as
    scripts/bench_decode.py measures it."""
    from tests.tiny_models import make_checkpoint
    from tp_jax.serving.sampling import SamplingParams
    if ctx.quick:
        path, ids, n = make_checkpoint("gqa", ctx.tmp), [5, 17, 300, 42, 9], 6
    else:
        from tp_jax.loaders.default import default_model_path
        from tp_jax.serving.tokenizer import load_tokenizer
        path = default_model_path()
        ids, n = load_tokenizer(path).encode("Once upon a time"), 64
    model = llm(path)
    run = lambda batch, k: model.generate([ids] * batch, SamplingParams(max_tokens=k, temperature=0.0,  # noqa: E731
                                                                       ignore_eos=True))
    out = {"model": os.path.basename(path), "config": model.setup.as_dict(), "quantization": model.quantization,
           "decode_tokens": n, "kv_pool_bytes": model.engine.core.pool.bytes_per_device, "batches": {}}
    for batch in BATCHES:
        run(batch, n), run(batch, 1)                               # compile
        times = {k: min(timed(lambda: run(batch, k)) for _ in range(2)) for k in (n, 1)}
        step = (times[n] - times[1]) / (n - 1)
        out["batches"][str(batch)] = {"step_ms": 1e3 * step, "tokens_per_s": batch / step if step > 0 else None,
                                      "memory": device_memory()}
    if not all(b["tokens_per_s"] for b in out["batches"].values()):
        raise CheckFailed("a decode step took no time: the measurement is broken", out)
    return out


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def check_server(ctx) -> dict:
    """`tp-jax serve` in a subprocess: healthy, lists its model, a greedy completion equal to the engine's."""
    import httpx
    from tests.server_process import ServerProcess
    from tp_jax.loaders.default import default_model_path
    from tp_jax.serving.sampling import SamplingParams
    if ctx.quick:
        from tests.tiny_models import make_tokenized_checkpoint
        path = make_tokenized_checkpoint(ctx.tmp, ctx.tokenizer_source())
    else:
        path = default_model_path()
    prompt = "Once upon a time"
    expected = llm(path).generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    gc.collect()
    args = [path, "--max-model-len", "256", "--max-num-seqs", "4", "--served-model-name", "check",
            "--kv-cache-memory-bytes", str(KV_BYTES)]
    with ServerProcess(args, ctx.tmp, name="device_check") as srv:
        t = time.perf_counter()
        srv.wait_ready(timeout_s=300)
        ready_s = time.perf_counter() - t
        models = [m["id"] for m in httpx.get(f"{srv.base}/models", timeout=60).json()["data"]]
        r = httpx.post(f"{srv.base}/completions", timeout=300,
                       json={"model": "check", "prompt": prompt, "max_tokens": 8, "temperature": 0})
        body = r.json()
    out = {"ready_s": ready_s, "models": models, "status": r.status_code,
           "text": body.get("choices", [{}])[0].get("text"), "expected": expected, "usage": body.get("usage")}
    if r.status_code != 200 or models != ["check"] or out["text"] != expected:
        raise CheckFailed(f"server: status {r.status_code}, models {models}, text {out['text']!r} (engine: "
                          f"{expected!r})", out)
    return out


CHECKS = {"golden": check_golden, "smollm2": check_smollm2, "greedy": check_greedy, "bench": check_bench,
          "server": check_server}


# --- the run ---------------------------------------------------------------------------------------------

class Context:
    def __init__(self, args, tmp: str):
        self.quick, self.tmp, self.wheels = args.quick, tmp, args.wheels

    def tokenizer_source(self) -> str:
        """SmolLM2's tokenizer: the embedded GGUF, else the copy scripts/offline_wheels.py put beside the wheels."""
        from tp_jax.loaders.default import DefaultModelMissing, default_model_path
        try:
            return default_model_path()
        except DefaultModelMissing:
            carried = None if self.wheels is None else os.path.join(self.wheels, "tokenizer")
            if carried is None or not os.path.isdir(carried):
                raise
            return carried


def write(path: str, summary: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["JAX_PLATFORMS"] = args.platform
    if args.platform == "cuda":                    # allocate as used: the server's process shares the GPU
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    summary = {"ok": False, "platform": args.platform, "quick": args.quick, "budget_s": args.budget_s, "checks": {}}
    start = time.perf_counter()
    try:
        if args.wheels is not None:
            summary["wheels"] = install_wheels(args.wheels)
        if args.platform == "cuda" and not cuda_packages() and not (args.no_install or args.wheels):
            install_cuda_extra()                   # does not return: this script runs again
        summary.update(preflight(args))
    except PreflightError as e:
        summary["checks"]["preflight"] = {"ok": False, "error": str(e), "seconds": time.perf_counter() - start}
        write(args.out, summary)
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary["checks"]["preflight"] = {"ok": True, "seconds": time.perf_counter() - start}
    print(f"device check on {summary['device']['kind']} ({args.platform}); jax {summary['versions']['jax']}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="tp_jax_device_check_") as tmp:
        ctx = Context(args, tmp)
        for name, check in CHECKS.items():
            t = time.perf_counter()
            try:
                record = {"ok": True, **check(ctx)}
            except CheckFailed as e:
                record = {"ok": False, "error": str(e), **e.details}
            except Exception as e:                 # a bug or a crash in a check: recorded, the others still run
                record = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            record["seconds"] = time.perf_counter() - t
            summary["checks"][name] = record
            gc.collect()
            status = "skipped" if "skipped" in record else "ok" if record["ok"] else "FAILED"
            print(f"  {name:8s} {status:7s} {record['seconds']:6.1f} s"
                  + ("" if record["ok"] else f"  {record['error'][:300]}"), flush=True)
            write(args.out, summary)
    summary["seconds"] = time.perf_counter() - start
    failed = [name for name, r in summary["checks"].items() if not r["ok"]]
    if summary["seconds"] > args.budget_s:
        failed.append(f"budget: {summary['seconds']:.0f} s > {args.budget_s:.0f} s")
    summary["failed"], summary["ok"] = failed, not failed
    write(args.out, summary)
    print(f"{'ok' if not failed else 'FAILED: ' + ', '.join(failed)}; {summary['seconds']:.0f} s; summary in "
          f"{args.out}", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
