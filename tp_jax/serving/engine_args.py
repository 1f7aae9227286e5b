"""`EngineArgs` (vLLM's name): the one list of engine arguments, each with its default, its check and its help.

    args = EngineArgs(model="path", tensor_parallel_size=8)     # TypeError / ValueError naming a bad one
    LLM(**kwargs)                  -> EngineArgs(**kwargs)  (LLM's signature is built from the fields)
    add_cli_arguments(parser)      -> one flag a field (help shows the default); from_cli(namespace)
    markdown_table()               -> the docs' argument table (docs/serving.md; tests/test_engine_args.py)

Nothing else restates the list. What an "auto" value becomes is decided by `resolve`
(tp_jax/serving/resolve.py), from these arguments and facts about the platform and the checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable
from typing import Any

import numpy as np

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")      # vLLM's names ("fp8" is e4m3), and int8
KV_CACHE_GROUPS = ("auto", "on", "off")


def attention_backends() -> tuple[str, ...]:
    """"auto" and the registered paged attention backends (tp_jax/models/attention.py PAGED_BACKENDS)."""
    from tp_jax.models.attention import PAGED_BACKENDS
    return ("auto", *PAGED_BACKENDS)


def layer_loops() -> tuple[str, ...]:
    """"auto" and the layer loops a stack runs (tp_jax/parallel/layers/stack.py LAYER_LOOPS)."""
    from tp_jax.parallel.layers.stack import LAYER_LOOPS
    return ("auto", *LAYER_LOOPS)


# --- checks: each raises TypeError (wrong type) or ValueError (out of range) naming the argument ---------

def _is_int(value: Any) -> bool:
    """A Python or numpy integer; a bool is not a count (True would silently mean 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _suggest(name: str, value: Any) -> str:
    """`; pass name=2` for 2.0 or "2"; nothing when no integer is meant."""
    meant = (isinstance(value, float) and value.is_integer()) or \
        (isinstance(value, str) and value.strip().lstrip("-").isdigit())
    return f"; pass {name}={int(value)}" if meant else ""


def count(meaning: str, minimum: int | None = 1, optional: bool = False) -> Callable[[str, Any], None]:
    """An int >= minimum (None: any int); `optional`: None too. `meaning` is said in the message."""
    def check(name: str, value: Any) -> None:
        if optional and value is None:
            return
        what = ("None or " if optional else "") + ("an int" if minimum is None else f"an int >= {minimum}")
        if not _is_int(value):
            raise TypeError(f"LLM: {name}={value!r} must be {what}{meaning}, got {type(value).__name__}"
                            f"{_suggest(name, value)}")
        if minimum is not None and int(value) < minimum:
            raise ValueError(f"LLM: {name}={value!r} must be >= {minimum}{meaning}")
    return check


def one_of(choices: tuple[str, ...] | Callable[[], list[str]], what: str, none: str = "") -> Callable:
    """A string among `choices` (or a callable giving them); `none`: what None means (None refused if empty)."""
    def check(name: str, value: Any) -> None:
        names = choices() if callable(choices) else choices
        listed = ", ".join(repr(c) for c in names)
        if value is None and none:
            return
        if not isinstance(value, str):
            raise TypeError(f"LLM: {name}={value!r} must be a string, one of {listed}"
                            f"{' or None' if none else ''}, got {type(value).__name__}")
        if value not in names:
            raise ValueError(f"LLM: {name}={value!r} is not {what}; choose one of {listed}"
                             f"{f', or None ({none})' if none else ''}")
    return check


def flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"LLM: {name}={value!r} must be True or False, got {type(value).__name__}")


def fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"LLM: {name}={value!r} must be a number in (0, 1], got {type(value).__name__}")
    if not 0 < value <= 1:
        raise ValueError(f"LLM: {name}={value!r} must be in (0, 1]")


def _model(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"LLM: {name}={value!r} must be a path (str or os.PathLike) to an HF directory or a "
                        f".gguf file, or None for the embedded default model; got {type(value).__name__}")


def _compile_cache(name: str, value: Any) -> None:
    if not isinstance(value, (bool, str, os.PathLike)):
        raise TypeError(f"LLM: {name}={value!r} must be True (the default directory), False (off) or a "
                        f"directory, got {type(value).__name__}")


def _quantizations() -> list[str]:
    from tp_jax.parallel.layers.quantization import quantization_choices
    return quantization_choices()


