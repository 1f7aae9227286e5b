"""Orbax checkpoints (tp_jax/loaders/orbax.py): convert once, restore onto any mesh.

A tiny HF model and the real SmolLM2 (from its GGUF) are converted to Orbax; loaded at
tp in {1, 2, 4, 8} (and pp x tp = 2 x 4) their logits equal the source loader's logits on
the same mesh. Orbax's own API restores the canonical tensors; bad checkpoints fail
naming the tensor.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.tiny_models import make_checkpoint
from tp_jax.parallel.layers.loading import WeightShapeError
from tp_jax.serving.llm import LLM
from tp_jax.loaders.orbax import (ORBAX_SUBDIR, OrbaxCheckpointError, OrbaxSource, chunk_shape, convert_to_orbax,
                                  write_orbax)
from tp_jax.loaders.model import tensor_split_dims
from tp_jax.loaders.place import MissingWeightError
from tp_jax.models.config import load_config
from tp_jax.loaders.safetensors import SafetensorsSource

TPS = [1, 2, 4, 8]
VARIANTS = ["h9kv3", "bias", "bf16sharded"]     # 9 q / 3 kv heads; biases; bf16 index-sharded files
LIMIT = 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """variant -> (HF dir, Orbax dir), converted once per module."""
    root = str(tmp_path_factory.mktemp("orbax_tiny"))
    out = {}
    for v in VARIANTS:
        hf, orbax_dir = make_checkpoint(v, root), os.path.join(root, v + "_orbax")
        convert_to_orbax(hf, orbax_dir)
        out[v] = hf, orbax_dir
    return out


def ids_for(vocab: int, batch: int = 2, length: int = 12) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (batch, length))


def max_diff(source: str, orbax_dir: str, ids, **mesh) -> float:
    """Max |logits| difference, source vs its Orbax copy; a GGUF source in float (its blocks dequantized at
    load, as the copy was written), not the default kept blocks, whose tiled GEMM sums in another order."""
    ref = LLM(source, progress=False, quantization=None, **mesh).get_logits(ids)
    got = LLM(orbax_dir, progress=False, **mesh).get_logits(ids)
    assert got.shape == ref.shape
    return float(np.abs(got - ref).max())


@pytest.mark.parametrize("variant,tp", [("h9kv3", tp) for tp in TPS] + [("bias", 4), ("bf16sharded", 8)])
def test_tiny_logits_equal_source(tiny, variant, tp):
    hf, orbax_dir = tiny[variant]
    diff = max_diff(hf, orbax_dir, ids_for(1001 if variant == "h9kv3" else 1000), tensor_parallel_size=tp)
    print(f"tiny {variant} tp={tp}: max abs logit diff orbax vs safetensors {diff:.1e}")
    assert diff <= LIMIT


def test_tiny_pipeline_parallel(tiny):
    hf, orbax_dir = tiny["h9kv3"]
    diff = max_diff(hf, orbax_dir, ids_for(1001), pipeline_parallel_size=2, tensor_parallel_size=4)
    print(f"tiny h9kv3 pp=2 tp=4: max abs logit diff {diff:.1e}")
    assert diff <= LIMIT


def test_orbax_api_restores_canonical_tensors(tiny):
    """Orbax's own restore gives exactly the HF tensors (names, shapes, dtypes, values); chunks as documented."""
    import orbax.checkpoint as ocp
    hf, orbax_dir = tiny["bf16sharded"]
    restored = ocp.PyTreeCheckpointer().restore(os.path.join(orbax_dir, ORBAX_SUBDIR))
    src = SafetensorsSource(hf)
    assert sorted(restored) == sorted(src.keys())
    for name in src.keys():
        want = src.get(name)[...]
        assert restored[name].dtype == want.dtype and np.array_equal(restored[name], want), name
    source = OrbaxSource(orbax_dir)
    split = tensor_split_dims(load_config(orbax_dir))       # read off the layers' declarations
    for name, rows_dim in [("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.0.mlp.down_proj.weight", 1),
                           ("model.embed_tokens.weight", 0)]:
        t = source.get(name)
        chunks = tuple(t._store.chunk_layout.read_chunk.shape)
        assert split[name] == rows_dim and chunks == chunk_shape(t.shape, rows_dim)
        assert chunks[rows_dim] == 64 and chunks[1 - rows_dim] == t.shape[1 - rows_dim]
    q = source.get("model.layers.1.self_attn.q_proj.weight")
    assert np.array_equal(q[64:128, 3:9], src.get("model.layers.1.self_attn.q_proj.weight")[64:128, 3:9])


