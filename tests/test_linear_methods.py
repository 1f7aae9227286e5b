"""Linear methods on every parallel layer: sharded == numpy on the dequantized weights, tp in {1,2,4,8} and 3.

References are independent of the code under test: int8 is quantized by numpy here
(`tests/quant_models.int8_reference`), GGUF blocks are made and dequantized by the `gguf`
package. The params each rank holds are checked exactly (the same Q and scales at every
tp), the GEMMs to float tolerance.
"""

import gguf
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.hlo import count
from tests.quant_models import gguf_dequantized, int8_dequantized, int8_reference
from tests.test_layers import batch_spec, build, hlo_of, randn
from tp_jax.parallel.heads import plan_heads
from tp_jax.parallel.layers import (ColumnParallelLinear, GGUFBlocks, Int8, LinearMethod, MergedColumnParallelLinear,
                                    ParallelLMHead, QKVParallelLinear, QuantizationError, ReplicatedLinear,
                                    RowParallelLinear, Unquantized, UnsupportedLayerError, VocabParallelEmbedding)
from tp_jax.parallel.layers import method as method_module
from tp_jax.parallel.layers.ggml import QuantizedArray
from tp_jax.parallel.layers.method import LINEAR
from tp_jax.parallel.layers.quantization import quantization_config, register_quantization
from tp_jax.parallel.shard import shard_module

QT = gguf.GGMLQuantizationType
METHODS = ["int8", "Q8_0", "Q4_1"]              # per layer; Q4_0's blocks: the dequantize and params tests
B = 6
TOL = dict(rtol=1e-4, atol=1e-4)


def method_of(name: str) -> LinearMethod:
    return Int8() if name == "int8" else GGUFBlocks(name)


def stored(name: str, w: np.ndarray):
    """What the checkpoint holds: the float weight (int8 quantizes it at load) or its GGUF blocks."""
    return w if name == "int8" else QuantizedArray.quantize(w, name)


def dequantized(name: str, w: np.ndarray) -> np.ndarray:
    """The weight the layer must compute with."""
    return int8_dequantized(w) if name == "int8" else gguf_dequantized(w, QT[name])


def load(layer, weights):
    layer.set_params(layer.load_global(weights))
    return layer


def run(layer, mesh, x, in_spec=None, out_spec=None):
    return np.asarray(shard_module(layer, mesh, in_specs=(in_spec or batch_spec(),),
                                   out_specs=out_spec or batch_spec())(x))


# --- every layer, every method ----------------------------------------------------------

@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("gather", [True, False])
def test_column(mesh, name, gather):
    w, b, x = randn(48, 64), randn(48, seed=1), randn(B, 64, seed=2)
    layer = load(build(mesh, ColumnParallelLinear, 64, 48, gather_output=gather, method=method_of(name)),
                 {"kernel": {"weight": stored(name, w)}, "bias": {"bias": b}})
    y = run(layer, mesh, x, out_spec=batch_spec() if gather else batch_spec("tp"))
    np.testing.assert_allclose(y, x @ dequantized(name, w).T + b, **TOL)


