"""YaRN rotary scaling and DeepSeek's interleaved rotary pairs (tp_jax/models/rope.py) vs transformers, float32.

The rope parameters are those of the real DeepSeek-V3, DeepSeek-V2-Lite and gpt-oss-20b config.json files, read by
`rope_from_hf` from the transformers config objects whose rotary embeddings transformers builds from them.
"""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding, apply_rotary_pos_emb,
                                                                  apply_rotary_pos_emb_interleave)

from tp_jax.models import rope as rope_module
from tp_jax.models.config import UnsupportedConfigError
from tp_jax.models.rope import RopeConfig, apply_rope, inv_freq, rope_from_hf, yarn_softmax_scale

DEEPSEEK_V3 = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 4096}
DEEPSEEK_V2_LITE = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}
GPT_OSS_20B = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
               "original_max_position_embeddings": 4096}
DEEPSEEK_SIZES = dict(qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=163840)


def deepseek_v3(rope_scaling: dict = DEEPSEEK_V3, **kw):
    return DeepseekV3Config(rope_scaling=dict(rope_scaling), rope_theta=10000, **{**DEEPSEEK_SIZES, **kw})


def deepseek_v2_lite(rope_scaling: dict = DEEPSEEK_V2_LITE):
    return DeepseekV2Config(rope_scaling=dict(rope_scaling), rope_theta=10000, **DEEPSEEK_SIZES)


def gpt_oss(rope_scaling: dict = GPT_OSS_20B):
    return GptOssConfig(rope_scaling=dict(rope_scaling), rope_theta=150000, head_dim=64, max_position_embeddings=131072)


CONFIGS = {"deepseek-v3": deepseek_v3, "deepseek-v2-lite": deepseek_v2_lite, "gpt-oss-20b": gpt_oss}
VARIANTS = {       # the other branches of transformers' yarn: a given attention_factor, mscale without mscale_all_dim,
    "attention_factor": lambda: deepseek_v3({**DEEPSEEK_V3, "attention_factor": 0.8}),     # factor from the lengths
    "mscale_only": lambda: deepseek_v3({k: v for k, v in DEEPSEEK_V3.items() if k != "mscale_all_dim"}),
    "no_factor": lambda: deepseek_v3({**DEEPSEEK_V3, "factor": None}),
    "default_betas": lambda: gpt_oss({k: v for k, v in GPT_OSS_20B.items() if not k.startswith("beta")}),
    "truncate_true": lambda: gpt_oss({**GPT_OSS_20B, "truncate": True}),
    "narrow_ramp": lambda: gpt_oss({**GPT_OSS_20B, "beta_fast": 2.0, "beta_slow": 2.0}),   # low == high
}


def hf_yarn(make) -> tuple[np.ndarray, float]:
    """transformers' yarn inv_freq and attention scaling, on a config object of its own (it standardizes it)."""
    freq, attention = ROPE_INIT_FUNCTIONS["yarn"](make())
    assert freq.dtype == torch.float32
    return freq.numpy(), attention


@pytest.mark.parametrize("name", [*CONFIGS, *VARIANTS])
def test_yarn_inv_freq_and_attention_factor_match_transformers(name):
    make = {**CONFIGS, **VARIANTS}[name]
    hf = make()
    dim = hf.head_dim                       # DeepSeek: qk_rope_head_dim, what its rotary embedding passes
    assert dim == 64
    rope = rope_from_hf(hf)
    want, attention = hf_yarn(make)
    assert rope.type == "yarn"
    assert rope.attention_factor == attention
    # the blend is transformers' float32 arithmetic op by op: bit-for-bit given torch's theta^(2i/dim) ...
    pos = (rope.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)).numpy()
    np.testing.assert_array_equal(rope_module._yarn(pos, rope, dim), want)
    # ... and inv_freq from theta^(2i/dim) correctly rounded: bit-for-bit wherever torch's float32 power is
    # correctly rounded too, within 1 ulp everywhere (torch's power is not correctly rounded everywhere, and
    # rounds differently on AVX2 and AVX-512 hosts)
    got = inv_freq(rope, dim)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_max_ulp(got, want, maxulp=1)
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    rounded = (np.float64(rope.theta) ** shape.astype(np.float64)).astype(np.float32) == pos
    assert rounded.mean() > 0.5
    np.testing.assert_array_equal(got[rounded], want[rounded])


def test_yarn_fields_from_real_configs():
    v3, lite, oss = (rope_from_hf(make()) for make in CONFIGS.values())
    assert (v3.theta, v3.factor, v3.beta_fast, v3.beta_slow, v3.mscale, v3.mscale_all_dim, v3.truncate) == \
        (10000.0, 40.0, 32.0, 1.0, 1.0, 1.0, True)
    assert v3.original_max_position_embeddings == 4096 and v3.attention_factor == 1.0
    assert (lite.mscale, lite.mscale_all_dim, lite.attention_factor) == (0.707, 0.707, 1.0)
    assert (oss.theta, oss.factor, oss.truncate, oss.mscale, oss.mscale_all_dim) == (150000.0, 32.0, False, None, None)
    assert oss.attention_factor == pytest.approx(0.1 * np.log(32.0) + 1.0, rel=1e-15)
    assert rope_from_hf(VARIANTS["no_factor"]()).factor == 163840 / 4096


def test_yarn_from_old_style_config_fields():
    """A transformers 4 style config: `rope_scaling` with "type", `rope_theta` beside it, the original length
    beside it too (transformers 5 moves it into the rope parameters)."""
    scaling = {k: v for k, v in DEEPSEEK_V3.items() if k != "original_max_position_embeddings"}
    old = SimpleNamespace(rope_scaling=scaling, rope_theta=10000, max_position_embeddings=163840,
                          original_max_position_embeddings=4096)
    assert rope_from_hf(old) == rope_from_hf(deepseek_v3())
    old_oss = SimpleNamespace(rope_scaling=dict(GPT_OSS_20B), rope_theta=150000, max_position_embeddings=131072)
    assert rope_from_hf(old_oss) == rope_from_hf(gpt_oss())


