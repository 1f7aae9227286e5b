"""The accelerator path, lowered on the CPU machine: the engine's step programs, with the configuration the resolve
step picks for a GPU and for a TPU, lowered for `cuda` and `tpu` on an abstract mesh of 8 devices.

Lowering needs no accelerator: `jax.jit(...).trace(...).lower(lowering_platforms=(p,))` runs each primitive's
lowering rule for platform p and gives its StableHLO. The program is ModelRunner's forward (tp_jax/serving/runner.py)
over ShapeDtypeStructs: the weights of an abstract model (no params allocated), the packed step and the KV pool,
sharded on an `AbstractMesh` (dp, pp, tp). What a lowered module shows, and these tests assert:

* it lowers (a construct with no lowering for the platform, a host callback, raises here);
* nothing CPU-only is in it: every custom call is the partitioner's (`accelerator_problems`), no float64 (TPUs
  have none), and the resolved configuration names no CPU-tuned setting (`config_problems`);
* the collectives the CPU tests count in compiled HLO: two all-reduces over tp per decoder layer (contract 3),
  MoE expert parallelism's all-gather and reduce-scatter over dp (3b), the pipeline's neighbour hand-off;
* the params' and the KV pool's shardings (each param's declared spec; the pool P(pp, tp, dp), donated).

The trace runs as it would on the accelerator: `jax.default_backend()` answers the target's name while it traces,
so the code's platform branches (MoE "ragged" dispatch, GEMMs over all rows rather than CPU row tiles) take the
accelerator's side (`test_the_accelerator_branches_are_traced` shows they do). What lowering cannot show (that
XLA:GPU / XLA:TPU compile and run it, its numbers, speed and memory) is scripts/device_check.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import ClassVar
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from tests.conftest import mesh_for
from tests.hlo import computations, count
from tp_jax.parallel.layers.method import LINEAR, UNQUANTIZED, LinearMethod
from tp_jax.parallel.layers.quantization import QUANTIZATIONS, QuantizationConfig
from tp_jax.serving import runner
from tp_jax.serving.batch import MIN_BLOCKS, MIN_TOKENS, StepShape, bucket, fine_bucket, packed_layout, prefill_layout
from tp_jax.serving.engine_args import EngineArgs
from tp_jax.serving.kv_pool import POOL_SPEC, PoolShape
from tp_jax.serving.resolve import CheckpointFacts, EngineSetup, Platform, resolve

PLATFORMS = {"cuda": "gpu", "tpu": "tpu"}        # lowering platform -> jax's backend name there (Platform.backend)
PARTITIONER_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
KERNEL_CALLS = frozenset({"__gpu$xla.gpu.triton", "tpu_custom_call"})     # Pallas' Triton and Mosaic calls
TPU_DEVICE = AbstractDevice("TPU v6 lite", 1, "tpu")     # Mosaic lowers for the TPU generation the mesh names
# settings the resolve step picks on a CPU only: tuned and measured on XLA:CPU (docs/performance.md)
CPU_TUNED = {"quantization": {"bf16", "gguf_bf16", "w8a8x2_bf16"}, "attention_backend": {"bf16"},
             "layer_loop": {"switch"}}
BLOCK_SIZE, NUM_BLOCKS = 16, 64


# --- the checks on a configuration and on a lowered module ---------------------------------------------------

def config_problems(setup) -> list[str]:
    """The settings of a resolved configuration that are tuned for XLA:CPU (empty: none)."""
    return [f"{name}={getattr(setup, name)!r} is tuned for XLA:CPU" for name, values in CPU_TUNED.items()
            if getattr(setup, name) in values]


def accelerator_problems(stablehlo: str) -> list[str]:
    """What in a lowered module (StableHLO text) an accelerator may not run: every custom call that is not the
    partitioner's or one of tp_jax's own Pallas kernels for the platform (a Triton or Mosaic call whose kernel is
    named tp_jax_*, tp_jax/models/paged_kernel.py), e.g. an XLA:CPU kernel such as LAPACK or an FFI target
    registered for CPU only, a host callback; and float64 values (TPUs have none). Empty: none."""
    found = []
    ours = {t for t in KERNEL_CALLS if all("tp_jax_" in line for line in stablehlo.splitlines()
                                           if f"custom_call @{t}" in line)}
    for target in sorted(set(re.findall(r"custom_call @([\w.$-]+)", stablehlo)) - PARTITIONER_CALLS - ours):
        why = ("a host callback: a round trip to Python inside the step" if "callback" in target else
               "an XLA:CPU kernel" if target.startswith(("lapack_", "ducc_", "xla_cpu")) else
               "a kernel XLA's accelerator backends may not have")
        found.append(f"custom call {target!r}: {why}")
    if re.search(r"xf64>", stablehlo):
        found.append("float64 values: TPUs have no float64")
    return found


# --- the cases: a model, a mesh of 8 devices, the resolved configuration -------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    model: str                   # "llama", "llama_deep" (10 layers, for pp), "qwen2_moe", "gguf" (tiny Q4_1 / Q8_0)
    dp: int
    pp: int
    tp: int
    expert_parallel: bool = False

    @property
    def id(self) -> str:
        return f"{self.model}-dp{self.dp}pp{self.pp}tp{self.tp}" + ("-ep" if self.expert_parallel else "")


CASES = [Case("llama", 1, 1, 8), Case("llama", 2, 1, 4), Case("llama_deep", 1, 2, 4),
         Case("qwen2_moe", 2, 1, 4, expert_parallel=True), Case("gguf", 1, 1, 8)]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from tests.quant_models import write_tiny_gguf
    return write_tiny_gguf(str(tmp_path_factory.mktemp("lowering_gguf")))[0]


def checkpoint(model: str, gguf_path: str | None):
    """(ModelConfig, source or None, CheckpointFacts) of a case's model (a float model from its config alone)."""
    from tp_jax.models.config import config_from_hf
    if model == "gguf":
        from tp_jax.loaders.model import checkpoint_weight_facts
        from tp_jax.loaders.sources import open_checkpoint
        ckpt = open_checkpoint(gguf_path)
        types, bf16 = checkpoint_weight_facts(ckpt.config, ckpt.source, mesh_for(1, 1, 1))
        return ckpt.config, ckpt.source, CheckpointFacts("gguf", ckpt.config.architecture, types, bf16)
    if model == "qwen2_moe":
        from tests.test_moe_models import hf_config
        cfg = config_from_hf(hf_config("qwen2_moe"))
    else:
        from tests.tiny_models import hf_config
        cfg = config_from_hf(hf_config("deep" if model == "llama_deep" else "gqa"))
    return cfg, None, CheckpointFacts("safetensors", cfg.architecture, frozenset({None}))


