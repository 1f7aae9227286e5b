"""Bad checkpoints and configs: each gives an error naming the file or tensor and what was expected."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.tiny_models import make_checkpoint
from tp_jax.parallel.layers.loading import WeightShapeError
from tp_jax.serving.llm import LLM
from tp_jax.loaders.place import MissingWeightError
from tp_jax.loaders.safetensors import CheckpointError
from tp_jax.models.config import UnsupportedConfigError


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_checkpoint("gqa", str(tmp_path_factory.mktemp("good")))


def copy(good, tmp_path, edit_tensors=None, edit_config=None):
    out = str(tmp_path / "m")
    shutil.copytree(good, out)
    if edit_tensors:
        path = os.path.join(out, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)
    if edit_config:
        cfg_path = os.path.join(out, "config.json")
        cfg = json.load(open(cfg_path))
        edit_config(cfg)
        json.dump(cfg, open(cfg_path, "w"))
    return out


def test_missing_tensor(good, tmp_path):
    path = copy(good, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingWeightError, match=r"lacks 1 tensor.*'model.layers.1.mlp.up_proj.weight'"):
        LLM(path, progress=False)


def test_wrong_shape(good, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    path = copy(good, tmp_path, edit)
    with pytest.raises(WeightShapeError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(16, 64\), "
                                              r"expected \(32, 64\)"):
        LLM(path, progress=False)


def test_truncated_file(good, tmp_path):
    path = copy(good, tmp_path)
    f = os.path.join(path, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated: tensor '.*' needs bytes up to"):
        LLM(path, progress=False)


def test_corrupt_header(good, tmp_path):
    path = copy(good, tmp_path)
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\xff\xfe garbage")
    with pytest.raises(CheckpointError, match=r"model.safetensors is corrupt: its header is not valid JSON"):
        LLM(path, progress=False)


def test_missing_config(good, tmp_path):
    path = copy(good, tmp_path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(FileNotFoundError, match=r"no config.json in"):
        LLM(path, progress=False)


def test_unsupported_architecture(good, tmp_path):
    path = copy(good, tmp_path, edit_config=lambda c: c.update(architectures=["FalconForCausalLM"]))
    with pytest.raises(ValueError, match=r"unsupported architecture 'FalconForCausalLM'; supported: .*LlamaForCausalLM"):
        LLM(path, progress=False)


@pytest.mark.parametrize("edit,msg", [
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     r"rope_type 'yarn' is not supported"),
    (lambda c: c.update(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (lambda c: c.update(sliding_window=32), r"sliding_window=32 \(an active sliding window\) is not supported"),
])
def test_unsupported_config_field(good, tmp_path, edit, msg):
    path = copy(good, tmp_path, edit_config=edit)
    with pytest.raises(UnsupportedConfigError, match=msg):
        LLM(path, progress=False)


def test_unsupported_dtype_on_disk(good, tmp_path):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.float64)
    path = copy(good, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' .* has dtype F64; supported on disk: F32, F16, BF16"):
        LLM(path, progress=False)


def test_unsupported_run_dtype(good):
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported"):
        LLM(good, dtype="int8", progress=False)


def test_too_many_devices(good):
    with pytest.raises(ValueError, match=r"= 16 devices, but only 8 cpu device\(s\)"):
        LLM(good, tensor_parallel_size=16, progress=False)


def test_max_model_len_beyond_the_model(good):
    with pytest.raises(ValueError, match=r"max_model_len=4096 must be in \[1, 128\]"):
        LLM(good, max_model_len=4096, progress=False)
