"""GRPO with Tunix, its rollouts served by tp_jax, beside Tunix's own (vanilla) rollout; on CPU.

What the script does:
1. writes a tiny random Qwen3 (or Llama 3: `--arch llama`) as a Hugging Face checkpoint, with a character-level
   tokenizer (transformers and tokenizers);
2. for each rollout engine, `tp_jax` (`TpJaxRollout`, an `LLM` on that checkpoint) and `vanilla` (Tunix's
   sampler on the actor model itself): Tunix loads the checkpoint with its own loader as actor and reference, and
   runs its `GRPOLearner` for `--steps` steps; the toy reward is the fraction of the completion's characters
   that are "a";
3. prints per step and engine: the rewards' mean and max, and the seconds the rollout took; then, for the
   tp_jax engine after training, the on-policy check: the rollout's logprobs of the tokens it sampled against
   the trainer's forward on the same weights (Tunix's `compute_per_token_logps` on the actor).

Run:  python examples/tunix_grpo.py [--steps 4] [--arch qwen3|llama]     (needs pip install 'tp-jax[tunix]')
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?"
PROMPTS = ["say a", "aaa", "banana", "the cat", "abc", "hello"]


def write_tiny_checkpoint(path: str, arch: str = "qwen3", seed: int = 0, tied: bool = False) -> str:
    """A tiny random Qwen3 / Llama (2 layers, GQA 4:2; `tied`: one embedding table) with a character tokenizer whose EOS is also its pad
    (as in many Hugging Face tokenizers: a sampled EOS ends the completion, never sits inside it). RoPE theta 1e6:
    Tunix's models apply that whatever their config says (tp_jax.integrations.tunix refuses any other)."""
    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    vocab = {"<eos>": 0, "<bos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                         pad_token="<eos>", unk_token="<unk>").save_pretrained(path)
    name = {"qwen3": "Qwen3", "llama": "Llama"}[arch]
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=0, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    torch.manual_seed(seed)
    getattr(transformers, f"{name}ForCausalLM")(cfg).eval().save_pretrained(path)
    return path


def reward_a(prompts, completions, **_):
    """The fraction of the completion's characters that are "a" (its special tokens' text left out)."""
    texts = [c.replace("<eos>", "").replace("<bos>", "") for c in completions]
    return [t.count("a") / max(len(t), 1) for t in texts]


def grpo(path: str, engine: str, steps: int, log: list) -> object:
    """Tunix's GRPOLearner for `steps` steps with rollouts from `engine`; its RLCluster, once trained."""
    import optax
    import transformers
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from tp_jax.integrations.tunix import TpJaxRollout, tunix_model

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)          # Tunix shards under Auto axes
    actor, reference = tunix_model(path, mesh=mesh), tunix_model(path, mesh=mesh)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rollout_engine = ("vanilla" if engine == "vanilla" else
                      functools.partial(TpJaxRollout, model_path=path, dtype="float32", max_model_len=64,
                                        progress=False))
    config = rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine=rollout_engine,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.adam(1e-2), eval_every_n_steps=1000,
                                            max_steps=steps),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=16,
                                                  temperature=1.0, top_p=1.0, kv_cache_size=64, seed=0))
    cluster = rl.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=config)
    generate = cluster.rollout.generate

    def timed(prompts, rollout_config, **kw):                       # seconds per rollout, per engine
        start = time.perf_counter()
        out = generate(prompts, rollout_config, **kw)
        jax.block_until_ready([jnp.asarray(t) for t in out.tokens])
        log.append({"engine": engine, "seconds": time.perf_counter() - start})
        return out

    def reward(prompts, completions, **kw):
        rewards = reward_a(prompts, completions)
        log[-1].update(step=sum(r["engine"] == engine for r in log), mean=float(np.mean(rewards)),
                       max=float(np.max(rewards)))
        r = log[-1]
        sync = f"  weight sync before it {syncs[-1]:.2f} s" if syncs else ""
        print(f"step {r['step']:2d}  {engine:8s}  reward mean {r['mean']:.3f}  max {r['max']:.3f}  "
              f"rollout {r['seconds']:.2f} s{sync}", flush=True)
        return rewards

    update = cluster.rollout.update_params

    def timed_update(params, filter_types=None):                    # Tunix's weight sync after each step
        start = time.perf_counter()
        update(params, filter_types)
        syncs.append(time.perf_counter() - start)

    syncs = []
    cluster.rollout.generate, cluster.rollout.update_params = timed, timed_update
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=[reward],
                                       algo_config=grpo_learner.GRPOConfig(num_generations=4, num_iterations=1,
                                                                           beta=0.04, epsilon=0.2))
    batches = [{"prompts": np.array([PROMPTS[(2 * i) % len(PROMPTS)], PROMPTS[(2 * i + 1) % len(PROMPTS)]])}
               for i in range(steps)]
    learner.train(batches)
    return cluster


def on_policy_check(cluster) -> dict:
    """The tp_jax rollout's logprobs of tokens it samples against Tunix's forward of the trained actor."""
    from flax import nnx
    from tunix.rl.rollout import base_rollout

    from tp_jax.integrations.tunix import deviation, on_policy_logprobs
    actor = cluster.actor_trainer.model
    cluster.rollout.update_params(nnx.state(actor, nnx.Param))
    config = base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=16, temperature=1.0, seed=1)
    lp = on_policy_logprobs(cluster.rollout, actor, PROMPTS * 2, config)
    return deviation(lp["sampled"], lp["trainer"], lp["mask"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    ap.add_argument("--engines", nargs="+", default=["tp_jax", "vanilla"], choices=["tp_jax", "vanilla"])
    args = ap.parse_args()
    path = write_tiny_checkpoint(os.path.join(tempfile.mkdtemp(prefix="tunix_grpo_"), args.arch), args.arch)
    log, clusters = [], {}
    for engine in args.engines:
        clusters[engine] = grpo(path, engine, args.steps, log)
    for engine in args.engines:
        rows = [r for r in log if r["engine"] == engine]
        print(f"{engine:8s}  rollouts {len(rows)}  seconds per rollout: first {rows[0]['seconds']:.2f}, "
              f"median of the rest {np.median([r['seconds'] for r in rows[1:]] or [np.nan]):.2f}  "
              f"reward mean first {rows[0].get('mean', np.nan):.3f} -> last {rows[-1].get('mean', np.nan):.3f}")
    if "tp_jax" in clusters:
        check = on_policy_check(clusters["tp_jax"])
        print(f"on-policy (tp_jax rollout vs Tunix compute_per_token_logps, float32, {check['tokens']} tokens): "
              f"max |dlogp| {check['max_abs']:.3g}, max |exp(dlogp) - 1| {check['ratio_dev']:.3g}, "
              f"bitwise {check['bitwise']}")


if __name__ == "__main__":
    main()