def test_yarn_refuses_unknown_keys():
    with pytest.raises(UnsupportedConfigError, match="beta_medium"):
        rope_from_hf(SimpleNamespace(rope_scaling={**GPT_OSS_20B, "beta_medium": 4.0}, rope_theta=150000))


@pytest.mark.parametrize("name", [*CONFIGS, "mscale_only"])
def test_yarn_softmax_scale_matches_transformers(name):
    hf = {**CONFIGS, **VARIANTS}[name]()
    scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5 if name.startswith("deepseek") else hf.head_dim ** -0.5
    rope = rope_from_hf(hf)
    assert yarn_softmax_scale(rope, scale) == yarn_apply_mscale(hf.rope_parameters, scale)
    if name == "deepseek-v3":
        assert yarn_softmax_scale(rope, scale) == pytest.approx(scale * (0.1 * np.log(40) + 1) ** 2, rel=1e-15)
    if name == "gpt-oss-20b":               # no mscale_all_dim: the softmax scale is left alone
        assert yarn_softmax_scale(rope, scale) == scale


def test_yarn_softmax_scale_without_scaling():
    assert yarn_softmax_scale(None, 0.125) == 0.125
    assert yarn_softmax_scale(RopeConfig(), 0.125) == 0.125 == yarn_apply_mscale({"rope_type": "default"}, 0.125)


def random_qk(seed: int, dim: int = 64, batch: int = 2, heads: int = 3, tokens: int = 7):
    """q[B, H, T, D], k[B, 1, T, D] (DeepSeek's shared rope key) and positions[B, T] reaching past 4096."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(batch, heads, tokens, dim, generator=g), torch.randn(batch, 1, tokens, dim, generator=g)
    positions = torch.randint(0, 20000, (batch, tokens), generator=g)
    return q, k, positions


def ours(x: torch.Tensor, positions: torch.Tensor, rope: RopeConfig, interleaved: bool, freq) -> np.ndarray:
    """tp_jax's rotation of torch's x[B, H, T, D] by the reference's own inverse frequencies `freq` (what is under
    test is the rotation; inv_freq is checked above, and 1 ulp of a frequency moves the angle at position 20000 by
    ~1e-3), returned as [B, H, T, D]."""
    freq = tuple(freq.tolist())
    out = apply_rope(jnp.asarray(x.numpy().transpose(0, 2, 1, 3)), jnp.asarray(positions.numpy()), freq,
                     rope.attention_factor, interleaved=interleaved)
    return np.asarray(out).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_interleaved_apply_rope_matches_deepseek_v3(name):
    hf = CONFIGS[name]()
    rope = rope_from_hf(hf)
    q, k, positions = random_qk(0)
    rotary = DeepseekV3RotaryEmbedding(hf)
    cos, sin = rotary(q, positions)
    freq = rotary.inv_freq.numpy()
    np.testing.assert_array_max_ulp(inv_freq(rope, 64), freq, maxulp=1)
    want_q, want_k = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    np.testing.assert_allclose(ours(q, positions, rope, True, freq), want_q.numpy(), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(ours(k, positions, rope, True, freq), want_k.numpy(), rtol=1e-5, atol=2e-6)
    plain_q, _ = apply_rotary_pos_emb(q, k, cos, sin)       # and the rotate_half layout is unchanged
    np.testing.assert_allclose(ours(q, positions, rope, False, freq), plain_q.numpy(), rtol=1e-5, atol=2e-6)


def test_interleaved_equals_complex_rotation_of_deepseek_v2():
    """DeepSeek-V2 rotates each pair (x0 + i x1) in place: another order of the same dims, the same q . k."""
    hf = deepseek_v2_lite()
    rope = rope_from_hf(hf)
    q, k, positions = random_qk(1)
    rotary = DeepseekV2RotaryEmbedding(hf)
    want_q, want_k = apply_rotary_emb(q, k, rotary(q, positions))
    freq = rotary.inv_freq.numpy()
    got_q, got_k = ours(q, positions, rope, True, freq), ours(k, positions, rope, True, freq)
    deinterleave = np.r_[0:64:2, 1:64:2]
    np.testing.assert_allclose(got_q, want_q.numpy()[..., deinterleave], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(got_k, want_k.numpy()[..., deinterleave], rtol=1e-5, atol=2e-6)
    scores = np.einsum("bhqd,bhkd->bhqk", got_q, np.broadcast_to(got_k, got_q.shape))
    want_scores = torch.einsum("bhqd,bhkd->bhqk", want_q, want_k.expand_as(want_q)).numpy()
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=2e-5)


def test_interleaved_is_rotate_half_of_the_deinterleaved_dims_and_keeps_the_rest():
    """Partial rotary (64 of 80 dims): the rotary dims de-interleaved then rotated as usual, bit for bit; the 16
    dims past them pass through."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 3, 80)), jnp.float32)
    positions = jnp.asarray(np.random.default_rng(3).integers(0, 9000, (2, 5)), jnp.int32)
    freq = tuple(inv_freq(rope_from_hf(gpt_oss()), 64).tolist())
    order = np.r_[0:64:2, 1:64:2, 64:80]
    got = apply_rope(x, positions, freq, 1.25, interleaved=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(apply_rope(x[..., order], positions, freq, 1.25)))
    np.testing.assert_array_equal(np.asarray(got[..., 64:]), np.asarray(x[..., 64:]))
