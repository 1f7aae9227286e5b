"""The OpenAI-compatible server, run as a subprocess (tiny Llama with SmolLM2's tokenizer, tp = 2 on 2
simulated devices), driven by the real `openai` client and checked against `LLM.generate` / `LLM.chat`
in this process: streamed == whole == the engine for greedy, seeded n = 2, vLLM's extra fields, stop
strings, logprobs, usage, 32 concurrent streams with /metrics agreeing, client disconnects freeing
their KV blocks, the request log line, and bench_server. Bad requests: test_server_errors.py;
API key and signals: test_server_signals.py; SmolLM2: test_server_smollm2.py.
"""

import asyncio

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from tests.server_process import metrics, request_log_lines, success, wait_metrics
from tp_jax.serving.sampling import SamplingParams

PROMPTS = ["Hello there", "The capital of France is"]


def streamed(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """(text per choice index, finish_reason per index, the chunks) of a completions or chat stream."""
    text, finish, chunks = {}, {}, []
    for ch in stream:
        chunks.append(ch)
        for c in ch.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            text[c.index] = text.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return text, finish, chunks


def test_models_and_health(tiny_server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 256
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}


def test_metrics_and_the_start_up_log_account_for_the_kv_pool(tiny_server, tiny_path):
    """/metrics gives KV bytes per token per device, how many max_model_len sequences fit and the blocks of each KV
    cache group, computed here from config.json (float32, tp = 2: each device holds half the kv heads), as the
    start-up log line says."""
    import json
    import math
    import os
    with open(os.path.join(tiny_path, "config.json")) as f:
        cfg = json.load(f)
    per_token = cfg["num_hidden_layers"] * (cfg["num_key_value_heads"] // 2) * 2 * cfg["head_dim"] * 4
    m = metrics(tiny_server.url)
    blocks = int(m["tp_jax:kv_blocks_total"])
    sequences = blocks // math.ceil(256 / 16)                           # --max-model-len 256, block_size 16
    assert m["tp_jax:kv_cache_bytes_per_token"] == per_token
    assert m["tp_jax:kv_cache_max_model_len_sequences"] == sequences
    assert m[f'tp_jax:cache_config_info{{block_size="16",cache_dtype="auto",num_gpu_blocks="{blocks}"}}'] == 1
    assert m['tp_jax:kv_cache_group_blocks{group="0",kind="full"}'] == math.ceil(256 / 16)     # one group: a Llama
    assert m['tp_jax:kv_cache_group_blocks_used{group="0",kind="full"}'] == 0
    assert (f"KV cache (kv_cache_dtype auto): {blocks} blocks x 16 tokens = {blocks * 16} tokens per replica, "
            f"{blocks * 16 * per_token / 2**20:.1f} MiB per device (float32, {per_token} bytes per token per device; "
            f"{sequences} sequences of max_model_len=256 fit)") in tiny_server.log()


def test_completions_whole_streamed_and_engine_agree(client, ref):
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    expected = ref.generate(PROMPTS, sp)
    for prompt, exp in zip(PROMPTS, expected):
        e = exp.outputs[0]
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert whole.choices[0].text == e.text and whole.choices[0].finish_reason == e.finish_reason
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
            (len(exp.prompt_token_ids), len(e.token_ids), len(exp.prompt_token_ids) + len(e.token_ids))
        text, finish, chunks = streamed(client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert text == {0: e.text} and finish == {0: e.finish_reason}
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(e.token_ids)
        assert chunks[-1].usage.prompt_tokens == len(exp.prompt_token_ids)
        assert all(ch.usage is None for ch in chunks[:-1])
    batch = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in expected]
    ids = client.completions.create(model="tiny", prompt=expected[1].prompt_token_ids, max_tokens=12, temperature=0)
    assert ids.choices[0].text == expected[1].outputs[0].text


def test_chat_whole_streamed_and_engine_agree(client, ref):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
    exp = ref.chat(messages, SamplingParams(max_tokens=10, temperature=0.0))[0]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == exp.outputs[0].text
    assert whole.usage.prompt_tokens == len(exp.prompt_token_ids)
    assert whole.usage.completion_tokens == len(exp.outputs[0].token_ids)
    text, finish, chunks = streamed(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == {0: exp.outputs[0].text} and finish == {0: exp.outputs[0].finish_reason}
    assert chunks[-1].usage.completion_tokens == len(exp.outputs[0].token_ids)


def test_n2_seeded_sampling_gives_two_choices_equal_to_the_engine(client, ref):
    sp = SamplingParams(n=2, max_tokens=10, temperature=0.9, seed=1234, ignore_eos=True)
    exp = [c.text for c in ref.generate(PROMPTS[0], sp)[0].outputs]
    assert exp[0] != exp[1]
    kw = dict(model="tiny", prompt=PROMPTS[0], n=2, max_tokens=10, temperature=0.9, seed=1234,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == exp
    assert whole.usage.completion_tokens == 20
    text, _, _ = streamed(client.completions.create(**kw, stream=True))
    assert text == {0: exp[0], 1: exp[1]}


def test_vllm_extra_sampling_fields_reach_the_engine(client, ref):
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, repetition_penalty=1.3,
                        seed=7, ignore_eos=True)
    exp = ref.generate(PROMPTS[1], sp)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0.8, top_p=0.9,
                                    seed=7, extra_body={"top_k": 20, "min_p": 0.02, "repetition_penalty": 1.3,
                                                        "ignore_eos": True})
    assert got.choices[0].text == exp.text and got.usage.completion_tokens == 16


def test_stop_string_cut_the_same_whole_and_streamed(client, ref):
    """A stop string spanning two tokens: the stream never shows its first half (held back)."""
    greedy = ref.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    tok = ref.get_tokenizer()
    boundary = len(tok.decode(greedy.token_ids[:6], skip_special_tokens=True))
    stop = greedy.text[boundary - 2:boundary + 2]
    exp = ref.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                  stop=[stop]))[0].outputs[0]
    assert exp.finish_reason == "stop" and stop not in exp.text
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (exp.text, "stop")
    assert whole.choices[0].model_extra["stop_reason"] == stop
    text, finish, _ = streamed(client.completions.create(**kw, stream=True))
    assert text == {0: exp.text} and finish == {0: "stop"}


