"""The loader checks the model, its name table and the checkpoint before reading any tensor data.

A small model (vocab embedding, fused QKV with biases, LayerNorm, a stacked block) and an
in-memory source whose reads are counted: every bad table, bad model or bad checkpoint
fails with a message naming the param path, the entry and the checkpoint tensor, and no
tensor byte has been read by then. Also: storage layouts (`in_out`) and fused tensors
with row offsets load exactly what separate `[out, in]` tensors load, at tp 1, 2, 4.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conftest import mesh_for
from tp_jax import (ColumnParallelLinear, Entry, LayerNorm, QKVParallelLinear, Stack, VocabParallelEmbedding,
                    WeightTable, fill, load_state)
from tp_jax.loaders.bind import CheckpointMismatchError, MissingWeightError, NameTableError
from tp_jax.parallel.layers import WeightShapeError

V, D, H, KV, HD, F = 100, 32, 4, 2, 8, 48


class Block(nnx.Module):
    def __init__(self, tp, rngs):
        self.up = ColumnParallelLinear(D, F, tp_size=tp, bias=False, rngs=rngs)


class Tiny(nnx.Module):
    def __init__(self, tp, rngs, plain_norm=False):
        self.embed = VocabParallelEmbedding(V, D, tp_size=tp, rngs=rngs)
        self.qkv = QKVParallelLinear(D, HD, H, KV, tp_size=tp, bias=True, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs) if plain_norm else LayerNorm(D, tp_size=tp, rngs=rngs)
        self.blocks = Stack(lambda r: Block(tp, r), 2, rngs)


def tensors(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"embed": rng.normal(size=(V, D)), "ln.w": rng.normal(size=D), "ln.b": rng.normal(size=D)}
    for p, n in (("q", H), ("k", KV), ("v", KV)):
        out[f"{p}.w"], out[f"{p}.b"] = rng.normal(size=(n * HD, D)), rng.normal(size=n * HD)
    for i in range(2):
        out[f"blocks.{i}.up"] = rng.normal(size=(F, D))
    return {k: v.astype(np.float32) for k, v in out.items()}


def entries() -> list[Entry]:
    return [Entry("embed", "embed.embedding", "weight"), Entry("ln.w", "norm.weight", "weight"),
            Entry("ln.b", "norm.bias", "bias"), Entry("blocks.{i}.up", "blocks.layers.up.kernel", "weight"),
            *[Entry(f"{p}.w", "qkv.kernel", p) for p in "qkv"], *[Entry(f"{p}.b", "qkv.bias", p) for p in "qkv"]]


class CountingSource:
    """An in-memory source that counts tensor reads (slicing), not lookups."""

    def __init__(self, tensors):
        self.tensors, self.reads = tensors, 0

    def keys(self):
        return list(self.tensors)

    def __contains__(self, name):
        return name in self.tensors

    def get(self, name):
        source, array = self, self.tensors[name]

        class Lazy:
            shape = array.shape

            def __getitem__(self, index):
                source.reads += 1
                return array[index]
        return Lazy()


def abstract(tp=2, **kw):
    mesh = mesh_for(1, 1, tp)
    with jax.set_mesh(mesh):
        return nnx.eval_shape(lambda: Tiny(tp, nnx.Rngs(0), **kw)), mesh


def load(table, source, tp=2, **kw):
    model, mesh = abstract(tp, **kw)
    fill(model, load_state(model, mesh, source, table, 2, jnp.float32, progress=False))
    return model


def refuse(table, error, pattern, source=None, **kw):
    source = source or CountingSource(tensors())
    with pytest.raises(error, match=pattern):
        load(table, source, **kw)
    assert source.reads == 0, "an error was raised only after reading tensor data"


def replace(table, old_hf, **changes):
    return [Entry(**{**e.__dict__, **changes}) if e.hf == old_hf else e for e in table]


def test_the_table_loads_and_reads():
    source = CountingSource(tensors())
    model = load(entries(), source)
    assert source.reads > 0
    w = tensors()
    assert np.array_equal(np.asarray(model.norm.bias[...]), w["ln.b"])
    assert np.array_equal(np.asarray(model.blocks.layers.up.kernel[...])[1], w["blocks.1.up"].T)


# --- the table against the model (issue 15, item 5) --------------------------------------------

def test_wrong_part_name():
    refuse(replace(entries(), "k.w", part="w"), NameTableError,
           r"Entry\(hf='k.w', param='qkv.kernel', part='w'.*param 'qkv.kernel' \(QKVParallelLinear\) has no part "
           r"'w'; its parts are \['q', 'k', 'v'\] \(checkpoint tensor 'k.w'\)")


def test_missing_fused_part():
    table = [e for e in entries() if e.hf != "v.w"]
    refuse(table, NameTableError, r"param 'qkv.kernel' needs parts \['q', 'k', 'v'\]; the table fills \['q', 'k'\] "
                                  r"\(from \['k.w', 'q.w'\]\) but not \['v'\]: add Entry\(hf=<checkpoint tensor>, "
                                  r"param='qkv.kernel', part='v'\)")


def test_plain_flax_layer_names_the_parallel_layer_to_use():
    refuse(entries(), NameTableError, r"param 'norm.scale' belongs to flax.nnx.*LayerNorm, which tp_jax cannot load "
                                      r"or shard: build that layer with tp_jax.LayerNorm", plain_norm=True)


def test_entry_matching_no_param():
    refuse(entries() + [Entry("ln.w", "norm.wieght", "weight")], NameTableError,
           r"Entry\(hf='ln.w', param='norm.wieght'.* matches no param of the model \(checkpoint tensor 'ln.w'\); "
           r"did you mean \['norm.weight'")


def test_param_filled_by_no_entry():
    refuse([e for e in entries() if e.param != "norm.bias"], NameTableError,
           r"param 'norm.bias' \(LayerNorm.bias\) is filled by no entry: add Entry\(hf=<checkpoint tensor>, "
           r"param='norm.bias', part='bias'\)")


def test_two_entries_for_one_part():
    refuse(entries() + [Entry("q.b", "qkv.kernel", "q")], NameTableError,
           r"Entry\(hf='q.b', param='qkv.kernel', part='q'.*part 'q' of param 'qkv.kernel' is already filled by 'q.w'")


@pytest.mark.parametrize("hf,param,msg", [
    ("blocks.0.up", "blocks.layers.up.kernel", r"must carry '\{i\}' \(the param is stacked by a Stack\)"),
    ("ln.{i}.w", "norm.weight", r"must not carry '\{i\}' \(the param is not under a Stack\)")])
def test_layer_index_only_on_stacked_params(hf, param, msg):
    table = [Entry(hf, e.param, e.part) if e.param == param else e for e in entries()]
    refuse(table, NameTableError, rf"checkpoint name '{re.escape(hf)}' {msg}; param '{param}'")


def test_every_problem_is_listed_at_once():
    table = replace(replace(entries(), "k.w", part="w"), "ln.b", param="norm.bais")
    refuse(table, NameTableError, r"\(4 problems\):\n.*'norm.bais'.*\n.*no part 'w'.*\n.*'norm.bias'.* filled by no "
                                  r"entry.*\n.*'qkv.kernel' needs .* but not \['k'\]")


# --- the checkpoint against the table (issue 16, item 2) ----------------------------------------

def test_missing_tensor_is_named():
    w = tensors()
    del w["blocks.1.up"]
    refuse(entries(), MissingWeightError, r"lacks 1 tensor\(s\) the model needs: \['blocks.1.up'\]",
           CountingSource(w))


def test_unused_tensors_are_refused():
    w = tensors()
    w["blocks.2.up"], w["stray"] = w["blocks.1.up"], w["ln.w"]
    refuse(entries(), CheckpointMismatchError, r"holds 2 tensor\(s\) that no param takes: \['blocks.2.up', 'stray'\]"
                                               r".*it has layers up to 2 \(3 layers\) but config.json says "
                                               r"num_hidden_layers=2", CountingSource(w))


def test_ignored_tensors_load():
    """A tensor the table ignores is neither refused nor read, and every param equals the load without it."""
    w = tensors()
    w["blocks.0.rotary.inv_freq"] = np.ones(4, np.float32)

    class Watching(CountingSource):
        def get(self, name):
            assert "rotary" not in name, f"the ignored tensor {name!r} was read"
            return super().get(name)
    got = nnx.to_flat_state(nnx.state(load(WeightTable(entries(), ignored=["blocks.{i}.rotary.inv_freq"]),
                                           Watching(w)), nnx.Param))
    want = dict(nnx.to_flat_state(nnx.state(load(entries(), CountingSource(tensors())), nnx.Param)))
    assert len(got) == len(want) == 6          # embedding, qkv kernel + bias, norm weight + bias, up
    for key, var in got:
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(want[key].get_value()), err_msg=key)
    assert np.array_equal(np.asarray(dict(got)[("blocks", "layers", "up", "kernel")].get_value())[0],
                          w["blocks.0.up"].T)


def test_wrong_shape_names_param_entry_and_tensor():
    w = tensors()
    w["k.w"] = np.zeros((KV * HD + 1, D), np.float32)
    refuse(entries(), WeightShapeError, r"tensor 'k.w' has shape \(17, 32\), expected \(16, 32\) \(param 'qkv.kernel' "
                                        r"part 'k', Entry\(hf='k.w'", CountingSource(w))


def test_transposed_weight_gets_the_layout_hint():
    """[in, out] where [out, in] is declared: caught by shape when not square (a square one cannot be,
    which is why a checkpoint's layout is declared on every entry of its table)."""
    w = tensors()
    w["k.w"] = w["k.w"].T.copy()
    refuse(entries(), WeightShapeError, r"tensor 'k.w' has shape \(32, 16\), expected \(16, 32\) .*its transpose "
                                        r"fits: the checkpoint stores it the other way round, declare "
                                        r"layout='in_out' in its Entry", CountingSource(w))


def test_source_that_returns_no_tensor():
    class Bad(CountingSource):
        def get(self, name):
            return [1, 2, 3]
    refuse(entries(), TypeError, r"the source returned list for tensor '.*'; a lazy tensor needs `.shape`",
           Bad(tensors()))


def test_safetensors_slice_handles_are_lazy_tensors(tmp_path):
    """What the docs promise: `safe_open(...).get_slice(name)` (no `.shape`, only `get_shape()`) works as is."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    path = str(tmp_path / "w.safetensors")
    save_file(tensors(), path)

    class Slices:
        def __init__(self):
            self.f = safe_open(path, framework="numpy")

        def keys(self):
            return list(self.f.keys())

        def __contains__(self, name):
            return name in self.f.keys()

        def get(self, name):
            return self.f.get_slice(name)
    model = load(entries(), Slices())
    assert np.array_equal(np.asarray(model.norm.weight[...]), tensors()["ln.w"])


# --- storage layout and fused tensors as declarations --------------------------------------------

def fused(w):
    """q | k | v in one [in, out] tensor (and one bias), as GPT-2's c_attn stores them."""
    f = dict(w)
    f["c_attn.w"] = np.concatenate([f.pop(f"{p}.w") for p in "qkv"]).T.copy()
    f["c_attn.b"] = np.concatenate([f.pop(f"{p}.b") for p in "qkv"])
    return f


def fused_entries():
    offsets = {"q": 0, "k": H * HD, "v": (H + KV) * HD}
    rest = [e for e in entries() if e.param not in ("qkv.kernel", "qkv.bias")]
    return rest + [Entry("c_attn.w", "qkv.kernel", p, layout="in_out", offset=o) for p, o in offsets.items()] + \
        [Entry("c_attn.b", "qkv.bias", p, offset=o) for p, o in offsets.items()]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_in_out_tensor_loads_like_separate_tensors(tp):
    separate = load(entries(), CountingSource(tensors()), tp)
    source = CountingSource(fused(tensors()))
    one = load(fused_entries(), source, tp)
    for name in ("kernel", "bias"):
        a, b = getattr(separate.qkv, name)[...], getattr(one.qkv, name)[...]
        assert np.array_equal(np.asarray(a), np.asarray(b)), name
        assert a.sharding == b.sharding


def test_fused_tensor_rows_no_part_takes():
    w = fused(tensors())
    w["c_attn.b"] = np.concatenate([w["c_attn.b"], np.zeros(8, np.float32)])
    refuse(fused_entries(), CheckpointMismatchError, r"rows 64..71 of fused tensor 'c_attn.b' \(72 rows in the "
                                                     r"declared layout\) feed no part", CountingSource(w))


def test_fused_tensor_too_short():
    w = fused(tensors())
    w["c_attn.w"] = w["c_attn.w"][:, :-8].copy()
    refuse(fused_entries(), WeightShapeError, r"tensor 'c_attn.w' has shape \(32, 56\); rows \[48, 64\) of a \(32,\) "
                                              r"tensor were expected \(param 'qkv.kernel' part 'v'", CountingSource(w))


def test_in_out_layout_on_a_vector_is_refused():
    table = [Entry(e.hf, e.param, e.part, layout="in_out") if e.hf == "ln.w" else e for e in entries()]
    refuse(table, NameTableError, r"layout='in_out' applies to 2-D weights; param 'norm.weight' part 'weight' is 1-D")
