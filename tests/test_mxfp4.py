"""gpt-oss's published MXFP4 experts (`quant_method: mxfp4`) read exactly, per device (tp_jax/loaders/mxfp4.py).

The published rule, written here independently of the reader (transformers' `quantize_to_mxfp4` needs the
triton kernels hub, so the tests pack by hand; `test_the_packing_rule_is_transformers` checks this rule
against transformers' `convert_moe_packed_tensors`):

* the float `X` is transformers' `[E, in, out]` (gate_up_proj `[E, D, 2F]`, down_proj `[E, F, D]`); it is
  stored as rows of `[E, out, in]`, each row's inputs in blocks of 32;
* `X_scales` uint8 `[E, out, in/32]`: a block's E8M0 exponent s, its scale 2^(s - 127);
* `X_blocks` uint8 `[E, out, in/32, 16]`: the block's 32 FP4 e2m1 codes (0..15: +-{0, .5, 1, 1.5, 2, 3, 4, 6},
  bit 3 the sign), two a byte: input 2j in the low nibble of byte j, input 2j + 1 in the high nibble;
* w = FP4[code] * 2^(s - 127).

Checked: the reader equals `convert_moe_packed_tensors` bit for bit (float32 and bfloat16, every byte and
every exponent), any slice equals the whole's slice; the config is accepted with its `modules_to_not_convert`
and refused for fields Mxfp4Config does not have; a checkpoint directory shows `X` in place of the pair; a
device reads only its experts' (EP) or its rows' (TP) bytes, and loads the dequantized weights; a tiny gpt-oss
with MXFP4 experts kept packed (the default) matches transformers on the dequantized experts (5e-4) through `LLM`
at tp 1, tp 2 and dp 2 x tp 2 with EP, each device holding its share of the stored bytes; an Orbax copy keeps the
blocks; kept packed, the experts are the stored codes and exponents, equal to the float experts under every
dispatch, and no dispatch converts them whole.
"""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tp_jax.loaders.mxfp4 import FP4_VALUES, MXFP4Tensor
from tp_jax.loaders.safetensors import CheckpointError
from tp_jax.models.quant_config import QuantConfigError, checkpoint_quant

GPT_OSS_QC = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
E, D, F = 4, 64, 64                           # experts, hidden, one expert's intermediate width
PREFIX = "model.layers.0.mlp.experts."


