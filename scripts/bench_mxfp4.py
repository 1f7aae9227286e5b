"""The tiny gpt-oss with MXFP4 experts (tests/test_mxfp4.py's): decode tokens/s, bytes per device against the stored
expert bytes, logits against transformers; one JSON line per mesh.

    python scripts/bench_mxfp4.py --write DIR                 # write the checkpoint and transformers' reference
    python scripts/bench_mxfp4.py --model DIR [--meshes 1x1 1x2 2x2ep] [--tokens 48] [--quantization auto]

Decode time is T(N tokens) - T(1 token) through `LLM.generate` (greedy, batch 1 and 8), median of `--rounds`.
`ratio` is the params per device over (the device's share of the stored blocks and scales + the float params beside
the experts). `--model` reads only the checkpoint and `LLM`, so the same command measures another tree
(`PYTHONPATH=OTHER_TREE python scripts/bench_mxfp4.py --model DIR`): run the trees in turn, in one session.
"""

import argparse
import json
import os
import pickle
import statistics
import time

PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15], [5, 17, 200, 42, 9], [299, 3, 77, 150], [3, 4, 5, 6]] * 2


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", default=None, help="write the checkpoint here (and its reference, ref.pkl)")
    ap.add_argument("--model", default=None, help="a checkpoint written by --write")
    ap.add_argument("--meshes", nargs="+", default=["1x1"], help="DPxTP, 'ep' for expert parallelism: 1x1 1x2 2x2ep")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--simulate-devices", type=int, default=8, help="N simulated CPU devices for a mesh of several")
    return ap.parse_args()


def stored_expert_bytes(path: str) -> int:
    import numpy as np
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        return sum(int(np.prod(f.get_slice(n).get_shape())) for n in f.keys() if n.endswith(("_blocks", "_scales")))


def measure(path: str, dp: int, tp: int, ep: bool, args) -> dict:
    import numpy as np
    import tp_jax
    from tp_jax.loaders.model import param_bytes_per_device
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    with open(os.path.join(path, "ref.pkl"), "rb") as f:
        ids, logits, _ = pickle.load(f)
    llm = LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep, progress=False,
              compile_cache=False, quantization=args.quantization)
    experts = llm.model.model.layers.layers.mlp.experts
    ranks = tp * (dp if ep else 1)
    kernels = sum(v.get_value().nbytes for n, v in vars(experts).items()
                  if n.startswith(("gate_up", "down")) and not n.endswith("_bias") and hasattr(v, "get_value")) // ranks
    held = param_bytes_per_device(llm.model, llm.mesh)
    stored = stored_expert_bytes(path) // ranks
    out = {"tree": os.path.dirname(os.path.dirname(tp_jax.__file__)), "dp": dp, "tp": tp, "ep": ep,
           "quantization": llm.quantization, "bytes_per_device": held, "stored_expert_bytes_per_device": stored,
           "ratio": round(held / (stored + held - kernels), 3),
           "max_abs_logit_diff": float(np.abs(llm.get_logits(ids) - logits).max())}

    def run(batch, n):
        t = time.perf_counter()
        llm.generate(PROMPTS[:batch], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t
    for batch in (1, 8):
        run(batch, args.tokens), run(batch, 1)
        times = [run(batch, args.tokens) - run(batch, 1) for _ in range(args.rounds)]
        out[f"decode_tokens_per_s_batch{batch}"] = round(batch * (args.tokens - 1) / statistics.median(times), 1)
    return out


def main():
    args = parse_args()
    if args.write:
        from tests.test_mxfp4 import write_tiny_gpt_oss_mxfp4
        os.makedirs(args.write, exist_ok=True)
        with open(os.path.join(args.write, "ref.pkl"), "wb") as f:
            pickle.dump(write_tiny_gpt_oss_mxfp4(args.write), f)
        print(json.dumps({"written": args.write, "stored_expert_bytes": stored_expert_bytes(args.write)}))
    if args.model:
        meshes = [(*(int(v) for v in m.removesuffix("ep").split("x")), m.endswith("ep")) for m in args.meshes]
        if args.simulate_devices and max(dp * tp for dp, tp, _ in meshes) > 1:
            from tp_jax.multihost.devices import simulate_cpu_devices
            simulate_cpu_devices(args.simulate_devices)
        for dp, tp, ep in meshes:
            print(json.dumps(measure(args.model, dp, tp, ep, args)), flush=True)


if __name__ == "__main__":
    main()
