"""The ragged Pallas paged attention kernel (tp_jax/models/paged_kernel.py), both forms (`triton`: the GPU's,
`mosaic`: the TPU's, pages copied by DMA) in Pallas' interpreters on CPU against the reference backend, and lowered
for `cuda` (Triton) and `tpu` (Mosaic, for a TPU v6e):

* decode rows alone: random pools, ragged rows (1 to 61 keys, blocks scattered over the pool), GQA groups of 1, 4
  and 6, no window / an int window / a traced per-layer window, soft-capping, sinks; float32 within 1e-5 of
  `paged_reference`, bfloat16 within bfloat16 rounding;
* ragged launches (`paged_pallas`): decode rows and prefill chunks (one after a prefix hit) in one launch, the same
  variants; MLA's latent pool; float8 pools with and without checkpoint scales; long decode rows split over their
  context (flash-decoding) and combined by log-sum-exp;
* the numeric contract: a decode row, a prefill chunk and a split row alone equal the same rows inside a launch,
  bit for bit;
* through the engine (`attention_backend="pallas"`, decode and prefill rows both by the kernel) on a tiny Llama,
  gpt-oss's sinks and alternating windows and DeepSeek-V3's latent attention: tokens equal and logprobs within 1e-5
  of the reference backend's in float32;
* lowered: one Triton custom call for `cuda` and one Mosaic custom call for `tpu`, for decode-only, mixed, latent,
  split and float8 launches.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tp_jax.models.attention import paged_pallas, paged_reference
from tp_jax.models.cache import PagedBatch
from tp_jax.models.paged_kernel import paged_attention


def paged_decode(q, k_pool, v_pool, layer, lengths, tables, scale, window=None, softcap=None, sinks=None,
                 interpret=None, form="triton"):
    """Decode rows alone: q[D, Hq, hd] (one query per row) over the first lengths[D] positions of each row's table
    tables[D, W] -> [D, Hq * hv] (`paged_attention` with every row a decode row)."""
    out = paged_attention(q[:, None], k_pool, v_pool, layer, (lengths - 1)[:, None], tables, scale, window, softcap,
                          sinks, decode_rows=q.shape[0], form=form, interpret=interpret)
    return out[:, 0]


def paged_decode_tpu(*args, **kw):
    return paged_decode(*args, form="mosaic", **kw)

KERNELS = {"triton": paged_decode, "mosaic": paged_decode_tpu}

LENGTHS = [1, 7, 16, 33, 61, 4]
BS, NB, HD = 4, 96, 16


def case(groups: int, dtype, seed: int = 0, lengths=LENGTHS):
    """(q, k_pool, v_pool, positions, tables, a PagedBatch of those decode rows, sinks)."""
    rng = np.random.default_rng(seed)
    hkv, hq, d = 2, 2 * groups, len(lengths)
    width = max(-(-n // BS) for n in lengths)
    tables = np.zeros((d, width), np.int32)
    free = rng.permutation(NB)
    for i, n in enumerate(lengths):
        m = -(-n // BS)
        tables[i, :m], free = free[:m], free[m:]
    pools = [jnp.asarray(rng.standard_normal((3, hkv, NB, BS, HD)), dtype) for _ in range(2)]
    q = jnp.asarray(rng.standard_normal((d, hq, HD)), dtype)
    positions = jnp.asarray(np.array(lengths) - 1, jnp.int32)
    empty = jnp.zeros((0, 0), jnp.int32)
    batch = PagedBatch(jnp.full((d,), -1, jnp.int32), jnp.asarray(tables), empty, jnp.zeros((0,), jnp.int32),
                       jnp.zeros((0,), jnp.int32), empty, empty)
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    return q, *pools, positions, jnp.asarray(tables), batch, sinks


VARIANTS = {"plain": {}, "window8": {"window": 8}, "softcap": {"softcap": 5.0},
            "sinks_window": {"window": 8, "sinks": True}}


# decode-only launches (the ragged cases below run every variant in both forms)
CASES = [("triton", 4, "plain", "float32"), ("triton", 4, "softcap", "bfloat16"),
         ("triton", 6, "sinks_window", "float32"), ("mosaic", 4, "window8", "bfloat16"),
         ("mosaic", 6, "sinks_window", "float32"), ("mosaic", 1, "softcap", "float32")]


@pytest.mark.parametrize("kernel,groups,variant,dtype", CASES)
def test_the_kernel_equals_the_reference(kernel, groups, variant, dtype):
    q, kp, vp, positions, tables, batch, sinks = case(groups, jnp.dtype(dtype))
    opts = dict(VARIANTS[variant])
    window = opts.pop("window", None)
    extra = {"softcap": opts.get("softcap"), "sinks": sinks if opts.get("sinks") else None}
    ref = paged_reference(q, kp, vp, jnp.int32(2), positions, batch, 0.25, window,
                          **{k: v for k, v in extra.items() if v is not None})
    got = KERNELS[kernel](q, kp, vp, jnp.int32(2), positions + 1, tables, 0.25, window, **extra)
    diff = float(jnp.abs(ref.astype(jnp.float32) - got.astype(jnp.float32)).max())
    bound = 1e-5 if dtype == "float32" else 2 ** -7 * float(jnp.abs(ref.astype(jnp.float32)).max())
    assert got.dtype == q.dtype and diff <= bound, (variant, groups, dtype, diff)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_traced_per_layer_window(kernel):
    """Inside a layer loop the window is a traced value (a stack whose layers differ)."""
    q, kp, vp, positions, tables, batch, _ = case(4, jnp.float32)
    run = jax.jit(lambda w: KERNELS[kernel](q, kp, vp, jnp.int32(0), positions + 1, tables, 0.25, w))
    for window in (3, 8, 1 << 30):
        ref = paged_reference(q, kp, vp, jnp.int32(0), positions, batch, 0.25, window)
        assert float(jnp.abs(run(jnp.int32(window)) - ref).max()) <= 1e-5, window


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_row_is_the_same_alone_and_in_a_batch(kernel):
    q, kp, vp, positions, tables, _, sinks = case(4, jnp.float32)
    together = KERNELS[kernel](q, kp, vp, jnp.int32(1), positions + 1, tables, 0.25, 8, 5.0, sinks)
    for i in range(q.shape[0]):
        width = -(-int(positions[i] + 1) // BS)
        alone = KERNELS[kernel](q[i:i + 1], kp, vp, jnp.int32(1), positions[i:i + 1] + 1, tables[i:i + 1, :width],
                             0.25, 8, 5.0, sinks)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(together[i]))


def test_lowered_for_cuda_it_is_one_triton_kernel():
    q, kp, vp, positions, tables, _, sinks = case(4, jnp.bfloat16)
    run = jax.jit(lambda q, kp, vp, n, t: paged_decode(q, kp, vp, jnp.int32(1), n, t, 0.25, 8, 5.0, sinks,
                                                        interpret=False))
    text = run.trace(q, kp, vp, positions + 1, tables).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1 and "tp_jax_paged_attention" in text


def test_exported_for_a_tpu_it_is_one_mosaic_kernel():
    """Mosaic lowers for the TPU generation the abstract device names (its vreg and VMEM sizes): exported for a TPU
    v6e from this CPU machine."""
    from jax import export
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh, AxisType
    q, kp, vp, positions, tables, _, sinks = case(4, jnp.bfloat16)
    run = jax.jit(lambda q, kp, vp, n, t: paged_decode_tpu(q, kp, vp, jnp.int32(1), n, t, 0.25, 8, 5.0, sinks,
                                                            interpret=False))
    tpu = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,),
                       abstract_device=AbstractDevice("TPU v6 lite", 1, "tpu"))
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, kp, vp, positions, tables)]
    with jax.sharding.use_abstract_mesh(tpu):
        text = export.export(run, platforms=["tpu"])(*args).mlir_module()
    assert text.count("custom_call @tpu_custom_call") == 1 and "tp_jax_paged_attention_tpu" in text


# --- ragged launches: decode rows and prefill chunks together --------------------------------------------------

RAGGED_ROWS = [(12, 1), (40, 1), (0, 1), (0, 16), (5, 11), (30, 3)]   # (cached context, new tokens); decodes first


def ragged_case(groups: int, dtype, seed: int = 0, rows=RAGGED_ROWS, hd: int = HD, width: int = 16, hkv: int = 2):
    """A pool holding every row's keys (its cached context and this step's tokens: a prefill chunk after a prefix
    hit starts at its context), the flat step's q and positions, and its PagedBatch (decode tables, prefill tables
    and the [P, width] prefill index, N for padding)."""
    rng = np.random.default_rng(seed)
    hq = hkv * groups
    d = sum(1 for _, n in rows if n == 1)
    n_tok = sum(n for _, n in rows) + 2                                     # 2 padding tokens
    tables = np.zeros((len(rows), 16), np.int32)
    index = np.full((len(rows) - d, width), n_tok, np.int32)
    pos = np.zeros(n_tok, np.int32)
    free, off = rng.permutation(NB), 0
    for i, (ctx, new) in enumerate(rows):
        m = -(-(ctx + new) // BS)
        tables[i, :m], free = free[:m], free[m:]
        pos[off:off + new] = np.arange(ctx, ctx + new)
        if i >= d:
            index[i - d, :new] = np.arange(off, off + new)
        off += new
    pools = [jnp.asarray(rng.standard_normal((3, hkv, NB, BS, hd)), dtype) for _ in range(2)]
    q = jnp.asarray(rng.standard_normal((n_tok, hq, hd)), dtype)
    empty = jnp.zeros((0, 2), jnp.int32)
    batch = PagedBatch(jnp.full((n_tok,), -1, jnp.int32), jnp.asarray(tables[:d]), empty, jnp.zeros((0,), jnp.int32),
                       jnp.zeros((0,), jnp.int32), jnp.asarray(tables[d:]), jnp.asarray(index))
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    return q, *pools, jnp.asarray(pos), batch, sinks, off


# every variant in one form or the other (the invariance tests run window, soft-cap and sinks at once in both)
RAGGED = [("triton", 4, "plain", "float32"), ("triton", 6, "sinks_window", "float32"),
          ("triton", 4, "plain", "bfloat16"), ("mosaic", 4, "window8", "float32"), ("mosaic", 1, "softcap", "float32"),
          ("mosaic", 6, "sinks_window", "float32")]


@pytest.mark.parametrize("form,groups,variant,dtype", RAGGED)
def test_a_ragged_launch_equals_the_reference(form, groups, variant, dtype):
    """Decode rows and prefill chunks (one after a 5-token prefix, one of 3 tokens after 30) in one launch."""
    q, kp, vp, pos, batch, sinks, n = ragged_case(groups, jnp.dtype(dtype))
    opts = dict(VARIANTS[variant])
    window = opts.pop("window", None)
    extra = {k: v for k, v in (("softcap", opts.get("softcap")), ("sinks", sinks if opts.get("sinks") else None))
             if v is not None}
    ref = paged_reference(q, kp, vp, jnp.int32(2), pos, batch, 0.25, window, **extra)[:n]
    got = paged_pallas(q, kp, vp, jnp.int32(2), pos, batch, 0.25, window, form=form, **extra)[:n]
    diff = float(jnp.abs(ref.astype(jnp.float32) - got.astype(jnp.float32)).max())
    bound = 1e-5 if dtype == "float32" else 2 ** -7 * float(jnp.abs(ref.astype(jnp.float32)).max())
    assert got.dtype == q.dtype and diff <= bound, (form, variant, groups, dtype, diff)


@pytest.mark.parametrize("form", ["triton", "mosaic"])
def test_the_latent_pool_in_a_ragged_launch(form):
    """MLA's latent pool: one KV head, the values its first r channels, no value pool (r = 32, rope = 16 here)."""
    q, kp, _, pos, batch, _, n = ragged_case(8, jnp.float32, seed=3, hd=48, hkv=1)
    vp = jnp.zeros(kp.shape[:-1] + (0,), kp.dtype)
    ref = paged_reference(q, kp, vp, jnp.int32(1), pos, batch, 0.2, None, v_dim=32)[:n]
    got = paged_pallas(q, kp, vp, jnp.int32(1), pos, batch, 0.2, None, v_dim=32, form=form)[:n]
    assert got.shape == ref.shape == (n, 8 * 32)
    assert float(jnp.abs(ref - got).max()) <= 1e-5


