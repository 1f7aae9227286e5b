"""One resolve step: EngineArgs + facts about the platform and the checkpoint -> a frozen engine configuration.

    config = resolve(args, Platform.of(mesh), CheckpointFacts(...), model_limit=8192)
    config.dtype, config.quantization, config.attention_backend, config.layer_loop, ...
    print(config.summary())        # logged once at start-up, each automatic choice with its reason

Every "auto" is decided here, in `RULES`: for each setting, rows of (when, what, why), the first row whose
test holds wins. A rule may read the settings decided before it (the order of `RULES`), never another
module's description of them. The table is the documentation: `rules_markdown()` is docs/design.md's.

The numeric contract (docs/design.md) the rules keep:
* batch invariance: what "auto" picks never depends on the step's size: a request's tokens and logprobs
  are the same alone and beside any other requests. A method that cannot keep it (`NOT_BATCH_INVARIANT`)
  is only ever named by the user, and the configuration says so;
* an explicit dtype is honoured: "float32" is float32 activations, accumulation and attention, a quantized
  checkpoint's weights exactly dequantized inside the dot; only "auto" chooses faster numerics;
* memory: a quantized checkpoint is held in at most its own bytes (its blocks kept).
Batch invariance also needs XLA:CPU's default LLVM level: the configuration says NO under a lower one.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

from tp_jax.parallel.layers.quantization import FLOAT_TYPES, PACKED_METHODS
from tp_jax.serving.engine_args import EngineArgs

ARG_NAMES = frozenset(f.name for f in dataclasses.fields(EngineArgs))
NOT_BATCH_INVARIANT = {"w8a8x2_bf16": "picks its dot (int8 or bf16) by the number of rows in the step"}


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the resolve step reads of the machine: jax's backend, the CPU's flags, the mesh's devices."""
    backend: str                                  # "cpu", "gpu", "tpu"
    cpu_flags: frozenset[str] = frozenset()
    num_devices: int = 1
    host_memory_bytes: int = 0
    llvm_level: int = 3                           # XLA:CPU's backend (LLVM) level: XLA_FLAGS' or its default, 3

    @classmethod
    def of(cls, mesh) -> Platform:
        from tp_jax.parallel.layers.quantization import cpu_flags
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(mesh.devices.flat[0].platform, cpu_flags(), int(mesh.devices.size), memory, llvm_level())

    def describe(self) -> str:
        simd = sorted(self.cpu_flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})
        llvm = f", LLVM -O{self.llvm_level}" if self.llvm_level != 3 else ""
        return f"{self.backend} x {self.num_devices}" + (f" ({' '.join(simd)}{llvm})" if self.backend == "cpu" else "")


def llvm_level(flags: str | None = None) -> int:
    """The last `--xla_backend_optimization_level=N` in XLA_FLAGS (as XLA reads them), else XLA's default 3."""
    found = re.findall(r"--xla_backend_optimization_level=(\d+)", os.environ.get("XLA_FLAGS", "") if flags is None
                       else flags)
    return int(found[-1]) if found else 3


@dataclasses.dataclass(frozen=True)
class CheckpointFacts:
    """What the resolve step reads of the checkpoint, from its headers only."""
    format: str                                   # "gguf", "safetensors", "orbax"
    architecture: str = ""
    quant_types: frozenset = frozenset()          # GGUF types of the weights a linear method would hold
    stored_bf16: bool = False                     # every such weight stored in bfloat16
    experts: bool = False                         # the model routes tokens to experts (an MoE feed-forward)
    kv_scales: bool = False                       # it holds KV cache scales (k_scale / v_scale tensors)

    @property
    def quantized(self) -> bool:
        return any(q is not None and q not in FLOAT_TYPES for q in self.quant_types)

    @property
    def packed_method(self) -> str | None:
        """The published format of its quantized weights ("gptq", "awq", "fp8", "compressed-tensors"), if any."""
        return next((q for q in sorted(self.quant_types, key=str) if q in PACKED_METHODS), None)

    def describe(self) -> str:
        kinds = ", ".join(sorted(str(q) for q in self.quant_types if q is not None))
        return f"{self.format} {self.architecture}" + (f" ({kinds})" if kinds else "") + \
            (" (bfloat16)" if self.stored_bf16 else "") + (" (KV cache scales)" if self.kv_scales else "")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of the rule table: `when` (said in the docs and the log) holds -> `then`, because `why`."""
    when: str
    test: Callable[[Any], bool]
    then: Callable[[Any], Any] | Any
    why: str
    shown: str = ""                               # what the docs' table says `then` is, when it is computed

    def value(self, facts) -> Any:
        return self.then(facts) if callable(self.then) else self.then


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a rule reads: the arguments, the platform, the checkpoint, and the settings decided before it."""
    args: EngineArgs
    platform: Platform
    checkpoint: CheckpointFacts
    chosen: dict

    def __getattr__(self, name):                  # facts.dtype: a setting decided earlier
        try:
            return self.__dict__["chosen"][name]
        except KeyError:
            raise AttributeError(name) from None


