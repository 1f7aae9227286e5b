"""Completions and chat completions on the async engine: validate, run, answer whole or as a stream.

    handler = Handler(aengine, tokenizer, ["my-model"], max_model_len, metrics)
    job = handler.completion_job(CompletionRequest(...))   # APIError (400) before anything is queued
    body = await handler.full(job)                         # the OpenAI response dict
    async for sse in handler.stream(job): ...              # "data: {...}\\n\\n" ... "data: [DONE]\\n\\n"

A job is one engine request per prompt (each with n samples); choice `i * n + j` is sample j
of prompt i. Every prompt is checked by the engine (`LLMEngine.check`) before any is queued.
Leaving `stream` early (a client that disconnects) closes the engine streams, which aborts
the requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from tp_jax.server.echo import join, prompt_logprobs_field, prompt_part
from tp_jax.server.metrics import ServerMetrics
from tp_jax.server.protocol import ChatCompletionRequest, CompletionRequest, requested_logprobs, sampling_params
from tp_jax.server.constraints import request_constraint
from tp_jax.server.chat_format import ChatFormat, choose as choose_chat_format
from tp_jax.server.chat_output import ChoiceStream, message as chat_message
from tp_jax.server.harmony import CALL, RETURN
from tp_jax.server.reasoning import wanted as reasoning_wanted
from tp_jax.server.tools import ToolMode, for_template, with_tools_described
from tp_jax.server.responses import (FINGERPRINT, TOKEN_IDS, ChoiceDelta, Delta, Tokens, chat_logprobs,
                                     completion_logprobs, usage)
from tp_jax.serving.llm_engine import PreparedRequest
from tp_jax.serving.outputs import CompletionOutput, RequestOutput
from tp_jax.serving.sampling import SamplingParams

log = logging.getLogger("tp_jax.server")
# apply_chat_template's own arguments: refused in chat_template_kwargs (the template's variables pass)
_TEMPLATE_CALL_ARGS = {"conversation", "tools", "documents", "chat_template", "tokenize", "return_dict", "padding",
                       "truncation", "max_length", "return_tensors", "tokenizer_kwargs", "return_assistant_tokens_mask"}


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Job:
    chat: bool
    id: str
    created: int
    model: str
    prompts: list[list[int]]                      # token ids per prompt
    params: SamplingParams
    request: CompletionRequest | ChatCompletionRequest
    echo_texts: list[str] | None = None           # completions with echo=true: each prompt's text
    tools: ToolMode | None = None                 # chat with tools (auto / required / named): calls parsed
    reasoning: str | None = None                  # chat read with a reasoning parser (reasoning.py)
    prepared: list[PreparedRequest] = dataclasses.field(default_factory=list)   # per prompt, as queued

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


class Handler:
    def __init__(self, aengine, tokenizer, model_names: list[str], max_model_len: int, metrics: ServerMetrics,
                 tool_parser: str | None = None, lora_modules: dict | None = None,
                 reasoning_parser: str | None = None):
        """`lora_modules`: served adapter name -> LoRARequest (`model=name` selects it). `tool_parser`,
        `reasoning_parser`: the flags' choices; None: chosen from the chat template (chat_format.py)."""
        self.aengine, self.tokenizer, self.names = aengine, tokenizer, list(model_names)
        self.loras = dict(lora_modules or {})
        self.format: ChatFormat = choose_chat_format(tokenizer, tool_parser, reasoning_parser)
        # gpt-oss's harmony: answers decoded with their markers (special tokens) kept, ended at <|return|> or <|call|>
        self.harmony = self.format.reasoning_parser == "openai_gptoss" or self.format.tool_parser == "openai"
        self.harmony_stops = harmony_stop_ids(tokenizer) if self.harmony else ()
        self.max_model_len, self.metrics = max_model_len, metrics
        self.tokens = Tokens(tokenizer)
        self.active: set[str] = set()                # engine request ids in flight

    async def abort_all(self) -> int:
        """End every request in flight now (each answers with finish_reason "abort"); how many."""
        ids = list(self.active)
        for rid in ids:
            await self.aengine.abort(rid)
        return len(ids)

    # --- turning a request into checked engine inputs ----------------------------------------------
    def completion_job(self, req: CompletionRequest) -> Job:
        if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
            raise APIError(400, "max_tokens=0 generates nothing: it is allowed only with echo=true (return the "
                                "prompt) or prompt_logprobs (score it); set one, or max_tokens >= 1", param="max_tokens")
        texts = req.prompts()
        prompts = [self._encode(p, "prompt" if len(texts) == 1 else f"prompt {i}", req.add_special_tokens)
                   for i, p in enumerate(texts)]
        job = self._job(False, "cmpl", req, prompts, req.max_tokens)
        if req.echo:
            job.echo_texts = [t if isinstance(t, str) else self._decode(ids) for t, ids in zip(texts, prompts)]
        return job

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        mode = self._tool_mode(req)
        job = self._job(True, "chatcmpl", req, [self.chat_prompt(req)], req.token_limit, mode)
        job.reasoning = reasoning_wanted(self.format.reasoning_parser, req.chat_template_kwargs,
                                         job.params.structured_outputs is not None)
        return job

    def chat_prompt(self, req) -> list[int]:
        """The token ids the chat template makes of `req.messages` (a chat completion's or `/tokenize`'s): what
        the engine is fed. Optional fields read: `continue_final_message`, `chat_template_kwargs`,
        `add_special_tokens`, `documents` (vLLM's; absent: False, none, False, none)."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template; use /v1/completions with token "
                                "ids", param="messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if tools and self.harmony:         # gpt-oss's template writes "// " + description; vLLM needs none
            tools = [{**t, "function": {"description": "", **t["function"]}} for t in tools]
        extra = getattr(req, "chat_template_kwargs", None) or {}
        if own := sorted(_TEMPLATE_CALL_ARGS & extra.keys()):
            raise APIError(400, f"chat_template_kwargs sets {', '.join(own)}: arguments of the template call, not "
                                f"variables of the template; remove them", param="chat_template_kwargs")
        effort = getattr(req, "reasoning_effort", None)          # vLLM's: a template variable (gpt-oss reads it)
        kwargs = {**({} if effort is None else {"reasoning_effort": effort}), **extra,
                  "add_generation_prompt": req.add_generation_prompt,
                  "continue_final_message": getattr(req, "continue_final_message", False)}
        messages = req.conversation()
        if tools and self.format.inject_tools and getattr(req, "tool_choice_name", "auto") == "auto":
            messages = with_tools_described(messages, tools)     # the template renders none: for "auto" to read
        try:
            text = self.tokenizer.apply_chat_template([for_template(m) for m in messages], tools=tools,
                                                      documents=getattr(req, "documents", None), tokenize=False,
                                                      **kwargs)
        except Exception as e:                         # the template's own complaint (jinja, missing template)
            raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None
        return list(self.tokenizer.encode(text, add_special_tokens=getattr(req, "add_special_tokens", False)))

    def _tool_mode(self, req: ChatCompletionRequest) -> ToolMode | None:
        choice = req.tool_choice_name
        if choice == "none":
            return None
        name = req.tool_choice.function.name if choice == "named" else None
        return ToolMode(choice, list(req.tools), name, self.format.tool_parser, req.parallel_tool_calls is not False)

    def _encode(self, prompt: str | list[int], where: str, special: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if not prompt:
            raise APIError(400, f"{where} is an empty string; give some text or token ids", param="prompt")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer files: send the prompt as token ids", param="prompt")
        return list(self.tokenizer.encode(prompt, add_special_tokens=special))

    def served(self, model: str | None):
        """The LoRARequest a request's `model` names (None: the base model); 404 model_not_found if not served."""
        if model is None or model in self.names:
            return None
        if model not in self.loras:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in [*self.names, *self.loras])} (GET /v1/models)",
                           param="model", code="model_not_found")
        return self.loras[model]

    def _job(self, chat: bool, prefix: str, req, prompts: list[list[int]], max_tokens: int | None,
             tools: ToolMode | None = None) -> Job:
        lora = self.served(req.model)
        constraint = None
        try:
            constraint = request_constraint(req, None if tools is None else tools.constraint())
            params = sampling_params(req, max_tokens, constraint and constraint[1])
            params = self._for_format(params) if chat else params
        except ValueError as e:
            raise APIError(400, str(e).removeprefix("SamplingParams: "), param=getattr(e, "param", None)) from None
        field = "messages" if chat else "prompt"
        prepared = []
        for i, ids in enumerate(prompts):
            where = field if len(prompts) == 1 else f"{field} {i}"
            try:
                prepared.append(self.aengine.engine.prepare(ids, params, where, lora))   # a bad grammar: 400 here
            except (ValueError, TypeError) as e:
                bad = constraint is not None and "structured outputs" in str(e)
                raise APIError(400, str(e), param=constraint[0] if bad else field) from None
            if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
                name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
                raise APIError(400, f"{where} has {len(ids)} tokens and {name}={max_tokens} asks for more: "
                                    f"{len(ids) + max_tokens} exceeds max_model_len={self.max_model_len}; lower "
                                    f"{name} to at most {self.max_model_len - len(ids)} or shorten the {field}",
                               param=name, code="context_length_exceeded")
        model = req.model if req.model is not None else self.names[0]
        return Job(chat, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, prompts, params, req,
                   tools=tools, prepared=prepared)

    def _for_format(self, params: SamplingParams) -> SamplingParams:
        """A chat request's params as the chat format needs them. Harmony (gpt-oss): decoded with special tokens
        kept (its markers are special tokens), and ended at <|return|> and <|call|> as vLLM ends it."""
        if not self.harmony:
            return params
        stops = params.stop_token_ids + tuple(t for t in self.harmony_stops if t not in params.stop_token_ids)
        return dataclasses.replace(params, skip_special_tokens=False, stop_token_ids=stops)

    # --- LoRA adapters at run time (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -------------
    def load_adapter(self, name: str, path: str) -> str:
        """Serve the adapter at `path` as model `name` (checked as a request's adapter is: 400 if refused)."""
        from tp_jax.serving.lora import LoRARequest
        if name in self.names or name in self.loras:
            raise APIError(400, f"the model name {name!r} is already served; unload it first or choose another "
                                f"lora_name", param="lora_name")
        known = [r.lora_int_id for r in self.loras.values()] + list(self.aengine.engine.core.lora_slots.known)
        req = LoRARequest(name, max(known, default=0) + 1, path)
        try:
            self.aengine.engine.core.check_lora(req, f"lora_name {name!r}")
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="lora_path") from None
        self.loras[name] = req
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, name: str) -> str:
        """Stop serving adapter `name` (requests already running finish with it)."""
        if self.loras.pop(name, None) is None:
            raise APIError(404, f"the LoRA adapter {name!r} is not served; served adapters: "
                                f"{', '.join(repr(n) for n in self.loras) or 'none'}", param="lora_name",
                           code="model_not_found")
        return f"Success: LoRA adapter '{name}' removed successfully."

    # --- running it ----------------------------------------------------------------------------------
    async def _run(self, job: Job, stream: bool) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative RequestOutput) as the engine makes progress, all prompts merged."""
        ids = [job.id if len(job.prompts) == 1 else f"{job.id}-{i}" for i in range(len(job.prompts))]
        timers = [self.metrics.timer(rid, len(p)) for rid, p in zip(ids, job.prompts)]
        gens = [self.aengine.generate(p, request_id=rid, stream=stream) for rid, p in zip(ids, job.prepared)]
        self.active.update(ids)
        try:
            async for i, out in merge(gens):
                timers[i].observe(out)
                yield i, out
        except (GeneratorExit, asyncio.CancelledError):
            for t in timers:
                t.abort("cancelled: the client disconnected")
            raise
        except BaseException as e:
            for t in timers:
                t.abort(f"error: {e}")
            raise
        finally:
            self.active.difference_update(ids)

    async def full(self, job: Job) -> dict:
        final: dict[int, RequestOutput] = {}
        async for i, out in self._run(job, stream=False):
            final[i] = out
        n = job.request.n                              # of the job's params.n = best_of samples: the n most likely
        best = lambda outs: sorted(outs, key=lambda c: -c.cumulative_logprob)[:n] if len(outs) > n else outs
        choices = [self._choice(job, i * n + k, c, final[i]) for i in sorted(final)
                   for k, c in enumerate(best(final[i].outputs))]
        body = {"id": job.id, "object": job.object, "created": job.created, "model": job.model, "choices": choices,
                "usage": self._usage(job, final.values()), "system_fingerprint": FINGERPRINT}
        if job.chat and job.request.prompt_logprobs is not None:          # vLLM: chat's is top-level
            body["prompt_logprobs"] = prompt_logprobs_field(final[0].prompt_token_ids, final[0].prompt_logprobs,
                                                            job.request.prompt_logprobs, self.tokens)
        return body

    def _choice(self, job: Job, index: int, c: CompletionOutput, out: RequestOutput) -> dict:
        lp = self._logprobs(job, Delta(c.token_ids, c.logprobs, c.text, None, None, 0))
        if job.chat:
            message, reason = chat_message(c.text, c.finish_reason, job.tools, job.reasoning)
            if job.request.functions is not None and message.get("tool_calls"):   # the deprecated form's answer
                calls = message.pop("tool_calls")
                message = {**message, "function_call": calls[0]["function"]}
                reason = "function_call" if reason == "tool_calls" else reason
            if job.request.echo_text:                 # vLLM's chat echo: the last (assistant) message first
                message = {**message, "content": job.request.echo_text + (message.get("content") or "")}
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason,
                    "stop_reason": c.stop_reason}
        text, lp, extra = self._with_prompt(job, index, out, c.text, lp, True)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, **extra}

    def _with_prompt(self, job: Job, index: int, out: RequestOutput, text: str, lp: dict | None, first: bool):
        """A completions choice's (text, logprobs, extra fields) with its prompt: echoed in front (`first`: the
        choice's first chunk, or the whole answer) and vLLM's `prompt_logprobs` field, when asked."""
        r, i, tokens = job.request, index // job.params.n, self._tokens(job)
        extra = {}
        top = r.prompt_logprobs if r.prompt_logprobs is not None else r.logprobs if r.echo else None
        if top is not None and first:             # vLLM: echo with logprobs scores the prompt, and says so here too
            extra["prompt_logprobs"] = prompt_logprobs_field(out.prompt_token_ids, out.prompt_logprobs, top, tokens)
        if not r.echo:
            return text, lp, extra
        prefix = prompt_part(job.echo_texts[i], out.prompt_token_ids, out.prompt_logprobs, r.logprobs, tokens)
        text, lp = join(prefix if first else None, len(job.echo_texts[i]), text, lp)
        return text, lp, extra

    def _logprobs(self, job: Job, d: Delta) -> dict | None:
        n = requested_logprobs(job.request)
        if n is None or d.logprobs is None:
            return None
        if job.chat:
            return chat_logprobs(d.token_ids, d.logprobs, n, self._tokens(job))
        return completion_logprobs(d.token_ids, d.logprobs, n, self._tokens(job), d.text_offset)

    def _tokens(self, job: Job) -> Tokens:
        """How logprobs name tokens: their text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
        return TOKEN_IDS if job.request.return_tokens_as_token_ids else self.tokens

    @staticmethod
    def _usage(job: Job, outs) -> dict:
        return usage(sum(len(p) for p in job.prompts), sum(len(c.token_ids) for o in outs for c in o.outputs))

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """Server-sent events: a chunk per new token(s) of each choice, usage if asked, then [DONE]."""
        async with contextlib.aclosing(self.chunks(job)) as chunks:     # closing it aborts the engine requests
            async for obj in chunks:
                yield sse(obj)
        yield "data: [DONE]\n\n"

    async def chunks(self, job: Job) -> AsyncIterator[dict]:
        """The stream's chunks as dicts (the Responses API's events are made from them); an engine failure
        mid-stream: OpenAI's error body, then the usage chunk if asked."""
        n, include_usage = job.params.n, job.request.include_usage
        deltas = [ChoiceDelta(job.params.stop) for _ in range(len(job.prompts) * n)]
        tool_streams = None if job.tools is None and job.reasoning is None else \
            [ChoiceStream(job.tools, job.reasoning) for _ in deltas]
        continuous = include_usage and job.request.continuous_usage           # vLLM: usage so far in every chunk
        last: dict[int, RequestOutput] = {}

        def chunk(choice):                             # one choice per chunk, as OpenAI and vLLM stream n > 1
            extra = {"usage": self._usage(job, last.values()) if continuous else None} if include_usage else {}
            if choice["finish_reason"] is not None and not include_usage:     # vLLM: the last chunk of a choice
                extra["system_fingerprint"] = FINGERPRINT                       # (or the usage chunk) says it
            return {"id": job.id, "object": f"{job.object}.chunk" if job.chat else job.object, "created": job.created,
                    "model": job.model, "choices": [choice], **extra}
        if job.chat:
            for k in range(len(deltas)):
                yield chunk({"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            for k in range(len(deltas) if job.request.echo_text else 0):       # vLLM: then the echo, per choice
                yield chunk({"index": k, "delta": {"content": job.request.echo_text}, "logprobs": None,
                             "finish_reason": None})
        try:
            async for i, out in self._run(job, stream=True):
                last[i] = out
                for c in out.outputs:
                    d = deltas[i * n + c.index].update(c)
                    if d is None:
                        continue
                    k = i * n + c.index
                    choice = self._chunk_choice(job, k, d, out, tool_streams and tool_streams[k])
                    if choice.get("delta", True) or choice["finish_reason"] is not None or choice["logprobs"]:
                        yield chunk(choice)                # (a tool call's opening, not yet a name: nothing to send)
        except Exception as e:                         # the engine failed mid-stream: say so, then end it
            log.exception("request %s failed", job.id)
            yield APIError(500, f"the request failed: {e}", type="internal_server_error").body()
        if include_usage:
            yield {"id": job.id, "object": f"{job.object}.chunk" if job.chat else job.object,
                   "created": job.created, "model": job.model, "choices": [], "system_fingerprint": FINGERPRINT,
                   "usage": self._usage(job, last.values())}

    def _chunk_choice(self, job: Job, index: int, d: Delta, out: RequestOutput,
                      tools: ChoiceStream | None = None) -> dict:
        common = {"index": index, "logprobs": self._logprobs(job, d), "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            common["stop_reason"] = d.stop_reason
        if tools is not None:
            delta, common["finish_reason"] = tools.delta(d.text, d.finish_reason)
            if job.request.functions is not None:         # the deprecated form streams function_call deltas
                delta, common["finish_reason"] = _legacy_delta(delta, common["finish_reason"])
            return {**common, "delta": delta}
        if job.chat:
            return {**common, "delta": {"content": d.text} if d.text or d.finish_reason is None else {}}
        text, common["logprobs"], extra = self._with_prompt(job, index, out, d.text, common["logprobs"], d.first)
        return {**common, "text": text, **extra}


def harmony_stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids of harmony's ends of an assistant turn, `<|return|>` and `<|call|>`, that the tokenizer has, less its
    EOS (already an end of every request: reported with stop_reason null, as vLLM reports it)."""
    vocab = {} if tokenizer is None else tokenizer.get_vocab()
    eos = getattr(tokenizer, "eos_token_id", None)
    return tuple(vocab[t] for t in (RETURN, CALL) if t in vocab and vocab[t] != eos)


def _legacy_delta(delta: dict, finish_reason: str | None) -> tuple[dict, str | None]:
    """A streamed tool-call delta in the deprecated `functions` form: the first call's name and arguments as
    `function_call` (OpenAI's legacy stream), finish_reason "function_call"."""
    calls = delta.pop("tool_calls", None)
    fn = next((c.get("function") for c in calls or () if c.get("index", 0) == 0), None)
    if fn:
        delta["function_call"] = {k: v for k, v in fn.items() if k in ("name", "arguments")}
    return delta, "function_call" if finish_reason == "tool_calls" else finish_reason


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def merge(gens: list) -> AsyncIterator[tuple[int, object]]:
    """Items of several async generators as they come, tagged with the generator's index.

    Closing the merged generator cancels the pumps, which closes every source generator."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, gen) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
