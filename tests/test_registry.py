"""Registering a model checks the loader side of the model contract, naming what is missing;
the registry finds model files by itself (adding a model touches only its file)."""

import os

import jax
import pytest
from flax import nnx

from tp_jax.models import registry
from tp_jax.models.registry import ModelContractError, register

MODELS_DIR = os.path.join(os.path.dirname(__file__), "..", "tp_jax", "models")


class Good(nnx.Module):
    def __init__(self, cfg, *, tp_size, pp_size, dtype, rngs):
        self.config = cfg

    @property
    def layer_map(self):
        return ()

    def hidden_states(self, ids, positions, cache=None, *, microbatches=1):
        return ids, cache

    def logits(self, h):
        return h

    def kv_layout(self):
        return None


def config(hf, raw=None):
    return None


def weights(cfg):
    return None


@pytest.fixture(autouse=True)
def clean_registry():
    registry.supported()                      # import every model file first: they register once
    before = dict(registry._MODELS)
    yield
    registry._MODELS.clear()
    registry._MODELS.update(before)


def test_a_good_model_registers():
    arch = register("GoodForCausalLM", Good, config=config, weights=weights)
    assert registry.architecture("GoodForCausalLM") is arch and arch.model is Good


def test_missing_layer_map_and_constructor_keywords():
    class Bad(nnx.Module):
        def __init__(self, cfg, *, tp_size, rngs):
            pass
    with pytest.raises(ModelContractError, match=r"register\('BadForCausalLM', .*Bad'\): its constructor lacks the "
                                                 r"keyword\(s\) \['pp_size', 'dtype'\].*; it has no `layer_map`"):
        register("BadForCausalLM", Bad, config=config, weights=weights)


def test_the_engine_side_of_the_contract():
    class NoServing(nnx.Module):
        def __init__(self, cfg, *, tp_size, pp_size, dtype, rngs):
            pass

        layer_map = ()

        def logits(self, h):
            return h
    with pytest.raises(ModelContractError, match=r"it has no `hidden_states` method \(hidden_states\(ids, positions, "
                                                 r"cache=None.*; it has no `kv_layout` method"):
        register("NoServingForCausalLM", NoServing, config=config, weights=weights)


def test_config_and_weights_must_be_functions():
    with pytest.raises(ModelContractError, match=r"`config=` must be a function config\(hf_config, raw\) -> "
                                                 r"ModelConfig, got 'nope'; `weights=` must be a function "
                                                 r"weights\(cfg\) -> WeightTable"):
        register("GoodForCausalLM", Good, config="nope", weights=None)


def test_a_model_that_does_not_keep_its_config():
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.config import ModelConfig
    from tp_jax.parallel.mesh import make_mesh

    class Forgets(Good):
        def __init__(self, cfg, *, tp_size, pp_size, dtype, rngs):
            pass
    register("ForgetsForCausalLM", Forgets, config=config, weights=weights)
    cfg = ModelConfig(architecture="ForgetsForCausalLM", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=8)
    with pytest.raises(ModelContractError, match=r"Forgets\(cfg, ...\) must keep its config as `self.config = cfg`"):
        abstract_model(cfg, make_mesh(devices=jax.devices()[:1]))


def test_every_model_file_registers_itself():
    """No list of models to edit: each file under models/ that calls register() is found."""
    files = [f for f in os.listdir(MODELS_DIR) if f.endswith(".py") and "\nregister(" in open(
        os.path.join(MODELS_DIR, f)).read()]
    found = {registry.model_class(a).__module__.rsplit(".", 1)[-1] for a in registry.supported()}
    assert {f[:-3] for f in files} == found
