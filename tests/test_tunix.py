"""Tunix's rollout on tp_jax (tp_jax/integrations/tunix.py) against real references: Tunix's models, loaded by
Tunix's own loader, pushed into the engine with `update_params`; the engine's logprobs against Tunix's
`compute_per_token_logps` on the same weights; greedy tokens against transformers and Tunix's vanilla sampler;
Tunix's GRPO learner syncing its weights into the engine; bad inputs refused by name. Needs Tunix: `make test`
installs it (the Makefile's $(TESTING), docs/rollouts.md); skipped only where google-tunix is not installed at all,
so that a dependency missing from tests/tunix-requirements.txt fails here instead of skipping the file."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if importlib.util.find_spec("tunix") is None:
    pytest.skip("Tunix is not installed (make test installs it; or pip install 'tp-jax[tunix]')",
                allow_module_level=True)
import tunix  # noqa: E402,F401  (installed: a missing dependency of it is an error, not a skip)

from flax import nnx  # noqa: E402

from tp_jax.integrations import tunix as tx  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
PROMPTS = ["say a", "banana", "what is 2 and 2?", "x"]
F32_BOUND = 2e-6          # float32: a few ulps of |logp| ~ 4 (measured 4.8e-7: docs/rollouts.md, "Tunix")


def _example():
    spec = importlib.util.spec_from_file_location("tunix_grpo", os.path.join(ROOT, "examples", "tunix_grpo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """{arch: (checkpoint A, checkpoint B)}: two tiny random models of the same architecture and config."""
    root, write = tmp_path_factory.mktemp("tunix"), _example().write_tiny_checkpoint
    out = {arch: (write(str(root / f"{arch}_a"), arch, seed=0), write(str(root / f"{arch}_b"), arch, seed=1))
           for arch in ("qwen3", "llama")}
    out["qwen3_tied"] = tuple(write(str(root / f"qwen3_tied_{s}"), "qwen3", seed=s, tied=True) for s in (2, 3))
    return out


def tokenizer(path):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(path)


def rollout_config(**kw):
    from tunix.rl.rollout import base_rollout
    return base_rollout.RolloutConfig(**{"max_tokens_to_generate": 10, "max_prompt_length": 16, **kw})


def hf_greedy(path, ids, n):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_every_tunix_param_maps_to_a_checkpoint_tensor(ckpt):
    """Tunix's loader table, inverted, names each Qwen3 / Llama 3 param (tied embeddings too) as the checkpoint
    does, its values bit for bit in the checkpoint's layout."""
    for arch, (a, _) in ckpt.items():
        actor = tx.tunix_model(a)
        shapes = tx.checkpoint_shapes(a)
        arrays = tx.checkpoint_arrays(nnx.state(actor, nnx.Param), tx.CheckpointNames(actor), shapes)
        assert sorted(arrays) == sorted(shapes), arch
        assert all(tuple(x.shape) == shapes[k] for k, x in arrays.items()), arch
        from safetensors.numpy import load_file
        stored = load_file(os.path.join(a, "model.safetensors"))
        assert all(np.array_equal(np.asarray(arrays[k]), stored[k]) for k in shapes), arch


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_update_params_then_greedy_equals_transformers_and_tunix(ckpt, arch):
    """The engine starts from checkpoint B; the actor holds A: after update_params (at construction) the greedy
    tokens are transformers' on A, and Tunix's vanilla sampler's on the actor. Engine at tp 2, actor on one
    device."""
    from tunix.rl.rollout import base_rollout, vanilla_rollout
    a, b = ckpt[arch]
    actor = tx.tunix_model(a)
    rollout = tx.TpJaxRollout(actor, tokenizer(a), model_path=b, dtype="float32", tensor_parallel_size=2,
                              max_model_len=64, progress=False)
    assert rollout.last_update["device_bytes"] > 0
    greedy = rollout_config(temperature=0.0, top_p=None)
    ours = rollout.generate(PROMPTS, greedy)
    n = greedy.max_tokens_to_generate
    for ids, toks in zip(ours.left_padded_prompt_tokens, ours.tokens):
        prompt = ids[int(np.argmax(ids != rollout.pad_id())):].tolist()
        ref = hf_greedy(a, prompt, n)
        eos = ref.index(rollout.eos_id()) + 1 if rollout.eos_id() in ref else n
        assert toks.tolist() == ref[:eos]                               # an EOS ends it and is kept
    cfg = actor.config
    vanilla = vanilla_rollout.VanillaRollout(actor, tokenizer(a), base_rollout.CacheConfig(
        cache_size=64, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
    theirs = vanilla.generate(PROMPTS, greedy)                          # Tunix's sampler drops the EOS
    assert [t.tolist()[:len(v)] for t, v in zip(ours.tokens, theirs.tokens)] == [v.tolist() for v in theirs.tokens]
    assert np.array_equal(ours.left_padded_prompt_tokens, theirs.left_padded_prompt_tokens)


def test_tied_embeddings_serve_the_actors_table(ckpt):
    """Qwen3 with one embedding table, as Qwen3-0.6B (no lm_head param in Tunix, no lm_head.weight in the
    checkpoint): the engine, started on other weights, gives Tunix's forward's logits after update_params."""
    a, b = ckpt["qwen3_tied"]
    actor = tx.tunix_model(a)
    assert actor.config.use_tied_embedding and not hasattr(actor, "lm_head")
    rollout = tx.TpJaxRollout(actor, tokenizer(a), model_path=b, dtype="float32", max_model_len=64, progress=False)
    ids = [1, 5, 6, 7, 8]
    logits = actor(jnp.asarray([ids]), positions=jnp.arange(5)[None], cache=None,
                   attention_mask=jnp.tril(jnp.ones((1, 5, 5), bool)))[0]
    assert np.abs(rollout.llm.get_logits([ids]) - np.asarray(logits)).max() < 1e-5


def test_logprobs_equal_the_trainers_forward_after_an_update(ckpt):
    """The actor's weights moved by a step of noise, pushed with update_params: the tokens the rollout samples get
    the logprobs Tunix's compute_per_token_logps gives on the actor (float32, within F32_BOUND), and the engine's
    own scoring (get_per_token_logps) gives back the sampled logprobs bit for bit."""
    a, _ = ckpt["qwen3"]
    actor = tx.tunix_model(a)
    rollout = tx.TpJaxRollout(actor, tokenizer(a), model_path=a, dtype="float32", max_model_len=64, progress=False)
    state = nnx.state(actor, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(state))))
    nnx.update(actor, jax.tree.map(lambda x: x + 0.02 * jax.random.normal(next(keys), x.shape), state))
    rollout.update_params(nnx.state(actor, nnx.Param))
    lp = tx.on_policy_logprobs(rollout, actor, PROMPTS * 2, rollout_config(temperature=1.0, seed=7))
    assert lp["mask"].sum() > 40
    trainer = tx.deviation(lp["sampled"], lp["trainer"], lp["mask"])
    assert trainer["max_abs"] < F32_BOUND and trainer["ratio_dev"] < F32_BOUND
    assert tx.deviation(lp["sampled"], lp["scored"], lp["mask"])["bitwise"]
    assert tx.deviation(lp["sampled"], lp["get_logits"], lp["mask"])["max_abs"] < F32_BOUND
    assert np.all(lp["scored"][~lp["mask"]] == 0)


