"""DeepSeek-V3 vs transformers (sigmoid scores with a correction bias, groups, YaRN, interleaved rotary) over the
meshes; multi-head latent attention's two forms against each other and its cache's bytes; Orbax round trip."""

import numpy as np
import pytest

from tests.flagship_models import GREEDY, PROMPTS, TOL, check, hf_config, mesh_cases, write_references
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams


@pytest.fixture(scope="session")
def ds3_references(tmp_path_factory):
    return write_references(str(tmp_path_factory.mktemp("deepseek_v3")), ("ds3",))


@pytest.mark.parametrize("name,dp,pp,tp,ep", mesh_cases(("ds3",)))
def test_deepseek_v3_matches_transformers(ds3_references, name, dp, pp, tp, ep):
    check(ds3_references, name, dp, pp, tp, ep)


@pytest.mark.parametrize("tp", [1, 2])
def test_absorbed_decode_equals_expanded_prefill(ds3_references, tp):
    """MLA on one sequence: the engine's paged steps attend absorbed (prompt tokens through prefill, then one token a
    step through decode), `get_logits` expanded; the log-probabilities of the same tokens agree within 5e-4."""
    import jax
    llm = LLM(ds3_references["ds3"][0], tensor_parallel_size=tp, progress=False, compile_cache=False)
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True,
                                                logprobs=0, prompt_logprobs=0))[0]
    seq = prompt + list(out.outputs[0].token_ids)
    expanded = np.asarray(jax.nn.log_softmax(llm.get_logits(np.asarray([seq]))[0].astype(np.float32), axis=-1))
    prefill = [lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], prompt[1:])]
    assert np.abs(np.asarray(prefill) - expanded[np.arange(len(prompt) - 1), prompt[1:]]).max() <= TOL
    decode = [lp[tok].logprob for lp, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    at = np.arange(len(prompt) - 1, len(seq) - 1)
    assert np.abs(np.asarray(decode) - expanded[at, seq[len(prompt):]]).max() <= TOL


def test_latent_cache_bytes_per_token():
    """The latent pool caches r + rope values per token and layer on each tp rank (replicated over tp), no values;
    the same model with standard attention would cache its tp share of the heads' keys (nope + rope) and values (v):
    at these tiny sizes, per layer, 240 bytes at tp = 1 (3.75x the latent's 64) and 60 at tp = 4 (replication's
    cost)."""
    import jax
    import jax.numpy as jnp
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.config import config_from_hf
    from tp_jax.parallel.mesh import make_mesh
    cfg = config_from_hf(hf_config("ds3"))
    for tp in (1, 2, 4):
        layout = abstract_model(cfg, make_mesh(tp=tp, devices=jax.devices()[:tp]), dtype=jnp.float32).kv_layout()
        assert (layout.kv_heads, layout.head_dim, layout.value_dim) == (tp, 12 + 4, 0)
        assert layout.bytes_per_token(1, tp) == cfg.num_layers * (12 + 4) * 4
        assert (cfg.num_heads // tp) * (6 + 4 + 5) * 4 == {1: 240, 2: 120, 4: 60}[tp]        # standard, a layer


def test_orbax_convert_and_restore(ds3_references, tmp_path):
    """Converted to Orbax, MLA's projections and norms and the correction bias round-trip (EP layout)."""
    from tp_jax.loaders.orbax import convert_to_orbax
    out = str(tmp_path / "orbax")
    convert_to_orbax(ds3_references["ds3"][0], out)
    check(ds3_references, "ds3", 1, 1, 2, True, path=out)