def pack(codes: np.ndarray, exponents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP4 codes uint8 [E, out, in] and E8M0 exponents uint8 [E, out, in/32] -> (blocks, scales) by the rule."""
    e, out, inp = codes.shape
    pairs = codes.reshape(e, out, inp // 32, 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8), np.ascontiguousarray(exponents, np.uint8)


def unpacked(codes: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """The float [E, in, out] the rule says a pair holds, computed from the codes (float64, then float32: exact)."""
    scale = 2.0 ** (exponents.astype(np.float64) - 127)
    w = FP4_VALUES[codes].astype(np.float64) * np.repeat(scale, 32, axis=-1)
    return w.astype(np.float32).transpose(0, 2, 1)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [E, in, out] -> (codes [E, out, in], exponents [E, out, in/32]): OCP MX's rule, the block's
    exponent floor(log2(max |w|)) - 2 (e2m1's largest exponent), each value rounded to the nearest code."""
    rows = w.transpose(0, 2, 1)
    e, out, inp = rows.shape
    blocks = rows.reshape(e, out, inp // 32, 32)
    amax = np.abs(blocks).max(-1)
    exp = np.clip(np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127, 127).astype(np.int64)
    scaled = blocks / (2.0 ** exp)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
    return codes.reshape(e, out, inp), (exp + 127).astype(np.uint8)


def transformers_float(blocks, scales, dtype="float32") -> np.ndarray:
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=getattr(torch, dtype))
    return out.float().numpy()


def random_pair(seed: int, experts: int, out: int, inp: int, exponents=(118, 126)):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (experts, out, inp), dtype=np.uint8)
    exps = rng.integers(*exponents, (experts, out, inp // 32), dtype=np.uint8)
    return codes, exps


# --- (a) the numbers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("top", [254, 255])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantized_is_transformers_bit_for_bit(dtype, top):
    """Every byte value and every exponent 0..top (255, E8M0's NaN code: transformers' ldexp gives inf or a finite
    power; so do we), float32 and bfloat16: the reader's float tensor is `convert_moe_packed_tensors`' bits."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)
    blocks.reshape(-1, 16)[:16] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scales = rng.integers(0, top + 1, (3, 40, 4), dtype=np.uint8)
    scales.reshape(-1)[:top + 1] = np.arange(top + 1)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=getattr(torch, dtype))
    bits = torch.int32 if dtype == "float32" else torch.int16
    ours = MXFP4Tensor("x", blocks, scales)[...].astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    assert ours.shape == tuple(ref.shape) == (3, 128, 40)
    assert np.array_equal(ours.view(np.int32 if dtype == "float32" else np.int16), ref.view(bits).numpy())


def test_the_packing_rule_is_transformers():
    """The rule in this file's docstring (low nibble first, the float tensor transposed) is what transformers
    reads: packed codes come back as FP4[code] * 2^(s - 127), transposed; the OCP quantizer round-trips."""
    codes, exps = random_pair(1, 2, 48, 96, exponents=(100, 140))
    blocks, scales = pack(codes, exps)
    assert np.array_equal(transformers_float(blocks, scales), unpacked(codes, exps))
    w = np.random.default_rng(2).normal(0, 0.05, (2, 96, 48)).astype(np.float32)
    q = unpacked(*quantize(w))
    assert np.array_equal(unpacked(*quantize(q)), q)                   # a quantized tensor is its own quantization
    assert np.abs(q - w).max() <= np.abs(w).max() / 4                    # e2m1: within a quarter of the block max


SLICES = [(Ellipsis,), (1,), (-1, 5, -3), (slice(1, 3), slice(5, 37), slice(3, 9)), (slice(None), slice(31, 33)),
          (0, slice(64, 96), slice(None)), (slice(2, 2),), (Ellipsis, slice(10, 20)), (2, Ellipsis, 7),
          (slice(None), slice(90, 200), slice(-4, None))]


@pytest.mark.parametrize("index", SLICES, ids=[str(i) for i in range(len(SLICES))])
def test_slices_are_the_wholes_slices(index):
    """Ints (negative too), contiguous slices, Ellipsis, slices cutting through 32-input blocks: t[i] == t[...][i]."""
    blocks, scales = pack(*random_pair(3, 3, 40, 128))
    t = MXFP4Tensor("x", blocks, scales)
    whole = transformers_float(blocks, scales)
    assert np.array_equal(t[index], whole[index]) and t[index].dtype == np.float32


def test_bad_pairs_and_indices_are_named():
    blocks, scales = pack(*random_pair(4, 2, 8, 64))
    with pytest.raises(CheckpointError, match=r"'x': x_blocks \(2, 8, 2, 16\) and x_scales \(2, 8, 3\)"):
        MXFP4Tensor("x", blocks, np.zeros((2, 8, 3), np.uint8))
    with pytest.raises(CheckpointError, match="x_scales is float32, not uint8"):
        MXFP4Tensor("x", blocks, scales.astype(np.float32))
    t = MXFP4Tensor("x", blocks, scales)
    with pytest.raises(IndexError, match="contiguous slices"):
        t[:, ::2]
    with pytest.raises(IndexError, match="out of bounds"):
        t[2]


# --- (b) the config ----------------------------------------------------------------------------------------------

def test_gpt_oss_config_is_read():
    """gpt-oss-20b / 120b's block: read, its modules_to_not_convert matched by transformers' rule; transformers'
    own Mxfp4Config (its quant_method an enum) reads the same."""
    from transformers import Mxfp4Config
    q = checkpoint_quant(GPT_OSS_QC)
    assert q.method == "mxfp4" and q.group_size == 32 and q.keep_float == tuple(GPT_OSS_QC["modules_to_not_convert"])
    for module in ("model.layers.3.self_attn", "model.layers.11.self_attn.q_proj", "model.layers.0.mlp.router",
                   "model.embed_tokens", "lm_head"):
        assert q.keeps_float(module), module
    for module in ("model.layers.0.mlp.experts", "model.layers.0.mlp.routers", "model.norm"):
        assert not q.keeps_float(module), module
    assert checkpoint_quant(Mxfp4Config(modules_to_not_convert=["lm_head"])).keep_float == ("lm_head",)
    assert checkpoint_quant({"quant_method": "mxfp4", "dequantize": True}).keep_float == ()


REFUSED = [
    ({**GPT_OSS_QC, "group_size": 16}, ["MXFP4 checkpoint", "quantization_config.group_size=16",
                                        "quant_method, modules_to_not_convert, dequantize"]),
    ({**GPT_OSS_QC, "modules_to_not_convert": "lm_head"}, ["modules_to_not_convert='lm_head'", "a list"]),
    ({**GPT_OSS_QC, "modules_to_not_convert": ["model.layers.(*"]}, ["modules_to_not_convert='model.layers.(*'",
                                                                     "regular expressions"]),
    ({"quant_method": "mxfp4", "dequantize": "yes"}, ["dequantize='yes'"]),
]


@pytest.mark.parametrize("qc,words", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_fields_mxfp4config_does_not_have_are_refused(qc, words):
    from tp_jax.models.config import UnsupportedConfigError, quantization_refusal
    with pytest.raises(QuantConfigError) as e:
        checkpoint_quant(qc)
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(UnsupportedConfigError):
        quantization_refusal(qc)


# --- (c) a checkpoint directory ------------------------------------------------------------------------------------

def write_checkpoint(path, tensors: dict, qc=GPT_OSS_QC, shards: int = 1) -> str:
    """`tensors` (numpy; bfloat16 as ml_dtypes) as safetensors (`shards` files with an index) and a config.json."""
    import torch
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    as_torch = {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == ml_dtypes.bfloat16
                else torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
    names = sorted(as_torch)
    files = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": names[i::shards] for i in range(shards)}
    if shards == 1:
        save_file(as_torch, os.path.join(path, "model.safetensors"))
    else:
        for file, part in files.items():
            save_file({n: as_torch[n] for n in part}, os.path.join(path, file))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {n: file for file, part in files.items() for n in part}}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["GptOssForCausalLM"], "quantization_config": qc}, f)
    return str(path)


def expert_tensors(seed: int = 0, experts: int = E, d: int = D, f: int = F) -> dict:
    """One layer's MXFP4 experts as gpt-oss stores them, their float biases and a float router."""
    rng = np.random.default_rng(seed)
    gate_up = pack(*random_pair(seed, experts, 2 * f, d))
    down = pack(*random_pair(seed + 1, experts, d, f))
    bf16 = lambda *s: rng.normal(0, 0.1, s).astype(ml_dtypes.bfloat16)         # noqa: E731
    return {PREFIX + "gate_up_proj_blocks": gate_up[0], PREFIX + "gate_up_proj_scales": gate_up[1],
            PREFIX + "down_proj_blocks": down[0], PREFIX + "down_proj_scales": down[1],
            PREFIX + "gate_up_proj_bias": bf16(experts, 2 * f), PREFIX + "down_proj_bias": bf16(experts, d),
            "model.layers.0.mlp.router.weight": bf16(experts, d), "model.layers.0.mlp.router.bias": bf16(experts)}


@pytest.mark.parametrize("shards", [1, 2])
def test_a_checkpoint_shows_each_pair_as_its_float_tensor(tmp_path, shards):
    """open_checkpoint: `gate_up_proj` [E, D, 2F] and `down_proj` [E, F, D] in place of their blocks and scales
    (which are consumed: not keys), transformers' dequantized tensors exactly; the float tensors as stored."""
    from tp_jax.loaders.sources import open_checkpoint
    tensors = expert_tensors()
    source = open_checkpoint(write_checkpoint(tmp_path / "m", tensors, shards=shards), config=False).source
    keys = set(source.keys())
    assert keys == {PREFIX + "gate_up_proj", PREFIX + "down_proj", PREFIX + "gate_up_proj_bias",
                    PREFIX + "down_proj_bias", "model.layers.0.mlp.router.weight", "model.layers.0.mlp.router.bias"}
    assert PREFIX + "gate_up_proj_blocks" not in source and PREFIX + "gate_up_proj" in source
    for name, shape in (("gate_up_proj", (E, D, 2 * F)), ("down_proj", (E, F, D))):
        t = source.get(PREFIX + name)
        assert t.shape == shape and t.dtype == np.float32
        whole = transformers_float(tensors[PREFIX + name + "_blocks"], tensors[PREFIX + name + "_scales"])
        assert np.array_equal(t[...], whole)
        assert np.array_equal(t[2, 10:40, 5:70], whole[2, 10:40, 5:70])
    bias = np.asarray(source.get(PREFIX + "down_proj_bias")[...])
    assert np.array_equal(bias.view(np.int16), tensors[PREFIX + "down_proj_bias"].view(np.int16))


def test_a_checkpoint_that_contradicts_its_config_is_named(tmp_path):
    """A pair under a module modules_to_not_convert names, a pair without its scales, a float twin beside a pair."""
    from tp_jax.loaders.sources import open_checkpoint
    t = expert_tensors()
    qc = {**GPT_OSS_QC, "modules_to_not_convert": ["model.layers.*.mlp.experts"]}
    with pytest.raises(CheckpointError, match=r"_proj_blocks' is stored MXFP4, but quantization_config."
                                              r"modules_to_not_convert \['model.layers.\*.mlp.experts'\]"):
        open_checkpoint(write_checkpoint(tmp_path / "a", t, qc), config=False)
    no_scales = {k: v for k, v in t.items() if not k.endswith("down_proj_scales")}
    with pytest.raises(CheckpointError, match=r"down_proj_blocks' has no '.*down_proj_scales' beside it"):
        open_checkpoint(write_checkpoint(tmp_path / "b", no_scales), config=False)
    twin = {**t, PREFIX + "down_proj": np.zeros((E, F, D), np.float32)}
    with pytest.raises(CheckpointError, match=r"down_proj' both float and as MXFP4"):
        open_checkpoint(write_checkpoint(tmp_path / "c", twin), config=False)


def test_float_experts_in_an_mxfp4_checkpoint_stay_float(tmp_path):
    """Modules stored float (listed in modules_to_not_convert, or not) read as they are."""
    from tp_jax.loaders.sources import open_checkpoint
    w = np.random.default_rng(5).normal(size=(E, D, 2 * F)).astype(np.float32)
    t = {**expert_tensors(), "model.layers.1.mlp.experts.gate_up_proj": w}
    source = open_checkpoint(write_checkpoint(tmp_path / "m", t), config=False).source
    assert np.array_equal(source.get("model.layers.1.mlp.experts.gate_up_proj")[...], w)


# --- (d) per device: only a device's bytes -------------------------------------------------------------------------

class Recording:
    """A safetensors source whose stored tensors log the bytes each read returns: [(name, index, nbytes)]."""

    def __init__(self, source):
        self.source, self.reads = source, []

    def keys(self):
        return self.source.keys()

    def __contains__(self, name):
        return name in self.source

    def get(self, name):
        return self.source.get(name)

    def raw(self, name):
        tensor, reads = self.source.raw(name), self.reads

        class Logged:
            shape, dtype = tensor.shape, tensor.dtype

            def __getitem__(self, index):
                out = np.asarray(tensor[index])
                reads.append((name, index, out.nbytes))
                return out
        return Logged()


class MoE(nnx.Module):
    def __init__(self, tp, ep, d, f, rngs):
        from tp_jax.parallel.layers.moe import Experts
        self.experts = Experts(E, d, f, tp_size=tp, ep_size=ep, rngs=rngs)


def table(f: int):
    """gpt-oss's layout, as a table sees it: `[E, in, out]` fused tensors (`layout="in_out"`, `index=e`); the
    gate and up parts as the first and last F outputs (gpt-oss interleaves them: its model's table says how)."""
    from tp_jax.parallel.layers import Entry
    out = []
    for e in range(E):
        out += [Entry(PREFIX + "gate_up_proj", "experts.gate_up", f"gate.{e}", layout="in_out", index=e, offset=0),
                Entry(PREFIX + "gate_up_proj", "experts.gate_up", f"up.{e}", layout="in_out", index=e, offset=f),
                Entry(PREFIX + "down_proj", "experts.down", f"down.{e}", layout="in_out", index=e)]
    return out


def mxfp4_source(tmp_path, f: int = F):
    from tp_jax.loaders.packed import PackedSource
    from tp_jax.loaders.safetensors import SafetensorsSource
    t = {k: v for k, v in expert_tensors(f=f).items() if "_blocks" in k or "_scales" in k}
    path = write_checkpoint(tmp_path / f"f{f}", t)
    recording = Recording(SafetensorsSource(path))
    return PackedSource(recording, checkpoint_quant(GPT_OSS_QC)), recording, t


@pytest.mark.parametrize("layout", ["tp", "ep"])
@pytest.mark.parametrize("f", [F, 32])
def test_a_device_reads_only_its_bytes(tmp_path, layout, f):
    """Each rank's block, built as the loader builds it (the statement's block over the entries' views): under TP
    (tp 2) rank r reads its F/2 rows of gate and of up, and its F/2 inputs of down (F = 32: half a 32-input block,
    so the block covering them), of every expert; under EP (ep 2) only its two experts, whole. Its bytes sum to
    its share of the checkpoint's; the block is transformers' dequantized weights."""
    from tp_jax.parallel.layers.table import TensorView
    from tp_jax.parallel.mesh import make_mesh
    source, recording, t = mxfp4_source(tmp_path, f)
    tp, ep = (2, None) if layout == "tp" else (1, 2)
    with jax.set_mesh(make_mesh(dp=1, tp=2, devices=jax.devices()[:2])):
        moe = nnx.eval_shape(lambda: MoE(tp, ep, D, f, nnx.Rngs(0)))
    statements = moe.experts.statements()
    views = {"gate_up": {}, "down": {}}
    for entry in table(f):
        param = entry.param.rsplit(".", 1)[1]
        rows = f if param == "gate_up" else None
        views[param][entry.part] = TensorView(source.get(entry.hf), entry.layout, entry.offset or 0, rows, entry.index)
    whole = {n: transformers_float(t[PREFIX + n + "_blocks"], t[PREFIX + n + "_scales"])
             for n in ("gate_up_proj", "down_proj")}
    stored = {n: t[PREFIX + n + "_blocks"].nbytes + t[PREFIX + n + "_scales"].nbytes for n in whole}
    for rank in range(2):
        for param, name in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            recording.reads.clear()
            block = statements[param].block(rank, views[param])
            read = sum(n for _, _, n in recording.reads)
            experts = range(E) if ep is None else [e for e in statements[param].slots[rank] if e >= 0]
            if ep is None:
                half = slice(rank * f // 2, (rank + 1) * f // 2)
                expect = np.concatenate([whole[name][:, :, half], whole[name][:, :, f:][:, :, half]], axis=2) \
                    if param == "gate_up" else whole[name][:, half, :]
                share = stored[name] // 2 if param == "gate_up" or f % 64 == 0 else stored[name]
            else:
                expect, share = whole[name][list(experts)], stored[name] * len(experts) // E
            assert np.array_equal(block, expect), (layout, rank, param)
            assert read == share, (layout, rank, param, read, share, recording.reads[:4])
            assert {n.rsplit(".", 1)[1] for n, _, _ in recording.reads} == {name + "_blocks", name + "_scales"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_state_holds_the_dequantized_experts(tmp_path, dtype):
    """The whole load (load_state at tp 2 and at ep 2): the experts held in the run's dtype are transformers'
    dequantized weights (exact in bfloat16 too)."""
    from tp_jax.loaders.place import fill, load_state
    from tp_jax.parallel.mesh import make_mesh
    source, _, t = mxfp4_source(tmp_path)
    gate_up = transformers_float(t[PREFIX + "gate_up_proj_blocks"], t[PREFIX + "gate_up_proj_scales"])
    down = transformers_float(t[PREFIX + "down_proj_blocks"], t[PREFIX + "down_proj_scales"])
    for tp, ep in ((2, None), (1, 2)):
        mesh = make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
        with jax.set_mesh(mesh):
            moe = nnx.eval_shape(lambda: MoE(2 if ep is None else 1, ep, D, F, nnx.Rngs(0)))
        fill(moe, load_state(moe, mesh, source, table(F), 1, getattr(jnp, dtype), progress=False))
        held = np.asarray(moe.experts.gate_up[...]).astype(np.float32)
        assert moe.experts.gate_up[...].dtype == getattr(jnp, dtype)
        if ep is None:                                   # [E, D, 2F/tp] per rank: gate then up of each rank
            h = F // 2
            ranks = [(gate_up[:, :, r * h:(r + 1) * h], gate_up[:, :, F + r * h:F + (r + 1) * h]) for r in range(2)]
            expect = np.concatenate([np.concatenate(pair, 2) for pair in ranks], 2)
        else:
            expect = gate_up
        assert np.array_equal(held, expect), (tp, ep)
        assert np.array_equal(np.asarray(moe.experts.down[...]).astype(np.float32), down), (tp, ep)


# --- (e) end to end: a tiny gpt-oss with MXFP4 experts -------------------------------------------------------------

GPT_OSS = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
               layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.3,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "truncate": False,
                                "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0},
               architectures=["GptOssForCausalLM"])
PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15], [5, 17, 200, 42, 9], [299, 3, 77, 150]]


def write_tiny_gpt_oss_mxfp4(path: str):
    """A tiny gpt-oss checkpoint at `path` as the published ones are stored: experts MXFP4 (quantized by the rule
    above from transformers' random float model), everything else float32. Returns (ids [4, 11], transformers'
    logits for them, its greedy tokens for `PROMPTS`): the reference is transformers on the dequantized experts (its
    float model holding exactly the weights the blocks and scales say). scripts/bench_mxfp4.py writes it too."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from tests.tiny_models import logits_and_greedy, randomize
    torch.manual_seed(0)
    model = randomize(transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**GPT_OSS)).eval())
    packed = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("sinks", "_proj_bias")):
                p.copy_(torch.randn_like(p))
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                w = p.detach().numpy() * (8.0 if n.endswith("gate_up_proj") else 1.0)    # so the clamp (7) acts
                codes, exps = quantize(w)
                packed[n + "_blocks"], packed[n + "_scales"] = pack(codes, exps)
                p.copy_(torch.from_numpy(unpacked(codes, exps)))
    model.save_pretrained(path, safe_serialization=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    assert all(n.removesuffix("_blocks") in tensors for n in packed if n.endswith("_blocks")), sorted(tensors)
    tensors = {n: t for n, t in tensors.items() if n + "_blocks" not in packed}
    save_file({**tensors, **{n: torch.from_numpy(v) for n, v in packed.items()}}, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": GPT_OSS_QC}, f)
    ids = np.random.default_rng(0).integers(0, GPT_OSS["vocab_size"], size=(4, 11))
    return (ids, *logits_and_greedy(model, ids, PROMPTS, max_new_tokens=6))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """(path, ids, logits, greedy) of `write_tiny_gpt_oss_mxfp4`."""
    pytest.importorskip("tp_jax.models.gpt_oss")
    path = str(tmp_path_factory.mktemp("gpt_oss") / "mxfp4")
    return (path, *write_tiny_gpt_oss_mxfp4(path))


def expert_bytes_bound(llm, path: str) -> tuple[int, int]:
    """(bytes of params on the busiest device, the bound's base: the stored expert bytes (blocks and scales) on a
    device, 1/ep or 1/tp of the checkpoint's, plus the float params a device holds beside the packed experts)."""
    from safetensors import safe_open
    from tp_jax.loaders.model import param_bytes_per_device
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        stored = sum(f.get_slice(n).get_shape()[0] * int(np.prod(f.get_slice(n).get_shape()[1:]))
                     for n in f.keys() if n.endswith(("_blocks", "_scales")))
    ranks = llm.mesh.shape["tp"] * (llm.mesh.shape["dp"] if llm.config.enable_expert_parallel else 1)
    experts = llm.model.model.layers.layers.mlp.experts
    packed = sum(int(np.prod(getattr(experts, n + s).get_value().shape)) * getattr(experts, n + s).get_value().dtype.itemsize
                 for n in ("gate_up", "down") for s in experts.method.suffixes) // ranks
    held = param_bytes_per_device(llm.model, llm.mesh)
    return held, stored // ranks + held - packed


@pytest.mark.parametrize("dp,tp,ep", [(1, 1, False), (1, 2, False), pytest.param(2, 2, True, marks=pytest.mark.slow)],
                         ids=["tp1", "tp2", "dp2tp2-ep"])
def test_gpt_oss_mxfp4_matches_transformers(gpt_oss_mxfp4, dp, tp, ep):
    """LLM(path, dtype="float32") on the MXFP4 checkpoint, gpt-oss's float name table unchanged: the experts kept
    as stored ("mxfp4": FP4 codes and E8M0 exponents, each device its experts' or rows' bytes: within 1.15x of
    its share of the stored blocks and scales plus its float params), dequantized inside the expert GEMMs;
    logits within 5e-4 of transformers on the dequantized experts, greedy tokens equal. The CPU default
    (dtype and quantization auto) is the same method: the same numbers."""
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    path, ids, logits, greedy = gpt_oss_mxfp4
    llm = LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep, progress=False,
              compile_cache=False, dtype="float32")
    assert llm.quantization == "mxfp4 fp4" and llm.setup.quantization == "mxfp4"
    held, base = expert_bytes_bound(llm, path)
    assert base <= held <= 1.15 * base, (held, base)
    diff = float(np.abs(llm.get_logits(ids) - logits).max())
    assert diff <= 5e-4, f"max abs logit diff {diff:.2e}"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == greedy
    if tp == 2 and not ep:
        default = LLM(path, tensor_parallel_size=tp, progress=False, compile_cache=False)
        assert default.setup.quantization == "mxfp4" and default.setup.dtype == "float32"
        assert np.array_equal(default.get_logits(ids), llm.get_logits(ids))


@pytest.mark.default_compile          # batch invariance is a promise at XLA's default LLVM level (docs/design.md)
def test_the_default_is_batch_invariant(gpt_oss_mxfp4):
    """The CPU default on the MXFP4 checkpoint (experts kept packed, gather dispatch): a request's tokens and logprobs
    are the same alone and beside others."""
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    llm = LLM(gpt_oss_mxfp4[0], tensor_parallel_size=2, progress=False, compile_cache=False)
    assert llm.setup.quantization == "mxfp4" and llm.setup.batch_invariant
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    beside = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], params)[1].outputs[0]
    assert alone.token_ids == beside.token_ids and alone.logprobs == beside.logprobs