def _asked(name: str) -> Rule:
    return Rule(f"{name} is not 'auto'", lambda f: getattr(f.args, name) != "auto",
                lambda f: getattr(f.args, name), "named by the user")


_cpu = lambda f: f.platform.backend == "cpu"                                  # noqa: E731
CPU_SPEC_BATCH = 4          # measured by scripts/bench_spec.py: docs/performance.md, "Speculative decoding"


def _speculative(f, disable_by_batch_size=None):
    from tp_jax.serving.speculative import SpeculativeConfig
    spec = SpeculativeConfig.parse(f.args.speculative_config)
    return spec if disable_by_batch_size is None else dataclasses.replace(spec, disable_by_batch_size=disable_by_batch_size)


_gguf_q = lambda f: f.checkpoint.quantized and f.checkpoint.packed_method is None   # noqa: E731
_packed = lambda f: f.checkpoint.packed_method is not None                    # noqa: E731

RULES: dict[str, list[Rule]] = {
    "dtype": [
        _asked("dtype"),
        Rule("CPU", _cpu, "float32", "XLA:CPU runs float32 element-wise ops and attention fastest; the linear "
             "method below picks its own dots"),
        Rule("accelerator", lambda f: True, "bfloat16", "bf16 is the accelerators' native type"),
    ],
    "layer_loop": [
        _asked("layer_loop"),
        Rule("one CPU device, an MoE model", lambda f: _cpu(f) and f.platform.num_devices == 1 and f.checkpoint.experts,
             "scan", "the switched loop switches only linear layers' GEMMs and stacks every other weight each step, "
             "the experts' too; the scan's gather reads just the routed experts (measured faster: "
             "scripts/bench_deepseek.py, docs/performance.md)"),
        Rule("one CPU device", lambda f: _cpu(f) and f.platform.num_devices == 1, "switch",
             "each GEMM reads its layer's weights in place, where the scan copies them out (measured faster: "
             "docs/performance.md)"),
        Rule("several devices, or an accelerator", lambda f: True, "scan",
             "one compiled layer body; on simulated CPU devices sharing cores the switch's conditionals cost "
             "more than the copies they save"),
    ],
    "quantization": [
        Rule("quantization is named", lambda f: f.args.quantization != "auto",
             lambda f: None if f.args.quantization == "none" else f.args.quantization, "named by the user"),
        Rule("a quantized GGUF, dtype named", lambda f: _gguf_q(f) and f.args.dtype != "auto", "gguf",
             "the blocks kept (the file's bytes), dequantized inside a dot in the named dtype: with float32 "
             "exactly the file's weights"),
        Rule("a quantized GGUF on CPU", lambda f: _gguf_q(f) and _cpu(f), "gguf_bf16",
             "the blocks kept (the file's bytes); each tile's weights dequantized to bf16 inside the GEMM, "
             "bf16 x bf16 -> float32 dots: the fastest method that keeps the blocks (docs/performance.md)"),
        Rule("a quantized GGUF on an accelerator", _gguf_q, "gguf",
             "the blocks kept (the file's bytes), dots in the run's dtype"),
        Rule("a GPTQ / AWQ / FP8 / compressed-tensors / MXFP4 checkpoint, dtype named",
             lambda f: _packed(f) and f.args.dtype != "auto", lambda f: f.checkpoint.packed_method,
             "its packed weights kept (the checkpoint's bytes), each tile dequantized exactly inside a dot in the "
             "named dtype"),
        Rule("an MXFP4 checkpoint on CPU", lambda f: f.checkpoint.packed_method == "mxfp4" and _cpu(f), "mxfp4",
             "its FP4 codes and E8M0 exponents kept (the checkpoint's bytes), each tile dequantized exactly inside "
             "a float32 dot: the checkpoint's weights exactly; bf16 dots measured no faster (the tiny gpt-oss's "
             "decode, a gpt-oss-20b-sized experts step: docs/performance.md) and moved the tiny model's logits by 0.1"),
        Rule("a GPTQ / AWQ / FP8 / compressed-tensors checkpoint on CPU", lambda f: _packed(f) and _cpu(f),
             lambda f: f.checkpoint.packed_method + "_bf16",
             "its packed weights kept (the checkpoint's bytes); each tile dequantized, rounded to bf16, "
             "bf16 x bf16 -> float32 dots, as for a GGUF"),
        Rule("a GPTQ / AWQ / FP8 / compressed-tensors / MXFP4 checkpoint on an accelerator", _packed,
             lambda f: f.checkpoint.packed_method, "its packed weights kept, dots in the run's dtype"),
        Rule("weights stored in bfloat16, CPU, dtype auto, switch loop",
             lambda f: f.checkpoint.stored_bf16 and _cpu(f) and f.args.dtype == "auto" and f.layer_loop == "switch",
             "bf16", "the weights as stored (half float32's bytes), bf16 x bf16 -> float32 dots"),
        Rule("any other checkpoint", lambda f: True, None, "the weights as stored, in the run's dtype"),
    ],
    "speculative_config": [
        Rule("no speculative_config", lambda f: f.args.speculative_config is None, None, "no speculative decoding"),
        Rule("speculative_config names disable_by_batch_size",
             lambda f: "disable_by_batch_size" in f.args.speculative_config, _speculative, "named by the user"),
        Rule("CPU", _cpu, lambda f: _speculative(f, CPU_SPEC_BATCH),
             f"proposals only while at most {CPU_SPEC_BATCH} requests run (disable_by_batch_size): a CPU step is "
             "compute-bound past a few rows, where rejected drafts cost more than accepted ones save "
             "(scripts/bench_spec.py, docs/performance.md)", f"the named config, disable_by_batch_size {CPU_SPEC_BATCH}"),
        Rule("an accelerator", lambda f: True, _speculative, "vLLM's default: proposals at any batch size",
             "the named config"),
    ],
    "kv_cache_dtype": [
        Rule("kv_cache_dtype is fp8", lambda f: f.args.kv_cache_dtype == "fp8", "fp8_e4m3", "named by the user "
             "(vLLM's fp8 is e4m3)"),
        _asked("kv_cache_dtype"),
        Rule("the checkpoint holds KV cache scales", lambda f: f.checkpoint.kv_scales, "auto",
             "the activations' dtype: a quantized cache only when named (kv_cache_dtype='fp8' reads the checkpoint's "
             "k_scale / v_scale)"),
        Rule("otherwise", lambda f: True, "auto", "the activations' dtype: a quantized cache only when named"),
    ],
    "decode_context_parallel_size": [
        Rule("decode_context_parallel_size is not 1", lambda f: f.args.decode_context_parallel_size != 1,
             lambda f: f.args.decode_context_parallel_size, "named by the user"),
        Rule("otherwise", lambda f: True, 1, "a latent cache replicated on every tp rank: splitting it divides its "
             "bytes per token per device by dcp but adds two collectives a layer (q's all-gather, the partials' "
             "all-to-all) and changes the softmax's summation order (logprobs within 2e-5 of dcp 1, not bit-equal: "
             "tests/test_dcp.py), so only when named"),
    ],
    "kv_cache_groups": [
        _asked("kv_cache_groups"),
        Rule("a speculative draft model", lambda f: getattr(f.speculative_config, "method", None) == "draft_model",
             "off", "the draft model writes the same tokens through the target's one block table per sequence"),
        Rule("otherwise", lambda f: True, "on", "a model mixing sliding and full layers holds a block table per group "
             "of layers of one kind (vLLM's hybrid KV cache manager): a sliding group only its window's blocks; "
             "a model with one kind of layer keeps one table, as before"),
    ],
    "attention_backend": [
        _asked("attention_backend"),
        Rule("a GPU or a TPU", lambda f: f.platform.backend in ("gpu", "tpu"), "pallas", "the ragged paged kernel "
             "(Triton on a GPU, Mosaic on a TPU) reads each row's blocks where they lie, where the reference gathers "
             "a dense copy of each row's context per layer per step (about 3x the KV bytes at long contexts); "
             "float32 softmax within 1e-5 of the reference, batch-invariant"),
        Rule("otherwise", lambda f: True, "reference", "each row attends its own blocks in fixed key chunks, in the "
             "run's dtype (batch-invariant)"),
    ],
}