def test_logprobs_match_the_engine(client, ref):
    exp = ref.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3,
                                                  ignore_eos=True))[0].outputs[0]
    tok = ref.get_tokenizer()
    lp = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in exp.token_ids]
    np.testing.assert_allclose(lp.token_logprobs, [d[t].logprob for t, d in zip(exp.token_ids, exp.logprobs)], atol=1e-4)
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)     # greedy: the top one
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6) for c in content)


def _mixed_requests(ref) -> list[tuple]:
    """32 requests: 16 text prompts and 16 token-id prompts of mixed lengths, 4..48 output tokens."""
    rng = np.random.default_rng(3)
    prompts = [" ".join(["word"] * int(k)) for k in rng.integers(1, 60, 16)]
    prompts += [rng.integers(100, 49000, int(k)).tolist() for k in rng.integers(3, 100, 16)]
    lengths = [4 + (i * 7) % 45 for i in range(32)]
    outs = ref.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths])
    return list(zip(prompts, lengths, outs))


def test_32_concurrent_streams_are_exact_and_metrics_agree(tiny_server, ref):
    requests = _mixed_requests(ref)
    tok = ref.get_tokenizer()
    before = metrics(tiny_server.url)

    async def one(aclient, prompt, max_tokens):
        stream = await aclient.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, tokens, usage, finish = "", [], None, None
        async for ch in stream:
            usage = ch.usage or usage
            for c in ch.choices:
                text += c.text
                tokens += c.logprobs.tokens
                finish = c.finish_reason or finish
        return text, tokens, usage, finish

    async def run_all():
        aclient = AsyncOpenAI(base_url=tiny_server.base, api_key="unused", max_retries=0, timeout=600)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p, m) for p, m, _ in requests))

    results = asyncio.run(run_all())
    for (prompt, m, exp), (text, tokens, usage, finish) in zip(requests, results):
        e = exp.outputs[0]
        assert tokens == [tok.decode([t]) for t in e.token_ids]          # its own tokens, none lost or repeated
        assert text == e.text and finish == "length" and len(tokens) == m
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(exp.prompt_token_ids), m)
    after = wait_metrics(tiny_server.url, lambda m: m["tp_jax:num_requests_running"] == 0)
    delta = lambda k: after[k] - before.get(k, 0.0)
    assert delta("tp_jax:generation_tokens_total") == sum(m for _, m, _ in requests)
    assert delta("tp_jax:prompt_tokens_total") == sum(len(o.prompt_token_ids) for *_, o in requests)
    assert success(after, "length") - success(before, "length") == 32
    assert delta("tp_jax:time_to_first_token_seconds_count") == 32
    assert delta("tp_jax:e2e_request_latency_seconds_count") == 32
    assert delta("tp_jax:inter_token_latency_seconds_count") == sum(m - 1 for _, m, _ in requests)
    assert after["tp_jax:num_requests_waiting"] == 0 and after["tp_jax:kv_blocks_used"] == 0


