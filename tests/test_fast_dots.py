"""The fast dots (bf16 x bf16 -> float32, int8 x int8 -> int32), each against an independent reference
on the same weights, within a stated bound, at tp in {1, 2, 8} and pp = 2.

* the two-digit int8 activations (`Int8(activations="int8x2")`) against numpy's own quantization;
* layers: `Bfloat16`, W8A8 (`Int8(activations="int8")` and `"int8x2"`) and GGUF blocks with bf16 dots
  against numpy on the weights the method holds (the float weight; int8's Q * s by numpy; the
  blocks dequantized by the `gguf` package), one row (padded to two inside) and six;
* models: a bf16 tiny Llama with quantization="bf16" against transformers in bfloat16 and in
  float32 on the same weights, and what the default "auto" picks for it (bf16 dots on one device under
  the switched / unrolled loop; float32 under the scan, on several devices, with a named dtype, with
  "none", and for a float32 checkpoint); the tiny GGUF with each fast dot (and "auto": W8A8 with two
  digits on CPU) against transformers on the dequantized weights (int8-rounded where the method holds
  int8), and W8A8 against transformers on the int8 weights.

Bounds are relative to the reference's largest magnitude: bf16 rounds x to 8 mantissa bits
(2^-9 relative per element), int8 to 1/254 of a row's (or block's) largest element, two int8
digits to 1/(254 * 254) of a row's largest element.
"""

import numpy as np
import pytest

from tests.conftest import mesh_for
from tests.quant_models import dequantized_copy, int8_dequantized, write_tiny_gguf
from tests.test_layers import batch_spec, build, randn
from tests.test_linear_methods import load, run
from tests.test_quantized_models import perplexity
from tests.tiny_models import hf_logits, make_checkpoint
from tp_jax.parallel.layers import Bfloat16, GGUFBlocks, Int8, ParallelLMHead, RowParallelLinear
from tp_jax.parallel.layers.ggml import QuantizedArray
from tp_jax.parallel.layers.method import fast_dot
from tp_jax.parallel.shard import shard_module
from tp_jax.serving.llm import LLM

# name -> (method, relative bound vs the float product on the method's weights)
METHODS = {"bf16": (Bfloat16(), 1e-2), "w8a8": (Int8("int8"), 2e-2), "w8a8x2": (Int8("int8x2"), 2e-4),
           "Q8_0 bf16": (GGUFBlocks("Q8_0", "bf16"), 1e-2), "Q4_0 bf16": (GGUFBlocks("Q4_0", "bf16"), 1e-2),
           "Q4_1 bf16": (GGUFBlocks("Q4_1", "bf16"), 1e-2)}
LAYOUTS = [(1, 1, 1), (2, 1, 1), (8, 1, 1), (2, 1, 2)]       # (tp, dp, pp)


def stored(name, w):
    return QuantizedArray.quantize(w, name.split()[0]) if name[0] == "Q" else w


def held(name, w):
    """The weight the method computes with, by an independent path."""
    if name[0] == "Q":
        return stored(name, w)[...]
    return int8_dequantized(w) if name.startswith("w8a8") else w