@dataclasses.dataclass(frozen=True)
class Setting:
    value: Any
    rule: str
    why: str
    automatic: bool


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """The resolved engine configuration: the arguments, the facts, and each decided setting with its reason."""
    args: EngineArgs
    platform: Platform
    checkpoint: CheckpointFacts
    settings: dict[str, Setting]
    max_model_len: int
    num_microbatches: int

    def __getattr__(self, name):
        """setup.x: a decided setting, else the argument as given (the one read-only view of the configuration
        that the engine, the scheduler, the pool and the scripts read)."""
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name].value
        args = self.__dict__.get("args")
        if args is not None and name in ARG_NAMES:
            return getattr(args, name)
        raise AttributeError(name)

    def named(self, name: str) -> bool:
        """The user named this setting (it was not decided by a rule): the loader refuses what does not fit it."""
        return not self.settings[name].automatic

    @property
    def batch_invariant(self) -> bool:
        return self.not_batch_invariant is None

    @property
    def not_batch_invariant(self) -> str | None:
        """Why a request's numbers can change beside other requests (None: they cannot)."""
        if self.quantization in NOT_BATCH_INVARIANT:
            return f"{self.quantization} {NOT_BATCH_INVARIANT[self.quantization]}"
        if self.platform.backend == "cpu" and self.platform.llvm_level < 3:
            return (f"XLA_FLAGS sets --xla_backend_optimization_level={self.platform.llvm_level}: below XLA:CPU's "
                    f"default 3, a float32 logprob moved by 1 ulp beside other requests")
        return None

    def summary(self) -> str:
        """vLLM's "Initializing an engine with config: ..." with a reason for each decided setting."""
        a = self.args
        lines = [f"Initializing an engine with config: model={a.model!r}, {self.checkpoint.describe()}, "
                 f"platform={self.platform.describe()}, tp={a.tensor_parallel_size}, pp={a.pipeline_parallel_size}, "
                 f"dp={a.data_parallel_size}, max_model_len={self.max_model_len}, "
                 f"num_microbatches={self.num_microbatches}"]
        for name, s in self.settings.items():
            how = f"auto: {s.rule}" if s.automatic else "named"
            lines.append(f"  {name} = {s.value if s.value is not None else 'none'}  ({how}: {s.why})")
        invariant = "yes" if self.batch_invariant else f"NO: {self.not_batch_invariant}"
        lines.append(f"  batch_invariant = {invariant}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {name: s.value for name, s in self.settings.items()} | {
            "max_model_len": self.max_model_len, "num_microbatches": self.num_microbatches,
            "batch_invariant": self.batch_invariant}