@pytest.mark.parametrize("name", METHODS)
def test_row(mesh, name):
    """in = 768: every tp's share is whole 32-element blocks (768 / 3 = 256, 768 / 8 = 96)."""
    w, b, x = randn(10, 768), randn(10, seed=1), randn(B, 768, seed=2)
    layer = load(build(mesh, RowParallelLinear, 768, 10, method=method_of(name)),
                 {"kernel": {"weight": stored(name, w)}, "bias": {"bias": b}})
    y = run(layer, mesh, x, in_spec=batch_spec("tp"))
    np.testing.assert_allclose(y, x @ dequantized(name, w).T + b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name", METHODS)
def test_replicated_and_merged(mesh, name):
    ws, x = [randn(24, 64, seed=1), randn(48, 64, seed=2)], randn(B, 64, seed=3)
    merged = load(build(mesh, MergedColumnParallelLinear, 64, (24, 48), bias=False, gather_output=True,
                        method=method_of(name)),
                  {"kernel": {"0": stored(name, ws[0]), "1": stored(name, ws[1])}})
    ref = np.concatenate([x @ dequantized(name, w).T for w in ws], -1)
    np.testing.assert_allclose(run(merged, mesh, x), ref, **TOL)
    rep = load(build(mesh, ReplicatedLinear, 64, 24, bias=False, method=method_of(name)),
               {"kernel": {"weight": stored(name, ws[0])}})
    np.testing.assert_allclose(run(rep, mesh, x), ref[:, :24], **TOL)


@pytest.mark.parametrize("name", METHODS)
def test_qkv_with_padded_heads(mesh, name):
    """9 query / 3 KV heads: padded or replicated slots at tp 2, 4, 8 hold zeros and copies."""
    heads, kv, hd, d = 9, 3, 4, 64
    ws = {"q": randn(heads * hd, d, seed=1), "k": randn(kv * hd, d, seed=2), "v": randn(kv * hd, d, seed=3)}
    x = randn(B, d, seed=4)
    layer = load(build(mesh, QKVParallelLinear, d, hd, heads, kv, method=method_of(name)),
                 {"kernel": {p: stored(name, w) for p, w in ws.items()}})
    got = shard_module(layer, mesh, in_specs=(batch_spec(),), out_specs=(batch_spec("tp"),) * 3)(x)
    plan = plan_heads(heads, kv, mesh.shape["tp"])
    for part, slots, y in zip("qkv", (plan.q_heads, plan.kv_heads, plan.kv_heads), got):
        full = (x @ dequantized(name, ws[part]).T).reshape(B, -1, hd)
        slots = slots.reshape(-1)
        ref = np.where((slots >= 0)[None, :, None], full[:, np.maximum(slots, 0)], 0)
        np.testing.assert_allclose(np.asarray(y).reshape(ref.shape), ref, **TOL)


@pytest.mark.parametrize("name", METHODS)
def test_vocab_embedding_and_head(mesh, name):
    """V = 100 pads to 128 (or 192 at tp = 3): padding rows are zero blocks, their logits the minimum."""
    vocab, d = 100, 64
    w, ids, h = randn(vocab, d), np.random.default_rng(1).integers(0, vocab, (B, 5)), randn(B, d, seed=2)
    emb = load(build(mesh, VocabParallelEmbedding, vocab, d, method=method_of(name)),
               {"embedding": {"weight": stored(name, w)}})
    ref = dequantized(name, w)
    np.testing.assert_allclose(run(emb, mesh, ids), ref[ids], **TOL)
    head = load(build(mesh, ParallelLMHead, vocab, d, method=method_of(name)),
                {"embedding": {"weight": stored(name, w)}})
    np.testing.assert_allclose(run(head, mesh, h), h @ ref.T, **TOL)


# --- what each rank holds ---------------------------------------------------------------

def test_int8_params_are_numpys_at_every_tp(mesh):
    """Q and s gathered from the ranks == numpy's quantization of the whole tensor: the split never changes
    them (a row layer's ranks see whole rows for the scale; a column layer's scales split with its rows)."""
    w = randn(48, 768)
    q, s = int8_reference(w)
    col = load(build(mesh, ColumnParallelLinear, 768, 48, bias=False, method=Int8()), {"kernel": {"weight": w}})
    row = load(build(mesh, RowParallelLinear, 768, 48, bias=False, method=Int8()), {"kernel": {"weight": w}})
    for layer in (col, row):
        np.testing.assert_array_equal(np.asarray(layer.kernel[...]), q)
        np.testing.assert_allclose(np.asarray(layer.kernel_scale[...]), s, rtol=1e-6)
    spec = lambda p: p.get_metadata()["out_sharding"]                      # noqa: E731
    assert (spec(col.kernel), spec(col.kernel_scale)) == (("tp", None), ("tp",))       # [out, in]: rows split
    assert (spec(row.kernel), spec(row.kernel_scale)) == ((None, "tp"), (None,))       # scales whole


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_params_are_the_file_blocks(mesh, name):
    """Values, scales (and mins) gathered from the ranks are the blocks' own bytes, for a row split too."""
    w = randn(48, 768)
    raw = QuantizedArray.quantize(w, name).blocks()                       # [48, 24, bytes]
    row = load(build(mesh, RowParallelLinear, 768, 48, bias=False, method=GGUFBlocks(name)),
               {"kernel": {"weight": QuantizedArray.quantize(w, name)}})
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0]
    np.testing.assert_array_equal(np.asarray(row.kernel_scale[...]), scale)
    if name == "Q4_1":
        np.testing.assert_array_equal(np.asarray(row.kernel_min[...]), raw[..., 2:4].copy().view(np.float16)[..., 0])
    start = 4 if name == "Q4_1" else 2
    np.testing.assert_array_equal(np.asarray(row.kernel[...]).view(np.uint8).reshape(raw[..., start:].shape),
                                  raw[..., start:])


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_is_ggufs(name):
    rng = np.random.default_rng(3)
    raw = QuantizedArray.quantize(rng.standard_normal((8, 256)).astype(np.float32) * 3, name).blocks()
    from tp_jax.parallel.layers.ggml import split_fields
    m = GGUFBlocks(name)
    fields = split_fields(raw, m.format)
    got = np.asarray(m.dequantize(*(fields[s] for s in m.suffixes)))
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw.reshape(8, -1), QT[name]))