def _structured(name: str, value: Any) -> None:
    known = {"disable_any_whitespace", "disable_additional_properties", "backend"}
    if not isinstance(value, dict) or set(value) - known:
        raise ValueError(f"LLM: {name}={value!r} must be a dict with keys among {sorted(known)}, e.g. "
                         f"{{'disable_any_whitespace': True}}")
    if value.get("backend", "guidance") not in ("guidance", "auto"):
        raise ValueError(f"LLM: {name}: backend {value['backend']!r}: only 'guidance' (llguidance) is available")
    if not all(isinstance(v, bool) for k, v in value.items() if k != "backend"):
        raise ValueError(f"LLM: {name}={value!r}: the options take True or False")


def _speculative(name: str, value: Any) -> None:
    from tp_jax.serving.speculative import SpeculativeConfig
    if isinstance(value, str):
        raise TypeError(f"LLM: {name} takes a dict (the command line's --speculative-config takes JSON)")
    try:
        SpeculativeConfig.parse(value, name)
    except ValueError as e:
        raise ValueError(f"LLM: {e}") from None


def _anything(name: str, value: Any) -> None:
    pass


def arg(default: Any, help: str, check: Callable[[str, Any], None], *, cli: bool = True,
        aliases: tuple[str, ...] = (), choices: tuple | Callable | None = None) -> Any:
    """A field of EngineArgs: `help` is one line; `cli`: False for the Python-only arguments."""
    kind = dict(default_factory=dict) if isinstance(default, dict) else dict(default=default)
    return dataclasses.field(**kind, metadata=dict(help=help, check=check, cli=cli, aliases=aliases,
                                                   choices=choices))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """Every argument of `LLM(...)`, `tp-jax serve` and `tp-jax generate`; checked when built."""
    model: str | None = arg(None, "HF directory, .gguf file or Orbax directory (None: the embedded SmolLM2)",
                            _model, cli=False)
    tensor_parallel_size: int = arg(1, "devices that split each layer", count(" (devices that split each "
                                    "layer)"), aliases=("--tp",))
    pipeline_parallel_size: int = arg(1, "stages the layers are split into", count(" (stages the layers are "
                                      "split into)"), aliases=("--pp",))
    data_parallel_size: int = arg(1, "model replicas", count(" (model replicas)"), aliases=("--dp",))
    decode_context_parallel_size: int = arg(1, "latent-attention (MLA) models: tp ranks a sequence's KV cache is "
                                            "interleaved over (each holds 1/dcp of its tokens); divides tp and "
                                            "block_size", count(" (tp ranks a sequence's latent KV cache is split "
                                                                "over)"), aliases=("--dcp",))
    dtype: str = arg("auto", "activations and accumulation: auto (float32 on CPU, bfloat16 on accelerators; "
                     "the linear methods choose their dots), or exactly float32 / bfloat16 / float16",
                     one_of(DTYPES, "a dtype"), choices=DTYPES)
    quantization: str | None = arg("auto", "how weights are held: auto (by checkpoint and platform, "
                                   "batch-invariant, at most the checkpoint's bytes), none (float), or a method "
                                   "of docs/quantization.md", one_of(_quantizations, "a quantization method",
                                                                     none="every weight in float"),
                                   choices=_quantizations, aliases=("-q",))
    max_model_len: int | None = arg(None, "tokens per sequence, prompt included (None: the model's limit, at "
                                    "most 2048)", count(" (tokens per sequence, prompt included; None: the "
                                                        "model's limit, at most 2048)", optional=True))
    kv_cache_dtype: str = arg("auto", "how the KV cache stores keys and values: auto (the activations' dtype), "
                              "fp8 / fp8_e4m3 or fp8_e5m2 (float8 with the checkpoint's k_scale / v_scale, else "
                              "scale 1.0 as vLLM: a quarter of float32's bytes, half of bf16's), or int8 (a float16 "
                              "scale per token and head: 2 more bytes a row); read back into the activations' dtype",
                              one_of(KV_CACHE_DTYPES, "a KV cache dtype"), choices=KV_CACHE_DTYPES)
    kv_cache_groups: str = arg("auto", "a model mixing sliding-window and full-attention layers: on (a block table "
                               "per group of layers of one kind: a sliding layer holds only its window's blocks), "
                               "off (every layer holds every token's block), or auto", one_of(KV_CACHE_GROUPS,
                                                                                             "a KV cache groups mode"),
                               choices=KV_CACHE_GROUPS)
    max_num_seqs: int = arg(256, "running sequences per dp replica", count(" (the most sequences generated "
                                                                           "together)"))
    max_num_batched_tokens: int = arg(512, "tokens per step per dp replica (the prefill chunk)",
                                      count(" (tokens per step per dp replica)"))
    block_size: int = arg(16, "tokens per KV cache block", count(" (tokens per KV cache block)"))
    num_gpu_blocks: int | None = arg(None, "KV cache blocks per dp replica (None: from the memory budget)",
                                     count(" (KV cache blocks; None: from the memory budget)", optional=True))
    kv_cache_memory_bytes: int | None = arg(None, "KV cache bytes per device (None: a share of device memory)",
                                            count(" (KV cache bytes per device)", optional=True))
    gpu_memory_utilization: float = arg(0.9, "accelerators: the share of each device's memory in use once the "
                                        "KV pool is allocated", fraction)
    enable_prefix_caching: bool = arg(True, "reuse the KV blocks of shared prompt prefixes", flag)
    num_microbatches: int | None = arg(None, "pipeline micro-batches per dp replica (None: "
                                       "pipeline_parallel_size)", count(" (pipeline micro-batches; None: "
                                                                        "pipeline_parallel_size)", optional=True))
    seed: int = arg(0, "the engine's randomness for unseeded requests", count("", minimum=None))
    max_logprobs: int = arg(20, "the most logprobs (and prompt_logprobs) a request may ask for",
                            count(" (the most logprobs a request may ask for)", minimum=0), cli=False)
    attention_backend: str = arg("auto", "paged attention: auto (pallas on a GPU or TPU, else reference), reference "
                                 "(float32), bf16 (bf16 dot operands, float32 accumulation, decode split-K), pallas "
                                 "(a ragged Pallas kernel reads every row's blocks in place: Triton on a GPU, Mosaic "
                                 "on a TPU)", one_of(attention_backends, "an attention backend"),
                                 choices=attention_backends)
    layer_loop: str = arg("auto", "how a step runs the decoder layers: auto, scan (stacked weights), switch "
                          "(per-layer weights read in place)", one_of(layer_loops, "a layer loop"),
                          choices=layer_loops)
    enable_expert_parallel: bool = arg(False, "MoE models: whole experts on the dp x tp devices of each stage "
                                       "(default: each expert split over tp)", flag)
    enable_lora: bool = arg(False, "serve LoRA adapters (PEFT's format) beside the base model, one per request "
                            "(lora_request)", flag)
    max_loras: int = arg(1, "LoRA: adapters one step can serve (device slots)", count(" (LoRA adapters per step)"))
    max_lora_rank: int = arg(16, "LoRA: the largest adapter rank accepted (every slot's width)",
                             count(" (the largest LoRA rank)"))
    max_cpu_loras: int | None = arg(None, "LoRA: adapters kept in host memory (None: max_loras)",
                                    count(" (LoRA adapters in host memory; None: max_loras)", optional=True))
    structured_outputs_config: dict = arg({}, "defaults for every constrained answer, vLLM's: "
                                          "disable_any_whitespace, disable_additional_properties, backend "
                                          "(guidance)", _structured)
    speculative_config: dict | None = arg(None, "speculative decoding, vLLM's keys: {\"method\": \"ngram\", "
                                          "\"num_speculative_tokens\": k, \"prompt_lookup_max\": n, "
                                          "\"prompt_lookup_min\": m, \"disable_by_batch_size\": b}, or a draft "
                                          "model: {\"model\": PATH, \"num_speculative_tokens\": k} (None: off)",
                                          _speculative)
    compile_cache: bool | str = arg(True, "JAX's persistent compilation cache: True (~/.cache/tp_jax/xla or "
                                    "$TP_JAX_COMPILE_CACHE), False, or a directory", _compile_cache)
    check_weights: bool = arg(True, "refuse weights holding NaN or infinity (a cheap check per tensor)", flag,
                              cli=False)
    progress: bool = arg(True, "a loading bar", flag, cli=False)
    devices: Any = arg(None, "the devices to use (None: jax.devices())", _anything, cli=False)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            f.metadata["check"](f.name, getattr(self, f.name))
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"LLM: max_num_batched_tokens={self.max_num_batched_tokens} is smaller than one block "
                             f"(block_size={self.block_size}); raise it to at least {self.block_size}")
        dcp, tp = self.decode_context_parallel_size, self.tensor_parallel_size
        if tp % dcp or self.block_size % dcp:
            what = f"tensor_parallel_size={tp}" if tp % dcp else f"block_size={self.block_size}"
            raise ValueError(f"LLM: decode_context_parallel_size={dcp} must divide {what} (its ranks are tp ranks, "
                             f"each holding block_size / dcp tokens of a block); choose one of "
                             f"{[d for d in range(1, tp + 1) if tp % d == 0 and self.block_size % d == 0]}")
        if self.quantization is None:
            object.__setattr__(self, "quantization", "none")
        if self.model is not None:
            object.__setattr__(self, "model", os.fspath(self.model))

    @classmethod
    def from_kwargs(cls, where: str = "LLM", **kwargs) -> EngineArgs:
        """EngineArgs(**kwargs), an unknown name refused with the closest known one."""
        names = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the arguments: {', '.join(names)}"
                raise TypeError(f"{where}: unknown argument {name!r}{hint}")
        return cls(**kwargs)

    def non_defaults(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != _default(f) and f.name not in ("progress", "devices")}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def default(name: str) -> Any:
    """The default of one argument (the server's request limits read max_logprobs')."""
    return _default(next(f for f in dataclasses.fields(EngineArgs) if f.name == name))


