"""Tunix (google-tunix) on tp_jax: its RL learners' rollouts served by an `LLM` (docs/rollouts.md, "Tunix").

    rollout = functools.partial(TpJaxRollout, model_path=path, dtype="float32")     # engine arguments
    cluster = rl_cluster.RLCluster(actor=actor, ..., cluster_config=rl_cluster.ClusterConfig(
        rollout_engine=rollout, ...))                                 # Tunix builds it with its actor model

* `TpJaxRollout` — Tunix's `BaseRollout` (tunix/rl/rollout/base_rollout.py) on an `LLM`: `generate` (the
  conventions of Tunix's vLLM rollout), `get_per_token_logps` (the engine scores prompt + completion),
  `update_params` (a Tunix model's params, mapped, into `LLM.update_weights`), `pad_id`, `eos_id`, `model`.
* `checkpoint_arrays(params, CheckpointNames(model), shapes)` — a Tunix model's params under the checkpoint's
  names and layouts. The names and transforms are Tunix's own: the table its safetensors loader reads a Hugging
  Face checkpoint with (`tunix.models.<family>.params._get_key_and_transform_mapping`), inverted, so nothing is
  written twice and a name Tunix maps is mapped here the same way.
* `on_policy_logprobs(rollout, actor, prompts, config)` / `deviation(a, b, mask)` — the sampled tokens' logprobs
  four ways (as sampled, the engine's scoring, `LLM.get_logits`, Tunix's `compute_per_token_logps`), compared.
* `tunix_config(path)` / `tunix_model(path)` — Tunix's ModelConfig and model (Qwen3, Llama 3) of a Hugging
  Face checkpoint, loaded by Tunix's own loader; a config Tunix would run differently from the checkpoint's
  architecture (a RoPE it does not apply, biases it does not hold) is refused.

Imported only when Tunix is installed: `pip install 'tp-jax[tunix]'`.
"""

from __future__ import annotations

import importlib
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
    from tunix.generate import tokenizer_adapter
    from tunix.rl.rollout import base_rollout
except ImportError as e:                                            # pragma: no cover - depends on the install
    raise ImportError(f"tp_jax.integrations.tunix needs Tunix (google-tunix), which is not installed ({e}); "
                      f"install the extra: pip install 'tp-jax[tunix]'") from e

from tp_jax.serving.sampling import SamplingParams

FAMILIES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama3"}     # HF architecture -> Tunix model package
TUNIX_ROPE_THETA = 1_000_000     # tunix 0.1.7's Qwen3 and Llama3 call apply_rope without the config's rope_theta


class TunixMappingError(ValueError):
    """Params that do not map onto the checkpoint's tensors (named, with the fix); nothing was changed."""


# --- Tunix's loader table, inverted -----------------------------------------------------------------------------

def _loader_table(model) -> dict:
    """{HF name regex: (Tunix name template, (permute, reshape) | None)}: Tunix's own loader table for `model`'s
    family (`tunix.models.qwen3.model.Qwen3` -> `tunix.models.qwen3.params`)."""
    package = type(model).__module__.rsplit(".", 1)[0]
    try:
        params = importlib.import_module(package + ".params")
        table = params._get_key_and_transform_mapping(model.config)
    except (ImportError, AttributeError) as e:
        raise TunixMappingError(f"{type(model).__name__}: Tunix has no safetensors loader table for it "
                                f"({package}.params._get_key_and_transform_mapping: {e}); pass params already named "
                                f"as the checkpoint names its tensors (Hugging Face names, [out, in] layouts)") from None
    return table


def _inverse(hf_pattern: str, tunix_template: str) -> tuple[re.Pattern, str] | None:
    """(a regex over Tunix names, the checkpoint name's format template) for one row of the loader table (the HF
    regex's groups are the Tunix template's \\1, \\2...), or None for a row that drops a group (not invertible)."""
    groups = re.findall(r"\(([^()]*)\)", hf_pattern)              # the HF regex's groups, in order
    pieces = re.split(r"\\(\d)", tunix_template)                # literal, group number, literal, ...
    numbers = [int(p) for p in pieces[1::2]]
    if sorted(set(numbers)) != list(range(1, len(groups) + 1)):
        return None
    regex = "".join(re.escape(p) if i % 2 == 0 else f"({groups[int(p) - 1]})" for i, p in enumerate(pieces))
    literals = re.split(r"\([^()]*\)", hf_pattern)                # the HF regex around its groups
    template = literals[0] + "".join("{%d}" % numbers.index(g + 1) + lit for g, lit in enumerate(literals[1:]))
    return re.compile(regex + r"\Z"), re.sub(r"\\(.)", r"\1", template)