@pytest.mark.parametrize("form", ["triton", "mosaic"])
def test_a_row_in_a_ragged_launch_is_the_same_alone(form):
    """The numeric contract in one launch: a decode row alone (a decode-only launch), and a prefill chunk alone, equal
    the same rows inside the mixed launch, bit for bit."""
    q, kp, vp, pos, batch, sinks, n = ragged_case(4, jnp.float32, seed=5)
    run = lambda q, pos, b: paged_pallas(q, kp, vp, jnp.int32(0), pos, b, 0.25, 8, 5.0, sinks, form=form)  # noqa
    together = np.asarray(run(q, pos, batch))
    d = batch.decode_tables.shape[0]
    for i in range(d):                                                    # decode rows
        alone = batch.replace(decode_tables=batch.decode_tables[i:i + 1], prefill_tables=batch.prefill_tables[:0],
                              prefill_index=batch.prefill_index[:0])
        np.testing.assert_array_equal(np.asarray(run(q[i:i + 1], pos[i:i + 1], alone))[0], together[i])
    for j in range(batch.prefill_tables.shape[0]):                        # prefill chunks
        tokens = np.asarray(batch.prefill_index[j])
        tokens = tokens[tokens < n]
        alone = batch.replace(decode_tables=batch.decode_tables[:0], prefill_tables=batch.prefill_tables[j:j + 1],
                              prefill_index=jnp.arange(16, dtype=jnp.int32)[None].at[0, len(tokens):].set(len(tokens)))
        got = np.asarray(run(q[tokens], pos[tokens], alone))
        np.testing.assert_array_equal(got, together[tokens])