def signature(first: tuple[str, ...] = ("model",)) -> inspect.Signature:
    """`LLM.__init__`'s signature from the fields: `model` positional, the rest keyword-only."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(EngineArgs):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name in first else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=_default(f), annotation=f.type))
    return inspect.Signature(params)


def docstring() -> str:
    """One line an argument: name (default): help."""
    return "\n".join(f"    {f.name} ({_default(f)!r}): {f.metadata['help']}" for f in dataclasses.fields(EngineArgs))


# --- the command line ---------------------------------------------------------------------------------

def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _cli_type(f: dataclasses.Field) -> Callable[[str], Any] | None:
    if f.name == "structured_outputs_config":
        return _json_object
    if f.name == "speculative_config":
        return _json_speculative
    if f.name == "compile_cache":
        return None
    if "int" in str(f.type):
        return int
    if "float" in str(f.type):
        return float
    return None


def _json_object(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}); e.g. '{{\"disable_any_whitespace\": true}}'") from None
    try:
        _structured("--structured-outputs-config", value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("LLM: ")) from None
    return value


def _json_speculative(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
        _speculative("--speculative-config", value)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("LLM: ")) from None
    return value


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag for each command-line field (`--tensor-parallel-size`, `--tp`, ...), its help with the default."""
    group = parser.add_argument_group("engine arguments (tp_jax.EngineArgs)")
    for f in dataclasses.fields(EngineArgs):
        meta = f.metadata
        if not meta["cli"]:
            continue
        d = _default(f)
        help = meta["help"] + (f" (default: {d})" if d not in (None, {}) else "")
        names = (flag_name(f.name), *meta["aliases"])
        if f.type == "bool":
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=d, help=help)
            continue
        if f.name == "compile_cache":
            group.add_argument(*names, dest=f.name, default=d, metavar="DIR|true|false", type=_bool_or_dir,
                               help=help)
            group.add_argument("--no-compile-cache", dest=f.name, action="store_false", help="the same as "
                               "--compile-cache false")
            continue
        choices = meta["choices"]
        choices = choices() if callable(choices) else choices
        group.add_argument(*names, dest=f.name, default=d, type=_cli_type(f), choices=choices, help=help,
                           metavar="JSON" if f.name in ("structured_outputs_config", "speculative_config") else None)


def _bool_or_dir(text: str) -> bool | str:
    low = text.lower()
    return True if low in ("true", "1", "on", "yes") else False if low in ("false", "0", "off", "no") else text


def from_cli(ns: argparse.Namespace, **extra: Any) -> EngineArgs:
    """EngineArgs from a parsed command line (`extra`: the Python-only fields, e.g. model, progress)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
              if f.metadata["cli"] and hasattr(ns, f.name)}
    return EngineArgs(**values, **extra)


def markdown_table() -> str:
    """The docs' table: argument, flag, default, meaning (tests/test_engine_args.py keeps docs/serving.md equal)."""
    rows = ["| argument | flag | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(EngineArgs):
        meta = f.metadata
        flags = ", ".join(f"`{n}`" for n in (flag_name(f.name), *meta["aliases"])) if meta["cli"] else "—"
        rows.append(f"| `{f.name}` | {flags} | `{_default(f)!r}` | {meta['help']} |")
    return "\n".join(rows)