def test_tiled_matmul_equals_one_product(monkeypatch):
    """The GEMM dequantizes a tile of output rows at a time; with tiny tiles the result is the same."""
    x, w = randn(3, 2, 64), randn(96, 64, seed=1)
    q, s = int8_reference(w)
    whole = np.asarray(method_module.tiled_matmul(x, [q], lambda a: a, np.float32))
    monkeypatch.setattr(method_module, "TILE_BYTES", 64 * 4 * 8)                  # 8 rows a tile: 12 tiles
    assert method_module.num_tiles(96, 64 * 4) == 12
    tiled = np.asarray(method_module.tiled_matmul(x, [q], lambda a: a, np.float32))
    np.testing.assert_allclose(tiled, whole, rtol=1e-5, atol=1e-3)          # |y| ~ 700
    np.testing.assert_allclose(whole, x @ q.astype(np.float32).T, rtol=1e-5, atol=1e-3)


def test_unquantized_is_the_default_and_holds_one_float_kernel():
    with nnx.use_eager_sharding(False):
        layer = ColumnParallelLinear(16, 32, tp_size=2, rngs=nnx.Rngs(0))
    assert isinstance(layer.method, Unquantized)
    assert sorted(layer.loading()) == ["bias", "kernel"] and layer.kernel[...].dtype == np.float32


# --- collectives do not change ----------------------------------------------------------

@pytest.mark.parametrize("name", ["int8", "Q4_1"])
@pytest.mark.parametrize("tp", [2, 8])
def test_hlo_same_collectives_as_float(name, tp):
    from tests.conftest import mesh_for
    mesh = mesh_for(1, 1, tp)
    row = build(mesh, RowParallelLinear, 768, 16, method=method_of(name))
    hlo = hlo_of(row, mesh, np.ones((2, 768), np.float32), P(None, "tp"), P())
    assert count(hlo, "all-reduce") == 1 and count(hlo, "all-gather") == 0
    col = build(mesh, ColumnParallelLinear, 64, 64, gather_output=True, method=method_of(name))
    hlo = hlo_of(col, mesh, np.ones((2, 64), np.float32), P(), P())
    assert count(hlo, "all-gather") == 1 and count(hlo, "all-reduce") == 0


# --- bad input --------------------------------------------------------------------------

def test_unknown_int8_activations_name_the_choices():
    with pytest.raises(QuantizationError, match=r"Int8\(activations='int16'\): choose 'float' \(weight-only\), "
                                                r"'int8' \(W8A8, per-token int8 activations\) or 'int8x2'"):
        Int8("int16")