def resolve(args: EngineArgs, platform: Platform, checkpoint: CheckpointFacts, model_limit: int) -> EngineSetup:
    """Decide every setting of `RULES` in order (each may read those before it); ValueError for a
    max_model_len past the model's limit."""
    max_model_len = min(model_limit, 2048) if args.max_model_len is None else int(args.max_model_len)
    if not 1 <= max_model_len <= model_limit:
        raise ValueError(f"max_model_len={args.max_model_len} must be in [1, {model_limit}] "
                         f"(the model's max_position_embeddings)")
    chosen: dict[str, Any] = {}
    settings: dict[str, Setting] = {}
    for name, rules in RULES.items():
        facts = Facts(args, platform, checkpoint, chosen)
        rule = next(r for r in rules if r.test(facts))
        chosen[name] = rule.value(facts)
        settings[name] = Setting(chosen[name], rule.when, rule.why, automatic=rule.why != "named by the user")
    micro = args.pipeline_parallel_size if args.num_microbatches is None else args.num_microbatches
    return EngineSetup(args, platform, checkpoint, settings, max_model_len, micro)


def rules_markdown() -> str:
    """The rule table as docs/design.md shows it (tests/test_engine_args.py keeps the two equal)."""
    rows = ["| setting | when | then | why |", "|---|---|---|---|"]
    for name, rules in RULES.items():
        for r in rules:
            none = "none (float)" if name == "quantization" else "none"
            then = r.shown or ("the named value" if callable(r.then) else f"`{r.then}`" if r.then is not None else none)
            rows.append(f"| `{name}` | {r.when} | {then} | {r.why} |")
    return "\n".join(rows)
