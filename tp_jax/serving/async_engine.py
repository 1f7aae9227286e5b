"""An asyncio front for the engine: one background thread steps it, each request streams its outputs.

    engine = AsyncLLMEngine(llm.engine)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), request_id="a"):
        print(out.outputs[0].text)                        # cumulative RequestOutput per step
    await engine.abort("a")
    engine.shutdown()

The engine thread owns the LLMEngine: requests and aborts reach it through a queue and are
applied between steps, so the engine itself needs no locks. Bad input raises in `generate`
before anything is queued. A consumer that stops iterating (a client that disconnects, a
cancelled task) aborts its request, which frees its KV blocks at the next step boundary.
`abort` ends the request's stream at once (its last output, finish_reason "abort"), without
waiting for a step in progress (a compile can take seconds): a stopping server's clients get
their last chunk within its grace period.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator, Callable

from tp_jax.serving.llm_engine import LLMEngine
from tp_jax.serving.outputs import RequestOutput
from tp_jax.serving.sampling import SamplingParams

_FINISHED = object()
_ABORTED = object()                                      # put on the caller's side by `abort`


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        """`on_step(engine, outputs)` runs on the engine thread after every step (metrics)."""
        self.engine, self.on_step = engine, on_step
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}          # the engine thread's
        self._open: dict[str, _Stream] = {}             # the callers' side: streams still being read
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tp_jax-engine", daemon=True)
        self._thread.start()

    # --- the caller's side (any event loop) ----------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams | None = None, *, request_id: str,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its RequestOutput after every step it makes progress in. `prompt` is as
        LLMEngine.add_request takes it: a prompt with `params`, or a PreparedRequest (the server's handlers
        prepare on the event loop, so a bad request is a 400 before anything is queued)."""
        if self.error is not None or self._stopped.is_set():
            raise RuntimeError(f"the engine has stopped{f': {self.error}' if self.error else ''}")
        loop = asyncio.get_running_loop()
        s = _Stream(loop, asyncio.Queue())
        done = concurrent.futures.Future()
        self._commands.put(("add", (request_id, prompt, params, stream, s), done))
        finished = added = False
        last = None
        self._open[request_id] = s
        try:
            await asyncio.wrap_future(done)             # raises the engine's ValueError / TypeError
            added = True
            while True:
                item = await s.queue.get()
                if item is _ABORTED:
                    if last is None:                     # nothing to end it with yet: the engine's final comes
                        continue
                    finished = True
                    yield _aborted(last)
                    return
                if item is _FINISHED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished, last = item.finished, item
                yield item
                if finished:
                    return
        finally:
            self._open.pop(request_id, None)
            if not finished and added:
                self._commands.put(("abort", request_id, None))
            elif not finished:                           # cancelled while the add was on its way
                done.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or
                                       self._commands.put(("abort", request_id, None)))

    async def abort(self, request_id: str) -> None:
        """End the request's stream now and free it in the engine at the next step boundary (awaited)."""
        s = self._open.get(request_id)
        if s is not None:
            s.put(_ABORTED)
        done = concurrent.futures.Future()
        self._commands.put(("abort", request_id, done))
        await asyncio.wrap_future(done)

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (e.g. a consistent stats snapshot)."""
        done = concurrent.futures.Future()
        self._commands.put(("call", fn, done))
        return done

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request, stop the thread (and release other processes' followers)."""
        self._commands.put(("stop", None, None))
        self._thread.join(timeout)

    # --- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                try:
                    cmd = self._commands.get(block=not busy, timeout=None if not busy else 0)
                except queue.Empty:
                    cmd = None
                if cmd is not None:
                    if self._apply(*cmd):
                        return
                    continue                             # drain every queued command before stepping
                outputs = self.engine.step()
                for out in outputs:
                    s = self._streams.get(out.request_id)
                    if s is not None:
                        s.put(out)
                        if out.finished:
                            del self._streams[out.request_id]
                if self.on_step is not None:
                    self.on_step(self.engine, outputs)
        except BaseException as e:                       # a device or engine failure: fail every stream
            self.error = e
            for s in self._streams.values():
                s.put(RuntimeError(f"the engine failed: {e}"))
            self._streams.clear()
        finally:
            self._stopped.set()
            self.engine.core.release_followers()

    def _apply(self, kind: str, arg, done: concurrent.futures.Future | None) -> bool:
        """Apply one command on the engine thread; True means stop."""
        if done is not None and not done.set_running_or_notify_cancel():
            return False                                 # its caller gave up before it ran
        try:
            if kind == "add":
                request_id, prompt, params, stream, s = arg
                self.engine.add_request(request_id, prompt, params, stream=stream)
                self._streams[request_id] = s
            elif kind == "abort":
                final = self.engine.abort(arg)
                s = self._streams.pop(arg, None)
                if s is not None:
                    s.put(final if final is not None else _FINISHED)
                    s.put(_FINISHED)
            elif kind == "call":
                if done is not None:
                    done.set_result(arg(self.engine))
                return False
            elif kind == "stop":
                for rid in list(self._streams):
                    self._apply("abort", rid, None)
                return True
        except Exception as e:
            if done is not None:
                done.set_exception(e)
                return False
            raise
        if done is not None:
            done.set_result(None)
        return False


def _aborted(last: RequestOutput) -> RequestOutput:
    """The stream's last output, ended: every sample still running gets finish_reason "abort"."""
    outputs = [c if c.finished() else dataclasses.replace(c, finish_reason="abort") for c in last.outputs]
    return dataclasses.replace(last, outputs=outputs, finished=True)