@pytest.mark.parametrize("form", ["triton", "mosaic"])
@pytest.mark.parametrize("fmt,scales", [("float8_e4m3fn", (0.5, 2.0)), ("float8_e5m2", None)])
def test_a_float8_pool_in_a_ragged_launch(form, fmt, scales):
    """A float8 cache (`kv_cache_dtype` fp8: uint8 pools holding the format's bits over per-layer k / v scales, or
    1.0 without checkpoint scales): the kernel reads the bits, the scales folded into the queries and the output."""
    from tp_jax.models.attention import quantize_rows
    from tp_jax.models.cache import KVQuant
    q, kp, vp, pos, batch, sinks, n = ragged_case(4, jnp.float32, seed=7)
    s = (1.0, 1.0) if scales is None else scales
    stored = KVQuant(np.dtype(getattr(jnp, fmt)))
    kq, vq = (quantize_rows(x, stored.dtype, sc) for x, sc in ((kp, s[0]), (vp, s[1])))
    extra = dict(stored=stored, scales=None if scales is None else jnp.asarray(scales, jnp.float32), sinks=sinks)
    ref = paged_reference(q, kq, vq, jnp.int32(2), pos, batch, 0.25, 8, **extra)[:n]
    got = paged_pallas(q, kq, vq, jnp.int32(2), pos, batch, 0.25, 8, form=form, **extra)[:n]
    assert float(jnp.abs(ref - got).max()) <= 1e-5
    assert float(jnp.abs(ref - paged_reference(q, kp, vp, jnp.int32(2), pos, batch, 0.25, 8, sinks=sinks)[:n]).max()) \
        > 1e-3                                                           # the rounding is real: the check can fail


