"""DeepSeek-V3-style decode vs a dense Llama of the same active params, through `LLM()`, one JSON line.

    python scripts/bench_deepseek.py [--tp 1 2] [--simulate-devices 2] [--batch 1 8] [--tokens 32] [--rounds 3]
                                     [--layers 4] [--experts 64] [--expert-width 256] [--top-k 4]
                                     [--layer-loop auto] [--dcp 1] [--keep DIR]

Two random float32 checkpoints, written by transformers:
* DeepSeek-V3 style: latent attention (q_lora_rank, kv_lora_rank, decoupled rope), sigmoid routing over
  `--experts` experts in 4 groups keeping 2, a random nonzero e_score_correction_bias, top-k, one shared expert,
  every layer MoE (first_k_dense_replace 0);
* a Llama with the same hidden size, layers, heads and vocab whose intermediate_size makes its active params per
  token (everything but the routed experts a token does not use) equal the DeepSeek model's, counted from the
  two models' parameter shapes ("params").
Each mesh of `--tp` runs in a fresh process ("meshes"): tp = 1 on the machine's real device and threads, tp > 1
on `--simulate-devices` CPU devices (0: real devices) with expert parallelism on for the DeepSeek model (the
dense one split over tp as usual). There both are loaded with `LLM()`'s defaults (dtype auto) and decode the
same prompts (one per row, greedy, ignore_eos); a decode step is (T(N tokens) - T(1 token)) / (N - 1), as in
bench_decode.py, measured in `--rounds` rounds alternating the two models (order flipped each round).
Reported per mesh and batch: each model's median tokens/s, `deepseek_over_dense` (the ratio of the medians)
and the per-round ratios; per mesh and model: the KV bytes one token takes on one device (the engine's pool:
MLA caches kv_lora_rank + qk_rope values per token and layer on every tp rank), the weight bytes per device
and what the resolve step chose. `--dcp d` (d > 1): on each mesh whose tp d divides, a third engine on the same
DeepSeek checkpoint with decode_context_parallel_size=d ("deepseek_dcp{d}": its latent cache split over the tp
ranks) joins the rounds, and `dcp_over_dcp1` is its median tokens/s over the plain DeepSeek's. `--keep DIR` keeps
the checkpoints (e.g. for scripts/profile_step.py --model DIR/deepseek --prompt-tokens 8).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="one mesh each, in its own process")
    ap.add_argument("--simulate-devices", type=int, default=2, help="CPU devices for tp > 1 (0: real devices)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "switch"],
                    help="LLM(layer_loop=...) for both models (auto: the resolve step's choice)")
    ap.add_argument("--dcp", type=int, default=1, help="also the DeepSeek model at this decode_context_parallel_size")
    ap.add_argument("--keep", default=None, help="write the checkpoints here and keep them (default: a temp dir)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)      # the mesh's tp, in its process
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1:
        ap.error("--tokens must be at least 2 and --rounds at least 1")
    return args


COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def deepseek_config(args):
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        **COMMON, vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, head_dim=32, v_head_dim=64, n_routed_experts=args.experts,
        moe_intermediate_size=args.expert_width, intermediate_size=4 * args.expert_width,
        num_experts_per_tok=args.top_k, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0,
        norm_topk_prob=True, routed_scaling_factor=2.5, architectures=["DeepseekV3ForCausalLM"])


def dense_config(args, intermediate: int):
    from transformers import LlamaConfig
    return LlamaConfig(**COMMON, vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       head_dim=args.hidden // args.heads, intermediate_size=intermediate,
                       architectures=["LlamaForCausalLM"])


def param_counts(model, top_k: int = 1, experts: int = 1) -> dict:
    """{"total", "active", "routed_experts"} from the parameter shapes (and the routers' correction bias): active
    is the total less the routed experts a token does not use, (1 - top_k / experts) of them."""
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                if n.endswith("e_score_correction_bias")]
    total = sum(t.numel() for _, t in tensors)
    routed = sum(t.numel() for n, t in tensors if ".mlp.experts." in n)
    return {"total": total, "active": total - routed * (experts - top_k) // experts, "routed_experts": routed}


def matching_intermediate(args, active: int, multiple: int) -> int:
    """The Llama intermediate_size (a multiple of `multiple`) whose active params come nearest `active`: the
    count is affine in it, so two shape-only (meta device) models give its slope."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        p = [param_counts(AutoModelForCausalLM.from_config(dense_config(args, i)))["active"] for i in (1, 2)]
    exact = 1 + (active - p[0]) / (p[1] - p[0])
    return max(multiple, round(exact / multiple) * multiple)


def write_checkpoints(args, root: str) -> dict:
    """Both checkpoints under `root` (float32 safetensors) and their parameter counts."""
    import math
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    ds = AutoModelForCausalLM.from_config(deepseek_config(args), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, b in ds.named_buffers():
            if n.endswith("e_score_correction_bias"):                 # zero at init: make the choice biased
                b.copy_(0.05 * torch.randn_like(b))
    ds.save_pretrained(os.path.join(root, "deepseek"), safe_serialization=True)
    ds_params = param_counts(ds, args.top_k, args.experts)
    del ds
    width = matching_intermediate(args, ds_params["active"], math.lcm(*args.tp))
    dense = AutoModelForCausalLM.from_config(dense_config(args, width), dtype=torch.float32).eval()
    dense.save_pretrained(os.path.join(root, "dense"), safe_serialization=True)
    dense_params = param_counts(dense)
    return {"deepseek": ds_params, "dense": {**dense_params, "intermediate_size": width},
            "active_deepseek_over_dense": round(ds_params["active"] / dense_params["active"], 5)}


def run_mesh(args, root: str, tp: int) -> dict:
    """The child process of one mesh (this script with --child tp); its JSON line."""
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", str(tp), "--dir", root]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines:
        return {"error": f"exit {r.returncode}", "stdout": r.stdout[-800:]}
    return json.loads(lines[-1])


def measure_mesh(args) -> dict:
    """Both models on a tp = args.child mesh: what each runs, its KV and weight bytes per device, and the decode
    tokens/s per batch, the models alternating over the rounds."""
    import numpy as np
    if args.child > 1 and args.simulate_devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(max(args.simulate_devices, args.child))
    import jax
    from bench_decode import _timed
    from tp_jax import LLM, SamplingParams
    from tp_jax.loaders.model import param_bytes_per_device
    tp, names = args.child, ("deepseek", "dense")
    dcp = f"deepseek_dcp{args.dcp}"
    if args.dcp > 1 and tp % args.dcp == 0:
        names += (dcp,)
    llms = {name: LLM(os.path.join(args.dir, name.split("_")[0]), tensor_parallel_size=tp, progress=False,
                      layer_loop=args.layer_loop,
                      **({"enable_expert_parallel": True} if name != "dense" and tp > 1 else {}),
                      **({"decode_context_parallel_size": args.dcp} if name == dcp else {}))
            for name in names}
    out = {"devices": jax.device_count(), "expert_parallel": tp > 1}
    for name, llm in llms.items():
        pool = llm.engine.core.pool
        out[name] = {"weights": llm.quantization, "dtype": jax.numpy.dtype(llm.dtype).name,
                     "layers": llm.layer_loop, "attention": llm.setup.attention_backend,
                     "kv_bytes_per_token_per_device": pool.bytes_per_token,
                     "weight_bytes_per_device": param_bytes_per_device(llm.model, llm.mesh)}
    rng = np.random.default_rng(0)
    for b in args.batch:
        prompts = rng.integers(3, args.vocab, (b, args.prompt_len)).tolist()
        run = lambda llm, k: llm.generate(prompts, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
        for llm in llms.values():                                            # compile both paths
            run(llm, args.tokens), run(llm, 1)
        steps = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                t_n = _timed(lambda: run(llms[name], args.tokens))
                t_1 = _timed(lambda: run(llms[name], 1))
                steps[name].append((t_n - t_1) / (args.tokens - 1))
        tps = {name: b / statistics.median(s) for name, s in steps.items()}
        out[f"batch{b}"] = {**{f"{n}_tokens_per_s": round(v, 2) for n, v in tps.items()},
                            "deepseek_over_dense": round(tps["deepseek"] / tps["dense"], 3),
                            "round_ratios": [round(d / s, 3) for s, d in zip(steps["deepseek"], steps["dense"])],
                            **({"dcp_over_dcp1": round(tps[dcp] / tps["deepseek"], 3)} if dcp in tps else {})}
    return out


def main():
    args = parse_args()
    if args.child is not None:
        print(json.dumps(measure_mesh(args)))
        return
    from bench_decode import cpu_description
    root = args.keep or tempfile.mkdtemp(prefix="tp_jax_deepseek_")
    params = write_checkpoints(args, root)
    result = {"cpu": cpu_description(), "tokens": args.tokens, "rounds": args.rounds, "prompt_len": args.prompt_len,
              "layer_loop": args.layer_loop,
              "deepseek": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "q_lora_rank": 256,
                           "kv_lora_rank": 128, "qk_nope": 64, "qk_rope": 32, "v": 64, "experts": args.experts,
                           "expert_width": args.expert_width, "top_k": args.top_k, "n_group": 4, "topk_group": 2,
                           "shared_experts": 1, "vocab": args.vocab},
              "params": params,
              "meshes": {f"tp{tp}" + ("_ep" if tp > 1 else ""): run_mesh(args, root, tp) for tp in args.tp}}
    if args.keep is None:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