def accelerator_setup(case: Case, backend: str, facts: CheckpointFacts, max_len: int, **named):
    """What the resolve step decides for `case` on `backend` ("gpu", "tpu"), with `named` engine arguments."""
    args = EngineArgs.from_kwargs(model=case.model, tensor_parallel_size=case.tp, pipeline_parallel_size=case.pp,
                                  data_parallel_size=case.dp, enable_expert_parallel=case.expert_parallel, **named)
    return resolve(args, Platform(backend, num_devices=case.dp * case.pp * case.tp), facts, max_len)


@dataclasses.dataclass
class Program:
    """The engine's step program for one case and configuration, with abstract arguments on an abstract mesh."""
    case: Case
    setup: EngineSetup
    forward: object              # ModelRunner's jitted forward
    weights: list                # ShapeDtypeStructs of the params, each with its declared spec
    specs: list[P]
    paths: list[str]             # each param's path in the model, e.g. "model.layers.layers.self_attn.o_proj.kernel"
    pool: jax.ShapeDtypeStruct   # K and V alike
    mesh: AbstractMesh
    backend: str                 # what `jax.default_backend()` answers while the program traces
    adapters: tuple = ()         # a LoRA engine's: (the adapter slots' weights, each token's slot), abstract

    def shapes(self) -> dict[str, StepShape]:
        """Decode steps of 1 and 32 rows and a 128-token prefill (two 64-query chunks), as `EngineCore.warmup_shapes`
        and `build_batch` lay them out; and one step mixing 8 decode rows with a 48-token prefill chunk."""
        g = self.case.dp * self.setup.num_microbatches
        decode = lambda d: StepShape(g, d, d, MIN_BLOCKS, 0, 0, 0, 0, 0)
        blocks = lambda n: bucket(-(-n // BLOCK_SIZE), MIN_BLOCKS)
        return {"decode1": decode(1), "decode32": decode(32),
                "prefill128": StepShape(g, fine_bucket(128, MIN_TOKENS), 0, 0, 0, 0, *prefill_layout([[128]]),
                                        blocks(128)),
                "mixed": StepShape(g, fine_bucket(8 + 48, MIN_TOKENS), 8, MIN_BLOCKS, 0, 0, *prefill_layout([[48]]),
                                   blocks(48))}

    def lower(self, platform: str, shape: StepShape):
        """The program traced as on `self.backend`, lowered for `platform`. (jax caches a jitted function's traces:
        a Program is traced as on one backend only, so another backend's trace is never reused.)"""
        n = sum(int(np.prod(s)) for _, s in packed_layout(shape))
        packed = jax.ShapeDtypeStruct((shape.groups, n), jnp.int32, sharding=NamedSharding(self.mesh, P("dp")))
        adapters = self.adapters and (self.adapters[0], jax.ShapeDtypeStruct((shape.groups, shape.tokens), jnp.int32,
                                                                              sharding=packed.sharding))
        with mock.patch.object(jax, "default_backend", lambda: self.backend), jax.sharding.use_abstract_mesh(self.mesh):
            traced = self.forward.trace(self.weights, packed, self.pool, self.pool, shape=shape, adapters=adapters)
            return traced.lower(lowering_platforms=(platform,))


def step_program(case: Case, setup, cfg, source, backend: str | None = None, max_loras: int = 0,
                 abstract_device=None) -> Program:
    """ModelRunner's forward for `case` under `setup` (its dtype, linear methods, layer loop, attention backend,
    micro-batches), built as LLM and EngineCore build it, on an AbstractMesh; the model abstract, no pool allocated.
    It traces as on `backend` (default: the setup's platform). `max_loras`: a LoRA engine's slots (rank 8).
    `abstract_device`: the mesh's device kind (a Mosaic kernel lowers for the TPU generation it names)."""
    from tp_jax.loaders.model import abstract_model
    from tp_jax.loaders.quantize import plan_methods
    from tp_jax.models.registry import architecture
    from tp_jax.parallel.layers.stack import use_layer_loop
    from tp_jax.serving.llm import as_dtype
    if setup.args.enable_expert_parallel:
        cfg = dataclasses.replace(cfg, enable_expert_parallel=True)
    mesh = mesh_for(case.dp, case.pp, case.tp)               # only to build the abstract model (jax.set_mesh)
    dtype = as_dtype(setup.dtype)
    model = abstract_model(cfg, mesh, dtype)
    if setup.quantization is not None:             # the float models' sources: no tensors (no method reads them)
        table = architecture(cfg.architecture).weights(cfg)
        table, source = (table, {}) if source is None else (table.for_names(source.keys()), source)
        methods = plan_methods(model, table, source, cfg.num_layers, setup.quantization,
                               strict=not setup.settings["quantization"].automatic)
        model = abstract_model(cfg, mesh, dtype, methods)
    use_layer_loop(model, mesh, setup.layer_loop)
    abstract = AbstractMesh((case.dp, case.pp, case.tp), ("dp", "pp", "tp"), axis_types=(AxisType.Auto,) * 3,
                            abstract_device=abstract_device)
    pool_shape = PoolShape(model.kv_layout(), NUM_BLOCKS, BLOCK_SIZE, (case.dp, case.pp, case.tp),
                           dcp=setup.decode_context_parallel_size)
    pool = jax.ShapeDtypeStruct(pool_shape.shape, pool_shape.layout.dtype,
                                sharding=NamedSharding(abstract, POOL_SPEC))
    lora = None
    if max_loras:
        from tp_jax.serving.lora import LoRAWeights
        lora = LoRAWeights(model, mesh, max_loras, 8)          # tiny zeros on the simulated mesh: their specs are read
    with mock.patch.object(runner, "new_pool", lambda shape, mesh: (pool, pool)):     # nothing allocated
        r = runner.ModelRunner(model, abstract, pool_shape, setup.num_microbatches, None, setup.attention_backend,
                               lora)
    declared = jax.tree_util.tree_leaves_with_path(nnx.get_partition_spec(nnx.state(model)),
                                                    is_leaf=lambda x: isinstance(x, P))
    paths = [".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path) for path, _ in declared]
    specs = [spec for _, spec in declared]
    weights = [jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(abstract, s))
               for w, s in zip(r.weights, specs, strict=True)]
    adapters = () if lora is None else (jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(abstract, s)), lora.args(),
        lora.specs(), is_leaf=lambda x: isinstance(x, P)),)
    return Program(case, setup, r._forward, weights, specs, paths, pool, abstract, backend or setup.platform.backend,
                   adapters)