def rel_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("name", METHODS)
def test_row_layer_and_head(name, tp):
    """A row layer (in 768: whole blocks at every tp) and a vocab head, 1 and 6 rows."""
    method, bound = METHODS[name]
    mesh = mesh_for(1, 1, tp)
    w, b, head_w = randn(40, 768), randn(40, seed=1), randn(100, 64, seed=3)
    row = load(build(mesh, RowParallelLinear, 768, 40, method=method), {"kernel": {"weight": stored(name, w)},
                                                                         "bias": {"bias": b}})
    head = load(build(mesh, ParallelLMHead, 100, 64, method=method), {"embedding": {"weight": stored(name, head_w)}})
    for rows in (1, 6):
        x, h = randn(rows, 768, seed=2), randn(rows, 64, seed=4)
        y = run(row, mesh, x, in_spec=batch_spec("tp"))
        assert y.dtype == np.float32
        assert rel_err(y - b, x @ held(name, w).T) <= bound, f"{name} tp={tp} rows={rows}"
        assert rel_err(run(head, mesh, h), h @ held(name, head_w).T) <= bound, f"{name} head tp={tp} rows={rows}"


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_by_rows_is_each_of_its_methods_bit_for_bit(tp):
    """ByRows(w8a8x2, bf16, max_rows=4) (the CPU default for a quantized GGUF): a column layer, a row layer and a
    vocab head give w8a8x2's outputs exactly up to 4 rows and bf16's from 5; its embedding is bf16's rows. Each of
    the two is checked against numpy above (test_row_layer_and_head), so this is their reference here."""
    from tp_jax.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
    from tp_jax.parallel.layers.quantization import W8A8x2Bf16Config
    config = W8A8x2Bf16Config(max_rows=4)
    mesh = mesh_for(1, 1, tp)
    w, b, head_w = randn(40, 768), randn(40, seed=1), randn(104, 64, seed=3)
    kinds = [(RowParallelLinear, (768, 40), {"kernel": {"weight": w}, "bias": {"bias": b}}, batch_spec("tp"), None),
             (ColumnParallelLinear, (768, 48), {"kernel": {"weight": randn(48, 768, seed=5)}, "bias": {"bias": randn(48)}},
              None, batch_spec("tp")),
             (ParallelLMHead, (104, 64), {"embedding": {"weight": head_w}}, None, None)]
    for cls, shape, weights, in_spec, out_spec in kinds:
        layers = {}
        for name, method in [("both", None), ("w8a8x2", Int8("int8x2")), ("bf16", Bfloat16())]:
            layer = build(mesh, cls, *shape, method=method)
            if method is None:
                layer = build(mesh, cls, *shape, method=config.method_for(layer, {}))
                assert layer.method.label == "w8a8x2 (<= 4 rows) / bf16"
            layers[name] = load(layer, weights)
        assert sorted(layers["both"].loading()) == sorted({*layers["w8a8x2"].loading(),
                                                          *(k + "_bf16" for k in layers["bf16"].loading()
                                                            if k == layers["bf16"].weight_name)})
        for rows in (1, 4, 5, 16):
            x = randn(rows, shape[1] if cls is ParallelLMHead else shape[0], seed=rows)
            got = {k: run(layer, mesh, x, in_spec=in_spec, out_spec=out_spec) for k, layer in layers.items()}
            same = "w8a8x2" if rows <= 4 else "bf16"
            np.testing.assert_array_equal(got["both"], got[same], err_msg=f"{cls.__name__} tp={tp} rows={rows}")
            assert not np.array_equal(got["w8a8x2"], got["bf16"])         # the two do differ: the choice is seen
    ids = np.arange(12).reshape(2, 6) * 8 % 104
    tables = {k: load(build(mesh, VocabParallelEmbedding, 104, 64, method=m), {"embedding": {"weight": head_w}})
              for k, m in [("both", config.method_for(build(mesh, VocabParallelEmbedding, 104, 64), {})),
                           ("bf16", Bfloat16())]}
    rows = {k: np.asarray(shard_module(t, mesh, in_specs=(batch_spec(),), out_specs=batch_spec())(ids))
            for k, t in tables.items()}
    np.testing.assert_array_equal(rows["both"], rows["bf16"])


def test_the_by_rows_threshold_follows_the_cpu(tmp_path):
    """w8a8x2_bf16's default threshold: 24 rows on a CPU with AMX-INT8 (XLA:CPU's int8 dot the faster up to 24
    tokens there), 4 elsewhere and where /proc/cpuinfo cannot be read; the named config uses this host's."""
    from tp_jax.parallel.layers.quantization import W8A8x2Bf16Config, cpu_flags, int8_max_rows
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    assert "amx_int8" in cpu_flags(str(info)) and "avx512_vnni" in cpu_flags(str(info))
    assert int8_max_rows(cpu_flags(str(info))) == 24
    assert int8_max_rows(frozenset({"avx512_vnni", "avx512_bf16"})) == 4          # the AMD EPYC measured
    assert cpu_flags(str(tmp_path / "missing")) == frozenset() and int8_max_rows(frozenset()) == 4
    assert W8A8x2Bf16Config().max_rows == int8_max_rows(cpu_flags())
    layer = build(mesh_for(1, 1, 1), RowParallelLinear, 768, 40)
    assert W8A8x2Bf16Config(max_rows=24).method_for(layer, {}).label == "w8a8x2 (<= 24 rows) / bf16"


def test_by_rows_refuses_what_it_cannot_hold():
    from tp_jax.parallel.layers import QuantizationError
    from tp_jax.parallel.layers.by_rows import ByRows
    with pytest.raises(QuantizationError, match=r"ByRows\(max_rows=0\): give a positive number of rows"):
        ByRows(Int8("int8x2"), Bfloat16(), 0)
    with pytest.raises(QuantizationError, match=r"ByRows: many_suffix='_scale' makes bf16's params collide with "
                                                r"w8a8x2's; choose another suffix"):
        ByRows(Int8("int8x2"), Bfloat16(), 4, many_suffix="_scale")


