"""Every bad request gets 400 (404 for an unknown route) with OpenAI's error body and a message naming
the problem, and never reaches the engine (its counters do not move). The tiny server of
tests/server_process.py; the `openai` client sees them as BadRequestError with that message."""

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server_process import metrics

CHAT = [{"role": "user", "content": "Hi"}]
TOO_LONG = list(range(100, 400))                     # 300 tokens > max_model_len 256

# (name, route, JSON body or raw bytes, words the message must contain, param)
CASES = [
    ("max_tokens 0 without echo or prompt_logprobs", "completions", {"prompt": "Hi", "max_tokens": 0},
     ["max_tokens=0 generates nothing", "echo=true", "prompt_logprobs"], "max_tokens"),
    ("max_tokens < 0", "completions", {"prompt": "Hi", "max_tokens": -1}, ["max_tokens", "greater than or equal to 0"],
     "max_tokens"),
    ("prompt_logprobs over 20", "completions", {"prompt": "Hi", "prompt_logprobs": 21},
     ["prompt_logprobs", "less than or equal to 20"], "prompt_logprobs"),
    ("negative prompt_logprobs", "chat/completions", {"messages": CHAT, "prompt_logprobs": -1},
     ["prompt_logprobs", "greater than or equal to 0"], "prompt_logprobs"),
    ("max_tokens 0 on chat", "chat/completions", {"messages": CHAT, "max_tokens": 0, "prompt_logprobs": 1},
     ["max_tokens", "greater than or equal to 1"], "max_tokens"),
    ("echo with a prompt at max_model_len and a token to generate", "completions",
     {"prompt": TOO_LONG[:256], "echo": True, "logprobs": 1, "max_tokens": 1},
     ["256 tokens", "max_model_len=256", "leaves no room to generate"], "prompt"),
    ("max_completion_tokens < 1", "chat/completions", {"messages": CHAT, "max_completion_tokens": 0},
     ["max_completion_tokens", "greater than or equal to 1"], "max_completion_tokens"),
    ("prompt longer than max_model_len", "completions", {"prompt": TOO_LONG},
     ["300 tokens", "max_model_len=256"], "prompt"),
    ("prompt + max_tokens over max_model_len", "completions", {"prompt": TOO_LONG[:200], "max_tokens": 100},
     ["200 tokens", "max_tokens=100", "max_model_len=256", "at most 56"], "max_tokens"),
    ("malformed JSON", "completions", b'{"prompt": "Hi",', ["malformed JSON"], None),
    ("body not an object", "completions", b"[1, 2]", ["must be a JSON object"], None),
    ("no body", "completions", b"", ["body is missing"], None),
    ("max_tokens of the wrong type", "completions", {"prompt": "Hi", "max_tokens": "ten"},
     ["max_tokens", "valid integer", "'ten'"], "max_tokens"),
    ("temperature of the wrong type", "completions", {"prompt": "Hi", "temperature": "hot"},
     ["temperature", "valid number"], "temperature"),
    ("prompt of the wrong type", "completions", {"prompt": 123}, ["prompt must be a string", "got 123"], "prompt"),
    ("stop of the wrong type", "completions", {"prompt": "Hi", "stop": [1]}, ["stop must be a string"], "stop"),
    ("messages of the wrong type", "chat/completions", {"messages": "Hi"}, ["messages", "valid list"], "messages"),
    ("messages missing", "chat/completions", {"model": "tiny"}, ["messages is required"], "messages"),
    ("unknown role", "chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, ["role", "'robot'"],
     "messages"),
    ("image content", "chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ["messages.0.content must be a string or a list of"], "messages"),
    ("a vLLM field not implemented here, not at its neutral value", "completions",
     {"prompt": "Hi", "use_beam_search": True}, ["use_beam_search=True is not supported", "leave it out"],
     "use_beam_search"),
    ("temperature above OpenAI's 2", "chat/completions", {"messages": CHAT, "temperature": 2.5},
     ["temperature", "less than or equal to 2"], "temperature"),
    ("more than 4 stop strings", "completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]},
     ["stop has 5 strings", "at most 4"], "stop"),
    ("min_tokens above max_tokens", "completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3},
     ["min_tokens=3 exceeds max_tokens=2"], None),
    ("logit_bias key not a token id", "completions", {"prompt": "Hi", "logit_bias": {"hello": 1}},
     ["logit_bias keys must be token ids", "'hello'"], "logit_bias"),
    ("logit_bias out of range", "completions", {"prompt": "Hi", "logit_bias": {"5": 101}},
     ["logit_bias.5", "less than or equal to 100"], "logit_bias"),
    ("logit_bias naming a token outside the vocabulary", "completions", {"prompt": "Hi", "logit_bias": {"60000": 1}},
     ["logit_bias names token ids outside [0, 49152)", "60000"], "prompt"),
    ("continue_final_message with add_generation_prompt", "chat/completions",
     {"messages": CHAT, "continue_final_message": True}, ["cannot take add_generation_prompt=true"],
     "continue_final_message"),
    ("top_k of the wrong type", "completions", {"prompt": "Hi", "top_k": "many"}, ["top_k", "valid integer"], "top_k"),
    ("logprobs over 20", "completions", {"prompt": "Hi", "logprobs": 21}, ["logprobs", "less than or equal to 20"],
     "logprobs"),
    ("top_p out of range", "completions", {"prompt": "Hi", "top_p": 1.5}, ["top_p", "less than or equal to 1"],
     "top_p"),
    ("n < 1", "completions", {"prompt": "Hi", "n": 0}, ["n:", "greater than or equal to 1"], "n"),
    ("negative temperature", "chat/completions", {"messages": CHAT, "temperature": -1}, ["temperature"], "temperature"),
    ("empty prompt", "completions", {"prompt": ""}, ["prompt is an empty string"], "prompt"),
    ("token id outside the vocabulary", "completions", {"prompt": [5, 60000]}, ["outside [0, 49152)", "60000"],
     "prompt"),
    ("tool without its function", "chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]},
     ["tools.0.function"], "tools"),
    ("json schema that does not compile", "chat/completions",
     {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}}}},
     ["structured outputs: the json cannot be compiled", "property 'a' is unsatisfiable"], "response_format"),
    ("a $ref that points nowhere", "chat/completions",
     {"messages": CHAT, "structured_outputs": {"json": {"$ref": "#/defs/nope"}}},
     ["Pointer '/defs/nope' does not exist"], "structured_outputs"),
    ("regex that does not compile", "completions", {"prompt": "Hi", "structured_outputs": {"regex": "[a-"}},
     ["structured outputs: the regex cannot be compiled"], "structured_outputs"),
    ("tool_choice auto without a tool", "chat/completions", {"messages": CHAT, "tool_choice": "auto"},
     ["tool_choice='auto' needs tools"], "tool_choice"),
    ("top_logprobs without logprobs", "chat/completions", {"messages": CHAT, "top_logprobs": 2},
     ["top_logprobs needs logprobs=true"], "top_logprobs"),
]