class CheckpointNames:
    """Tunix name -> (checkpoint name, (permute, reshape) | None), from Tunix's loader table for a model."""

    def __init__(self, model):
        self.model = type(model).__name__
        rows = [(_inverse(hf, tunix), transform) for hf, (tunix, transform) in _loader_table(model).items()]
        self.rows = [(*row, transform) for row, transform in rows if row is not None]

    def __call__(self, name: str):
        for regex, template, transform in self.rows:
            m = regex.match(name)
            if m:
                return template.format(*m.groups()), transform
        return None


def flat_params(params) -> dict[str, object]:
    """{"layers.0.attn.q_proj.w": array} of an nnx State (its Params only) or a nested dict of arrays."""
    if isinstance(params, nnx.State):
        return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(params)
                if isinstance(v, nnx.Param) or not isinstance(v, nnx.Variable)}
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
        out[".".join(str(k) for k in keys if k != "value")] = x
    return out


def _to_checkpoint_layout(x, transform, shape: tuple[int, ...]):
    """Undo the loader's `v.transpose(permute).reshape(reshape)` for a tensor whose checkpoint shape is `shape`."""
    if transform is None:
        return x
    permute, reshape = transform
    if permute is None:
        return x.reshape(shape)
    permuted = tuple(shape[p] for p in permute)
    return jnp.transpose(x.reshape(permuted) if reshape else x, np.argsort(permute))


def checkpoint_arrays(params, names: CheckpointNames, shapes: dict[str, tuple[int, ...]]) -> dict[str, object]:
    """{checkpoint name: array in the checkpoint's layout} of a Tunix model's params (`shapes`: the checkpoint's
    tensor shapes, which say how a reshaped [D, N, H] goes back to [N * H, D]). The arrays stay where they are
    (transposes and reshapes run on their devices). Raises TunixMappingError naming an unmapped param."""
    out, unmapped = {}, []
    for name, x in flat_params(params).items():
        mapped = names(name)
        if mapped is None:
            unmapped.append(name)
            continue
        target, transform = mapped
        if target not in shapes:
            raise TunixMappingError(f"update_params: {names.model} param {name!r} maps to {target!r}, which the "
                                    f"engine's checkpoint does not have; serve a checkpoint of the same architecture "
                                    f"and config as the Tunix model")
        out[target] = _to_checkpoint_layout(x, transform, shapes[target])
    if unmapped:
        lora = [n for n in unmapped if "lora" in n]
        fix = ("merge the LoRA adapters into the base weights first (the engine serves merged weights)" if lora else
               "its loader table has no row for them")
        raise TunixMappingError(f"update_params: {len(unmapped)} {names.model} param(s) have no checkpoint name, "
                                f"e.g. {unmapped[:3]}: {fix}; nothing was changed")
    return out


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of the checkpoint at `path` (headers only)."""
    from tp_jax.loaders.sources import open_checkpoint
    source = open_checkpoint(path).source
    return {k: tuple(source.get(k).shape) for k in source.keys()}


# --- Tunix's model of a Hugging Face checkpoint ------------------------------------------------------------------

def _family(cfg: dict, path: str) -> str:
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in FAMILIES:
        raise ValueError(f"tunix_config: {path!r} is a {arch}; the Tunix models mapped here are "
                         f"{', '.join(FAMILIES)} (tunix.models.qwen3, tunix.models.llama3)")
    return FAMILIES[arch]


def _refuse_what_tunix_runs_differently(cfg: dict, path: str) -> None:
    """Tunix 0.1.7's Qwen3 and Llama3 apply RoPE with theta 1e6 and no scaling whatever their config says, and hold
    no attention or MLP biases: such a checkpoint would be run one way by the trainer and another by the engine."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if float(theta) != TUNIX_ROPE_THETA or kind != "default":
        problems.append(f"RoPE theta {theta} / type {kind!r} (Tunix's model applies theta {TUNIX_ROPE_THETA:.0e}, "
                        f"no scaling, whatever its ModelConfig says)")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if cfg.get(flag):
            problems.append(f"{flag}=True (Tunix's model has no such weights or window)")
    if cfg.get("num_experts"):
        problems.append("experts (Tunix's Qwen3-MoE stacks them; not mapped here)")
    if problems:
        raise ValueError(f"tunix_config: {path!r}: {'; '.join(problems)}: Tunix's forward would differ from the "
                         f"checkpoint's architecture (and from tp_jax's)")


