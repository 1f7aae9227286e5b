"""The prompt in responses: completions' `echo` (OpenAI) and the `prompt_logprobs` field (vLLM).

* `prompt_part` — what an echoing completions choice puts first: the prompt's text and, with
  `logprobs`, OpenAI's logprobs over the prompt tokens: `tokens`, `token_logprobs` (null
  first: nothing predicts the first token), `top_logprobs` (null first), `text_offset`.
  lm-evaluation-harness scores a continuation from exactly this (`echo: true, logprobs: 1`).
* `join` — a choice's text and logprobs behind that prefix (offsets moved past the prompt).
* `prompt_logprobs_field` — vLLM's layout: `[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]`,
  each entry the prompt token's own logprob plus the N most likely; `rank` 1 is the most likely (the prompt
  token's own rank as the engine counted it; the top N's by their order).
"""

from __future__ import annotations

from tp_jax.server.responses import Tokens, _finite, _top


def prompt_part(text: str, prompt_ids: list[int], prompt_lps: list | None, n: int | None,
                tokens: Tokens) -> tuple[str, dict | None]:
    """(the echoed text, the prompt's completions logprobs or None when `n` (logprobs) is None)."""
    if n is None or prompt_lps is None:
        return text, None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for t, entries in zip(prompt_ids, prompt_lps):
        token = tokens.text(t)
        out["tokens"].append(token)
        out["token_logprobs"].append(None if entries is None else _finite(entries[t].logprob))
        out["top_logprobs"].append(None if entries is None else
                                   {tokens.text(j): _finite(lp) for j, lp in _top(entries, n)})
        out["text_offset"].append(offset)
        offset += len(token)
    return text, out


def join(prefix: tuple[str, dict | None] | None, shift: int, text: str, logprobs: dict | None):
    """(text, logprobs) of a choice with `prefix` (from `prompt_part`; None: already sent) in front;
    the generated tokens' offsets move `shift` characters (the echoed text's length)."""
    if logprobs is not None:
        logprobs = {**logprobs, "text_offset": [o + shift for o in logprobs["text_offset"]]}
    if prefix is None:
        return text, logprobs
    ptext, plp = prefix
    if plp is not None:
        gen = logprobs or {k: [] for k in plp}
        logprobs = {k: plp[k] + gen[k] for k in plp}
    return ptext + text, logprobs


def prompt_logprobs_field(prompt_ids: list[int], prompt_lps: list | None, n: int, tokens: Tokens) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}."""
    if prompt_lps is None:
        return None
    out = []
    for t, entries in zip(prompt_ids, prompt_lps):
        if entries is None:
            out.append(None)
            continue
        keep = [t] + [j for j, _ in _top(entries, n)]          # its own, then the N most likely (of the engine's k)
        out.append({str(j): {"logprob": _finite(entries[j].logprob), "rank": entries[j].rank,
                             "decoded_token": tokens.text(j)} for j in keep})
    return out