@pytest.fixture(scope="module")
def programs(gguf_file):
    """program(case, backend, trace_as=None) -> Program: `case` as resolved for `backend`, traced as on `trace_as`
    (default: that backend), each built once."""
    @functools.cache
    def program(case: Case, backend: str, trace_as: str | None = None) -> Program:
        cfg, source, facts = checkpoint(case.model, gguf_file)
        setup = accelerator_setup(case, backend, facts, cfg.max_position_embeddings)
        return step_program(case, setup, cfg, source, trace_as,
                            abstract_device=TPU_DEVICE if backend == "tpu" else None)
    return program


@pytest.fixture(scope="module")
def lowered(programs):
    """lowered(case, platform) -> {shape name: (StableHLO text, HLO text)} of the resolved configuration."""
    @functools.cache
    def lower(case: Case, platform: str) -> dict[str, tuple[str, str]]:
        prog = programs(case, PLATFORMS[platform])
        out = {}
        for name, shape in prog.shapes().items():
            low = prog.lower(platform, shape)
            out[name] = (low.as_text(), low.as_text(dialect="hlo"))
        return out
    return lower


# --- reading a lowered module ---------------------------------------------------------------------------------

def reachable(hlo: str, roots: list[str]) -> str:
    """The text of the computations `roots` and of every computation they call, each once."""
    comps, seen, todo = computations(hlo), set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += re.findall(r"(?:to_apply|body|condition|calls)=%?([\w.\-]+)", comps[name])
        todo += [c for group in re.findall(r"branch_computations=\{([^}]*)\}", comps[name])
                 for c in re.findall(r"%?([\w.\-]+)", group)]
    return "".join(comps[n] for n in sorted(seen))


