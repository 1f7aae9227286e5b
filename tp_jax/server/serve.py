"""Serve a model over an OpenAI-compatible HTTP API: `tp-jax serve [MODEL] --tp N ...`.

    tp-jax serve --simulate-devices 8 --tp 8 --port 8000        # the embedded SmolLM2, 8 CPU devices
    tp-jax serve /data/Llama-3.1-8B --tp 8 --host 0.0.0.0 --api-key $KEY

Start-up: bind the port (so a busy port fails before the load), load the model on the mesh,
start the engine thread, serve with uvicorn. Many hosts: every process runs the same
command; process 0 binds the port, serves and drives the engine, the others run its steps
(`EngineCore.follow`) until it stops. SIGINT / SIGTERM: stop accepting connections, give
in-flight requests `--shutdown-timeout` seconds to finish, abort the rest, stop the engine
(releasing the other processes) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
import threading

import uvicorn

from tp_jax.server.command import add_engine_args, build_llm, env_default, initialize
from tp_jax.server.reasoning import REASONING_PARSERS
from tp_jax.server.tool_parsers import PARSERS

log = logging.getLogger("tp_jax.server")
ENV_API_KEY = "TP_JAX_API_KEY"
ENGINE_THREAD = "tp_jax-engine"          # AsyncLLMEngine's thread
ENGINE_STOP_S = 2.0                      # for the engine thread to finish its step and stop
BACKSTOP_S = 2                           # after the grace period and the aborts, uvicorn cancels what is left


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                    help="HF directory, .gguf file or Orbax directory (default: the embedded SmolLM2)")
    ap.add_argument("--model", default=None, help="the same as MODEL")
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="name(s) clients use as `model` (default: MODEL as given, or SmolLM2-135M-Instruct)")
    ap.add_argument("--api-key", default=env_default(ENV_API_KEY),
                    help=f"require `Authorization: Bearer KEY` on /v1 routes (or env {ENV_API_KEY})")
    ap.add_argument("--warmup", action="store_true", help="compile the common step shapes before serving")
    ap.add_argument("--shutdown-timeout", type=float, default=3.0,
                    help="seconds in-flight requests may finish after SIGINT / SIGTERM before they are aborted")
    ap.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                    help="how tool_choice \"auto\" reads the model's tool calls: hermes (Qwen2.5 / Qwen3, "
                         "<tool_call> JSON), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), qwen3_coder "
                         "(<function=...> XML), openai (gpt-oss's harmony to=functions.NAME messages); default: "
                         "chosen from the chat template (logged at start-up)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="accepted for vLLM's command lines; tool_choice \"auto\" works without it")
    ap.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                    help="move a thinking model's thoughts into reasoning_content: deepseek_r1 (everything before "
                         "</think>), qwen3 (a <think>...</think> block), openai_gptoss (gpt-oss's harmony analysis "
                         "channel); default: chosen from the chat template")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="with --enable-lora: LoRA adapters (PEFT directories) served as models of their own, "
                         "`model=NAME` selecting one (vLLM's JSON form {\"name\": ..., \"path\": ...} too)")
    ap.add_argument("--allow-runtime-lora-updating", action="store_true",
                    default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                    help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (or env "
                         "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as in vLLM)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--disable-access-log", action="store_true", help="no uvicorn line per HTTP request")
    ap.set_defaults(run=run)


def default_model_name(model: str | None, model_path: str) -> str:
    """MODEL as the user gave it (vLLM's rule); for the embedded default, its file name without suffixes."""
    return model if model is not None else os.path.basename(model_path).split(".")[0]


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (a busy port fails before minutes of loading)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a port number (0..65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or stop the "
                         f"process using it") from None
    return sock


def run(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.model is not None and args.model_pos is not None and args.model != args.model_pos:
        raise ValueError(f"two models given: MODEL={args.model_pos!r} and --model={args.model!r}; give one")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0 seconds")
    model = args.model if args.model is not None else args.model_pos
    loras = lora_modules(args)
    from tp_jax.multihost.distributed import is_driver, process_index
    initialize(args)
    sock = bind(args.host, args.port) if is_driver() else None
    try:
        llm = build_llm(args, model)
        engine = llm.engine
        if not is_driver():
            log.info("process %d (pid %d): following process 0's engine steps", process_index(), os.getpid())
            engine.core.follow()
            log.info("process %d: released by process 0, exiting", process_index())
            return 0
        if args.warmup:
            log.info("compiled %d step shapes", len(engine.core.warmup()))
        else:
            log.info("%d common step shapes compile on first use: the first request of each shape waits for its "
                     "compile (seconds); --warmup compiles them before serving", len(engine.core.warmup_shapes()))
        names = args.served_model_name or [default_model_name(model, llm.model_path)]
        check_lora_modules(loras, llm, names)
        serve(llm, sock, names, args, loras)
    finally:
        if sock is not None:
            sock.close()
    return 0


def lora_modules(args) -> dict:
    """--lora-modules as name -> LoRARequest (ids 1, 2, ...), their syntax checked before the model loads."""
    import json
    from tp_jax.serving.lora import LoRARequest
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the adapters' device slots)")
    out = {}
    for i, item in enumerate(args.lora_modules, start=1):
        try:
            spec = json.loads(item) if item.lstrip().startswith("{") else dict(zip(("name", "path"),
                                                                                item.split("=", 1)))
        except ValueError as e:
            raise ValueError(f"--lora-modules {item!r} is not valid JSON ({e})") from None
        name, path = spec.get("name"), spec.get("path")
        if not name or not path:
            raise ValueError(f"--lora-modules {item!r}: give NAME=PATH (or {{\"name\": ..., \"path\": ...}})")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is used twice; give each adapter its own name")
        out[name] = LoRARequest(name, i, path)
    return out


def check_lora_modules(loras: dict, llm, names: list[str]) -> None:
    """Each adapter read and checked against the loaded model (a bad one: exit 2, one line)."""
    for name, req in loras.items():
        if name in names:
            raise ValueError(f"--lora-modules: {name!r} is also the base model's served name; rename the adapter")
        llm.engine.core.check_lora(req, f"--lora-modules {name}")


def serve(llm, sock: socket.socket, names: list[str], args, loras: dict | None = None) -> None:
    """Run uvicorn on `sock` until SIGINT / SIGTERM; the app stops the engine on the way out."""
    from tp_jax.server.app import create_app
    from tp_jax.serving.async_engine import AsyncLLMEngine
    try:
        tokenizer = llm.get_tokenizer()
    except ValueError:
        tokenizer = None                                  # token-id prompts only
    aengine = AsyncLLMEngine(llm.engine)
    app = create_app(aengine, tokenizer, model_names=names, max_model_len=llm.max_model_len, api_key=args.api_key,
                     model_root=llm.model_path, shutdown_timeout_s=ENGINE_STOP_S,
                     tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser, lora_modules=loras,
                     runtime_lora=args.allow_runtime_lora_updating)
    from tp_jax.server.dev import DEV_MODE_ENV, add_dev_routes, dev_mode
    if dev_mode():                                        # /sleep, /wake_up, /update_weights_from_disk (dev.py)
        add_dev_routes(app, aengine, llm)
        log.warning("%s=1: the development endpoints are on (/sleep, /wake_up, /is_sleeping, "
                    "/update_weights_from_disk); do not expose this server", DEV_MODE_ENV)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.disable_access_log,
                            timeout_graceful_shutdown=math.ceil(args.shutdown_timeout) + BACKSTOP_S, lifespan="on")
    host, port = sock.getsockname()[:2]
    log.info("serving %s as %s on http://%s:%d (pid %d, max_model_len %d)", llm.model_path, ", ".join(names),
             host, port, os.getpid(), llm.max_model_len)
    # uvicorn restores the handlers it found and re-raises the signal after its graceful
    # shutdown: make those handlers quiet so the process ends with exit code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        GracefulServer(config, app.state.handler, args.shutdown_timeout).run(sockets=[sock])
    finally:
        aengine.shutdown(timeout=0.1)                     # a no-op after the app's own shutdown
    busy = any(t.name == ENGINE_THREAD and t.is_alive() for t in threading.enumerate())
    if busy:
        log.warning("the engine is still inside a step; exiting without waiting for it")
    log.info("stopped")
    import jax
    if busy or jax.process_count() == 1:
        # Everything is shut down; skip the interpreter's teardown of JAX, XLA and torch (seconds).
        # Many processes exit normally: jax.distributed's shutdown barrier runs at exit.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class GracefulServer(uvicorn.Server):
    """uvicorn's server; on SIGINT / SIGTERM, requests still running after the grace period are aborted
    through the engine, so their clients get a last chunk (finish_reason "abort") and `[DONE]` rather
    than a cut connection. uvicorn cancels whatever is left BACKSTOP_S later."""

    def __init__(self, config: uvicorn.Config, handler, grace_s: float):
        super().__init__(config)
        self.handler, self.grace_s, self._abort_scheduled = handler, grace_s, False

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if not self._abort_scheduled:
            self._abort_scheduled = True
            loop = asyncio.get_running_loop()        # signals are handled on the loop's (main) thread
            loop.call_soon_threadsafe(lambda: loop.create_task(self._abort_after_grace()))

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self.grace_s)
        n = await self.handler.abort_all()
        if n:
            log.info("aborted %d request(s) still running after the %.1f s grace period", n, self.grace_s)
