"""Speculative decoding against plain decoding on the same model, same run, one JSON line.

    python scripts/bench_spec.py [--model PATH] [--tokens 128] [--k 5] [--lookup-max 4] [--lookup-min 2]
                                 [--rounds 3] [--mixed-batch 32] [--draft PATH | --draft-layers N]

Two engines over the same weights, one with `speculative_config={"method": "ngram", ...}` (or,
with `--draft`, a draft model: `{"model": PATH, ...}`; `--draft-layers N` writes one first: the
target's first N layers with its final norm and head, a layer-skip draft made by transformers),
one without, each asked the same greedy requests (`ignore_eos`, `--tokens` tokens each) in
alternating rounds; each keeps its best round (this machine is shared). Workloads:
* `quote`: batch 1, chat prompts that quote a passage of ~190 tokens back (repeat it, fix its typos,
  continue a list that repeats, rewrite it): where proposals from the prompt should stand;
* `ordinary`: batch 1, prompts with nothing to copy;
* `mixed`: `--mixed-batch` requests at once, half of each kind.
Per workload: tokens/s of each engine (`plain_`, `ngram_` or `draft_model_tokens_per_s`),
`speedup` (speculative / plain), the acceptance rate and
the mean accepted length (1 + accepted drafts per verified step), and whether the greedy tokens
are equal (they must be).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PASSAGE = ("The river rose quickly after the storm, and by morning the old stone bridge was under water. "
           "Farmers moved their animals to the hills, while the children watched from the schoolhouse windows. "
           "By noon the rain had stopped, but the water kept rising until it reached the steps of the church. "
           "The mayor called a meeting in the town hall, and everyone agreed to build a wall of sandbags along "
           "the main street. Men and women worked through the afternoon, filling bags with sand from the quarry "
           "and passing them from hand to hand. When the sun went down, the wall was finished, and the water "
           "stopped a few steps short of the first houses. The next morning the river began to fall, and the "
           "people of the town walked down to the bridge to see what the flood had left behind.")
TYPOS = PASSAGE.replace("quickly", "quikly").replace("morning", "mornign").replace("animals", "animls")
QUOTE = [f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
         f"Fix the spelling mistakes in this passage and write it out again in full:\n\n{TYPOS}",
         "Write the following list out again, then continue it: apple, banana, cherry, apple, banana, cherry, "
         "apple, banana, cherry, apple, banana",
         f"Rewrite this passage in the past perfect tense, keeping every sentence:\n\n{PASSAGE}"]
ORDINARY = ["Write a short poem about the sea.", "What are three good habits for students?",
            "Explain why the sky is blue.", "Tell me a story about a dragon who learns to cook."]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mixed-batch", type=int, nargs="+", default=[32])
    ap.add_argument("--quote-batch", type=int, nargs="+", default=[1], help="quote prompts at these batch sizes")
    ap.add_argument("--workloads", nargs="+", default=["quote", "ordinary", "mixed"])
    ap.add_argument("--draft", default=None, help="a draft model's checkpoint instead of n-gram proposals")
    ap.add_argument("--draft-layers", type=int, default=None, help="a layer-skip draft of the target's first N layers")
    return ap.parse_args()


def layer_skip_draft(model: str | None, layers: int) -> str:
    """The target's first `layers` layers, its final norm and head, as a float32 safetensors checkpoint (a GGUF
    is converted first, by tp_jax's converter); its directory."""
    import tempfile
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tp_jax.loaders.convert import convert_gguf
    from tp_jax.loaders.default import default_model_path
    src = model or default_model_path()
    if src.endswith(".gguf"):
        convert_gguf(src, src := tempfile.mkdtemp(prefix="target_"), "float32")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.model.layers = hf.model.layers[:layers]
    hf.config.num_hidden_layers = layers
    out = tempfile.mkdtemp(prefix=f"draft{layers}_")
    hf.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def main():
    args = parse_args()
    from scripts.bench_decode import cpu_description
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    draft = layer_skip_draft(args.model, args.draft_layers) if args.draft_layers else args.draft
    method = "ngram" if draft is None else "draft_model"
    spec = {"method": method, "num_speculative_tokens": args.k}
    spec.update({"prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min} if draft is None
                else {"model": draft})
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    plain = LLM(args.model, progress=False)
    fast = LLM(args.model, progress=False, speculative_config=spec)
    tok = plain.get_tokenizer()
    chat = lambda p: tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                        tokenize=False), add_special_tokens=False)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    mixed = lambda b: [chat(QUOTE[i % len(QUOTE)] if i % 2 == 0 else ORDINARY[i % len(ORDINARY)]) for i in range(b)]
    quote = lambda b: [[chat(QUOTE[(i + j) % len(QUOTE)]) for j in range(b)] for i in range(len(QUOTE) if b == 1 else 1)]
    workloads = {}
    for b in args.quote_batch if "quote" in args.workloads else []:
        workloads["quote" if b == 1 else f"quote_batch{b}"] = quote(b)
    if "ordinary" in args.workloads:
        workloads["ordinary"] = [[chat(p)] for p in ORDINARY]
    for b in args.mixed_batch if "mixed" in args.workloads else []:
        workloads["mixed" if b == 32 else f"mixed_batch{b}"] = [mixed(b)]
    for llm in (plain, fast):                                    # compile the shapes the runs use
        for batches in workloads.values():
            for batch in batches:
                llm.generate(batch, params)
    result = {"bench": "spec", "model": args.model or "embedded SmolLM2", "tokens": args.tokens,
              "speculative_config": spec, "draft_layers": args.draft_layers, "cpu": cpu_description(),
              "workloads": {}}
    for name, batches in workloads.items():
        best = {"plain": float("inf"), method: float("inf")}
        tokens, counters = {}, None
        for _ in range(args.rounds):
            for key, llm in (("plain", plain), (method, fast)):
                core = llm.engine.core
                before = (core.spec.drafts, core.spec.draft_tokens, core.spec.accepted_tokens)
                t = time.perf_counter()
                outs = [o for batch in batches for o in llm.generate(batch, params)]
                best[key] = min(best[key], time.perf_counter() - t)
                tokens[key] = [o.outputs[0].token_ids for o in outs]
                if key == method:
                    counters = [a - b for a, b in zip((core.spec.drafts, core.spec.draft_tokens,
                                                       core.spec.accepted_tokens), before)]
        n = sum(len(t) for t in tokens["plain"])
        drafts, proposed, accepted = counters
        result["workloads"][name] = {
            "requests": sum(len(b) for b in batches), "batch": len(batches[0]),
            "plain_tokens_per_s": round(n / best["plain"], 2), f"{method}_tokens_per_s": round(n / best[method], 2),
            "speedup": round(best["plain"] / best[method], 3),
            "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
            "greedy_equal": tokens["plain"] == tokens[method]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
