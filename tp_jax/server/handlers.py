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
from tp_jax.server.tools import ToolMode, ToolStream, for_template
from tp_jax.server.responses import ChoiceDelta, Delta, Tokens, chat_logprobs, completion_logprobs, usage
from tp_jax.serving.llm_engine import PreparedRequest
from tp_jax.serving.outputs import CompletionOutput, RequestOutput
from tp_jax.serving.sampling import SamplingParams

log = logging.getLogger("tp_jax.server")


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
    prepared: list[PreparedRequest] = dataclasses.field(default_factory=list)   # per prompt, as queued

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


class Handler:
    def __init__(self, aengine, tokenizer, model_names: list[str], max_model_len: int, metrics: ServerMetrics,
                 tool_parser: str | None = None, lora_modules: dict | None = None):
        """`lora_modules`: served adapter name -> LoRARequest (`model=name` selects it)."""
        self.aengine, self.tokenizer, self.names = aengine, tokenizer, list(model_names)
        self.loras = dict(lora_modules or {})
        self.tool_parser = tool_parser                # tools.PARSERS key for tool_choice "auto", or None
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
        prompts = [self._encode(p, "prompt" if len(texts) == 1 else f"prompt {i}") for i, p in enumerate(texts)]
        job = self._job(False, "cmpl", req, prompts, req.max_tokens)
        if req.echo:
            job.echo_texts = [t if isinstance(t, str) else self._decode(ids) for t, ids in zip(texts, prompts)]
        return job

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template; use /v1/completions with token "
                                "ids", param="messages")
        mode = self._tool_mode(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = self.tokenizer.apply_chat_template([for_template(m) for m in req.conversation()], tools=tools,
                                                      tokenize=False, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:                         # the template's own complaint (jinja, missing template)
            raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._job(True, "chatcmpl", req, [ids], req.token_limit, mode)

    def _tool_mode(self, req: ChatCompletionRequest) -> ToolMode | None:
        choice = req.tool_choice_name
        if choice == "none":
            return None
        if choice == "auto" and self.tool_parser is None:
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs a server started with '
                                '--tool-call-parser (hermes, llama3_json) to read the model\'s calls; send tool_choice '
                                '"required", a named function or "none", or restart the server with the flag',
                           param="tool_choice")
        name = req.tool_choice.function.name if choice == "named" else None
        return ToolMode(choice, list(req.tools), name, self.tool_parser, req.parallel_tool_calls is not False)

    def _encode(self, prompt: str | list[int], where: str) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if not prompt:
            raise APIError(400, f"{where} is an empty string; give some text or token ids", param="prompt")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer files: send the prompt as token ids", param="prompt")
        return list(self.tokenizer.encode(prompt))

    def _job(self, chat: bool, prefix: str, req, prompts: list[list[int]], max_tokens: int | None,
             tools: ToolMode | None = None) -> Job:
        lora = None if req.model is None or req.model in self.names else self.loras.get(req.model)
        if req.model is not None and req.model not in self.names and lora is None:
            raise APIError(404, f"the model `{req.model}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in [*self.names, *self.loras])} (GET /v1/models)",
                           param="model", code="model_not_found")
        constraint = None
        try:
            constraint = request_constraint(req, None if tools is None else tools.constraint())
            params = sampling_params(req, max_tokens, constraint and constraint[1])
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
        n = job.params.n
        choices = [self._choice(job, i * n + c.index, c, final[i]) for i in sorted(final) for c in final[i].outputs]
        body = {"id": job.id, "object": job.object, "created": job.created, "model": job.model, "choices": choices,
                "usage": self._usage(job, final.values())}
        if job.chat and job.request.prompt_logprobs is not None:          # vLLM: chat's is top-level
            body["prompt_logprobs"] = prompt_logprobs_field(final[0].prompt_token_ids, final[0].prompt_logprobs,
                                                            job.request.prompt_logprobs, self.tokens)
        return body

    def _choice(self, job: Job, index: int, c: CompletionOutput, out: RequestOutput) -> dict:
        lp = self._logprobs(job, Delta(c.token_ids, c.logprobs, c.text, None, None, 0))
        if job.chat:
            message, reason = ({"role": "assistant", "content": c.text}, c.finish_reason) if job.tools is None \
                else job.tools.message(c.text, c.finish_reason)
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason,
                    "stop_reason": c.stop_reason}
        text, lp, extra = self._with_prompt(job, index, out, c.text, lp, True)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, **extra}

    def _with_prompt(self, job: Job, index: int, out: RequestOutput, text: str, lp: dict | None, first: bool):
        """A completions choice's (text, logprobs, extra fields) with its prompt: echoed in front (`first`: the
        choice's first chunk, or the whole answer) and vLLM's `prompt_logprobs` field, when asked."""
        r, i = job.request, index // job.params.n
        extra = {}
        if r.prompt_logprobs is not None and first:
            extra["prompt_logprobs"] = prompt_logprobs_field(out.prompt_token_ids, out.prompt_logprobs,
                                                             r.prompt_logprobs, self.tokens)
        if not r.echo:
            return text, lp, extra
        prefix = prompt_part(job.echo_texts[i], out.prompt_token_ids, out.prompt_logprobs, r.logprobs, self.tokens)
        text, lp = join(prefix if first else None, len(job.echo_texts[i]), text, lp)
        return text, lp, extra

    def _logprobs(self, job: Job, d: Delta) -> dict | None:
        n = requested_logprobs(job.request)
        if n is None or d.logprobs is None:
            return None
        if job.chat:
            return chat_logprobs(d.token_ids, d.logprobs, n, self.tokens)
        return completion_logprobs(d.token_ids, d.logprobs, n, self.tokens, d.text_offset)

    @staticmethod
    def _usage(job: Job, outs) -> dict:
        return usage(sum(len(p) for p in job.prompts), sum(len(c.token_ids) for o in outs for c in o.outputs))

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """Server-sent events: a chunk per new token(s) of each choice, usage if asked, then [DONE]."""
        n, include_usage = job.params.n, job.request.include_usage
        deltas = [ChoiceDelta(job.params.stop) for _ in range(len(job.prompts) * n)]
        tool_streams = None if job.tools is None else [ToolStream(job.tools) for _ in deltas]
        extra = {"usage": None} if include_usage else {}
        chunk = lambda choices: sse({"id": job.id, "object": f"{job.object}.chunk" if job.chat else job.object,
                                     "created": job.created, "model": job.model, "choices": choices, **extra})
        if job.chat:
            yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for k in range(len(deltas))])
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in self._run(job, stream=True):
                last[i] = out
                choices = []
                for c in out.outputs:
                    d = deltas[i * n + c.index].update(c)
                    if d is not None:
                        k = i * n + c.index
                        choices.append(self._chunk_choice(job, k, d, out, tool_streams and tool_streams[k]))
                if choices:
                    yield chunk(choices)
        except Exception as e:                         # the engine failed mid-stream: say so, then end it
            log.exception("request %s failed", job.id)
            yield sse(APIError(500, f"the request failed: {e}", type="internal_server_error").body())
        if include_usage:
            yield sse({"id": job.id, "object": f"{job.object}.chunk" if job.chat else job.object,
                       "created": job.created, "model": job.model, "choices": [],
                       "usage": self._usage(job, last.values())})
        yield "data: [DONE]\n\n"

    def _chunk_choice(self, job: Job, index: int, d: Delta, out: RequestOutput,
                      tools: ToolStream | None = None) -> dict:
        common = {"index": index, "logprobs": self._logprobs(job, d), "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            common["stop_reason"] = d.stop_reason
        if tools is not None:
            delta, common["finish_reason"] = tools.delta(d.text, d.finish_reason)
            return {**common, "delta": delta}
        if job.chat:
            return {**common, "delta": {"content": d.text} if d.text or d.finish_reason is None else {}}
        text, common["logprobs"], extra = self._with_prompt(job, index, out, d.text, common["logprobs"], d.first)
        return {**common, "text": text, **extra}


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
