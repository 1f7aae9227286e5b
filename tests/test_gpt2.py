"""GPT-2 (tp_jax/models/gpt2.py) against transformers' GPT2LMHeadModel: logits and greedy generation
at tp 1, 2, 4, 8 and with pp = 2; its config map and name table.

The tiny model has 6 heads, so tp 4 pads heads and tp 8 replicates them; norms and biases
are random (HF initializes them to 1 and 0) so every weight matters.
"""

import json
import os
import shutil

import numpy as np
import pytest

from tests.tiny_models import logits_and_greedy, randomize
from tp_jax.models.config import UnsupportedConfigError
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

CONFIG = dict(vocab_size=1000, n_embd=48, n_layer=3, n_head=6, n_positions=128, bos_token_id=1, eos_token_id=2,
              initializer_range=0.2, architectures=["GPT2LMHeadModel"])
PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 200, 300], [5, 17, 300, 42, 9], [999, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MESHES = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (4, 2)]          # (tp, pp)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint dir, ids, logits, greedy tokens per prompt) from transformers."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    path = str(tmp_path_factory.mktemp("gpt2"))
    torch.manual_seed(6)                 # a seed whose greedy continuations do not repeat one token
    model = randomize(GPT2LMHeadModel(GPT2Config(**CONFIG)).eval())
    model.save_pretrained(path)
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=(3, 13))
    return (path, ids, *logits_and_greedy(model, ids, PROMPTS))


@pytest.mark.parametrize("tp,pp", MESHES, ids=[f"tp{t}pp{p}" for t, p in MESHES])
def test_logits_and_greedy_match_transformers(reference, tp, pp):
    path, ids, ref, greedy = reference
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, progress=False)
    assert llm.config.architecture == "GPT2LMHeadModel" and llm.config.intermediate_size == 4 * 48
    diff = float(np.abs(llm.get_logits(ids) - ref).max())
    print(f"GPT-2 tp={tp} pp={pp}: max abs logit diff {diff:.2e} (max |logit| {np.abs(ref).max():.1f})")
    assert diff <= 1e-4, f"tp={tp} pp={pp}: max abs logit diff {diff:.2e}"
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == greedy


def test_untied_head(tmp_path):
    """tie_word_embeddings=false: a separate lm_head.weight, loaded into a ParallelLMHead."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(3)
    model = randomize(GPT2LMHeadModel(GPT2Config(**{**CONFIG, "tie_word_embeddings": False})).eval())
    model.save_pretrained(str(tmp_path))
    ids = np.arange(10)[None] * 7
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    llm = LLM(str(tmp_path), tensor_parallel_size=2, progress=False)
    assert llm.model.lm_head is not None
    assert float(np.abs(llm.get_logits(ids) - ref).max()) <= 1e-4


def test_every_kernel_entry_declares_the_conv1d_layout():
    """A square Conv1D weight (attn.c_proj, [D, D]) passes any shape check in either orientation, so the
    table states the layout on every kernel entry."""
    from tp_jax.models.gpt2 import gpt2_config, gpt2_weights
    from transformers import GPT2Config
    table = gpt2_weights(gpt2_config(GPT2Config(**CONFIG)))
    kernels = [e for e in table.entries if e.param.endswith(".kernel")]
    assert len(kernels) == 6 and all(e.layout == "in_out" for e in kernels)


def edited(reference, tmp_path, edit):
    out = str(tmp_path / "m")
    shutil.copytree(reference[0], out)
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))
    return out


@pytest.mark.parametrize("edit,msg", [
    (lambda c: c.update(scale_attn_by_inverse_layer_idx=True),
     r"config field scale_attn_by_inverse_layer_idx=True is not supported by tp_jax's GPT2LMHeadModel \(default "
     r"False\)"),
    (lambda c: c.update(activation_function="swish"), r"activation_function='swish' is not supported for "
                                                      r"GPT2LMHeadModel; supported: \['gelu', 'gelu_new'"),
    (lambda c: c.pop("n_embd"), r"config.json lacks the field 'n_embd', which GPT2LMHeadModel requires"),
])
def test_config_fields_refused(reference, tmp_path, edit, msg):
    with pytest.raises(UnsupportedConfigError, match=msg):
        LLM(edited(reference, tmp_path, edit), progress=False)