def loop_bodies(hlo: str) -> list[str]:
    """The names of the while loops' bodies (a lax.scan lowers to one; a layer loop's body calls the layer)."""
    return re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo)


def replica_groups(text: str, op: str) -> list[list[list[int]]]:
    """The replica groups of each `op` in HLO text."""
    lines = [ln for ln in text.splitlines() if re.search(rf"\b{op}(?:-start)?\(", ln)]
    return [[[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m)]
            for ln in lines for m in re.findall(r"replica_groups=\{((?:\{[\d,]+\},?)+)\}", ln)]


def main_args(stablehlo: str) -> list[tuple[str, list[tuple[str, ...]], bool]]:
    """(tensor type, sharding as one tuple of mesh axes per dimension, donated?) of each argument of @main."""
    sig = re.search(r"func\.func public @main\((.*?)\) ->", stablehlo, re.S).group(1)
    out = []
    for arg in re.split(r"%arg\d+: ", sig)[1:]:
        dims = re.search(r"#sdy\.sharding<@mesh, \[(.*?)\]>", arg)
        assert dims, f"no sdy.sharding on an argument of @main (is Shardy off?): {arg[:200]}"
        axes = [tuple(re.findall(r'"(\w+)"', d)) for d in re.findall(r"\{([^}]*)\}", dims.group(1))]
        out.append((arg.split(" ", 1)[0], axes, "jax.buffer_donor = true" in arg or "tf.aliasing_output" in arg))
    return out


