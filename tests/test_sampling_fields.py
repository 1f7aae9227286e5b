"""vLLM's sampling fields `min_tokens` and `logit_bias`, a stop token's text, and a character cut by max_tokens,
on the engine (the tiny tokenized Llama of tests/server_process.py at tp = 2), against transformers' own
`generate` with its processors for the same rules (`min_new_tokens`, `sequence_bias`) on the same weights."""

import numpy as np
import pytest

from tp_jax.serving.sampling import SamplingParams

PROMPT = [1, 504, 3458, 314, 4420, 28, 260, 1007]


@pytest.fixture(scope="module")
def hf(tiny_path):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


def hf_generate(hf, ids, new, **kw):
    """transformers' greedy tokens and its raw logits per step (before any processor)."""
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits)[:, 0].numpy()


def streamed(llm, sp, events=False):
    """The RequestOutput of PROMPT run as a stream (detokenized token by token); with its StreamEvents."""
    gen = llm.start([PROMPT], sp)
    seen = list(gen.events())
    return (seen, gen.outputs()[0]) if events else gen.outputs()[0]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_min_tokens_holds_back_the_stop_token_as_transformers_min_new_tokens(ref, hf):
    plain = ref.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop = plain.token_ids[1]                          # ends the plain request at its second token
    early = ref.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop],
                                                  ignore_eos=True))[0].outputs[0]
    assert early.token_ids == plain.token_ids[:2] and early.stop_reason == stop
    held = ref.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop], min_tokens=5,
                                                 ignore_eos=True))[0].outputs[0]
    expected, _ = hf_generate(hf, PROMPT, 8, eos_token_id=stop, min_new_tokens=5)
    assert held.token_ids == expected and len(held.token_ids) >= 5
    assert stop not in held.token_ids[:5]


def test_logit_bias_moves_the_choice_as_transformers_sequence_bias_and_logprobs_stay_raw(ref, hf):
    plain = ref.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0]
    bias = {plain.token_ids[0]: -100.0, 42: 3.0, 1000: 8.0}
    out = ref.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=bias,
                                                logprobs=0))[0].outputs[0]
    expected, raw = hf_generate(hf, PROMPT, 6, sequence_bias={(t,): b for t, b in bias.items()})
    assert out.token_ids == expected and out.token_ids != plain.token_ids
    lp = log_softmax(raw)                                   # the unbiased distribution's logprobs
    np.testing.assert_allclose([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)],
                               lp[np.arange(6), expected], atol=2e-4)
    sampled = ref.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True,
                                                    logit_bias={1000: 100.0}))[0].outputs[0]
    assert sampled.token_ids == [1000] * 6                 # +100 wins every draw


def test_a_stop_tokens_text_is_left_out_unless_asked_for(ref):
    tok = ref.get_tokenizer()
    plain = ref.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop = plain.token_ids[2]
    for stream in (False, True):                          # decoded at the end, and incrementally
        run = (lambda sp: streamed(ref, sp)) if stream else (lambda sp: ref.generate([PROMPT], sp)[0])
        cut = run(SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop])).outputs[0]
        assert cut.token_ids == plain.token_ids[:3] and cut.stop_reason == stop and cut.finish_reason == "stop"
        assert cut.text == tok.decode(plain.token_ids[:2], skip_special_tokens=True), stream
        kept = run(SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop],
                                  include_stop_str_in_output=True)).outputs[0]
        assert kept.text == tok.decode(plain.token_ids[:3], skip_special_tokens=True), stream


def test_max_tokens_inside_a_multibyte_character_ends_without_a_replacement_character(ref):
    tok = ref.get_tokenizer()
    lead = tok.convert_tokens_to_ids("ä")                  # byte 0xE4 alone: the first of a 3-byte character
    assert tok.decode([lead]) == "\ufffd"
    sp = SamplingParams(max_tokens=2, temperature=0.0, logit_bias={lead: 100.0})
    whole = ref.generate([PROMPT], sp)[0].outputs[0]
    events, out = streamed(ref, sp, events=True)
    assert whole.token_ids == out.outputs[0].token_ids == [lead, lead]
    assert whole.text == out.outputs[0].text == "".join(e.text for e in events) == ""


def test_prompt_logprobs_carry_the_prompt_tokens_rank_as_transformers_counts_it(ref, hf):
    import torch
    out = ref.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    with torch.no_grad():
        lp = log_softmax(hf(torch.tensor([PROMPT])).logits[0].numpy())          # [T, V]
    for i, entry in enumerate(out.prompt_logprobs[1:]):                          # token i + 1, scored at position i
        own = lp[i, PROMPT[i + 1]]
        lo, hi = (int((lp[i] > own + d).sum()) + 1 for d in (2e-4, -2e-4))      # within roundoff of the reference
        rank = entry[PROMPT[i + 1]].rank
        assert lo <= rank <= hi, (i, rank, lo, hi)


def test_skip_special_tokens_false_keeps_them_as_transformers_decode_does(ref):
    tok = ref.get_tokenizer()
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])      # special; <|im_end|>: EOS
    sp = dict(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True, logit_bias={im_start: 11.0, 4: 11.0})
    drawn = ref.generate([PROMPT], SamplingParams(**sp))[0].outputs[0]
    special = {im_start, 4}
    assert special & set(drawn.token_ids) and set(drawn.token_ids) - special          # a mix of both kinds
    assert drawn.text == tok.decode(drawn.token_ids, skip_special_tokens=True)
    for stream in (False, True):                          # decoded at the end, and incrementally
        run = (lambda p: streamed(ref, p)) if stream else (lambda p: ref.generate([PROMPT], p)[0])
        kept = run(SamplingParams(**sp, skip_special_tokens=False)).outputs[0]
        assert kept.token_ids == drawn.token_ids
        assert kept.text == tok.decode(drawn.token_ids, skip_special_tokens=False) != drawn.text, stream
        cut = run(SamplingParams(**sp, skip_special_tokens=False, stop="<|im_start|>")).outputs[0]   # stop strings
        assert cut.text == kept.text[:kept.text.index("<|im_start|>")] and cut.stop_reason == "<|im_start|>"
        for include in (False, True):                     # the EOS that ended it: left out unless asked for, as vLLM
            eos = run(SamplingParams(max_tokens=4, temperature=0.0, logit_bias={im_end: 100.0},
                                     skip_special_tokens=False, include_stop_str_in_output=include)).outputs[0]
            assert eos.token_ids == [im_end] and (eos.finish_reason, eos.stop_reason) == ("stop", None)
            assert eos.text == ("<|im_end|>" if include else ""), (stream, include)
