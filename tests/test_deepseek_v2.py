"""DeepSeek-V2 vs transformers, with and without q_lora_rank: logits within 5e-4 and greedy tokens equal at tp 1, 2,
4, dp 2 x tp 2 (EP on and off) and pp 2 x tp 2 (the checkpoints: tests/flagship_models.py); config refusals."""

import pytest

from tests.flagship_models import check, hf_config, mesh_cases, write_references
from tp_jax.models.config import UnsupportedConfigError, config_from_hf

NAMES = ("ds2", "ds2_qlora")


@pytest.fixture(scope="session")
def ds2_references(tmp_path_factory):
    return write_references(str(tmp_path_factory.mktemp("deepseek_v2")), NAMES)


@pytest.mark.parametrize("name,dp,pp,tp,ep", mesh_cases(NAMES))
def test_deepseek_v2_matches_transformers(ds2_references, name, dp, pp, tp, ep):
    check(ds2_references, name, dp, pp, tp, ep)


def test_config_fields_and_refusals():
    """The map: latent sizes, routing, the first dense layer; what transformers' V2 would run otherwise is refused."""
    cfg = config_from_hf(hf_config("ds2"))
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.head_dim, cfg.ff_kinds) == (None, 12, 10, ("dense", "moe"))
    assert (cfg.scoring_func, cfg.n_group, cfg.topk_group, cfg.group_score, cfg.routed_scaling_factor,
            cfg.shared_expert_intermediate_size, cfg.shared_gate) == ("softmax", 4, 2, "max", 2.0, 16, False)
    for field, value, match in [("norm_topk_prob", True, "never renormalizes"),
                                ("topk_method", "noaux_tc", "topk_method"),
                                ("num_key_value_heads", 2, "num_key_value_heads"),
                                ("hidden_act", "gelu", "hidden_act")]:
        with pytest.raises(UnsupportedConfigError, match=match):
            config_from_hf(hf_config("ds2", **{field: value}))