def sdy_axes(spec: P, ndim: int) -> list[tuple[str, ...]]:
    """A PartitionSpec as `main_args` reads a sharding: one tuple of axes per dimension."""
    dims = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return dims + [()] * (ndim - len(dims))


# --- the tests ------------------------------------------------------------------------------------------------

GGUF = CheckpointFacts("gguf", "LlamaForCausalLM", frozenset({"Q4_1", "Q8_0", "F32"}))
BF16 = CheckpointFacts("safetensors", "LlamaForCausalLM", frozenset({None}), stored_bf16=True)
F32 = CheckpointFacts("safetensors", "LlamaForCausalLM", frozenset({None}))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("devices", [1, 8])
def test_resolve_picks_no_cpu_tuned_setting(backend, devices):
    """On an accelerator "auto" is bf16 (an explicit float32 kept), the scan loop, the pallas attention kernel, float
    weights or a GGUF's blocks with dots in the run's dtype: never a setting tuned for XLA:CPU."""
    for facts in (F32, BF16, GGUF):
        for dtype in ("auto", "float32"):
            s = resolve(EngineArgs(dtype=dtype), Platform(backend, num_devices=devices), facts, 8192)
            assert config_problems(s) == [], (facts, dtype, s.summary())
            assert (s.dtype, s.layer_loop, s.attention_backend) == \
                   ("bfloat16" if dtype == "auto" else "float32", "scan", "pallas")
            assert s.quantization == ("gguf" if facts is GGUF else None)
            assert f"platform={backend} x {devices}" in s.summary()
    on_cpu = resolve(EngineArgs(), Platform("cpu"), GGUF, 8192)         # the checker itself: CPU's choice is caught
    assert config_problems(on_cpu) == ["quantization='gguf_bf16' is tuned for XLA:CPU",
                                       "layer_loop='switch' is tuned for XLA:CPU"]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_step_programs_lower_with_nothing_cpu_only(programs, lowered, case, platform):
    """Each step shape lowers for the platform, as one program over 8 devices, in bfloat16, with no custom call
    but the partitioner's and no float64; the configuration it was built with names nothing CPU-tuned."""
    prog = programs(case, PLATFORMS[platform])
    assert config_problems(prog.setup) == [], prog.setup.summary()
    assert prog.setup.dtype == "bfloat16" and prog.setup.quantization == ("gguf" if case.model == "gguf" else None)
    for name, (text, _) in lowered(case, platform).items():
        assert accelerator_problems(text) == [], (case.id, platform, name)
        assert "mhlo.num_partitions = 8" in text
        assert "xbf16>" in text


