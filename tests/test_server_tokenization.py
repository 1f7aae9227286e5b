"""vLLM's extra endpoints on the tiny server (tests/server_process.py): `/tokenize` gives the tokenizer's ids
(completion form) and exactly the ids a chat completion feeds the engine (chat form, checked against the
prompt the completion reports back), `/detokenize` inverts it, and `/version`, `/ping`, the `/v1/models`
permission entry answer as vLLM's do. Unknown models are 404, bad token ids 400; an API key guards `/v1`
only, as in vLLM."""

import asyncio
import types
from importlib.metadata import version

import httpx
import pytest

from tp_jax.server.openapi import ErrorResponse

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TEXT = "Héllo wörld — 你好, naïve café 🙂 end"


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from tp_jax.serving.tokenizer import load_tokenizer
    return load_tokenizer(tiny_path)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_a_prompt_is_the_tokenizers_ids(tiny_server, tokenizer, special):
    r = post(tiny_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": special, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(TEXT, add_special_tokens=special)
    assert r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    default = post(tiny_server, "/tokenize", {"model": "tiny", "prompt": TEXT}).json()
    assert default["tokens"] == tokenizer.encode(TEXT) and default["token_strs"] is None      # vLLM's defaults
    extra = post(tiny_server, "/tokenize", {"prompt": TEXT, "frobnicate": 1})      # unknown fields: vLLM's rule
    assert extra.status_code == 200 and extra.json()["tokens"] == default["tokens"]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_tokenize_a_chat_is_what_the_chat_completion_fed_the_engine(tiny_server, tools):
    extra = {"tools": tools} if tools else {}
    tok = post(tiny_server, "/tokenize", {"messages": CHAT, **extra, "return_token_strs": True}).json()
    chat = post(tiny_server, "/v1/chat/completions", {"messages": CHAT, **extra, "max_tokens": 1,
                                                       "prompt_logprobs": 0}).json()
    assert chat["usage"]["prompt_tokens"] == tok["count"] == len(tok["tokens"])
    assert chat["prompt_logprobs"][0] is None                # vLLM's layout: None, then {id: ...} per token
    assert [int(next(iter(lp))) for lp in chat["prompt_logprobs"][1:]] == tok["tokens"][1:]
    assert tok["token_strs"][0] == "<|im_start|>" and "".join(tok["token_strs"]).endswith("assistant\u010a")


def test_tokenize_chat_options(tiny_server, tokenizer):
    base = post(tiny_server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    bare = post(tiny_server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert base[:len(bare)] == bare and len(base) > len(bare)                  # "<|im_start|>assistant\n" more
    prefill = CHAT + [{"role": "assistant", "content": "Blue"}]
    cont = post(tiny_server, "/tokenize", {"messages": prefill, "continue_final_message": True}).json()["tokens"]
    assert tokenizer.decode(cont).endswith("assistant\nBlue")                # left open: no end-of-turn
    both = post(tiny_server, "/tokenize", {"messages": prefill, "continue_final_message": True,
                                           "add_generation_prompt": True})
    assert both.status_code == 400 and "cannot both be true" in both.json()["error"]["message"]


def test_detokenize_round_trips_non_ascii_text(tiny_server, tokenizer):
    ids = post(tiny_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    r = post(tiny_server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": TEXT}
    assert post(tiny_server, "/detokenize", {"model": "tiny", "tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, words, param", [
    ("/detokenize", {"tokens": [5, 49152, 7]}, ["tokens[1]=49152", "0 to 49151"], "tokens"),
    ("/detokenize", {"tokens": [-1]}, ["tokens.0", "greater than or equal to 0"], "tokens"),
    ("/detokenize", {"tokens": "12"}, ["tokens", "valid list"], "tokens"),
    ("/tokenize", {}, ["neither prompt nor messages", "send one"], None),
    ("/tokenize", {"prompt": "Hi", "messages": CHAT}, ["both prompt and messages"], None),
    ("/tokenize", {"prompt": "Hi", "tools": TOOLS}, ["tools applies to the chat form only"], None),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
     ["chat_template_kwargs sets tokenize"], "chat_template_kwargs"),
])
def test_bad_bodies_are_400_naming_the_problem(tiny_server, path, body, words, param):
    r = post(tiny_server, path, body)
    assert r.status_code == 400, r.text
    error = ErrorResponse.model_validate(r.json()).error
    assert all(w in error.message for w in words), error.message
    assert error.param == param


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": "nope", "prompt": "Hi"}),
                                        ("/tokenize", {"model": "nope", "messages": CHAT}),
                                        ("/detokenize", {"model": "nope", "tokens": [1]})])
def test_an_unknown_model_is_404(tiny_server, path, body):
    r = post(tiny_server, path, body)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "'tiny'" in r.json()["error"]["message"]


def test_version_ping_and_the_models_permission(tiny_server):
    assert httpx.get(f"{tiny_server.url}/version").json() == {"version": version("tp-jax")}
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{tiny_server.url}/ping")
        assert r.status_code == 200 and r.content == b""
    card = httpx.get(f"{tiny_server.base}/models").json()["data"][0]
    assert card["owned_by"] == "tp_jax" and card["max_model_len"] == 256 and card["root"] and card["parent"] is None
    (perm,) = card["permission"]
    assert perm.pop("id").startswith("modelperm-") and isinstance(perm.pop("created"), int)
    assert perm == {"object": "model_permission", "allow_create_engine": False, "allow_sampling": True,
                    "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}


def test_an_api_key_guards_v1_only_as_in_vllm(tokenizer):
    from tp_jax.server.app import create_app
    app = create_app(types.SimpleNamespace(error=None), tokenizer, model_names=["tiny"], max_model_len=256,
                     api_key="secret")

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return [(await c.post("/tokenize", json={"prompt": "Hi"})).status_code,
                    (await c.post("/detokenize", json={"tokens": [1]})).status_code,
                    (await c.get("/version")).status_code, (await c.get("/ping")).status_code,
                    (await c.get("/v1/models")).status_code]
    assert asyncio.run(ask()) == [200, 200, 200, 200, 401]
