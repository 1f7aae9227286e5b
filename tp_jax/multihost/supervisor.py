"""Many hosts: a dead peer ends this process with one clear line and exit code 3.

When a peer dies, JAX's coordination service ends every other process from a C++ thread:
an absl FATAL record ("Terminating process because the JAX distributed service detected
fatal errors"), a C++ stack dump and SIGABRT (rc -6). The peer is noticed after the
heartbeat timeout, or at once when it was process 0, which hosts the service. jaxlib 0.10
has no working hook for this: a Python `missed_heartbeat_callback` aborts with
std::bad_cast before it is called. So `supervise()` forks:

* the child runs the program. Its native (C/C++) stdout and stderr go to a pipe; Python's
  own `sys.stdout` / `sys.stderr` keep the real ones, so stdout carries only what the
  program prints (Gloo's "[Gloo] Rank 0 is connected ..." lines move to stderr).
* the parent, the process that was started, only relays that pipe to stderr and waits.
  Native log records (absl: warnings, errors) are held back a moment; when the child dies of
  JAX's fatal error they are dropped and one line naming the dead peer is printed instead,
  exit code 3. Otherwise it exits as the child did (same code, or the same signal). It
  forwards SIGINT / SIGTERM / SIGHUP to the child, and the child is SIGKILLed if it dies.

Seen with jaxlib 0.10.2; the fatal texts parsed by `describe` are in tests/test_supervisor.py.
"""

from __future__ import annotations

import io
import os
import re
import select
import signal
import sys
import time

EXIT_PEER_LOST = 3
FATAL_MARK = "JAX distributed service detected fatal errors"
HOLD_S = 2.0                                   # how long native log records are held back
# absl / glog record prefix: severity, MMDD, time, thread id, file:line]
_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^\s\]]+:\d+\]")
_RECORD_START = re.compile(rb"^[IWEF]\d{0,4}( |$)")     # what may still become a record
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def describe(text: str, process_id: int | None, num_processes: int | None, coordinator: str | None,
             heartbeat_s: float) -> str:
    """The one line for JAX's fatal error `text`: which process died, and what happens to this one."""
    me = "this process" if process_id is None else f"process {process_id}"
    of = f" of {num_processes}" if num_processes else ""
    m = (re.search(r"Task (?:\S*task:)?(\d+) heartbeat timeout", text)
         or re.search(r"stopped sending heartbeats\):\s*(?:\S*task:)?(\d+)", text))
    if m:
        return (f"tp_jax: process {m.group(1)}{of} died or stopped responding (no heartbeat for "
                f"{heartbeat_s:g} s); {me} stops too (exit {EXIT_PEER_LOST})")
    if "leader task" in text or "Failed to send RPC to coordination service" in text:
        at = f" at {coordinator}" if coordinator else ""
        return (f"tp_jax: process 0{of} (the coordinator{at}) died or cannot be reached; {me} stops too "
                f"(exit {EXIT_PEER_LOST})")
    status = text.split("absl::Status:", 1)[-1].strip().splitlines()
    why = status[0][:200] if status else "no details"
    return f"tp_jax: the job failed on another process ({why}); {me} stops too (exit {EXIT_PEER_LOST})"


def supervise(process_id: int | None, num_processes: int | None, coordinator: str | None,
              heartbeat_s: float) -> bool:
    """Fork; returns True in the child (which runs the program), never in the parent.

    Returns False without forking where the child cannot be tied to the parent (not Linux).
    """
    if sys.platform != "linux":
        return False                            # no PR_SET_PDEATHSIG: run unsupervised
    for f in (sys.stdout, sys.stderr):
        f.flush()
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _die_with(parent)
        _native_output_to(write_end)
        return True
    os.close(write_end)
    code = Watcher(pid, read_end, lambda text: describe(text, process_id, num_processes, coordinator,
                                                        heartbeat_s)).run()
    if code < 0:                                # die as the child did (SIGKILL, SIGABRT, SIGINT, ...)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def _die_with(parent: int) -> None:
    import ctypes
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:                               # the parent died before prctl
        os._exit(1)


def _native_output_to(fd: int) -> None:
    """fds 1 and 2 (C/C++ writers) -> `fd`; sys.stdout / sys.stderr keep the real ones."""
    real = {1: os.dup(1), 2: os.dup(2)}
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = _text_stream(real[1], sys.stdout)
    sys.stderr = _text_stream(real[2], sys.stderr)


def _text_stream(fd: int, like) -> io.TextIOWrapper:
    """A text stream on `fd` that buffers as `like` does (unbuffered under python -u)."""
    raw = io.FileIO(fd, "w")
    binary = raw if isinstance(getattr(like, "buffer", None), io.RawIOBase) else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=like.encoding, errors=like.errors, line_buffering=like.line_buffering,
                            write_through=like.write_through)


class Watcher:
    """The parent: relay the child's native output to stderr, then exit as the child did."""

    def __init__(self, pid: int, fd: int, describe_fatal, out_fd: int = 2):
        self.pid, self.fd, self.describe_fatal, self.out_fd = pid, fd, describe_fatal, out_fd
        self.partial = b""
        self.held: list[bytes] = []              # native log records (and what follows) held back
        self.held_at = 0.0

    def run(self) -> int:
        """The exit code for this process: the child's, -N if a signal N ended it, 3 for a dead peer."""
        before = {sig: signal.signal(sig, self._forward) for sig in _FORWARDED}
        try:
            status = None
            while status is None:
                ready, _, _ = select.select([self.fd], [], [], 0.2)
                if ready and not self._read():
                    status = os.waitpid(self.pid, 0)[1]              # EOF: the child has closed its output
                else:
                    done, st = os.waitpid(self.pid, os.WNOHANG)
                    status = st if done else None
                self._release(time.monotonic())
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
        self._drain()
        return self._exit_code(status)

    def _forward(self, sig, _frame) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def _read(self) -> bool:
        """Relay what is there; False at end of file."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        self._feed(chunk)
        return bool(chunk)

    def _drain(self) -> None:
        """What the child wrote before it died (a grandchild may keep the pipe open: never block)."""
        os.set_blocking(self.fd, False)
        while select.select([self.fd], [], [], 0)[0] and self._read():
            pass
        if self.partial:
            self._line(self.partial)
            self.partial = b""

    def _feed(self, chunk: bytes) -> None:
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            self._line(line + b"\n")
        if self.partial and not self.held and not _RECORD_START.match(self.partial):
            self._write(self.partial)                             # e.g. a progress bar without newline
            self.partial = b""

    def _line(self, line: bytes) -> None:
        if self.held or _RECORD.match(line.decode(errors="replace")):
            self.held.append(line)
            self.held_at = time.monotonic()
        else:
            self._write(line)

    def _release(self, now: float) -> None:
        if self.held and now - self.held_at > HOLD_S:
            held, self.held = self.held, []
            self._write(b"".join(held))

    def _write(self, data: bytes) -> None:
        try:
            os.write(self.out_fd, data)
        except OSError:
            pass

    def _exit_code(self, status: int) -> int:
        text = b"".join(self.held).decode(errors="replace")
        if status != 0 and FATAL_MARK in text:                     # absl FATAL: SIGABRT
            self._write((self.describe_fatal(text) + "\n").encode())
            return EXIT_PEER_LOST
        self._release(float("inf"))
        return os.waitstatus_to_exitcode(status)