def expected_collectives(case: Case) -> dict[str, int]:
    """Per decoder layer (the layer loop's body): the counts the CPU tests assert in compiled HLO."""
    if case.expert_parallel:     # tests/test_moe.py: o_proj's all-reduce; the block's dp all-gather, reduce-scatter
        return {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 0}     # and its tp all-reduce
    return {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0}       # contract 3


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_collectives_are_the_ones_the_cpu_tests_count(lowered, case):
    """Per step shape, in the HLO of the module lowered for cuda (tpu's has the same counts): each layer loop holds
    a decoder layer's collectives over the tp group of consecutive devices (tests/test_llama.py, tests/test_moe.py;
    one loop per pipeline tick at pp > 1); outside the loops the embedding's all-reduce and, at pp > 1, the last
    stage's result summed over pp; the stage hand-off a collective-permute to the next stage, same tp rank
    (tests/test_pipeline.py); no all-to-all anywhere."""
    ops = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
    tp_groups = [list(range(s, s + case.tp)) for s in range(0, 8, case.tp)]
    for name, (_, hlo) in lowered(case, "cuda").items():
        bodies = [reachable(hlo, [b]) for b in loop_bodies(hlo)]
        layer_loops = [b for b in bodies if count(b, "all-reduce")]
        assert len(layer_loops) == 2 * case.pp - 1, name      # ticks: pp + micro-batches (pp by default) - 1
        for body in layer_loops:
            assert {op: count(body, op) for op in expected_collectives(case)} == expected_collectives(case), name
            assert replica_groups(body, "all-reduce") == [tp_groups] * 2, "a tp group is consecutive devices"
            if case.expert_parallel:                 # the same tp rank of each dp replica
                dp_groups = [list(range(r, 8, case.tp)) for r in range(case.tp)]
                assert replica_groups(body, "all-gather") == replica_groups(body, "reduce-scatter") == [dp_groups]
        outside = count(hlo, "all-reduce") - count(reachable(hlo, loop_bodies(hlo)), "all-reduce")
        assert outside == 1 + (case.pp > 1), name
        assert count(hlo, "all-to-all") == 0
        pairs = [(int(a), int(b)) for p in re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", hlo)
                 for a, b in re.findall(r"\{(\d+),(\d+)\}", p)]
        assert (len(pairs) > 0) == (case.pp > 1) and all(dst - src == case.tp for src, dst in pairs), name
        tpu = lowered(case, "tpu")[name][1]
        assert [count(tpu, op) for op in ops] == [count(hlo, op) for op in ops], name


def intended_split(path: str, expert_parallel: bool) -> set[tuple[str, ...]]:
    """The mesh axes a param's dimensions are split over besides a layer stack's pp (docs/design.md, contracts
    2, 3b; the vocab padded and split over tp), from its name alone."""
    rules = [(r"embed_tokens|lm_head", {("tp",)}), (r"\.experts\.", {("dp", "tp") if expert_parallel else ("tp",)}),
             (r"(qkv|o|gate_up|down)_proj\.", {("tp",)}), (r"norm|mlp\.gate\.|shared_expert_gate", set())]
    return next(axes for pattern, axes in rules if re.search(pattern, path))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_param_and_kv_shardings_are_the_intended_ones(programs, lowered, case):
    """@main's arguments as lowered: each param with its declared spec, which splits it as its layer says (a stacked
    param's layers over pp); the step's buffer over dp; K and V [layers, KV heads, blocks, ...] over (pp, tp, dp),
    bfloat16, donated (written in place)."""
    prog = programs(case, "gpu")
    text, _ = lowered(case, "cuda")["decode32"]
    args = main_args(text)
    assert len(args) == len(prog.weights) + 3                  # the params, the packed step, K, V
    for path, w, spec, (_, axes, donated) in zip(prog.paths, prog.weights, prog.specs, args):
        assert axes == sdy_axes(spec, w.ndim) and not donated, path
        stacked = ".layers.layers." in path
        assert (axes[0] == ("pp",)) == stacked, path
        assert {a for a in axes[int(stacked):] if a} == intended_split(path, case.expert_parallel), (path, axes)
    assert args[-3][1] == [("dp",), ()]
    for tensor, axes, donated in args[-2:]:
        assert axes == [("pp",), ("tp",), ("dp",), (), ()] and donated and tensor.endswith("xbf16>"), tensor


