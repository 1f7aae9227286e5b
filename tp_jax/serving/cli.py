"""What the command line needs beyond the front door (scripts/generate.py is only wiring).

* `read_prompts_file(path)`: one prompt per line, checked before the model loads: a
  missing file, a directory, bad UTF-8 (with the line) or no prompt at all is a one-line error.
* `json_line(obj)`: one JSON object per line that always parses: NaN / inf (a NaN logprob)
  are written as null, never as bare `NaN`.
* `OrderedStreams`: several prompts' token streams printed one after another, each under
  its `--- prompt i` header (the first live, the others held until their turn).
* `run_cli(fn)`: exit codes: 0 done, 2 bad input (one `error:` line), 3 a dead peer
  (`tp_jax.multihost`). Ctrl-C (130, one line) is the script's own handler, installed before
  anything heavy is imported.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable

import numpy as np

EXIT_BAD_INPUT = 2
USER_ERRORS = (ValueError, FileNotFoundError, NotImplementedError, KeyError)


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


# --- exits ---------------------------------------------------------------------------------------

def run_cli(fn: Callable[[], int]) -> int:
    """`fn()`'s exit code; bad input -> one `error:` line and 2; a dead peer -> see tp_jax.multihost."""
    try:
        return fn()
    except USER_ERRORS as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as e:
        jax = sys.modules.get("jax")                     # asked without starting a backend
        if jax is not None and jax.distributed.is_initialized() and isinstance(e, jax.errors.JaxRuntimeError):
            from tp_jax.multihost.distributed import raise_unless_peer_died
            raise_unless_peer_died(e)            # a dead peer: the supervisor says so and exits 3
        raise
