"""Bad checkpoints and configs: each gives an error naming the file or tensor and what was expected."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.tiny_models import make_checkpoint
from tp_jax.parallel.layers.loading import WeightShapeError
from tp_jax.serving.llm import LLM
from tp_jax.loaders.place import CheckpointMismatchError, MissingWeightError, NonFiniteWeightError
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
    (lambda c: c.update(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
     r"rope_type 'mrope' is not supported"),
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
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' .* has dtype F64; supported on disk: F32, BF16, F16"):
        LLM(path, progress=False)


def test_unsupported_run_dtype(good):
    with pytest.raises(ValueError, match=r"dtype='int8' is not a dtype; choose one of 'auto', 'float32', 'bfloat16', 'float16'"):
        LLM(good, dtype="int8", progress=False)


def test_too_many_devices(good):
    with pytest.raises(ValueError, match=r"= 16 devices, but only 8 cpu device\(s\)"):
        LLM(good, tensor_parallel_size=16, progress=False)


def test_max_model_len_beyond_the_model(good):
    with pytest.raises(ValueError, match=r"max_model_len=4096 must be in \[1, 128\]"):
        LLM(good, max_model_len=4096, progress=False)


# --- a checkpoint that does not match its config.json (issue 16, item 2; issue 15, item 1) --------

CONFIG_MISMATCHES = {
    "fewer layers than the weights": (
        dict(num_hidden_layers=1), CheckpointMismatchError,
        r"holds 9 tensor\(s\) that no param takes: \['model.layers.1\..*it has layers up to 1 \(2 layers\) but "
        r"config.json says num_hidden_layers=1"),
    "more layers than the weights": (
        dict(num_hidden_layers=3), MissingWeightError,
        r"lacks 9 tensor\(s\) the model needs: \['model.layers.2\..*the checkpoint has layers 0..1 \(2 layers\) "
        r"but config.json says 3"),
    "another vocab": (
        dict(vocab_size=1200), WeightShapeError,
        r"tensors with the wrong shape \(2 problems\)(.|\n)*tensor 'model.embed_tokens.weight' has shape "
        r"\(1000, 64\), expected \(1200, 64\) \(param 'model.embed_tokens.embedding' part 'weight', "
        r"Entry\(hf='model.embed_tokens.weight'"),
    "a field of another architecture": (
        dict(embedding_multiplier=12.0), UnsupportedConfigError,
        r"config field embedding_multiplier=12.0 asks for a scaled token embedding \(Granite\), which tp_jax's "
        r"LlamaForCausalLM does not implement"),
    "a missing required field": (
        dict(intermediate_size=None), UnsupportedConfigError,
        r"config.json lacks the field 'intermediate_size', which LlamaForCausalLM requires"),
}


@pytest.mark.parametrize("case", list(CONFIG_MISMATCHES))
def test_config_that_does_not_fit_is_refused(good, tmp_path, case):
    change, error, msg = CONFIG_MISMATCHES[case]

    def edit(cfg):
        cfg.update(change)
        for k in [k for k, v in change.items() if v is None]:
            cfg.pop(k)
    with pytest.raises(error, match=msg):
        LLM(copy(good, tmp_path, edit_config=edit), progress=False)


def test_gptq_tensors_that_contradict_their_config_are_named(good, tmp_path):
    """A GPTQ checkpoint whose scales do not have the groups config.json's group_size implies: one line naming the
    tensor, its shape and the field, before any weight is read (not a reshape error deep in the load)."""
    def gptq_tensors(t):
        for name in [n for n in t if n.endswith("_proj.weight")]:
            base, (rows, cols) = name[:-len(".weight")], t[name].shape
            del t[name]
            t.update({f"{base}.qweight": np.zeros((cols // 8, rows), np.int32),
                      f"{base}.qzeros": np.zeros((2, rows // 8), np.int32),
                      f"{base}.scales": np.ones((2, rows), np.float16), f"{base}.g_idx": np.zeros(cols, np.int32)})
    qc = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "quant_method": "gptq"}
    path = copy(good, tmp_path, gptq_tensors, lambda c: c.update(quantization_config=qc))
    with pytest.raises(CheckpointError, match=r"GPTQ weight 'model\.layers\.0\..*': scales \(2, \d+\), expected "
                                              r"\(1, \d+\) for group_size 128 \(check quantization_config\.group_size\)"):
        LLM(path, progress=False)


def test_stray_tensor(good, tmp_path):
    path = copy(good, tmp_path, lambda t: t.update({"model.extra_proj.weight": np.zeros((4, 4), np.float32)}))
    with pytest.raises(CheckpointMismatchError, match=r"holds 1 tensor\(s\) that no param takes: "
                                                      r"\['model.extra_proj.weight'\]"):
        LLM(path, progress=False)


# --- non-finite weights (issue 16, item 3) ---------------------------------------------------------

def test_nan_weight_is_refused_unless_the_check_is_off(good, tmp_path):
    def edit(t):
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    path = copy(good, tmp_path, edit)
    with pytest.raises(NonFiniteWeightError, match=r"tensor\(s\) \['model.layers.1.mlp.down_proj.weight'\] \(param "
                                                   r"'model.layers.layers.mlp.down_proj.kernel', tp rank 0\) hold NaN "
                                                   r"or infinity: the checkpoint is damaged.*check_weights=False"):
        LLM(path, tensor_parallel_size=2, progress=False)
    logits = LLM(path, progress=False, check_weights=False).get_logits([[1, 2, 3]])
    assert np.isnan(logits).all()              # the flag skips the check; the NaN reaches every logit


def test_weight_overflowing_float16(good, tmp_path):
    def edit(t):
        t["model.norm.weight"][0] = 1e6
    path = copy(good, tmp_path, edit)
    with pytest.raises(NonFiniteWeightError, match=r"\['model.norm.weight'\] .* overflow float16"):
        LLM(path, dtype="float16", progress=False)


# --- small loader defects (issue 16, item 12) --------------------------------------------------------

def test_architectures_given_as_a_string(good, tmp_path):
    path = copy(good, tmp_path, edit_config=lambda c: c.update(architectures="LlamaForCausalLM"))
    assert LLM(path, progress=False).config.architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("text,msg", [
    ("{not json", r"model.safetensors.index.json is not valid JSON"),
    ('{"metadata": {}}', r"model.safetensors.index.json has no \"weight_map\" object"),
    ('{"weight_map": {"model.norm.weight": "../model.safetensors"}}',
     r"model.safetensors.index.json: tensor 'model.norm.weight' maps to '../model.safetensors', not a file name"),
    ('{"weight_map": {"model.norm.weight": "model.safetensors"}}',
     r"model.safetensors.index.json does not list tensor\(s\) \['lm_head.weight'"),
    ('{"weight_map": {"model.nrm.weight": "model.safetensors"}}',
     r"model.safetensors.index.json puts tensor 'model.nrm.weight' in model.safetensors, which does not hold it"),
])
def test_invalid_index_names_the_file(good, tmp_path, text, msg):
    path = copy(good, tmp_path)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write(text)
    with pytest.raises(CheckpointError, match=msg):
        LLM(path, progress=False)


def test_upper_case_gguf_suffix(tmp_path):
    from tests.test_gguf import quantized_file, tiny_hf_tensors
    from tp_jax.loaders.gguf import GGUFSource, QT
    from tp_jax.loaders.sources import open_checkpoint
    path = quantized_file(tmp_path / "M.GGUF", QT.F32, tiny_hf_tensors())
    ckpt = open_checkpoint(path)
    assert isinstance(ckpt.source, GGUFSource) and ckpt.config.num_layers == 1


def test_progress_bar_ends_at_100_percent(good, capfd):
    LLM(good, progress=True)
    bars = capfd.readouterr().err.replace("\r", "\n").splitlines()
    last = [b for b in bars if b.startswith("loading weights")][-1]
    assert re.match(r"loading weights: 100%\|.*\| (\d+)/\1 ", last), last


# --- the config map (issue 15, item 1) ----------------------------------------------------------

def test_fields_without_effect_on_inference_are_accepted(good, tmp_path):
    path = copy(good, tmp_path, edit_config=lambda c: c.update(attention_dropout=0.1, initializer_range=0.5,
                                                               use_cache=False))
    assert LLM(path, progress=False).config.num_layers == 2