def test_gpt_oss_mxfp4_bf16_dot_bound(gpt_oss_mxfp4):
    """quantization="mxfp4_bf16" (x rounded to bf16 at each expert dot, the dequantized weights exact in bf16,
    float32 sums): logits within 0.2 of transformers (measured 0.10 on this model, whose largest |logit| is 10.4);
    quantization=None: the experts dequantized to float at load, as before."""
    from tp_jax.serving.llm import LLM
    path, ids, logits, _ = gpt_oss_mxfp4
    llm = LLM(path, tensor_parallel_size=2, progress=False, compile_cache=False, quantization="mxfp4_bf16")
    assert llm.quantization == "mxfp4 fp4 (bf16 dot)"
    diff = float(np.abs(llm.get_logits(ids) - logits).max())
    assert diff <= 0.2, f"max abs logit diff {diff:.2e}"
    float_llm = LLM(path, tensor_parallel_size=2, progress=False, compile_cache=False, quantization=None)
    assert float_llm.quantization == "none"
    assert float(np.abs(float_llm.get_logits(ids) - logits).max()) <= 5e-4


def test_orbax_copy_keeps_the_blocks(gpt_oss_mxfp4, tmp_path):
    """convert_to_orbax writes the stored blocks and scales as they are (the copy reads as the same float tensors);
    with a dtype it writes the dequantized float experts."""
    from tp_jax.loaders.orbax import convert_to_orbax
    from tp_jax.loaders.sources import open_checkpoint
    path = gpt_oss_mxfp4[0]
    convert_to_orbax(path, str(tmp_path / "kept"))
    convert_to_orbax(path, str(tmp_path / "f32"), dtype="float32")
    src, kept, f32 = (open_checkpoint(p, config=False).source for p in (path, tmp_path / "kept", tmp_path / "f32"))
    raw = set(kept.source.keys())
    assert PREFIX + "gate_up_proj_blocks" in raw and PREFIX + "gate_up_proj" not in raw
    assert sorted(src.keys()) == sorted(kept.keys()) == sorted(f32.keys())
    for name in (PREFIX + "gate_up_proj", PREFIX + "down_proj"):
        assert np.array_equal(kept.get(name)[...], src.get(name)[...])
        assert np.array_equal(np.asarray(f32.get(name)[...]), src.get(name)[...])