@pytest.mark.parametrize("name,route,body,words,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_400_naming_the_problem(tiny_server, name, route, body, words, param):
    before = metrics(tiny_server.url)
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = httpx.post(f"{tiny_server.base}/{route}", timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    for w in words:
        assert w in err["message"], err["message"]
    after = metrics(tiny_server.url)
    for k in ("tp_jax:engine_steps_total", "tp_jax:prompt_tokens_total", "tp_jax:generation_tokens_total"):
        assert after[k] == before[k], f"{k}: the bad request reached the engine"


def test_an_unknown_model_is_404_model_not_found_as_openai_and_vllm_answer(tiny_server):
    r = httpx.post(f"{tiny_server.base}/completions", json={"model": "gpt-9", "prompt": "Hi"}, timeout=60)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "gpt-9" in err["message"] and "does not exist" in err["message"] and "'tiny'" in err["message"]
    client = OpenAI(base_url=tiny_server.base, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError, match="the model `gpt-9` does not exist"):
        client.chat.completions.create(model="gpt-9", messages=CHAT)


def test_the_openai_client_sees_the_message(tiny_server):
    client = OpenAI(base_url=tiny_server.base, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="max_model_len=256"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 300}])
    with pytest.raises(openai.BadRequestError, match="use_beam_search=True is not supported"):
        client.completions.create(model="tiny", prompt="Hi", extra_body={"use_beam_search": True})


def test_unknown_route_is_404_in_the_same_shape(tiny_server):
    r = httpx.get(f"{tiny_server.base}/engines", timeout=60)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Not Found: GET /v1/engines"