def test_unknown_method_name_lists_the_choices():
    with pytest.raises(QuantizationError, match=r"unknown quantization method 'int4'; choose one of \['auto', "
                                                r"'none', 'awq', 'awq_bf16', 'bf16', 'compressed-tensors', "
                                                r"'compressed-tensors_bf16', 'fp8', 'fp8_bf16', 'gguf', 'gguf_bf16', "
                                                r"'gptq', 'gptq_bf16', 'int8', 'mxfp4', 'mxfp4_bf16', 'w8a8', 'w8a8x2', 'w8a8x2_bf16'\]"):
        quantization_config("int4")
    with pytest.raises(QuantizationError, match=r"GGUF quant type 'Q5_0' is not kept quantized; kept: "
                                                r"\['Q8_0', 'Q4_0', 'Q4_1'\]"):
        GGUFBlocks("Q5_0")


def test_method_that_does_not_serve_a_layer_kind_is_named():
    class LinearOnly(Int8):
        name = "linear-only"
        kinds = (LINEAR,)

    with nnx.use_eager_sharding(False):
        with pytest.raises(UnsupportedLayerError, match=r"quantization method 'linear-only' does not support "
                                                        r"VocabParallelEmbedding\(vocab=100, dim=64, tp=2\): it "
                                                        r"serves \['linear'\] layers; leave this layer unquantized"):
            VocabParallelEmbedding(100, 64, tp_size=2, rngs=nnx.Rngs(0), method=LinearOnly())


def test_gguf_blocks_cut_by_the_split_are_refused_naming_the_layer_and_fix():
    with nnx.use_eager_sharding(False):
        with pytest.raises(UnsupportedLayerError, match=r"'gguf Q4_1' cannot hold RowParallelLinear\(in=64, "
                                                        r"out=8, tp=4\): its input columns split over tp=4 into 16 "
                                                        r"per rank, not runs of whole 32-element blocks; choose a tp"):
            RowParallelLinear(64, 8, tp_size=4, rngs=nnx.Rngs(0), method=GGUFBlocks("Q4_1"))
        with pytest.raises(UnsupportedLayerError, match=r"weight part 'weight' has 40 input columns, not whole "
                                                        r"32-element blocks"):
            ColumnParallelLinear(40, 8, tp_size=1, rngs=nnx.Rngs(0), method=GGUFBlocks("Q8_0"))


def test_gguf_method_refuses_a_float_tensor_naming_it():
    with nnx.use_eager_sharding(False):
        layer = ColumnParallelLinear(64, 8, tp_size=1, bias=False, rngs=nnx.Rngs(0), method=GGUFBlocks("Q8_0"))
    with pytest.raises(QuantizationError, match=r"tensor 'model.w' is ndarray, not Q8_0 blocks"):
        layer.load_block("kernel", 0, {"weight": randn(8, 64)}, {"weight": "model.w"})
    with pytest.raises(QuantizationError, match=r"tensor 'model.w' is Q4_0, not Q8_0 blocks"):
        layer.load_block("kernel", 0, {"weight": QuantizedArray.quantize(randn(8, 64), "Q4_0")}, {"weight": "model.w"})


def test_register_quantization_checks_its_arguments():
    with pytest.raises(TypeError, match=r"expected a QuantizationConfig subclass"):
        register_quantization("mine", Int8)
    with pytest.raises(ValueError, match=r"'none' is reserved"):
        from tp_jax.parallel.layers.quantization import Int8Config
        register_quantization("none", Int8Config)


def test_int8_applies_to_a_jitted_forward_without_float_weights():
    """The int8 layer's params are int8 values and float32 scales, nothing else."""
    with nnx.use_eager_sharding(False):
        layer = ColumnParallelLinear(64, 32, tp_size=1, bias=False, rngs=nnx.Rngs(0), method=Int8())
    params = {"/".join(map(str, k)): v.get_value().dtype for k, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert params == {"kernel": np.int8, "kernel_scale": np.float32}
    x = jax.numpy.ones((2, 64))
    assert layer(x).shape == (2, 32)
