"""Tiny random Hugging Face checkpoints written by the tests (the golden references)."""

from __future__ import annotations

import os

import numpy as np

VARIANTS = {
    # name: LlamaConfig overrides
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "h9kv3": dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72, head_dim=8, vocab_size=1001),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama3rope": dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}),
    "linearrope": dict(num_attention_heads=4, num_key_value_heads=2,
                       rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "bias": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "bf16sharded": dict(num_attention_heads=8, num_key_value_heads=2),
}

# Deeper models for pipeline parallelism (pp up to 8; 10 layers do not split evenly).
DEEP = {"deep": dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=10)}

BASE = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
            rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def hf_config(name: str):
    from transformers import LlamaConfig
    kw = {**BASE, **{**VARIANTS, **DEEP}[name]}
    if "rope_parameters" not in kw:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    return LlamaConfig(**kw)


def make_checkpoint(name: str, root: str) -> str:
    """Write variant `name` under `root` once; returns the directory."""
    import torch
    from transformers import LlamaForCausalLM
    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(sum(map(ord, name)))
    model = randomize(LlamaForCausalLM(hf_config(name)).eval())
    if name == "bf16sharded":
        model = model.to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    else:
        model.save_pretrained(path, safe_serialization=True)
    return path


def randomize(model):
    """Random norm weights and biases (HF initializes them to 1 and 0), so every weight matters."""
    import torch
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def hf_logits(path: str, ids: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def logits_and_greedy(model, ids: np.ndarray, prompts: list[list[int]], max_new_tokens: int = 12):
    """A transformers model's logits for `ids` [B, T] and its greedy tokens for each prompt (no eos stop);
    refuses a degenerate reference (a continuation with 3 distinct tokens or fewer)."""
    import torch
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits.float().numpy()
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert all(len(set(g)) > 3 for g in greedy), f"degenerate greedy reference {greedy}"
    return logits, greedy


def hf_greedy(path: str, ids: list[int], max_new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[0, len(ids):].tolist()


def make_tokenized_checkpoint(root: str, gguf_path: str) -> str:
    """A tiny random Llama with SmolLM2's real tokenizer (vocab 49152), for text-level tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from tp_jax.serving.tokenizer import load_tokenizer
    path = os.path.join(root, "tokenized")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(7)
    cfg = LlamaConfig(**{**BASE, "vocab_size": 49152, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "eos_token_id": 2, "max_position_embeddings": 256,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    load_tokenizer(gguf_path).save_pretrained(path)
    return path


def dequantized_reference(path: str, ids: np.ndarray) -> np.ndarray:
    """transformers' logits with every weight int8 quantizes replaced by its int8 round trip: per output row
    (the last dim of torch's [.., out, in] layout: linear layers, both tables, the stacked experts), the
    router (`mlp.gate`) and the norms float."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                s = p.abs().amax(dim=-1, keepdim=True) / 127
                p.copy_(torch.round(p / torch.where(s > 0, s, 1)).clamp(-127, 127) * s)
        return model(torch.tensor(ids)).logits.float().numpy()


def check_int8_and_orbax(path: str, ids: np.ndarray, logits: np.ndarray, orbax_dir: str, **mesh) -> None:
    """A model family through the rest of the stack: `quantization="int8"` equals transformers on the int8
    round-tripped weights (and differs visibly from the float model); an Orbax conversion restores the same logits."""
    from tp_jax.loaders.orbax import convert_to_orbax
    from tp_jax.serving.llm import LLM
    int8 = LLM(path, quantization="int8", progress=False, **mesh).get_logits(ids)
    diff = float(np.abs(int8 - dequantized_reference(path, ids)).max())
    assert diff <= 2e-4 and 10 * diff < float(np.abs(int8 - logits).max()), diff
    convert_to_orbax(path, orbax_dir)
    restored = LLM(orbax_dir, progress=False, **mesh).get_logits(ids)
    assert float(np.abs(restored - logits).max()) <= 2e-4


# --- one model family against transformers (tests/test_gemma.py, test_phi3.py, test_olmo.py, test_mixed_layers.py) ---

# the first prompt (13 tokens) is longer than the tests' sliding windows; 12 greedy tokens cross them again
FAMILY_PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 200, 300], [5, 17, 300, 42, 9], [999, 3]]


def family_reference(cfg, path: str, seed: int = 0, attn: str | None = None, check=None):
    """transformers' model of `cfg`, randomized (`randomize`) with `seed` and saved at `path`: (path, ids [3, 13],
    its float32 logits for ids, its greedy tokens for FAMILY_PROMPTS). `check(model, ids, logits)` runs before
    generate (which leaves state a variant built from the model would inherit)."""
    import torch
    from transformers import AutoModelForCausalLM
    kw = {} if attn is None else {"attn_implementation": attn}
    torch.manual_seed(seed)
    randomize(AutoModelForCausalLM.from_config(cfg).eval()).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(3, 13))
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits.numpy()
    if check is not None:
        check(model, ids, logits)
    ref, greedy = logits_and_greedy(model, ids, FAMILY_PROMPTS)
    assert np.array_equal(ref, logits)
    return path, ids, logits, greedy


def check_family(reference, mesh: tuple[int, int, int], tol: float = 2e-4, **kw) -> None:
    """`LLM` at mesh (dp, pp, tp) against `family_reference`'s logits (max abs <= tol) and greedy tokens."""
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    path, ids, logits, greedy = reference
    dp, pp, tp = mesh
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, progress=False, **kw)
    diff = float(np.abs(llm.get_logits(ids) - logits).max())
    print(f"{os.path.basename(path)} {mesh} {kw} ({llm.layer_loop}): max abs logit diff {diff:.2e}")
    assert diff <= tol, diff
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(FAMILY_PROMPTS, params)] == greedy


def run_counting_blocks(llm, prompts, params):
    """Each prompt's (tokens, [(token, logprob)] per step), the first two generated together and the third after
    them (a shared prefix then comes from the cache); the most blocks one request held at once, over its KV cache
    groups; the third's cached tokens."""
    core, held = llm.engine.core, [0]
    step = core.step

    def counting():
        outs = step()
        bm = core.scheduler.blocks[0]
        held[0] = max([held[0]] + [sum(b >= 0 for t in bm.group_tables for b in t[rid]) for rid in bm.tables])
        return outs
    core.step = counting
    try:
        outs = llm.generate(prompts[:2], params) + llm.generate(prompts[2:], params)
    finally:
        core.step = step
    got = [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in sorted(d.items())] for d in o.outputs[0].logprobs])
           for o in outs]
    return got, held[0], outs[2].num_cached_tokens
