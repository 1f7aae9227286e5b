"""Published quantized checkpoints (GPTQ, AWQ, FP8, compressed-tensors) against transformers on their dequantized
weights: tiny Llama (and Qwen3-MoE) checkpoints written by the packing rules and the compressed-tensors package
(tests/quantized_checkpoints.py), loaded per device and kept packed.

* `dtype="float32"`: logits within 2e-4 of a float32 transformers model holding the exactly dequantized weights,
  greedy tokens equal, at tp 1, 2, 4 and pp 2 x tp 2 (tp 4 cuts the 32-input groups of o_proj and down_proj);
* the default ("auto": bf16 dots on CPU) within 1% perplexity of that reference, and batch-invariant;
* per-device parameter bytes at most 1.3 x the checkpoint's bytes / tp;
* what is not read is refused before any weight is read, naming the method, the scheme and the field.
"""

import json
import os

import numpy as np
import pytest

from tests.quantized_checkpoints import FORMATS, write_quantized
from tests.tiny_models import logits_and_greedy
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

MESHES = [(1, 1, 2), (1, 1, 4), (1, 2, 2)]          # (dp, pp, tp) beside tp 1
SEEDS = {"MixtralConfig": 3}
GREEDY_ON_MESHES = ("gptq4_sym_actorder", "awq4", "ct_w8a8", "fp8_block")   # one per dot path (all: at tp 1)                          # a seed whose greedy references are not degenerate
IDS = np.random.default_rng(0).integers(0, 512, size=(3, 13))
PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 200, 30], [5, 17, 250, 42, 9], [99, 3]]   # < both vocabs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("published_quant"))


@pytest.fixture(scope="module")
def reference(root):
    """fmt -> (checkpoint, logits of IDS and greedy tokens of PROMPTS from transformers on the dequantized twin)."""
    import torch
    from transformers import AutoModelForCausalLM
    cache = {}

    def get(fmt: str, config=None, vocab: int = 512):
        family = "llama" if config is None else type(config).__name__
        if (fmt, family) not in cache:
            path, twin = write_quantized(root if config is None else os.path.join(root, family), fmt,
                                         seed=SEEDS.get(family, 0), config=config)
            model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
            ids = IDS % vocab
            cache[fmt, family] = (path, ids, *logits_and_greedy(model, ids, PROMPTS))
        return cache[fmt, family]
    return get


def check(ref, mesh=(1, 1, 1), greedy: bool = True, **kw):
    path, ids, logits, tokens = ref
    dp, pp, tp = mesh
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              progress=False, **kw)
    assert llm.quantization.split()[0] in ("gptq", "awq", "fp8", "compressed-tensors"), llm.quantization
    diff = float(np.abs(llm.get_logits(ids) - logits).max())
    print(f"{os.path.basename(path)} {mesh} {kw}: {llm.quantization}, max abs logit diff {diff:.2e}")
    assert diff <= 2e-4, diff
    if greedy:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == tokens
    return llm


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_float32_is_the_dequantized_checkpoint(reference, fmt):
    """Every format and scheme, kept packed, at tp 1: transformers' logits on the exactly dequantized weights."""
    check(reference(fmt))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "dp{}pp{}tp{}".format(*m))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_float32_on_meshes(reference, fmt, mesh):
    """Each rank reads its slice of the packed words, scales, zero points and g_idx: column layers their output
    rows, row layers their input columns (tp 4 cuts o_proj's and down_proj's 32-input groups; GPTQ's act order
    gathers each rank's scales by g_idx)."""
    check(reference(fmt), mesh, greedy=mesh == (1, 2, 2) and fmt in GREEDY_ON_MESHES)


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    shifted = logits[:, :-1] - logits[:, :-1].max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(np.exp(-np.take_along_axis(logp, ids[:, 1:, None], -1).mean()))