def test_the_accelerator_branches_are_traced(programs):
    """Traced for an accelerator, an MoE prefill dispatches its experts with `ragged_dot` (XLA's grouped GEMM) and a
    dense layer's GEMM takes the step's 128 rows at once; traced as on a CPU, the same programs use the dense
    dispatch and 32-row tiles (`row_tiled`): the modules above are the accelerator's, not the CPU's lowered for it."""
    moe = programs(CASES[3], "gpu")
    shape = moe.shapes()["prefill128"]
    for platform, backend in PLATFORMS.items():
        assert "chlo.ragged_dot" in programs(CASES[3], backend).lower(platform, shape).as_text(), platform
    assert "ragged_dot" not in programs(CASES[3], "gpu", trace_as="cpu").lower("cuda", shape).as_text()
    dense = programs(CASES[0], "gpu")                           # tp 8, hidden 64: a GEMM's input is [rows, 64]
    rows = lambda text: {int(m) for m in re.findall(r"stablehlo\.dot_general .*: \(tensor<(\d+)x64xbf16>", text)}
    shape = dense.shapes()["prefill128"]
    assert 128 in rows(dense.lower("cuda", shape).as_text())
    on_cpu = rows(programs(CASES[0], "gpu", trace_as="cpu").lower("cuda", shape).as_text())
    assert 32 in on_cpu and 128 not in on_cpu


@dataclasses.dataclass(frozen=True)
class CpuKernelGemm(LinearMethod):
    """A linear method with a CPU-only construct: the float GEMM (`Unquantized`'s), its result passed through an
    FFI kernel registered for XLA:CPU only (`host=False`) or a host callback (`host=True`)."""
    host: bool = False
    name: ClassVar[str] = "cpu_kernel"
    kinds: ClassVar[tuple[str, ...]] = (LINEAR,)
    suffixes = UNQUANTIZED.suffixes

    def params(self, weight, name, shape, dtype):
        return UNQUANTIZED.params(weight, name, shape, dtype)

    def apply(self, layer, x):
        y = UNQUANTIZED.apply(layer, x)
        out = jax.ShapeDtypeStruct(y.shape, y.dtype)
        return jax.pure_callback(np.asarray, out, y) if self.host else jax.ffi.ffi_call("tp_jax_cpu_gemm", out)(y)


def cpu_kernel_config(host: bool) -> type[QuantizationConfig]:
    class Config(QuantizationConfig):
        name: ClassVar[str] = "cpu_kernel"

        def method_for(self, layer, tensors):
            return CpuKernelGemm(host) if layer.weight_kind == LINEAR else None
    return Config


def test_a_cpu_only_construct_in_the_accelerator_configuration_is_caught(monkeypatch, gguf_file):
    """The checks above fail on what must not reach an accelerator: a linear method whose GEMM calls an XLA:CPU FFI
    kernel lowers, and `accelerator_problems` names the kernel; one with a host callback does not lower for cuda or
    tpu at all; a CPU-tuned method named for a GPU lowers cleanly (it is ordinary dots), so `config_problems`
    catches it in the configuration."""
    case = CASES[0]
    cfg, source, facts = checkpoint(case.model, None)
    for host in (False, True):
        monkeypatch.setitem(QUANTIZATIONS, "cpu_kernel", cpu_kernel_config(host))
        for platform, backend in PLATFORMS.items():
            setup = accelerator_setup(case, backend, facts, cfg.max_position_embeddings, quantization="cpu_kernel")
            prog = step_program(case, setup, cfg, source, abstract_device=TPU_DEVICE if backend == "tpu" else None)
            shape = prog.shapes()["decode1"]
            if host:
                with pytest.raises(ValueError, match="lowering"):      # a callback needs devices at lowering
                    prog.lower(platform, shape)
            else:
                assert accelerator_problems(prog.lower(platform, shape).as_text()) == [
                    "custom call 'tp_jax_cpu_gemm': a kernel XLA's accelerator backends may not have"]
    case = CASES[4]
    cfg, source, facts = checkpoint(case.model, gguf_file)
    setup = accelerator_setup(case, "gpu", facts, cfg.max_position_embeddings, quantization="gguf_bf16")
    assert config_problems(setup) == ["quantization='gguf_bf16' is tuned for XLA:CPU"]
    prog = step_program(case, setup, cfg, source)
    assert accelerator_problems(prog.lower("cuda", prog.shapes()["decode1"]).as_text()) == []