# --- (f) kept packed: the codes and exponents as stored, dequantized inside the expert GEMMs -----------------------

def test_packed_rows_are_the_stored_codes_and_exponents():
    """`MXFP4Tensor.expert(e)`: the packed [out, in] weight of expert e: its codes and E8M0 exponents as stored (any
    slice), its float slices the float tensor's transposed; the jax decoders give FP4's 16 values (bit for bit, -0
    included) and 2^(s - 127) for every finite exponent."""
    from tp_jax.parallel.layers.packed import e2m1_to_float32, e8m0_to_float32
    codes, exps = random_pair(6, 3, 40, 128)
    t = MXFP4Tensor("x", *pack(codes, exps))
    rows = t.expert(2)
    assert rows.shape == (40, 128) and rows.kind == "fp4" and rows.quant_type == "mxfp4"
    assert np.array_equal(rows.values(slice(None), slice(None)), codes[2])
    assert np.array_equal(rows.values(slice(3, 9), slice(40, 70)), codes[2, 3:9, 40:70])
    assert np.array_equal(rows.scales(slice(5, 7), slice(1, 3)), exps[2, 5:7, 1:3])
    assert np.array_equal(rows.groups(slice(30, 70)), np.arange(30, 70) // 32)
    assert np.array_equal(rows[2:9, 31:65], t[2][31:65, 2:9].T)
    got = np.asarray(e2m1_to_float32(jnp.arange(16, dtype=jnp.uint8)))
    assert np.array_equal(got.view(np.int32), FP4_VALUES.view(np.int32))
    s = np.arange(1, 255, dtype=np.uint8)
    assert np.array_equal(np.asarray(e8m0_to_float32(jnp.asarray(s))), np.ldexp(np.float32(1), s.astype(np.int32) - 127))
    with pytest.raises(IndexError, match="has 3 experts, not expert 3"):
        t.expert(3)


def packed_experts(e: int, d: int, f: int, seed: int = 0):
    """(float `Experts` holding the dequantized kernels, the same experts kept as MXFP4 codes and exponents), tp 1,
    gpt-oss's activation and biases."""
    from tp_jax.parallel.layers.moe import Experts
    from tp_jax.parallel.layers.packed import PackedExperts, PackedWeight
    from tp_jax.parallel.mesh import make_mesh
    rng = np.random.default_rng(seed)
    fp4 = PackedWeight("mxfp4", "fp4", 32, scale_dtype="uint8")
    with jax.set_mesh(make_mesh(devices=jax.devices()[:1])):
        dense = Experts(e, d, f, bias=True, activation="swigluoai", interleaved=True, rngs=nnx.Rngs(0))
        kept = Experts(e, d, f, bias=True, activation="swigluoai", interleaved=True, rngs=nnx.Rngs(0))
        kept.use_method(PackedExperts((("gate_up", fp4), ("down", fp4))))
    for name, out, inp in (("gate_up", 2 * f, d), ("down", d, f)):
        codes, exps = random_pair(int(rng.integers(1 << 30)), e, out, inp)
        blocks, scales = pack(codes, exps)
        getattr(kept, name).set_value(jnp.asarray(blocks.reshape(e, out, inp // 2)))
        getattr(kept, name + "_scale").set_value(jnp.asarray(scales))
        getattr(dense, name).set_value(jnp.asarray(unpacked(codes, exps)))
        bias = jnp.asarray(rng.normal(0, 0.1, (e, out)).astype(np.float32))
        for layer in (dense, kept):
            getattr(layer, name + "_bias").set_value(bias)
    return dense, kept


@pytest.mark.parametrize("tile_bytes", [None, 4096], ids=["one-tile", "tiles"])
@pytest.mark.parametrize("dispatch", ["gather", "dense", "ragged"])
def test_packed_experts_are_the_float_experts_under_every_dispatch(dispatch, tile_bytes, monkeypatch):
    """The experts kept as MXFP4, float32: each dispatch's output equals the float experts' (the dequantized weights
    exactly; only the sums' order may differ: 2e-6 of the output's scale), in one tile or built tile by tile
    (`expert_tiles` > 1)."""
    from tp_jax.parallel.layers import method
    if tile_bytes:
        monkeypatch.setattr(method, "TILE_BYTES", tile_bytes)
        monkeypatch.setattr(method, "EXPERT_TILE_COLUMNS", 16)
    dense, kept = packed_experts(4, 64, 64)
    assert (kept.method.expert_tiles(kept, "gate_up", 4) > 1) == bool(tile_bytes)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(6, 64)).astype(np.float32))
    ids = jnp.asarray(np.array([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2], [0, 3]], np.int32))
    w = jnp.asarray(rng.uniform(size=(6, 2)).astype(np.float32))
    want = np.asarray(dense(x, ids, w, dispatch))
    got = np.asarray(kept(x, ids, w, dispatch))
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), np.abs(got - want).max()


