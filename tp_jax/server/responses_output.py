"""The Responses API's answers, made from the chat path's: the Response object, its output items, its events.

* `output_items(message, finish_reason, logprobs)` — a chat completion's message as Response output
  items: a `reasoning` item (when a reasoning parser split one off), a `message` item with one
  `output_text` part, then one `function_call` item per tool call.
* `response_object(run, output, finish_reason, usage)` — the Response: `status` "completed", or
  "incomplete" (`incomplete_details.reason` "max_output_tokens") when the token limit cut it,
  the request's settings echoed as OpenAI does.
* `Events` — a stream: the chat stream's deltas become OpenAI's server-sent events, each
  `event: <type>` / `data: {..., "sequence_number": k}`: `response.created`, `response.in_progress`,
  then per output item `response.output_item.added`, (`response.content_part.added`,
  `response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`) or
  (`response.function_call_arguments.delta`..., `.done`), `response.output_item.done`; last
  `response.completed` (`response.incomplete` when cut short) with the whole Response.
"""

from __future__ import annotations

import json
import uuid

INCOMPLETE = {"length": "max_output_tokens"}          # chat finish_reason -> incomplete_details.reason


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    if finish_reason == "abort":
        return "cancelled"
    return "incomplete" if finish_reason in INCOMPLETE else "completed"


def response_usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},    # no hosted tools run here
            "total_tokens": usage["total_tokens"]}


def _reasoning_of(message: dict) -> str | None:
    return message.get("reasoning_content") or message.get("reasoning")


def message_item(text: str, logprobs: list | None, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": _id("msg"), "type": "message", "status": status, "role": "assistant", "content": [part]}


def function_call_item(call: dict, status: str = "completed") -> dict:
    return {"id": _id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict, finish_reason: str | None, logprobs: dict | None) -> list[dict]:
    """A chat message's output items (a message item even when the text is empty, if there is nothing else)."""
    status, calls = status_of(finish_reason), message.get("tool_calls") or []
    items = [reasoning_item(r)] if (r := _reasoning_of(message)) else []
    if message.get("content") or not (calls or items):
        items.append(message_item(message.get("content") or "", logprobs and logprobs.get("content"), status))
    return items + [function_call_item(c) for c in calls]


def response_object(run, output: list[dict], finish_reason: str | None, usage: dict | None,
                    status: str | None = None) -> dict:
    """The Response of `run` (a responses_api.Run); `status` overrides the one finish_reason gives."""
    r = run.request
    status = status or status_of(finish_reason)
    reason = INCOMPLETE.get(finish_reason) if status == "incomplete" else None
    return {"id": run.id, "object": "response", "created_at": run.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": None if reason is None else {"reason": reason},
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls, "model": run.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": r.previous_response_id,
            "reasoning": r.reasoning or {"effort": None, "summary": None}, "service_tier": r.service_tier,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "frequency_penalty": 0.0, "presence_penalty": 0.0,      # vLLM's fields; a Responses request sets neither
            "text": r.text_config(), "tool_choice": r.tool_choice_echo(), "tools": [t.model_dump() for t in r.tools],
            "top_logprobs": r.top_logprobs, "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": r.truncation, "usage": response_usage(usage), "user": r.user, "metadata": r.metadata or {}}


def as_messages(output: list[dict]) -> list[dict]:
    """Output items as the chat messages a follow-up's conversation continues with (reasoning dropped, as
    vLLM; the text and the calls are one assistant turn)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


class Events:
    """One streamed response: `start()`, `delta(chunk choice)` per chat chunk, then `finish(...)` (or
    `failed(error)`); each returns its server-sent events. One output item is open at a time."""

    def __init__(self, run):
        self.run, self.seq, self.output = run, 0, []
        self.open: dict | None = None               # the output item being streamed (also in self.output)

    def event(self, type_: str, **fields) -> str:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        initial = response_object(self.run, [], None, None, status="in_progress")
        return [self.event("response.created", response=initial), self.event("response.in_progress", response=initial)]

    def delta(self, choice: dict) -> list[str]:
        d, out = choice.get("delta") or {}, []
        if reasoning := _reasoning_of(d):
            out += self._text("reasoning", reasoning, [])
        if d.get("content"):
            out += self._text("message", d["content"], (choice.get("logprobs") or {}).get("content") or [])
        for call in d.get("tool_calls") or []:
            if call.get("id"):                      # a new call: its name comes whole, its arguments in pieces
                out += self._close() + self._add(function_call_item({**call, "function": {
                    "name": call["function"]["name"], "arguments": ""}}, "in_progress"))
            if args := (call.get("function") or {}).get("arguments"):
                self.open["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=args))
        return out

    def finish(self, finish_reason: str | None, usage: dict | None) -> tuple[list[str], dict]:
        """The closing events and the whole Response (what `response.completed` carries)."""
        out = [] if self.output else self._add(message_item("", [], "in_progress")) + self._part_added()
        out += self._close(status_of(finish_reason))
        response = response_object(self.run, self.output, finish_reason, usage)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + [self.event(kind, response=response)], response

    def failed(self, error: dict) -> list[str]:
        """The engine failed mid-stream: OpenAI's `error` event, then `response.failed`."""
        out = self._close("incomplete")
        response = {**response_object(self.run, self.output, None, None, status="failed"),
                    "error": {"code": "server_error", "message": error.get("message", "the request failed")}}
        return out + [self.event("error", code="server_error", message=response["error"]["message"], param=None),
                      self.event("response.failed", response=response)]

    # --- one output item at a time -----------------------------------------------------------------
    def _where(self, part: bool = False) -> dict:
        where = {"item_id": self.open["id"], "output_index": len(self.output) - 1}
        return {**where, "content_index": 0} if part else where

    def _add(self, item: dict) -> list[str]:
        self.output.append(item)
        self.open = item
        added = {**item, "content": []} if "content" in item else item      # its parts come with their own events
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)]

    def _part_added(self) -> list[str]:
        return [self.event("response.content_part.added", **self._where(True), part=self.open["content"][0])]

    def _text(self, kind: str, text: str, logprobs: list) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != kind:
            item = message_item("", [], "in_progress") if kind == "message" else reasoning_item("", "in_progress")
            out = self._close() + self._add(item) + self._part_added()
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", **self._where(True), delta=text)]
        part["logprobs"] += logprobs
        return out + [self.event("response.output_text.delta", **self._where(True), delta=text, logprobs=logprobs)]

    def _close(self, status: str = "completed") -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", **self._where(), name=item["name"],
                                  arguments=item["arguments"]))
        else:
            part, where = item["content"][0], self._where(True)
            if item["type"] == "message":
                out.append(self.event("response.output_text.done", **where, text=part["text"],
                                      logprobs=part["logprobs"]))
            else:
                out.append(self.event("response.reasoning_text.done", **where, text=part["text"]))
            out.append(self.event("response.content_part.done", **where, part=part))
        item["status"] = status if item["type"] == "message" else "completed"
        out.append(self.event("response.output_item.done", output_index=len(self.output) - 1, item=item))
        self.open = None
        return out