def test_dtype_cast_on_disk(tiny, tmp_path):
    hf, _ = tiny["h9kv3"]
    out = str(tmp_path / "bf16")
    convert_to_orbax(hf, out, dtype="bfloat16")
    src, got = SafetensorsSource(hf), OrbaxSource(out)
    name = "model.layers.0.mlp.gate_proj.weight"
    assert {str(got.get(n).dtype) for n in got.keys()} == {"bfloat16"}
    assert np.array_equal(got.get(name)[...], src.get(name)[...].astype(got.get(name).dtype))
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"


class Without:
    """A source that lacks one tensor."""

    def __init__(self, source, drop: str):
        self.source, self.drop = source, drop

    def keys(self):
        return [k for k in self.source.keys() if k != self.drop]

    def get(self, name):
        return self.source.get(name)


def test_missing_tensor(tiny, tmp_path):
    hf, _ = tiny["h9kv3"]
    out = str(tmp_path / "m")
    shutil.copytree(hf, out, ignore=shutil.ignore_patterns("*.safetensors"))
    write_orbax(Without(SafetensorsSource(hf), "model.layers.1.mlp.up_proj.weight"), os.path.join(out, ORBAX_SUBDIR))
    with pytest.raises(MissingWeightError, match=r"lacks 1 tensor.*'model.layers.1.mlp.up_proj.weight'"):
        LLM(out, progress=False)


def test_config_does_not_match_tensors(tiny, tmp_path):
    _, orbax_dir = tiny["h9kv3"]
    out = str(tmp_path / "m")
    shutil.copytree(orbax_dir, out)
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["hidden_size"] = 81                  # still a multiple of the 9 heads, so config.json itself is valid
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(WeightShapeError, match=r"tensor '[a-z_.0-9]+weight' has shape \(1001, 72\), "
                                               r"expected \(1001, 81\).*match config.json"):
        LLM(out, tensor_parallel_size=2, progress=False)


def test_incomplete_checkpoint(tiny, tmp_path):
    _, orbax_dir = tiny["bias"]
    out = str(tmp_path / "m")
    shutil.copytree(orbax_dir, out)
    os.remove(os.path.join(out, ORBAX_SUBDIR, "_METADATA"))
    with pytest.raises(OrbaxCheckpointError, match=r"not a complete Orbax PyTree checkpoint.*re-run"):
        LLM(out, progress=False)