def test_two_int8_digits_are_numpys_two_digit_product():
    """int8_dot(two_digits=True) == numpy's q1 + q2 / 254 per token (x / s = q1 + rest) times the int8 weights,
    up to float32 rounding; one digit alone is >100x further from the float product."""
    import jax.numpy as jnp
    from tp_jax.parallel.layers.int8 import int8_dot
    x, q_w = randn(6, 384), np.random.default_rng(5).integers(-127, 128, (40, 384)).astype(np.int8)
    x[:, 7] *= 30                                                       # an outlier input: one scale per token
    s = np.abs(x).max(axis=1, keepdims=True) / 127
    q1 = np.round(x / s)
    q2 = np.clip(np.round((x / s - q1) * 254), -127, 127)
    ref = ((q1 @ q_w.T.astype(np.float64)) + (q2 @ q_w.T.astype(np.float64)) / 254) * s
    got = np.asarray(int8_dot(jnp.asarray(x), jnp.asarray(q_w), True))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    one = np.asarray(int8_dot(jnp.asarray(x[:1]), jnp.asarray(q_w), True))
    np.testing.assert_allclose(one, got[:1], rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    exact = x.astype(np.float64) @ q_w.T.astype(np.float64)
    err1 = rel_err(np.asarray(int8_dot(jnp.asarray(x), jnp.asarray(q_w), False)), exact)
    err2 = rel_err(got, exact)
    print(f"int8 activations vs the float product: one digit {err1:.2e}, two digits {err2:.2e}")
    assert err2 <= 5e-4 and err2 * 100 <= err1                         # measured 2.3e-4 and 5.1e-2


def test_bf16_is_the_bf16_rounded_product_accumulated_in_float32():
    """Bfloat16 computes bf16(x) @ bf16(W) exactly up to float32 summation order, one row as six."""
    import jax.numpy as jnp
    import ml_dtypes
    x, w = randn(6, 256), randn(256, 96, seed=1)
    ref = x.astype(ml_dtypes.bfloat16).astype(np.float64) @ w.astype(ml_dtypes.bfloat16).astype(np.float64)
    got = np.asarray(fast_dot(jnp.asarray(x), jnp.asarray(w, jnp.bfloat16), "md,df->mf"))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    one = np.asarray(fast_dot(jnp.asarray(x[:1]), jnp.asarray(w, jnp.bfloat16), "md,df->mf"))
    np.testing.assert_allclose(one, got[:1], rtol=1e-6, atol=1e-6)             # the padded row changes nothing


def test_row_layer_all_reduce_runs_in_float32_in_a_bf16_model():
    """A bf16 layer with a fast method: the partial sums are reduced in float32, the output is bf16."""
    import jax
    from tests.test_layers import hlo_of
    mesh = mesh_for(1, 1, 2)
    row = build(mesh, RowParallelLinear, 64, 16, method=Bfloat16(), dtype=jax.numpy.bfloat16, bias=False)
    hlo = hlo_of(row, mesh, randn(4, 64).astype(jax.numpy.bfloat16), batch_spec("tp"), batch_spec())
    reduces = [line for line in hlo.splitlines() if "all-reduce(" in line]
    assert reduces and all("f32[" in line.split("=")[1].split("all-reduce(")[0] for line in reduces), reduces


# --- models -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fast"))


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 1000, size=(3, 13))


def load_llm(path, layout, **kw):
    tp, dp, pp = layout
    return LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp, progress=False, **kw)


@pytest.mark.slow
def test_bf16_checkpoint_with_bf16_dots_against_transformers(root, ids):
    """A bf16 checkpoint's weights as stored, bf16 dots: closer to transformers float32 on the same weights
    than transformers' own bf16 run is, at every layout."""
    import torch
    from transformers import AutoModelForCausalLM
    path = make_checkpoint("bf16sharded", root)
    ref32 = hf_logits(path, ids)
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref16 = hf16(torch.tensor(ids)).logits.float().numpy()
    gap16 = float(np.abs(ref16 - ref32).max())
    for layout in LAYOUTS:
        llm = load_llm(path, layout, quantization="bf16")
        assert llm.quantization == "bf16"
        got = llm.get_logits(ids)
        err = float(np.abs(got - ref32).max())
        print(f"bf16 tiny {layout}: max |ours - hf float32| {err:.2e}, |hf bf16 - hf float32| {gap16:.2e}")
        assert err <= gap16 and rel_err(got, ref32) <= 1e-2


