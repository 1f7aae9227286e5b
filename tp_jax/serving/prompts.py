"""Prompts in: what the front door accepts, normalized once into token ids.

* `split_prompts(prompts)`: the single prompts of one `generate` call (one prompt, a list of
  them, a 2-D token-id array: one per row);
* `parse_prompt(prompt, tokenizer, where)`: one prompt -> (its text or None, its token ids):
  a string (tokenized here), a sequence of int token ids, or a {"prompt": ...} /
  {"prompt_token_ids": ...} dict;
* `per_prompt_params(params, n)`: one SamplingParams per prompt.

Errors are TypeError / ValueError naming `where` and the fix. LLMEngine.prepare runs these,
then the engine's own checks (tp_jax/serving/llm_engine.py).
"""

from __future__ import annotations

import numbers

import numpy as np

from tp_jax.serving.sampling import SamplingParams


def split_prompts(prompts) -> list:
    """A list of single prompts from whatever `generate` accepts (one prompt, a list, a 2-D array)."""
    if isinstance(prompts, (str, dict, bytes, bytearray)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim not in (1, 2):
            raise ValueError(f"generate: a token-id array must be 1-D (one prompt) or 2-D (one per row), "
                             f"got shape {prompts.shape}")
        prompts = [prompts] if prompts.ndim == 1 else list(prompts)
    try:
        prompts = list(prompts)
    except TypeError:
        raise TypeError(f"generate: prompts must be a string, token ids or a list of them, got "
                        f"{type(prompts).__name__}") from None
    if prompts and all(isinstance(p, (numbers.Number, np.generic)) for p in prompts):
        return [prompts]                                 # one prompt of token ids
    if not prompts:
        raise ValueError("generate: no prompts given")
    return prompts


def parse_prompt(prompt, tokenizer, where: str = "prompt") -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt: a string, a sequence of int token ids, or a dict
    with "prompt" or "prompt_token_ids". TypeError / ValueError name what is wrong."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return parse_prompt(list(prompt["prompt_token_ids"]), tokenizer, where)
        if "prompt" in prompt:
            return parse_prompt(prompt["prompt"], tokenizer, where)
        raise ValueError(f"{where}: a dict prompt needs a 'prompt' or 'prompt_token_ids' key, got {sorted(prompt)}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where} is an empty string")
        if tokenizer is None:
            raise ValueError(f"{where} is text, but this model has no tokenizer files; pass token-id lists instead")
        return prompt, list(tokenizer.encode(prompt))
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"{where} is {type(prompt).__name__}; pass a str (decode it first) or a list of token ids")
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise ValueError(f"{where} is an array of shape {prompt.shape}; one prompt is a 1-D list of token ids")
    try:
        items = list(prompt)
    except TypeError:
        raise TypeError(f"{where} must be a string or a list of token ids, got {type(prompt).__name__}") from None
    for j, t in enumerate(items):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{where}: token {j} is {t!r} ({type(t).__name__}); token ids must be integers")
    return None, [int(t) for t in items]


def per_prompt_params(sp, n: int) -> list:
    """One SamplingParams (or None: the defaults) per prompt; the type of each is checked by LLMEngine.prepare."""
    if sp is None or isinstance(sp, SamplingParams):
        return [sp] * n
    try:
        sp = list(sp)
    except TypeError:
        raise TypeError(f"generate: sampling params must be a SamplingParams or a list of them, got "
                        f"{type(sp).__name__}") from None
    if len(sp) != n:
        raise ValueError(f"generate: got {len(sp)} sampling params for {n} prompts; pass one SamplingParams "
                         f"or one per prompt")
    return sp


def per_prompt_adapters(lora_request, n: int) -> list:
    """One LoRARequest (or None: the base model) per prompt, from one or a list of them."""
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(f"generate: got {len(lora_request)} lora_requests for {n} prompts; pass one LoRARequest "
                         f"(or None) or one per prompt")
    return list(lora_request)
