"""JAX's persistent compilation cache, on by default: a second run loads its compiled steps from disk.

    enable()              # the default directory, unless TP_JAX_COMPILE_CACHE=0
    enable("/some/dir")   # a directory of your own
    enable(False)         # off for this process

The directory is `$TP_JAX_COMPILE_CACHE` if set (a path; "0", "off" or "false" turn the
cache off), else `$XDG_CACHE_HOME/tp_jax/xla` (default `~/.cache/tp_jax/xla`). Programs that
took at least `min_compile_s` to compile are stored (JAX keys them by the program, the
devices and the compiler flags, so a changed model or mesh never reads a stale entry);
JAX's own `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, when set, replaces that threshold.
`LLM(compile_cache=...)` and the scripts' `--no-compile-cache` call this; the first call in a
process decides.
"""

from __future__ import annotations

import os

import jax

ENV = "TP_JAX_COMPILE_CACHE"
OFF = ("0", "off", "false", "no")
_state: dict[str, str | None] = {}


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tp_jax", "xla")


def enable(path: str | bool | None = True, min_compile_s: float = 0.5) -> str | None:
    """Turn the cache on (once per process); the directory in use, or None when it is off."""
    if "dir" in _state:
        return _state["dir"]
    env = os.environ.get(ENV, "").strip()
    if path is False or path is None or env.lower() in OFF:
        _state["dir"] = None
        return None
    directory = path if isinstance(path, str) else (env or default_dir())
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile cache directory {directory!r} cannot be created ({e}); set {ENV} to a writable "
                         f"directory, or to 0 to turn the cache off") from None
    jax.config.update("jax_compilation_cache_dir", directory)
    min_compile_s = float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", min_compile_s))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _state["dir"] = directory
    return directory
