"""Gemma3ForCausalLM (the text model), and the text model of Gemma3ForConditionalGeneration checkpoints.

Gemma 2's layer with per-head q/k norms ((1 + w) RMSNorm over head_dim) and two rotary embeddings: the sliding
layers rotate with the local base (`rope_parameters["sliding_attention"]`, 10000), the global ones with theta 1e6
and its scaling (`rope_parameters["full_attention"]`); `layer_types` (or the older `sliding_window_pattern`, 6:
five sliding layers, then a global one) says which layer is which.
No soft-capping in released checkpoints (read if set).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from tp_jax.models.config import UnsupportedConfigError, eos_ids, quantization_refusal
from tp_jax.models.gemma2 import Gemma2ForCausalLM, gemma_config, gemma_weights
from tp_jax.models.registry import register
from tp_jax.parallel.layers import WeightTable


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's modules; its params plus self_attn.q_norm / k_norm [head_dim] per layer."""


register("Gemma3ForCausalLM", Gemma3ForCausalLM,
         config=functools.partial(gemma_config, qk_norm=True, local_rope=True), weights=gemma_weights)


class Gemma3ForConditionalGeneration(Gemma2ForCausalLM):
    """The text model of a Gemma 3 vision-language checkpoint (4B, 12B, 27B): Gemma3ForCausalLM's graph, built
    from the config's `text_config`; the vision tower and projector tensors are left unread (text in, text out)."""


def gemma3_text_config(hf, raw=None):
    """`text_config` read as a Gemma3ForCausalLM config (absent fields take the class defaults, as transformers
    does; the published files state only what differs), with the checkpoint's architecture and special tokens."""
    quantization_refusal(getattr(hf, "quantization_config", None))
    text = getattr(hf, "text_config", None)
    if text is None:
        raise UnsupportedConfigError("config.json of Gemma3ForConditionalGeneration has no text_config")
    text = copy.deepcopy(text)
    text.architectures = ["Gemma3ForCausalLM"]
    cfg = gemma_config(text, None, qk_norm=True, local_rope=True)
    eos = eos_ids(getattr(hf, "eos_token_id", None)) or cfg.eos_token_ids
    bos = getattr(hf, "bos_token_id", None)
    return dataclasses.replace(cfg, architecture="Gemma3ForConditionalGeneration", eos_token_ids=eos,
                               bos_token_id=cfg.bos_token_id if bos is None else bos)


def gemma3_vlm_weights(cfg):
    """Gemma3ForCausalLM's table under the language model's prefix: "language_model.model." as the released
    files store it, or "model.language_model." as transformers 5 saves it (a variant)."""
    base = gemma_weights(cfg)

    def moved(prefix: str, lm_head: str) -> WeightTable:
        rename = lambda n: (lm_head if n == "lm_head.weight" else prefix + n[len("model."):]) \
            if n.startswith(("model.", "lm_head.")) else n
        vision = ["vision_tower.*", "multi_modal_projector.*", "model.vision_tower.*", "model.multi_modal_projector.*"]
        return WeightTable([dataclasses.replace(e, hf=rename(e.hf)) for e in base.entries],
                           [rename(n) for n in base.ignored] + vision)
    new = moved("model.language_model.", "lm_head.weight")
    old = moved("language_model.model.", "language_model.lm_head.weight")
    return dataclasses.replace(old, variants=(new,))


register("Gemma3ForConditionalGeneration", Gemma3ForConditionalGeneration, config=gemma3_text_config,
         weights=gemma3_vlm_weights)