def test_a_client_disconnect_frees_its_blocks(tiny_server, client):
    url = tiny_server.url
    before = metrics(url)
    stream = client.completions.create(model="tiny", prompt="Tell me a long story", max_tokens=230, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in zip(range(3), stream):
        pass
    busy = metrics(url)
    assert busy["tp_jax:num_requests_running"] == 1 and busy["tp_jax:kv_blocks_used"] > 0
    stream.close()                                                   # the client goes away mid-stream
    after = wait_metrics(url, lambda m: m["tp_jax:num_requests_running"] == 0 and m["tp_jax:kv_blocks_used"] == 0)
    assert after["tp_jax:num_requests_running"] == 0 and after["tp_jax:kv_blocks_used"] == 0
    assert success(after, "abort") - success(before, "abort") == 1
    assert after["tp_jax:generation_tokens_total"] - before["tp_jax:generation_tokens_total"] < 230

    async def whole_request_then_leave():                            # not streaming: the same
        async with httpx.AsyncClient(timeout=600) as http:
            task = asyncio.create_task(http.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": "Tell me a long story", "max_tokens": 230, "ignore_eos": True}))
            running = await asyncio.to_thread(wait_metrics, url, lambda m: m["tp_jax:kv_blocks_used"] > 0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return running

    running = asyncio.run(whole_request_then_leave())
    assert running["tp_jax:num_requests_running"] == 1
    after2 = wait_metrics(url, lambda m: m["tp_jax:num_requests_running"] == 0 and m["tp_jax:kv_blocks_used"] == 0)
    assert after2["tp_jax:kv_blocks_used"] == 0
    assert success(after2, "abort") - success(after, "abort") == 1


def test_each_request_is_logged_with_its_tokens_and_latency(tiny_server, client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    lines = request_log_lines(tiny_server.log(), r.id)
    assert len(lines) == 1, tiny_server.log()[-2000:]
    assert f"{r.usage.prompt_tokens} prompt + 7 completion tokens, finish length" in lines[0]
    assert "ttft" in lines[0] and "latency" in lines[0]


def test_bench_server_drives_the_workload(tiny_server):
    from tp_jax.server.bench_client import bench_server
    rng = np.random.default_rng(0)
    work = [{"id": f"b{i}", "prompt": rng.integers(100, 49000, 5 + 9 * i).tolist(), "max_tokens": 4 + 3 * i,
             "arrival": 0.15 * i} for i in range(6)]
    before = metrics(tiny_server.url)
    result = bench_server(tiny_server.url, work)
    after = metrics(tiny_server.url)
    assert result["num_requests"] == 6 and result["output_tokens"] == sum(w["max_tokens"] for w in work)
    assert after["tp_jax:generation_tokens_total"] - before["tp_jax:generation_tokens_total"] == result["output_tokens"]
    for key in ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                "itl_p99_s"):
        assert result[key] is not None and result[key] > 0, key
    assert result["itl_p50_s"] is not None and result["itl_p50_s"] >= 0   # chunks read in one burst: gaps of ~0 s
    assert result["ttft_p50_s"] <= result["ttft_p99_s"] and result["itl_p50_s"] <= result["itl_p99_s"]