def test_existing_output_refused_then_overwritten_by_cli(tiny, tmp_path):
    hf, _ = tiny["bias"]
    orbax_dir = str(tmp_path / "m")
    convert_to_orbax(hf, orbax_dir)
    with pytest.raises(FileExistsError, match=r"already exists; delete it"):
        convert_to_orbax(hf, orbax_dir)
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "convert.py")
    run = subprocess.run([sys.executable, script, hf, orbax_dir, "--to", "orbax", "--overwrite"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(OrbaxSource(orbax_dir).keys()) == sorted(SafetensorsSource(hf).keys())


# --- the real SmolLM2-135M-Instruct, converted from its Q4_1 GGUF ---------------------------

@pytest.fixture(scope="module")
def smollm2_orbax(smollm2_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("smollm2_orbax"))
    convert_to_orbax(smollm2_path, out)
    return out


@pytest.fixture(scope="module")
def smollm2_ids(smollm2_orbax):
    from tp_jax.serving.tokenizer import load_tokenizer
    ids = load_tokenizer(smollm2_orbax).encode("The history of the printing press begins in the fifteenth century")
    return np.array([ids])


@pytest.mark.slow
@pytest.mark.parametrize("tp", TPS)
def test_smollm2_logits_equal_gguf(smollm2_path, smollm2_orbax, smollm2_ids, tp):
    diff = max_diff(smollm2_path, smollm2_orbax, smollm2_ids, tensor_parallel_size=tp)
    print(f"SmolLM2 tp={tp}: max abs logit diff orbax vs GGUF {diff:.1e}")
    assert diff <= LIMIT


@pytest.mark.slow
def test_smollm2_pipeline_parallel(smollm2_path, smollm2_orbax, smollm2_ids):
    diff = max_diff(smollm2_path, smollm2_orbax, smollm2_ids, pipeline_parallel_size=2, tensor_parallel_size=4)
    print(f"SmolLM2 pp=2 tp=4: max abs logit diff orbax vs GGUF {diff:.1e}")
    assert diff <= LIMIT


# --- an interrupted conversion and the converter's command line (issue 16, item 12) ---------------

def test_interrupted_conversion_leaves_nothing_behind(tiny, tmp_path, monkeypatch):
    """Ctrl-C during the write: no half checkpoint stays, the next run converts normally."""
    from tp_jax.loaders import orbax as orbax_module
    hf, _ = tiny["bias"]
    out = str(tmp_path / "m")
    reads = []

    def interrupted_read(self):
        reads.append(1)
        if len(reads) == 3:
            raise KeyboardInterrupt
        return np.ascontiguousarray(self.tensor[...], dtype=self.dtype)
    monkeypatch.setattr(orbax_module._LazyLeaf, "read", interrupted_read)
    with pytest.raises(KeyboardInterrupt):
        convert_to_orbax(hf, out)
    assert not [n for n in os.listdir(out) if n.startswith(ORBAX_SUBDIR)], os.listdir(out)
    monkeypatch.undo()
    convert_to_orbax(hf, out)
    assert sorted(OrbaxSource(out).keys()) == sorted(SafetensorsSource(hf).keys())


def test_leftover_temporary_checkpoint_is_named(tiny, tmp_path):
    """A directory a killed conversion left (orbax's temp name, no orbax/): the error says so, not
    "no model.safetensors"."""
    hf, orbax_dir = tiny["bias"]
    out = str(tmp_path / "m")
    shutil.copytree(orbax_dir, out)
    os.rename(os.path.join(out, ORBAX_SUBDIR), os.path.join(out, ORBAX_SUBDIR + ".orbax-checkpoint-tmp-1234"))
    with pytest.raises(OrbaxCheckpointError, match=r"holds no finished Orbax checkpoint, only \[.*orbax.orbax-"
                                                   r"checkpoint-tmp-1234'\], left by an interrupted conversion; "
                                                   r"delete it and re-run `python scripts/convert.py SRC .* --to "
                                                   r"orbax --overwrite`"):
        LLM(out, progress=False)
    convert_to_orbax(hf, out, overwrite=True)                 # --overwrite clears the leftover too
    assert os.listdir(out).count(ORBAX_SUBDIR) == 1 and not any("tmp" in n for n in os.listdir(out))


@pytest.mark.parametrize("args,msg", [
    (["{hf}", "{out}"], r"^convert.py: error: .*/m/orbax already exists; pass --overwrite to replace it\n$"),
    (["{hf}/nope", "{out}2"], r"^convert.py: error: model '.*/nope' is neither a directory"),
    (["{hf}", "{out}3", "--to", "safetensors"], r"^convert.py: error: --to safetensors converts a .gguf file; "),
])
def test_convert_script_errors_are_one_line(tiny, tmp_path, args, msg):
    hf, _ = tiny["bias"]
    out = str(tmp_path / "m")
    convert_to_orbax(hf, out)
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "convert.py")
    run = subprocess.run([sys.executable, script, *[a.format(hf=hf, out=out) for a in args]],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "overwrite=True" not in run.stderr, run.stderr
    assert re.match(msg, run.stderr), run.stderr
