"""On-policy logprobs with Tunix: tp_jax's rollout against the trainer's own forward, float32 and bf16.

For a tiny random Qwen3 and Llama 3 (examples/tunix_grpo.py's checkpoint, loaded by Tunix's own loader as the
actor, its weights pushed into the engine with `update_params`), the tokens the rollout samples (temperature 1)
are scored four ways (`tp_jax.integrations.tunix.on_policy_logprobs`): as sampled, by the engine's prompt scoring
(`get_per_token_logps`), by `LLM.get_logits` and by Tunix's `compute_per_token_logps` on the actor. Prints one
markdown row per model and dtype: the largest |dlogp| and the importance ratio's deviation max |exp(dlogp) - 1|.

Run:  python scripts/tunix_logprobs.py              (needs pip install 'tp-jax[tunix]'; ~1 min on CPU)
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import jax.numpy as jnp
import transformers

from tp_jax.integrations.tunix import TpJaxRollout, deviation, on_policy_logprobs, tunix_model

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROMPTS = ["say a", "aaa", "banana", "the cat", "abc", "hello", "what is 2 and 2?", "x"] * 2


def example():
    spec = importlib.util.spec_from_file_location("tunix_grpo", os.path.join(ROOT, "examples", "tunix_grpo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(path: str, arch: str, dtype: str) -> str:
    from tunix.rl.rollout import base_rollout
    actor = tunix_model(path, dtype={"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype])
    rollout = TpJaxRollout(actor, transformers.AutoTokenizer.from_pretrained(path), model_path=path, dtype=dtype,
                           max_model_len=64, progress=False)
    config = base_rollout.RolloutConfig(max_tokens_to_generate=24, max_prompt_length=16, temperature=1.0, seed=3)
    lp = on_policy_logprobs(rollout, actor, PROMPTS, config)
    cells = []
    for other in ("trainer", "get_logits", "scored"):
        d = deviation(lp["sampled"], lp[other], lp["mask"])
        cells.append("bitwise equal" if d["bitwise"] else f"{d['max_abs']:.2g} / {d['ratio_dev']:.2g}")
    return f"| {arch} | {dtype} | {d['tokens']} | " + " | ".join(cells) + " |"


def main():
    tiny = example()
    root = tempfile.mkdtemp(prefix="tunix_logprobs_")
    print("| model | dtype | tokens | Tunix `compute_per_token_logps` (the trainer) | `LLM.get_logits` | "
          "engine scoring (`get_per_token_logps`) |")
    print("|---|---|---|---|---|---|")
    for arch in ("qwen3", "llama"):
        path = tiny.write_tiny_checkpoint(os.path.join(root, arch), arch)
        for dtype in ("float32", "bfloat16"):
            print(row(path, arch, dtype), flush=True)
    print("cells: max |dlogp| / max |exp(dlogp) - 1| against the logprobs the engine sampled the tokens with")


if __name__ == "__main__":
    main()