def tunix_config(path: str, dtype=jnp.float32):
    """Tunix's ModelConfig (tunix.models.qwen3 / llama3) for the Hugging Face checkpoint at `path`."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    family = _family(cfg, path)
    _refuse_what_tunix_runs_differently(cfg, path)
    model_lib = importlib.import_module(f"tunix.models.{family}.model")
    heads = cfg["num_attention_heads"]
    common = dict(num_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"], embed_dim=cfg["hidden_size"],
                  hidden_dim=cfg["intermediate_size"], num_heads=heads,
                  head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                  num_kv_heads=cfg.get("num_key_value_heads", heads), rope_theta=TUNIX_ROPE_THETA,
                  norm_eps=cfg["rms_norm_eps"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    if family == "qwen3":
        return model_lib.ModelConfig(**common, use_tied_embedding=tied, dtype=dtype, param_dtype=dtype)
    return model_lib.ModelConfig(**common, weight_tying=tied)


def tunix_model(path: str, dtype=jnp.float32, mesh=None):
    """Tunix's model of the Hugging Face checkpoint at `path`, loaded by Tunix's own safetensors loader (params
    and, for Qwen3, activations in `dtype`)."""
    config = tunix_config(path, dtype)
    family = type(config).__module__.split(".")[-2]
    params = importlib.import_module(f"tunix.models.{family}.params")
    return params.create_model_from_safe_tensors(path, config, mesh=mesh, dtype=dtype)


# --- the rollout -----------------------------------------------------------------------------------------------

def _seed(seed) -> int | None:
    """Tunix's RolloutConfig.seed (None, an int, a jax.Array: an int or a PRNG key's data) as an int."""
    if seed is None:
        return None
    data = np.asarray(jax.random.key_data(seed) if jnp.issubdtype(getattr(seed, "dtype", np.int32),
                                                                    jax.dtypes.prng_key) else seed)
    return int(data.ravel()[-1]) if data.size else None


def _engine_layout(mesh, config, engine_args: dict) -> dict:
    """The engine's devices from Tunix's rollout mesh (its devices; tp = the config's tensor_parallel_size, else
    all of them over data_parallel_size), unless the engine arguments say."""
    if mesh is None or "devices" in engine_args or "tensor_parallel_size" in engine_args:
        return engine_args
    devices = list(mesh.devices.flat)
    dp = config.data_parallel_size if config is not None and config.data_parallel_size > 0 else 1
    tp = config.tensor_parallel_size if config is not None and config.tensor_parallel_size > 0 else len(devices) // dp
    return {**engine_args, "devices": devices[:dp * tp], "tensor_parallel_size": tp, "data_parallel_size": dp}


class TpJaxRollout(base_rollout.BaseRollout):
    """Tunix's `BaseRollout` on a tp_jax `LLM`.

    `TpJaxRollout(rollout_actor, tokenizer, mesh, rollout_config, model_path=..., **engine_args)`: Tunix's
    RLCluster builds it with the four (pass `functools.partial(TpJaxRollout, model_path=..., ...)` as
    `ClusterConfig.rollout_engine`); `model_path` is a Hugging Face checkpoint of the actor's architecture and
    config (its weights are replaced by the actor's at once), `engine_args` are `LLM`'s (or give `llm=`).

    * `generate` follows Tunix's vLLM rollout: prompts tokenized by Tunix's tokenizer (BOS added once), left-padded
      to `max_prompt_length` (or the next power of two above the longest); completions stop at
      `rollout_config.eos_tokens` (else the tokenizer's EOS), which they keep, as vLLM's do; `logprobs`
      (with `return_logprobs`) are the sampled tokens' raw logprobs (before temperature); `seed`: request i of
      call c draws with seed + c * len(prompts) + i (None: the engine's own randomness).
    * `get_per_token_logps(prompt_tokens, completion_tokens)` — [B, C] float32: the engine scores each prompt +
      completion as one request (`prompt_logprobs`): bit for bit the logprobs it sampled them with (the
      batch-invariant default). The prompt's left padding (`pad_id`) is left out; completion positions after
      the last non-pad token are 0 (Tunix's loss masks them).
    * `update_params(params)` — the actor's params (an nnx State or dict under Tunix's names) through Tunix's
      loader table, inverted, into `LLM.update_weights`: resharded on device, swapped between steps.
    """

    def __init__(self, rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None, *,
                 model_path: str | None = None, llm=None, **engine_args):
        from tp_jax.serving.llm import LLM
        if (llm is None) == (model_path is None):
            raise ValueError("TpJaxRollout: give model_path (a checkpoint of the actor's architecture, with engine "
                             "arguments) or llm (an LLM already built), exactly one")
        self.llm = llm if llm is not None else LLM(model_path, **_engine_layout(mesh, rollout_config, engine_args))
        tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.tokenizer = (tokenizer if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter)
                          else tokenizer_adapter.TokenizerAdapter(tokenizer))
        self._actor = rollout_actor
        self._names = CheckpointNames(rollout_actor) if rollout_actor is not None else None
        self._shapes = checkpoint_shapes(self.llm.model_path)
        self._calls = 0
        self.last_update: dict | None = None
        if rollout_actor is not None:                                    # serve the actor's weights from the start
            self.update_params(nnx.state(rollout_actor, nnx.Param))

    # --- BaseRollout --------------------------------------------------------------------------------------------
    def generate(self, prompts: list[str], rollout_config, **kwargs) -> base_rollout.RolloutOutput:
        """Samples a completion of each prompt (see the class docstring for the conventions)."""
        if kwargs:
            raise TypeError(f"TpJaxRollout.generate: unexpected arguments {sorted(kwargs)}; the sampling settings "
                            f"come from rollout_config")
        ids = [self._tokenize(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
        outs = self.llm.generate([{"prompt_token_ids": x} for x in ids],
                                 self._sampling(rollout_config, len(ids)))
        tokens = [np.asarray(o.outputs[0].token_ids, np.int32) for o in outs]
        logprobs = None
        if rollout_config.return_logprobs:
            logprobs = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        return base_rollout.RolloutOutput(
            text=[self.tokenizer.decode(t.tolist()) for t in tokens], logits=None, tokens=tokens,
            left_padded_prompt_tokens=self._left_padded(ids, rollout_config.max_prompt_length), logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens, completion_tokens) -> jax.Array:
        """[B, C] float32: each completion token's logprob given the prompt and the tokens before it."""
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        if prompts.ndim != 2 or completions.ndim != 2 or len(prompts) != len(completions):
            raise ValueError(f"get_per_token_logps: prompt_tokens [B, P] and completion_tokens [B, C] with the same "
                             f"B, got shapes {prompts.shape} and {completions.shape}")
        pad = self.pad_id()
        rows, spans = [], []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            p = p[int(np.argmax(p != pad)):].tolist() if (p != pad).any() else []     # the left padding
            if not p:
                raise ValueError(f"get_per_token_logps: prompt {i} is all padding (pad_id {pad}); a completion is "
                                 f"scored given a prompt of at least one token")
            n = int(np.flatnonzero(c != pad)[-1]) + 1 if (c != pad).any() else 0
            rows.append(p + c[:n].tolist())
            spans.append((len(p), n))
        outs = self.llm.generate([{"prompt_token_ids": r} for r in rows],
                                 SamplingParams(max_tokens=0, prompt_logprobs=0))
        out = np.zeros(completions.shape, np.float32)
        for i, (o, row, (start, n)) in enumerate(zip(outs, rows, spans)):
            out[i, :n] = [o.prompt_logprobs[j][row[j]].logprob for j in range(start, start + n)]
        return jnp.asarray(out)

    def update_params(self, params, filter_types=None) -> None:
        """The engine serves `params` (the actor's, under Tunix's names) from its next step."""
        if filter_types is not None and any(t is not nnx.Param for t in filter_types):
            raise TunixMappingError(f"update_params: filter_types {filter_types} (LoRA params only): the engine "
                                    f"serves whole weights; merge the adapters into the base weights and pass "
                                    f"nnx.state(model, nnx.Param)")
        arrays = (checkpoint_arrays(params, self._names, self._shapes) if self._names is not None
                  else flat_params(params))
        # Tunix's sync_weights forbids every host transfer on CPU; the update moves small host values (scalars its
        # placement programs take, one NaN flag per param read back; int8 methods quantize on the host): allowed
        # here, for the update only (the weights themselves go device to device)
        with jax.transfer_guard("allow"):
            self.last_update = self.llm.update_weights(arrays)

    def pad_id(self) -> int:
        return self.tokenizer.pad_id()

    def eos_id(self) -> int:
        return self.tokenizer.eos_id()

    def model(self):
        """None: the engine holds its weights in tp_jax's layout (`self.llm.model`), not as a Tunix model. Tunix's
        learner then sees that the actor and the rollout share no weights and syncs them after every step (the
        engine's own nnx model would not do: Tunix 0.1.7's `is_sharing_weights` maps over both models' leaves and
        fails when their numbers differ). Tunix's `offload_to_cpu` moves this model: not supported, use
        `self.llm.sleep()`."""
        return None

    # --- helpers ------------------------------------------------------------------------------------------------
    def _tokenize(self, prompt: str) -> list[int]:
        """Tunix's sampler's tokenization: the tokenizer's ids with one BOS in front."""
        bos = self.tokenizer.bos_id()
        return self.tokenizer.dedup_bos_ids(([bos] if bos else []) + list(self.tokenizer.encode(prompt)))

    def _sampling(self, config, n: int) -> list[SamplingParams]:
        eos = list(config.eos_tokens or [self.eos_id()])
        seed = _seed(config.seed)
        base = dict(max_tokens=config.max_tokens_to_generate, temperature=config.temperature,
                    top_p=1.0 if config.top_p is None else config.top_p,
                    top_k=0 if config.top_k is None else config.top_k,
                    ignore_eos=True, stop_token_ids=eos, logprobs=0 if config.return_logprobs else None)
        first = None if seed is None else seed + self._calls * n
        self._calls += 1
        return [SamplingParams(**base, seed=None if first is None else first + i) for i in range(n)]

    def _left_padded(self, ids: list[list[int]], max_prompt_length: int) -> np.ndarray:
        longest = max(len(x) for x in ids)
        width = max_prompt_length if max_prompt_length and max_prompt_length >= longest else 1 << (longest - 1).bit_length()
        return np.array([[self.pad_id()] * (width - len(x)) + x for x in ids], np.int32)


# --- on-policy: the rollout's logprobs against the trainer's forward ---------------------------------------------

def on_policy_logprobs(rollout: TpJaxRollout, actor, prompts: list[str], rollout_config) -> dict[str, np.ndarray]:
    """Sample `prompts` with the rollout (its weights being `actor`'s), then the sampled tokens' logprobs [B, C] by
    four ways: "sampled" (what the engine drew them with), "scored" (`get_per_token_logps`: the engine's prompt
    scoring), "get_logits" (`LLM.get_logits`' dense forward, then the sampler's log-softmax) and "trainer"
    (Tunix's `compute_per_token_logps` on `actor`: the trainer's own forward); "mask" marks the real tokens."""
    import dataclasses

    from tunix.rl import common

    from tp_jax.parallel.invariant import row_log_softmax
    config = dataclasses.replace(rollout_config, return_logprobs=True)
    out = rollout.generate(prompts, config)
    pad, width = rollout.pad_id(), config.max_tokens_to_generate
    completions = np.array([np.pad(t, (0, width - len(t)), constant_values=pad) for t in out.tokens])
    prompt_ids = out.left_padded_prompt_tokens
    sampled = np.zeros(completions.shape, np.float32)
    dense = np.zeros(completions.shape, np.float32)
    for i, (lp, t) in enumerate(zip(out.logprobs, out.tokens)):
        sampled[i, :len(lp)] = lp
        p = prompt_ids[i][int(np.argmax(prompt_ids[i] != pad)):].tolist()
        logits = rollout.llm.get_logits([p + t.tolist()])[0]                    # [T, V]
        logp = np.asarray(row_log_softmax(jnp.asarray(logits[len(p) - 1:-1])))
        dense[i, :len(t)] = logp[np.arange(len(t)), t]
    graphdef, state = nnx.split(actor)
    trainer = common.compute_per_token_logps(graphdef, state, jnp.asarray(prompt_ids), jnp.asarray(completions),
                                             pad_id=pad, eos_id=rollout.eos_id())
    scored = rollout.get_per_token_logps(jnp.asarray(prompt_ids), jnp.asarray(completions))
    return {"sampled": sampled, "scored": np.asarray(scored), "get_logits": dense, "trainer": np.asarray(trainer),
            "mask": completions != pad}


def deviation(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> dict:
    """max |a - b|, max |exp(a - b) - 1| (the importance ratio's deviation from 1) and bitwise equality, over
    `mask`."""
    delta = np.where(mask, a.astype(np.float64) - b.astype(np.float64), 0.0)
    return {"max_abs": float(np.abs(delta).max()), "ratio_dev": float(np.abs(np.expm1(delta)).max()),
            "bitwise": bool((np.where(mask, a, 0) == np.where(mask, b, 0)).all()), "tokens": int(mask.sum())}


__all__ = ["TpJaxRollout", "TunixMappingError", "CheckpointNames", "checkpoint_arrays", "checkpoint_shapes",
           "flat_params", "tunix_config", "tunix_model", "on_policy_logprobs", "deviation"]