def test_auto_gives_a_bf16_checkpoint_bf16_dots_where_they_are_fast(root, ids):
    """The default quantization="auto" on CPU: a checkpoint stored in bf16 gets bf16 dots under the switched layer
    loop (the default on one device; named here on two), float32 under the scan (the default on several devices),
    with a dtype the user names and with "none"; a float32 checkpoint stays float32. Each against transformers
    float32 on the same weights: bf16 dots within transformers' own bf16 gap, float32 within 1e-4."""
    import jax
    import torch
    from transformers import AutoModelForCausalLM
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU choice (accelerators run the model in bf16)")
    path = make_checkpoint("bf16sharded", root)
    ref32 = hf_logits(path, ids)
    with torch.no_grad():
        ref16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(
            torch.tensor(ids)).logits.float().numpy()
    gap16 = float(np.abs(ref16 - ref32).max())
    cases = [((1, 1, 1), {}, "switch", "bf16"), ((1, 1, 1), dict(layer_loop="scan"), "scan", "none"), ((2, 1, 1), {}, "scan", "none"),
             ((2, 1, 1), dict(layer_loop="switch"), "switch", "bf16"),
             ((1, 1, 1), dict(dtype="float32"), "switch", "none"),
             ((1, 1, 1), dict(quantization="none"), "switch", "none")]
    for layout, kw, loop, want in cases:
        llm = load_llm(path, layout, **kw)
        err = float(np.abs(llm.get_logits(ids) - ref32).max())
        print(f"bf16 tiny {layout} {kw}: {llm.layer_loop}, {llm.quantization}, max |ours - hf float32| {err:.2e} "
              f"(hf bf16: {gap16:.2e})")
        assert (llm.layer_loop, llm.quantization) == (loop, want)
        assert err <= (gap16 if want == "bf16" else 1e-4)
    path32 = make_checkpoint("gqa", root)
    llm = load_llm(path32, (1, 1, 1))
    assert (llm.layer_loop, llm.quantization) == ("switch", "none")
    assert float(np.abs(llm.get_logits(ids) - hf_logits(path32, ids)).max()) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("quantization,bound", [("gguf_bf16", 2e-2), ("w8a8x2", 2e-4), ("auto", 2e-2)])
def test_gguf_fast_dots_against_transformers_on_the_dequantized_weights(root, ids, quantization, bound):
    """The same logits at every layout (each rank quantizes whole blocks, or int8 rows); perplexity within 1% of
    the reference. "w8a8x2" holds the dequantized weights int8 per row: its reference is transformers on those
    int8 weights. "auto" keeps the blocks: "gguf_bf16" on CPU at every layout, "gguf" elsewhere."""
    import jax
    path, float_dir, deq_dir = write_tiny_gguf(root)
    if quantization == "w8a8x2":
        deq_dir = dequantized_copy(deq_dir, f"{deq_dir}_int8", lambda _, w: int8_dequantized(w, np.float32))
    ref_deq = hf_logits(deq_dir, ids)
    ppl_ref = perplexity(ref_deq, ids)
    cpu = jax.default_backend() == "cpu"
    for layout in LAYOUTS:
        llm = load_llm(path, layout, quantization=quantization)
        want = {"w8a8x2": "w8a8x2"}.get(quantization)
        assert llm.quantization == want if want else llm.quantization.endswith("dot)") == cpu
        got = llm.get_logits(ids)
        err, ppl = rel_err(got, ref_deq), perplexity(got, ids)
        print(f"gguf {quantization} ({llm.quantization}) {layout}: max |logits - ref| / max |ref| {err:.2e}, "
              f"perplexity {ppl:.3f} vs {ppl_ref:.3f}")
        assert err <= bound and abs(ppl / ppl_ref - 1) <= 0.01
        # measured: w8a8x2 5.0e-5 - 6.7e-5 at the four layouts


@pytest.mark.slow
@pytest.mark.parametrize("quantization,bound", [("w8a8", 3e-2), ("w8a8x2", 2e-4)])
def test_w8a8_against_transformers_on_the_int8_weights(root, ids, quantization, bound):
    path = make_checkpoint("h9kv3", root)
    ref = hf_logits(dequantized_copy(path, f"{path}_int8", lambda _, w: int8_dequantized(w)), ids)
    for layout in LAYOUTS:
        llm = load_llm(path, layout, quantization=quantization)
        assert llm.quantization == quantization
        err = rel_err(llm.get_logits(ids), ref)
        print(f"{quantization} tiny {layout}: max |logits - ref| / max |ref| {err:.2e}")
        assert err <= bound
