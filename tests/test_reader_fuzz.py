"""Fuzzing the three readers: a safetensors header, a GGUF header, a safetensors index JSON.

Each example truncates a small valid file and/or flips bytes in it (hypothesis), then opens
it with our reader. Allowed outcomes: a clear error (`CheckpointError` / `GGUFError`) whose
message names the file; or a reader that accepted the file and whose every tensor is
exactly what the format's own library reads from the same bytes (safetensors) or the bytes
at the original tensor's place (GGUF: tensor data is located by a checked layout, so no
flip can make a name read another tensor's bytes; data flips are read where they are).
Never another exception, a crash or a hang (each example runs under an alarm).
FUZZ_EXAMPLES=2000 FUZZ_RANDOM=1 runs a longer, randomized search.
"""

import contextlib
import json
import os
import shutil
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from tests.test_gguf import QT, quantized_file, tiny_hf_tensors
from tp_jax.loaders.gguf import GGUFError, GGUFSource
from tp_jax.loaders.safetensors import INDEX, CheckpointError, SafetensorsSource

SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                    derandomize=not os.environ.get("FUZZ_RANDOM"), database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextlib.contextmanager
def alarm(seconds: int = 20):
    def hang(*_):
        raise TimeoutError(f"the reader ran for more than {seconds} s")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def opened(open_source, path: str):
    """`open_source()`, or None after checking that its error is a reader error naming `path`."""
    with alarm():
        try:
            return open_source()
        except (CheckpointError, GGUFError) as e:
            assert path in str(e), str(e)
            return None


def write(directory, name: str, data: bytes) -> str:
    path = str(directory / name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def mutations(size: int, header: int):
    """(truncate_to or None, [(position, xor byte)]): flips mostly in the first `header` bytes."""
    pos = st.one_of(st.integers(0, max(0, header - 1)), st.integers(0, size - 1))
    flips = st.lists(st.tuples(pos, st.integers(1, 255)), max_size=4)
    cut = st.one_of(st.none(), st.integers(0, size - 1))
    return st.tuples(cut, flips)


def mutate(data: bytes, mutation) -> bytes:
    cut, flips = mutation
    out = bytearray(data if cut is None else data[:cut])
    for p, x in flips:
        if p < len(out):
            out[p] ^= x
    return bytes(out)


def small_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"model.norm.weight": rng.normal(size=16).astype(np.float32),
            "model.embed_tokens.weight": rng.normal(size=(10, 16)).astype(np.float32),
            "lm_head.weight": rng.normal(size=(10, 16)).astype(np.float16)}


# --- safetensors header ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def safetensors_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("st")
    save_file(small_tensors(), str(d / "model.safetensors"))
    data = (d / "model.safetensors").read_bytes()
    return data, 8 + int.from_bytes(data[:8], "little")


@SETTINGS
@given(data=st.data())
def test_safetensors_header(safetensors_file, tmp_path_factory, data):
    original, header = safetensors_file
    bad = mutate(original, data.draw(mutations(len(original), header)))
    d = tmp_path_factory.mktemp("st_fuzz")
    path = write(d, "model.safetensors", bad)
    source = opened(lambda: SafetensorsSource(str(d)), path)
    with alarm():
        if source is None:
            return
        from safetensors.numpy import load_file
        reference = load_file(path)          # the library must accept what we accept
        assert sorted(reference) == sorted(source.keys())
        for name in source.keys():
            got = source.get(name)[...]
            assert got.dtype == reference[name].dtype and np.array_equal(got, reference[name], equal_nan=True), name
    shutil.rmtree(d)


# --- GGUF header -------------------------------------------------------------------------------

class Layout(dict):
    """GGUF tensor name -> (first byte, byte count) in the original file (short repr for hypothesis)."""

    def __repr__(self) -> str:
        return f"Layout({len(self)} tensors)"


class Blob(bytes):
    """File contents with a short repr (hypothesis prints the arguments of a failing example)."""

    def __repr__(self) -> str:
        return f"Blob({len(self)} bytes)"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = quantized_file(tmp_path_factory.mktemp("gguf") / "tiny.gguf", QT.F32, tiny_hf_tensors())
    reader = GGUFSource(path)._reader
    layout = Layout({t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors})
    return Blob(open(path, "rb").read()), int(reader.data_offset), layout


