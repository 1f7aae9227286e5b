"""Every parallel layer, sharded == numpy on the full HF-layout weights, for tp in {1,2,4,8} and 3."""


import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.hlo import count
from tp_jax.parallel.heads import plan_heads
from tp_jax.parallel.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                           QKVParallelLinear, ReplicatedLinear, RowParallelLinear, VocabParallelEmbedding,
                           WeightShapeError)
from tp_jax.parallel.shard import shard_module

D, B = 16, 6          # hidden size, batch (a multiple of dp = 2)
RTOL = ATOL = 2e-5


def rng(seed=0):
    return np.random.default_rng(seed)


def randn(*shape, seed=0):
    return rng(seed).standard_normal(shape).astype(np.float32)


def build(mesh, cls, *args, **kw):
    with jax.set_mesh(mesh):
        return cls(*args, tp_size=mesh.shape["tp"], rngs=nnx.Rngs(0), **kw)


def load(layer, weights):
    """Fill `layer` from HF-layout tensors {param: {part: array}} through its declarations."""
    layer.set_params(layer.load_global({k: v for k, v in weights.items() if k in layer.loading()}))
    return layer


def batch_spec(*rest):
    return P("dp", *rest)


@pytest.mark.parametrize("bias", [True, False])
def test_replicated(mesh, bias):
    w, b, x = randn(12, D), randn(12, seed=1), randn(B, D, seed=2)
    layer = load(build(mesh, ReplicatedLinear, D, 12, bias=bias), {"kernel": {"weight": w}, "bias": {"bias": b}})
    y = shard_module(layer, mesh, in_specs=(batch_spec(),), out_specs=batch_spec())(x)
    np.testing.assert_allclose(y, x @ w.T + (b if bias else 0), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gather", [True, False])
def test_column(mesh, bias, gather):
    w, b, x = randn(24, D), randn(24, seed=1), randn(B, D, seed=2)
    layer = load(build(mesh, ColumnParallelLinear, D, 24, bias=bias, gather_output=gather),
                 {"kernel": {"weight": w}, "bias": {"bias": b}})
    out = batch_spec() if gather else batch_spec("tp")
    y = shard_module(layer, mesh, in_specs=(batch_spec(),), out_specs=out)(x)
    np.testing.assert_allclose(y, x @ w.T + (b if bias else 0), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gather", [True, False])
def test_merged_column(mesh, bias, gather):
    sizes = (24, 48)
    ws = [randn(s, D, seed=i) for i, s in enumerate(sizes)]
    bs = [randn(s, seed=10 + i) for i, s in enumerate(sizes)]
    x = randn(B, D, seed=5)
    layer = load(build(mesh, MergedColumnParallelLinear, D, sizes, bias=bias, gather_output=gather),
                 {"kernel": {"0": ws[0], "1": ws[1]}, "bias": {"0": bs[0], "1": bs[1]}})
    refs = [x @ w.T + (b if bias else 0) for w, b in zip(ws, bs)]
    if gather:
        y = shard_module(layer, mesh, in_specs=(batch_spec(),), out_specs=batch_spec())(x)
        np.testing.assert_allclose(y, np.concatenate(refs, -1), rtol=RTOL, atol=ATOL)
    else:
        parts = shard_module(layer, mesh, in_specs=(batch_spec(),), out_specs=(batch_spec("tp"),) * 2,
                             method=lambda m, x: tuple(m.split(m(x))))(x)
        for got, ref in zip(parts, refs):
            np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row(mesh, bias, input_is_parallel):
    w, b, x = randn(10, 24), randn(10, seed=1), randn(B, 24, seed=2)
    layer = load(build(mesh, RowParallelLinear, 24, 10, bias=bias, input_is_parallel=input_is_parallel),
                 {"kernel": {"weight": w}, "bias": {"bias": b}})
    x_spec = batch_spec("tp") if input_is_parallel else batch_spec()
    y = shard_module(layer, mesh, in_specs=(x_spec,), out_specs=batch_spec())(x)
    np.testing.assert_allclose(y, x @ w.T + (b if bias else 0), rtol=RTOL, atol=ATOL)


def test_row_without_reduce_adds_bias_once(mesh):
    w, b, x = randn(10, 24), randn(10, seed=1), randn(B, 24, seed=2)
    layer = load(build(mesh, RowParallelLinear, 24, 10, reduce_results=False),
                 {"kernel": {"weight": w}, "bias": {"bias": b}})
    partial = shard_module(layer, mesh, in_specs=(batch_spec("tp"),), out_specs=P("tp", "dp"),
                           method=lambda m, x: m(x)[None])(x)          # [tp, B, F]
    np.testing.assert_allclose(np.asarray(partial).sum(0), x @ w.T + b, rtol=RTOL, atol=ATOL)


HEADS = [(8, 8), (8, 2), (8, 1), (9, 3), (12, 4), (32, 8)]


@pytest.mark.parametrize("heads,kv", HEADS)
@pytest.mark.parametrize("bias", [True, False])
def test_qkv(mesh, heads, kv, bias):
    hd, tp = 4, mesh.shape["tp"]
    wq, wk, wv = randn(heads * hd, D, seed=1), randn(kv * hd, D, seed=2), randn(kv * hd, D, seed=3)
    bq, bk, bv = randn(heads * hd, seed=4), randn(kv * hd, seed=5), randn(kv * hd, seed=6)
    x = randn(B, D, seed=7)
    layer = load(build(mesh, QKVParallelLinear, D, hd, heads, kv, bias=bias),
                 {"kernel": {"q": wq, "k": wk, "v": wv}, "bias": {"q": bq, "k": bk, "v": bv}})
    q, k, v = shard_module(layer, mesh, in_specs=(batch_spec(),), out_specs=(batch_spec("tp"),) * 3)(x)
    plan = plan_heads(heads, kv, tp)

    def ref(w, b, slots):        # [B, n_slots, hd]; padded slots are zero
        full = (x @ w.T + (b if bias else 0)).reshape(B, -1, hd)
        return np.where((slots >= 0)[None, :, None], full[:, np.maximum(slots, 0)], 0)

    np.testing.assert_allclose(q, ref(wq, bq, plan.q_heads.reshape(-1)), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(k, ref(wk, bk, plan.kv_heads.reshape(-1)), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(v, ref(wv, bv, plan.kv_heads.reshape(-1)), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("vocab", [1000, 49159])
def test_vocab_embedding(mesh, vocab):
    e = randn(vocab, 8)
    ids = rng(1).integers(0, vocab, size=(B, 5))
    ids[0, :2] = [0, vocab - 1]
    layer = load(build(mesh, VocabParallelEmbedding, vocab, 8), {"embedding": {"weight": e}})
    y = shard_module(layer, mesh, in_specs=(batch_spec(),), out_specs=batch_spec())(ids)
    np.testing.assert_array_equal(y, e[ids])


@pytest.mark.parametrize("vocab", [1000, 49159])
@pytest.mark.parametrize("gather", [True, False])
def test_lm_head(mesh, vocab, gather):
    w, h = randn(vocab, 8), randn(B, 8, seed=1)
    layer = load(build(mesh, ParallelLMHead, vocab, 8, gather_output=gather), {"embedding": {"weight": w}})
    out = batch_spec() if gather else batch_spec("tp")
    logits = np.asarray(shard_module(layer, mesh, in_specs=(batch_spec(),), out_specs=out)(h))
    ref = h @ w.T
    np.testing.assert_allclose(logits[:, :vocab], ref, rtol=1e-4, atol=1e-4)
    if not gather:                            # padded logits are the minimum: never win, never sampled
        assert logits.shape[1] == layer.padded_size > vocab
        assert (logits[:, vocab:] == np.finfo(np.float32).min).all()
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))


def hlo_of(layer, mesh, x, in_spec, out_spec):
    graph_fn = shard_module(layer, mesh, in_specs=(in_spec,), out_specs=out_spec, jit=False)
    return jax.jit(graph_fn).lower(x).compile().as_text()



@pytest.mark.parametrize("tp", [1, 2, 8])
def test_hlo_row_one_all_reduce_column_one_all_gather(tp):
    from tests.conftest import mesh_for
    mesh = mesh_for(1, 1, tp)
    row = build(mesh, RowParallelLinear, 64, 16)
    hlo = hlo_of(row, mesh, np.ones((2, 64), np.float32), P(None, "tp"), P())
    assert count(hlo, "all-reduce") == (1 if tp > 1 else 0)
    assert count(hlo, "all-to-all") == 0
    col = build(mesh, ColumnParallelLinear, 16, 64, gather_output=True)
    hlo = hlo_of(col, mesh, np.ones((2, 16), np.float32), P(), P())
    assert count(hlo, "all-gather") == (1 if tp > 1 else 0)
    assert count(hlo, "all-reduce") == 0


# --- bad input ------------------------------------------------------------------------

def test_indivisible_dimension_is_refused():
    with pytest.raises(ValueError, match=r"out_features=30 is not divisible by tp=4"):
        ColumnParallelLinear(8, 30, tp_size=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"output_sizes\[1\]=10 is not divisible by tp=4"):
        MergedColumnParallelLinear(8, (16, 10), tp_size=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"in_features=30 is not divisible by tp=4"):
        RowParallelLinear(30, 8, tp_size=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"tp_size=0"):
        ColumnParallelLinear(8, 8, tp_size=0, rngs=nnx.Rngs(0))


def test_wrong_weight_shape_names_tensor_and_shape():
    with nnx.use_eager_sharding(False):
        layer = ColumnParallelLinear(8, 16, tp_size=2, rngs=nnx.Rngs(0))
        qkv = QKVParallelLinear(8, 4, 4, 2, tp_size=2, rngs=nnx.Rngs(0))
    with pytest.raises(WeightShapeError, match=r"'model.w' has shape \(16, 7\), expected \(16, 8\)"):
        layer.load_block("kernel", 0, {"weight": np.zeros((16, 7))}, {"weight": "model.w"})
    parts = {"q": np.zeros((16, 8)), "k": np.zeros((8, 8)), "v": np.zeros((4, 8))}
    with pytest.raises(WeightShapeError, match=r"'v' has shape \(4, 8\), expected \(8, 8\)"):
        qkv.load_block("kernel", 1, parts)
    with pytest.raises(KeyError, match=r"missing weight part\(s\) \['v'\]"):
        qkv.load_block("kernel", 1, {"q": parts["q"], "k": parts["k"]})


def test_heads_not_multiple_of_kv():
    with pytest.raises(ValueError, match=r"num_heads=10 is not a multiple of num_kv_heads=4"):
        QKVParallelLinear(8, 4, 10, 4, tp_size=2, rngs=nnx.Rngs(0))


def test_switched_gemm_applies_the_indexed_slots_weight():
    """A switched loop's view of a layer holds a SlotSwitch in place of its weight: gemm is then a lax.switch over
    the slots' own weights (x W_i^T for the traced index, one row padded to two); the layers themselves keep their
    arrays and multiply by their own weight."""
    from tp_jax.parallel.layers.switched import SlotSwitch
    from tp_jax.parallel.mesh import make_mesh
    mesh = make_mesh(devices=jax.devices()[:1])
    layers = [build(mesh, ColumnParallelLinear, 16, 8, bias=False) for _ in range(3)]
    for i, layer in enumerate(layers):
        layer.kernel.set_value(layer.kernel[...] * (i + 1))
    weights = [np.asarray(layer.kernel[...]) for layer in layers]                 # [in, out]: W^T

    def view(index):
        graphdef, state = nnx.split(layers[0])
        own = id(layers[0].kernel.get_value())
        leaves, treedef = jax.tree.flatten(state)
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, [SlotSwitch(index, layers) if id(v) == own else v
                                                               for v in leaves]))

    for rows in (1, 5):
        x = randn(rows, 16, seed=rows)
        switched = jax.jit(lambda i, x: view(i).gemm(x))
        for i in range(3):
            np.testing.assert_allclose(np.asarray(switched(np.int32(i), x)), x @ weights[i], rtol=1e-5, atol=1e-5)
    for layer, w in zip(layers, weights):
        assert isinstance(layer.kernel.get_value(), jax.Array)
        np.testing.assert_allclose(np.asarray(layer.gemm(x)), x @ w, rtol=1e-5, atol=1e-5)


def test_switch_loop_equals_scan():
    """A Stack given the SwitchLoop (one array per slot, switched GEMMs, the rest indexed) gives the scan's numbers;
    the loop is the stack's own strategy (`Stack.loop`), and its params are stored per slot."""
    from tp_jax.parallel.layers import Stack
    from tp_jax.parallel.layers.stack import SCAN
    from tp_jax.parallel.layers.switched import SWITCH
    from tp_jax.parallel.mesh import make_mesh
    mesh = make_mesh(devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        stack = Stack(lambda r: ColumnParallelLinear(16, 16, tp_size=1, bias=True, rngs=r), 3, nnx.Rngs(0))
    x = randn(5, 16)

    def run(stack, x):
        return stack(lambda layer, i, h, c: (h + layer(h), c), x)[0]

    scanned = np.asarray(jax.jit(run)(stack, x))
    assert stack.loop is SCAN
    stack.use_loop(SWITCH, mesh)
    assert stack.loop is SWITCH and stack.layers is None and len(stack.slots) == 3
    np.testing.assert_allclose(np.asarray(jax.jit(run)(stack, x)), scanned, rtol=1e-6, atol=1e-6)