@pytest.mark.default_compile          # batch invariance is a promise at XLA's default LLVM level (docs/design.md)
@pytest.mark.parametrize("fmt", ["gptq4_sym_actorder", "awq4", "ct_w8a8", "fp8_block"])
def test_default_is_close_and_batch_invariant(reference, fmt):
    """No dtype: the packed weights kept, bf16 dots (the resolve step's rule on CPU): perplexity of the reference's
    own greedy text within 1% of the reference's; a request's tokens and logprobs are the same alone and beside
    others."""
    path, ids, logits, tokens = reference(fmt)
    llm = LLM(path, progress=False)
    assert llm.quantization.endswith("(bf16 dot)") and llm.setup.batch_invariant, llm.quantization
    text = np.array([PROMPTS[0] + tokens[0]])
    import torch
    from transformers import AutoModelForCausalLM
    twin = AutoModelForCausalLM.from_pretrained(path + "_dequantized", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = perplexity(twin(torch.tensor(text)).logits.numpy(), text)
    got = perplexity(llm.get_logits(text), text)
    print(f"{fmt}: perplexity {got:.4f} vs {ref:.4f} ({100 * (got / ref - 1):+.3f}%)")
    assert abs(got / ref - 1) <= 0.01
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    beside = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], params)[1].outputs[0]
    assert alone.token_ids == beside.token_ids
    assert alone.logprobs == beside.logprobs


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_device_bytes_within_the_checkpoint(reference, tp):
    """Per-device parameter bytes <= 1.3 x the checkpoint's bytes / tp, for every format (the default method)."""
    from tp_jax.loaders.model import param_bytes_per_device
    for fmt in FORMATS:
        path = reference(fmt)[0]
        llm = LLM(path, tensor_parallel_size=tp, progress=False)
        ratio = param_bytes_per_device(llm.model, llm.mesh) / (os.path.getsize(f"{path}/model.safetensors") / tp)
        print(f"{fmt} tp {tp}: {ratio:.3f} x the checkpoint's bytes / tp")
        assert ratio <= 1.3, (fmt, ratio)


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"],
                          tie_word_embeddings=False, max_position_embeddings=128, rms_norm_eps=1e-6)


def mixtral_config():
    from transformers import MixtralConfig
    return MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, architectures=["MixtralForCausalLM"], tie_word_embeddings=False,
                         max_position_embeddings=128, rms_norm_eps=1e-5)


@pytest.mark.parametrize("fmt,family", [("fp8_block", "qwen3_moe"), ("ct_w4a16_asym", "qwen3_moe"),
                                        ("gptq4", "mixtral"), ("gptq4_sym_actorder", "mixtral"),
                                        ("awq4", "mixtral")])
def test_moe_experts_kept_packed(reference, fmt, family):
    """Tiny Qwen3-MoE (FP8 blocks as Qwen3-30B-A3B-FP8 holds them, compressed-tensors) and Mixtral (GPTQ, with
    act order too, AWQ)
    checkpoints: the experts stay packed (`PackedExperts`), exact in float32 with and without expert parallelism."""
    from flax import nnx
    from tp_jax.parallel.layers import Experts
    from tp_jax.parallel.layers.packed import PackedExperts
    config = qwen3_moe_config() if family == "qwen3_moe" else mixtral_config()
    ref = reference(fmt, config=config, vocab=256)
    for mesh, ep in (((1, 1, 2), False), ((2, 1, 2), True), ((1, 2, 2), True)):
        llm = check(ref, mesh, greedy=mesh == (1, 1, 2), enable_expert_parallel=ep)
        experts = [n for _, n in nnx.iter_graph(llm.model) if isinstance(n, Experts)]
        assert experts and all(isinstance(e.method, PackedExperts) for e in experts)


def test_none_dequantizes_and_a_named_method_must_match(reference):
    """quantization=None loads the same weights as float (the same logits); naming another method is refused."""
    from tp_jax.parallel.layers.method import QuantizationError
    path, ids, logits, _ = reference("awq4")
    llm = LLM(path, dtype="float32", quantization=None, progress=False)
    assert llm.quantization == "none"
    assert float(np.abs(llm.get_logits(ids) - logits).max()) <= 2e-4
    with pytest.raises(QuantizationError, match="reads gptq checkpoints; this one is awq"):
        LLM(path, quantization="gptq", progress=False)


REFUSED = [   # quantization_config -> words the error must name (method, scheme, field)
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ["GPTQ", "3-bit", "bits=3"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     ["GPTQ", "checkpoint_format='marlin'"]),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, ["AWQ", "GEMV", "version='gemv'"]),
    ({"quant_method": "fp8", "fmt": "e5m2"}, ["FP8", "fmt='e5m2'"]),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "sparsity_config": {"format": "sparse-24"},
      "config_groups": {}}, ["compressed-tensors", "sparsity_config"]),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     ["compressed-tensors", "nvfp4-pack-quantized", "format"]),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 64}}}},
     ["compressed-tensors", "2-bit", "num_bits=2"]),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["bitsandbytes 4-bit"]),
]