@SETTINGS
@given(data=st.data())
def test_gguf_header(gguf_file, tmp_path_factory, data):
    original, header, layout = gguf_file
    bad = mutate(original, data.draw(mutations(len(original), header)))
    d = tmp_path_factory.mktemp("gguf_fuzz")
    path = write(d, "m.gguf", bad)
    source = opened(lambda: GGUFSource(path), path)
    if source is not None:
        opened(lambda: check_gguf(source, bad, layout), path)     # reading may still refuse, naming the file
    shutil.rmtree(d)


def check_gguf(source, bad: bytes, layout: Layout) -> None:
    """An accepted file: each tensor holds the bytes at its place, reads, and the config builds."""
    for t in source._reader.tensors:
        if t.name in layout:         # a flipped name is a new name
            start, n = layout[t.name]
            want = np.frombuffer(bad, np.uint8, count=n, offset=start)
            assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), want), t.name
    for name in source.keys():
        source.get(name)[...]
    source.hf_config()


# --- index JSON --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded")
    t = small_tensors()
    files = {"model-00001-of-00002.safetensors": ["model.norm.weight", "lm_head.weight"],
             "model-00002-of-00002.safetensors": ["model.embed_tokens.weight"]}
    for file, names in files.items():
        save_file({n: t[n] for n in names}, str(d / file))
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, ns in files.items() for n in ns}}
    (d / INDEX).write_text(json.dumps(index, indent=2))
    return d, (d / INDEX).read_bytes()


@SETTINGS
@given(data=st.data())
def test_index_json(sharded_dir, tmp_path_factory, data):
    d, original = sharded_dir
    bad = mutate(original, data.draw(mutations(len(original), len(original))))
    work = tmp_path_factory.mktemp("index_fuzz")
    for name in os.listdir(d):
        if name != INDEX:
            os.symlink(d / name, work / name)
    index = write(work, INDEX, bad)
    source = opened(lambda: SafetensorsSource(str(work)), index)
    with alarm():
        if source is None:
            return
        expected = small_tensors()
        assert sorted(source.keys()) == sorted(expected)
        for name, want in expected.items():
            assert np.array_equal(source.get(name)[...], want), name
    shutil.rmtree(work)


# --- GGUF metadata arrays: our fast parse == gguf.GGUFReader's -----------------------------------

ARRAY_ITEMS = {
    "str": st.text(max_size=6),             # (the writer refuses empty arrays)
    "u8": st.integers(0, 255), "i32": st.integers(-2**31, 2**31 - 1), "u64": st.integers(0, 2**64 - 1),
    "f32": st.floats(width=32, allow_nan=False), "bool": st.booleans(),
}


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrays=st.lists(st.sampled_from(sorted(ARRAY_ITEMS)).flatmap(
           lambda kind: st.tuples(st.just(kind), st.lists(ARRAY_ITEMS[kind], min_size=1, max_size=40))), max_size=5),
       big_endian=st.booleans())
def test_gguf_metadata_arrays_parse_as_the_gguf_package_does(tmp_path_factory, arrays, big_endian):
    """Every field (tokenizer-sized arrays take a fast path in our reader) has the same offset, parts,
    types and contents as `gguf.GGUFReader` reads from the same file, in either byte order."""
    import gguf
    from tp_jax.loaders.gguf import open_reader
    kinds = {"u8": gguf.GGUFValueType.UINT8, "i32": gguf.GGUFValueType.INT32, "u64": gguf.GGUFValueType.UINT64,
             "f32": gguf.GGUFValueType.FLOAT32, "bool": gguf.GGUFValueType.BOOL}
    path = str(tmp_path_factory.mktemp("gguf_meta") / "m.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    for i, (kind, values) in enumerate(arrays):
        if kind == "str":
            w.add_array(f"test.strings{i}", values)
        else:
            w.add_key_value(f"test.{kind}{i}", values, gguf.GGUFValueType.ARRAY, sub_type=kinds[kind])
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    theirs, ours = gguf.GGUFReader(path), open_reader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.types, got.data) == (want.offset, want.types, want.data), key
        assert [(p.dtype, p.tolist()) for p in got.parts] == [(p.dtype, p.tolist()) for p in want.parts], key
        assert got.contents() == want.contents(), key
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)


def test_the_embedded_gguf_reads_as_the_gguf_package_reads_it():
    """The default model's 49k-entry tokenizer arrays: the same fields as `gguf.GGUFReader`'s."""
    import gguf
    from tp_jax.loaders.default import default_model_path
    from tp_jax.loaders.gguf import open_reader
    theirs, ours = gguf.GGUFReader(default_model_path()), open_reader(default_model_path())
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.types, got.data, len(got.parts)) == (want.types, want.data, len(want.parts)), key
        assert got.contents() == want.contents(), key
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in theirs.tensors]