def test_grpo_learner_syncs_its_weights_into_the_engine(ckpt):
    """Two steps of Tunix's GRPOLearner with the rollout: Tunix sees separate weights (model() is None) and calls
    update_params after each step; the engine then serves the trained actor's weights exactly."""
    import functools

    import optax
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner
    a, _ = ckpt["qwen3"]
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    config = rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine=functools.partial(tx.TpJaxRollout, model_path=a, dtype="float32", max_model_len=64,
                                         progress=False),
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.adam(1e-2), eval_every_n_steps=1000, max_steps=2),
        rollout_config=rollout_config(temperature=1.0, seed=0, kv_cache_size=64))
    cluster = rl.RLCluster(actor=tx.tunix_model(a, mesh=mesh), reference=tx.tunix_model(a, mesh=mesh),
                           tokenizer=tokenizer(a), cluster_config=config)
    updates = []
    update = cluster.rollout.update_params
    cluster.rollout.update_params = lambda p, f=None: (updates.append(1), update(p, f))
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=[_example().reward_a],
                                       algo_config=grpo_learner.GRPOConfig(num_generations=2, beta=0.04))
    learner.train([{"prompts": np.array(PROMPTS[:2])}] * 2)
    assert len(updates) == 2
    trained = cluster.actor_trainer.model
    ids = [1, 5, 6, 7]
    logits = np.asarray(trained(jnp.asarray([ids]), positions=jnp.arange(4)[None], cache=None,
                                attention_mask=jnp.tril(jnp.ones((1, 4, 4), bool)))[0])
    assert np.abs(cluster.rollout.llm.get_logits([ids]) - logits).max() < 1e-4


def test_bad_inputs_are_named(ckpt, tmp_path):
    """An unmapped param, LoRA-only params, a Tunix model of another config, a checkpoint Tunix runs differently:
    each refused with the problem and the fix; a refused update leaves the old weights served."""
    a, _ = ckpt["qwen3"]
    actor = tx.tunix_model(a)
    rollout = tx.TpJaxRollout(actor, tokenizer(a), model_path=a, dtype="float32", max_model_len=64, progress=False)
    before = rollout.llm.get_logits([[1, 5, 6]])
    params = nnx.to_pure_dict(nnx.state(actor, nnx.Param))
    with pytest.raises(tx.TunixMappingError, match=r"have no checkpoint name.*'extra\.w'"):
        rollout.update_params({**params, "extra": {"w": jnp.zeros(3)}})
    with pytest.raises(tx.TunixMappingError, match="merge the adapters"):
        rollout.update_params(params, filter_types=(nnx.LoRAParam,))
    import dataclasses
    wider = actor.config
    other = type(actor)(dataclasses.replace(wider, hidden_dim=wider.hidden_dim * 2), rngs=nnx.Rngs(0))
    with pytest.raises(Exception, match=r"mlp\.(gate|up|down)_proj\.weight"):
        rollout.update_params(nnx.state(other, nnx.Param))
    assert np.array_equal(rollout.llm.get_logits([[1, 5, 6]]), before)
    from tests.tiny_models import make_checkpoint
    with pytest.raises(ValueError, match="RoPE theta 10000.0.*applies theta 1e\\+06"):
        tx.tunix_config(make_checkpoint("gqa", str(tmp_path)))
    with pytest.raises(ValueError, match="give model_path .* or llm"):
        tx.TpJaxRollout(actor, tokenizer(a))
    with pytest.raises(ValueError, match=r"prompt 0 is all padding"):
        rollout.get_per_token_logps(jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 2), jnp.int32))