def test_no_dispatch_converts_the_local_experts_whole():
    """Compiled (nothing allocated): the scratch memory of a prefill-sized step (256 tokens) of 8 MXFP4 experts under
    the dense and ragged dispatches exceeds the float experts' own step (which converts nothing) by less than half of
    the experts in float32 (12.6 MB), where converting them whole would take all of it."""
    from tp_jax.parallel.mesh import make_mesh
    layers = packed_experts(8, 256, 512)
    experts_f32 = 3 * 8 * 256 * 512 * 4
    args = (jax.ShapeDtypeStruct((256, 256), jnp.float32), jax.ShapeDtypeStruct((256, 2), jnp.int32),
            jax.ShapeDtypeStruct((256, 2), jnp.float32))

    def temp(layer, dispatch):
        graph, state = nnx.split(layer)
        with jax.set_mesh(make_mesh(devices=jax.devices()[:1])):
            step = jax.jit(lambda s, x, i, w: nnx.merge(graph, s)(x, i, w, dispatch))
            return step.lower(state, *args).compile().memory_analysis().temp_size_in_bytes
    for dispatch in ("dense", "ragged"):
        float_temp, kept_temp = (temp(layer, dispatch) for layer in layers)
        assert kept_temp - float_temp < experts_f32 / 2, (dispatch, kept_temp, float_temp, experts_f32)


def test_a_nan_exponent_is_refused_when_kept(tmp_path):
    """E8M0's NaN code (255) in an expert kept packed: a QuantizationError naming the tensor and the fix (the float
    path reads it as transformers does)."""
    from tp_jax.parallel.layers.method import QuantizationError
    from tp_jax.parallel.layers.packed import PackedWeight, rank_block
    from tp_jax.parallel.layers.loading import PartRows, ShardedParam
    codes, exps = random_pair(7, 1, 8, 64)
    exps[0, 3, 1] = 255
    rows = MXFP4Tensor("x", *pack(codes, exps)).expert(0)
    weight = ShardedParam({"weight": PartRows((8, 64), np.arange(8)[None])}, split=0)
    fp4 = PackedWeight("mxfp4", "fp4", 32, scale_dtype="uint8")
    assert np.array_equal(rank_block(fp4, weight, "", 0, {"weight": rows}, {}), pack(codes, exps)[0].reshape(8, 32))
    with pytest.raises(QuantizationError, match=r"MXFP4Rows\('x', expert 0.*E8M0 scale 255.*quantization=None"):
        rank_block(fp4, weight, "_scale", 0, {"weight": rows}, {})