def split_case(groups: int, seed: int = 4, chunk_blocks: int = 3):
    """ragged_case's step with its decode rows also laid out split-K (flash-decoding: chunks of `chunk_blocks`
    blocks, as build_batch lays them out), two padding chunks after them."""
    from tp_jax.serving.batch import split_decode_rows
    q, kp, vp, pos, batch, sinks, n = ragged_case(groups, jnp.float32, seed=seed)
    d = batch.decode_tables.shape[0]
    lengths = [int(p) + 1 for p in pos[:d]]
    rv = sum(-(-x // (BS * chunk_blocks)) for x in lengths) + 2
    chunks = np.zeros((rv, chunk_blocks), np.int32), np.full(rv, d, np.int32), np.zeros(rv, np.int32)
    split_decode_rows(lengths, np.asarray(batch.decode_tables), BS, *chunks)
    return q, kp, vp, pos, batch.replace(**dict(zip(("chunk_tables", "chunk_row", "chunk_start"),
                                                    map(jnp.asarray, chunks)))), sinks, n


@pytest.mark.parametrize("form", ["triton", "mosaic"])
def test_long_decode_rows_split_over_their_context(form):
    """Flash-decoding: each decode row's context in chunks (here 3 blocks: the 41-key row in 4), each chunk a row of
    the launch returning its log-sum-exp, combined per row (the sinks once, in the combine), beside prefill rows."""
    q, kp, vp, pos, batch, sinks, n = split_case(6)
    ref = paged_reference(q, kp, vp, jnp.int32(2), pos, batch, 0.25, 8, softcap=5.0, sinks=sinks)[:n]
    got = paged_pallas(q, kp, vp, jnp.int32(2), pos, batch, 0.25, 8, 5.0, sinks, form=form)[:n]
    assert float(jnp.abs(ref - got).max()) <= 1e-5
    whole = paged_pallas(q, kp, vp, jnp.int32(2), pos, batch.replace(chunk_tables=batch.chunk_tables[:0]), 0.25, 8,
                         5.0, sinks, form=form)[:n]
    d = batch.decode_tables.shape[0]
    assert float(jnp.abs(whole[:d] - got[:d]).max()) > 0          # a different sum: the split path ran


def test_a_split_row_is_the_same_alone():
    """The numeric contract with split rows: a decode row's chunks follow from its own length, so the row alone (its
    own chunks) equals the row inside the step, bit for bit."""
    q, kp, vp, pos, batch, sinks, n = split_case(4, seed=6)
    together = np.asarray(paged_pallas(q, kp, vp, jnp.int32(0), pos, batch, 0.25, None, None, sinks))
    row = np.asarray(batch.chunk_row)
    for i in range(batch.decode_tables.shape[0]):
        mine = row == i
        alone = batch.replace(decode_tables=batch.decode_tables[i:i + 1], chunk_tables=batch.chunk_tables[mine],
                              chunk_row=jnp.zeros(int(mine.sum()), jnp.int32), chunk_start=batch.chunk_start[mine],
                              prefill_tables=batch.prefill_tables[:0], prefill_index=batch.prefill_index[:0])
        got = np.asarray(paged_pallas(q[i:i + 1], kp, vp, jnp.int32(0), pos[i:i + 1], alone, 0.25, None, None, sinks))
        np.testing.assert_array_equal(got[0], together[i])


def test_a_ragged_launch_lowers_for_cuda_and_tpu():
    """A mixed step's launch, MLA's latent pool at DeepSeek-V3's widths (r = 512, rope = 64, 16 heads a rank), a
    launch with split decode rows and one over a float8 pool, lowered: one Triton kernel for `cuda`, one Mosaic kernel
    exported for a TPU v6e."""
    q, kp, vp, pos, batch, sinks, _ = ragged_case(4, jnp.bfloat16)
    mixed = lambda form: jax.jit(lambda q, kp, vp, pos: paged_pallas(         # noqa: E731
        q, kp, vp, jnp.int32(1), pos, batch, 0.25, 8, None, sinks, form=form))
    assert _lowered_kernels(mixed("triton"), "cuda", q, kp, vp, pos) == 1
    assert _lowered_kernels(mixed("mosaic"), "tpu", q, kp, vp, pos) == 1
    ql, kl, _, posl, batchl, _, _ = ragged_case(16, jnp.bfloat16, hd=576, hkv=1, seed=2)
    vl = jnp.zeros(kl.shape[:-1] + (0,), kl.dtype)
    latent = lambda form: jax.jit(lambda q, kp, vp, pos: paged_pallas(        # noqa: E731
        q, kp, vp, jnp.int32(1), pos, batchl, 0.1, None, v_dim=512, form=form))
    assert _lowered_kernels(latent("triton"), "cuda", ql, kl, vl, posl) == 1
    assert _lowered_kernels(latent("mosaic"), "tpu", ql, kl, vl, posl) == 1
    qs, ks, vs, poss, batchs, sinkss, _ = split_case(4)
    split = lambda form: jax.jit(lambda q, kp, vp, pos: paged_pallas(         # noqa: E731
        q, kp, vp, jnp.int32(1), pos, batchs, 0.25, 8, None, sinkss, form=form))
    assert _lowered_kernels(split("triton"), "cuda", qs, ks, vs, poss) == 1
    assert _lowered_kernels(split("mosaic"), "tpu", qs, ks, vs, poss) == 1
    from tp_jax.models.attention import quantize_rows
    from tp_jax.models.cache import KVQuant
    fp8 = KVQuant(np.dtype(jnp.float8_e4m3fn))
    kq, vq = (quantize_rows(x, fp8.dtype, 0.5) for x in (kp, vp))
    quantized = lambda form: jax.jit(lambda q, kp, vp, pos: paged_pallas(      # noqa: E731
        q, kp, vp, jnp.int32(1), pos, batch, 0.25, 8, None, sinks, stored=fp8, scales=jnp.asarray([0.5, 0.5]),
        form=form))
    assert _lowered_kernels(quantized("triton"), "cuda", q, kq, vq, pos) == 1
    assert _lowered_kernels(quantized("mosaic"), "tpu", q, kq, vq, pos) == 1


def _lowered_kernels(fn, platform: str, *args) -> int:
    """How many Pallas kernels `fn` lowers to for `platform` (cuda: Triton custom calls; tpu: Mosaic ones, exported for
    a TPU v6e), as the platform's default backend (not in the interpreter)."""
    from unittest import mock
    if platform == "cuda":
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return text.count("custom_call @__gpu$xla.gpu.triton")
    from jax import export
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh, AxisType
    tpu = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,),
                       abstract_device=AbstractDevice("TPU v6 lite", 1, "tpu"))
    with mock.patch.object(jax, "default_backend", lambda: "tpu"), jax.sharding.use_abstract_mesh(tpu):
        text = export.export(fn, platforms=["tpu"])(*[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args])
    return text.mlir_module().count("custom_call @tpu_custom_call")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import os

    import torch
    import transformers
    from tests.flagship_models import _randomize_extras, hf_config
    from tests.tiny_models import make_checkpoint, randomize
    root = str(tmp_path_factory.mktemp("paged_kernel"))
    torch.manual_seed(0)
    widths = {"gpt_oss": dict(head_dim=16),                    # Triton's sizes: powers of two, at least 16
              "ds3": dict(kv_lora_rank=16, qk_rope_head_dim=16, head_dim=16)}
    for name in ("gpt_oss", "ds3"):
        model = _randomize_extras(randomize(transformers.AutoModelForCausalLM.from_config(
            hf_config(name, **widths[name])).eval()))
        model.save_pretrained(os.path.join(root, name), safe_serialization=True)
    return {"llama": make_checkpoint("gqa", root), "gpt_oss": os.path.join(root, "gpt_oss"),
            "ds3": os.path.join(root, "ds3")}


@pytest.mark.parametrize("name", ["llama", "gpt_oss", "ds3"])
def test_the_engine_with_the_kernel_equals_the_reference_backend(checkpoints, name, monkeypatch):
    from tp_jax import LLM, SamplingParams
    from tp_jax.models import paged_kernel
    launches = []
    real = paged_kernel.paged_attention
    monkeypatch.setattr(paged_kernel, "paged_attention",
                        lambda *a, **k: launches.append((a[0].shape[1], k["chunk_keys"])) or real(*a, **k))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 30, 47)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    outs = {}
    for backend in ("reference", "pallas"):
        llm = LLM(checkpoints[name], dtype="float32", attention_backend=backend, block_size=4,
                  max_num_batched_tokens=16, progress=False)
        assert llm.setup.attention_backend == backend
        outs[backend] = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert any(qb > 1 for qb, _ in launches) and any(keys for _, keys in launches)     # prefill blocks; decode chunks
    for ref, got in zip(outs["reference"], outs["pallas"]):
        assert got.token_ids == ref.token_ids
        lp = lambda c: np.array([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])   # noqa: E731
        assert float(np.abs(lp(got) - lp(ref)).max()) <= 1e-5