@pytest.mark.parametrize("qc,words", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_unsupported_schemes_are_refused_before_any_read(reference, root, qc, words):
    """The config is refused by LLM(...) before a tensor is read (the checkpoint holds none)."""
    from tp_jax.models.config import UnsupportedConfigError
    path = os.path.join(root, f"refused_{abs(hash(json.dumps(qc, sort_keys=True)))}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(reference("gptq4")[0], "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": qc}, f)
    with pytest.raises(UnsupportedConfigError) as e:
        LLM(path, progress=False)
    assert all(w in str(e.value) for w in words), str(e.value)


# --- published quantization_config blocks, built abstractly at tp 8 --------------------------------------------

QUANT_CONFIGS = os.path.join(os.path.dirname(__file__), "data", "quant_configs")
PUBLISHED = sorted(f[:-5] for f in os.listdir(QUANT_CONFIGS) if f.endswith(".json"))


class MetaPacked:
    """A packed weight's shape and scheme as a published checkpoint stores it, nothing to read (bytes: its stored
    tensors, fp16 scales; FP8: float32 block scales)."""

    def __init__(self, quant, shape):
        self.quant_type, self.shape = quant.method, tuple(shape)
        self.kind = "fp8" if quant.method == "fp8" else f"int{quant.bits}"
        self.group_size = quant.block[1] if quant.block else (quant.group_size or shape[1])
        self.act_order, self.num_groups = quant.desc_act, -(-shape[1] // self.group_size)
        self.scale_dtype = np.dtype(np.float32 if quant.block else np.float16)
        self.zero_point = 1 << (quant.bits - 1) if quant.sym else None
        out, inp = shape
        if quant.block:
            self.stored_bytes = out * inp + -(-out // quant.block[0]) * self.num_groups * 4
        else:
            self.stored_bytes = (out * inp * quant.bits // 8 + self.num_groups * out * (2 + quant.bits / 8)
                                 + inp * 4 * (quant.method == "gptq"))

    def values(self, o, i):
        raise AssertionError("an abstract build reads no weight")

    def __getitem__(self, index):
        raise AssertionError("an abstract build reads no weight")


class MetaFloat(MetaPacked):
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.stored_bytes = self.dtype.itemsize * int(np.prod(shape))


def abstract_source(model, table, cfg, quant, dtype):
    """{tensor name: MetaPacked | MetaFloat} for every tensor the model binds: the decoder's linear weights and
    experts packed (as the published checkpoints hold them), everything else float in `dtype` (torch_dtype)."""
    from tp_jax.loaders.bind import bind
    from tp_jax.parallel.layers.method import EXPERTS, LINEAR
    shapes, packed_names = {}, set()
    for b in bind(model, table):
        kind = getattr(b.module, "weight_kind", None)
        packed = ((kind == LINEAR and b.name == b.module.weight_name) or kind == EXPERTS) and \
            not getattr(b.module, "keep_float", False)
        for layer in b.layers(cfg.num_layers):
            for part, e in b.entries.items():
                name, shape = e.name(layer), b.decl.parts[part].hf_shape
                rows = (e.offset or 0) + shape[0]                 # a fused tensor (Phi-3's qkv): its parts' rows
                shapes[name] = (max(rows, shapes.get(name, (0,))[0]), *shape[1:])
                if packed:
                    packed_names.add(name)
    return {n: MetaPacked(quant, s) if n in packed_names else MetaFloat(s, dtype) for n, s in shapes.items()}


class DictSource(dict):
    def keys(self):
        return list(super().keys())

    def get(self, name):
        return self[name]


def build_at_tp8(published: dict, name: str, directory) -> None:
    """`published` (a config.json with a quantization_config) built abstractly at tp 8 with the method "auto"
    picks on CPU over metadata-only tensors: the decoder's linear layers (and experts) packed, held in at most
    1.3 x the checkpoint's bytes / 8 per device."""
    import jax
    import jax.numpy as jnp
    from tp_jax.loaders.model import abstract_model, param_bytes_per_device
    from tp_jax.loaders.quantize import plan_methods
    from tp_jax.models.config import load_config
    from tp_jax.models.quant_config import checkpoint_quant
    from tp_jax.models.registry import architecture
    from tp_jax.parallel.mesh import make_mesh
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(published, f)
    cfg = load_config(str(directory))
    quant = checkpoint_quant(published["quantization_config"])
    mesh = make_mesh(tp=8, devices=jax.devices()[:8])
    table = architecture(cfg.architecture).weights(cfg)
    dtype = {"float16": np.float16, "bfloat16": jnp.bfloat16, "float32": np.float32}[
        published.get("torch_dtype") or published.get("dtype") or "bfloat16"]
    source = DictSource(abstract_source(abstract_model(cfg, mesh), table, cfg, quant, dtype))
    plan = plan_methods(abstract_model(cfg, mesh), table, source, cfg.num_layers, quant.method + "_bf16")
    model = abstract_model(cfg, mesh, methods=plan)
    held = param_bytes_per_device(model, mesh)
    stored = sum(t.stored_bytes for t in source.values())
    print(f"{name} ({quant.scheme}): {len(plan)} packed params, {held / 2**30:.2f} GiB a device at tp 8 for a "
          f"{stored / 2**30:.2f} GiB checkpoint: {held / (stored / 8):.3f} x its bytes / 8")
    assert len([m for m in plan.values() if "packed" in type(m).__name__.lower()]) >= 3
    assert held <= 1.3 * stored / 8


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_quantization_config_builds_at_tp8(name, tmp_path):
    """Each published config (tests/data/quant_configs/INDEX.md) is read, or refused naming its scheme (3-bit
    GPTQ); a read one builds at tp 8 with the method "auto" picks on CPU, every decoder linear layer (and expert)
    kept packed, in at most 1.3 x the checkpoint's bytes / 8 per device."""
    from tp_jax.models.config import UnsupportedConfigError, load_config
    with open(os.path.join(QUANT_CONFIGS, name + ".json")) as f:
        published = json.load(f)
    os.makedirs(tmp_path / "m")
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(published, f)
    if published["quantization_config"].get("bits") == 3:
        with pytest.raises(UnsupportedConfigError, match=r"GPTQ checkpoint with 3-bit.*bits=3 is not supported"):
            load_config(str(tmp_path / "m"))
        return
    build_at_tp8(published, name, tmp_path / "m")


@pytest.mark.parametrize("fmt", ["gptq4_sym_actorder", "fp8_block"])
def test_orbax_conversion_stays_packed(reference, root, fmt):
    """convert_to_orbax keeps the stored words, scales and zero points (the copy loads packed, the same logits and
    bytes); with a dtype it writes the dequantized float weights and drops quantization_config."""
    from tp_jax.loaders.model import param_bytes_per_device
    from tp_jax.loaders.orbax import convert_to_orbax
    path, ids, logits, _ = reference(fmt)
    packed, floats = os.path.join(root, f"{fmt}_orbax"), os.path.join(root, f"{fmt}_orbax_f32")
    convert_to_orbax(path, packed)
    convert_to_orbax(path, floats, dtype="float32")
    a = check(reference(fmt), (1, 1, 2), greedy=False)
    b = LLM(packed, dtype="float32", tensor_parallel_size=2, progress=False)
    assert b.quantization == a.quantization and np.array_equal(b.get_logits(ids), a.get_logits(ids))
    assert param_bytes_per_device(b.model, b.mesh) == param_bytes_per_device(a.model, a.mesh)
    c = LLM(floats, dtype="float32", tensor_parallel_size=2, progress=False)
    assert c.quantization == "none" and float(np.abs(c.get_logits(ids) - logits).max()) <= 2e-4
    with open(os.path.join(floats, "config.json")) as f:
        assert "quantization_config" not in json.load(f)


# every architecture tp_jax runs (but GPT-2, whose Conv1D weights no format packs here) with a published block
ARCHITECTURES = ["Llama-3.1-8B-Instruct", "Mistral-7B-Instruct-v0.3", "Qwen2.5-7B-Instruct", "Qwen3-8B",
                 "Qwen3-30B-A3B", "Mixtral-8x7B-v0.1", "gemma-2-9b", "gemma-3-1b-it", "gemma-3-4b-it",
                 "Phi-3.5-mini-instruct", "OLMo-2-1124-7B-Instruct", "OLMoE-1B-7B-0924"]
BLOCKS = ["MythoMax-L2-13B-GPTQ@gptq-8bit-128g-actorder_True", "TinyLlama-1.1B-Chat-v1.0-AWQ", "Qwen3-32B-FP8",
          "Genz-70b-GPTQ"]


@pytest.mark.parametrize("i,arch", list(enumerate(ARCHITECTURES)), ids=ARCHITECTURES)
def test_published_blocks_on_every_architecture(i, arch, tmp_path):
    """A published quantization_config block (GPTQ with act order, AWQ, FP8 blocks, in turn) on each
    architecture's published config: read, planned and built at tp 8 within the bytes bound (Phi-3's fused
    qkv and gate_up, Gemma 3's vision checkpoint, the MoE models' experts)."""
    configs = os.path.join(os.path.dirname(__file__), "data", "configs")
    with open(os.path.join(configs, arch + ".json")) as f:
        published = json.load(f)
    block = BLOCKS[i % len(BLOCKS)]
    with open(os.path.join(QUANT_CONFIGS, block + ".json")) as f:
        published["quantization_config"] = json.load(f)["quantization_config"]
    build_at_tp8(published, f"{arch} + {block}'s block", tmp_path / "m")
