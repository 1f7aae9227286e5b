"""The engine core (vLLM v1's EngineCore): requests in, one scheduled step at a time, tokens out.

    core = EngineCore(model, mesh, llm.setup, eos_token_ids=(2,))     # setup: the resolved configuration
    core.add("a", [1, 2, 3], SamplingParams(max_tokens=8))     # prepared by the front door (LLMEngine)
    while core.has_unfinished():
        for out in core.step(): ...          # EngineOutput: the new token of each request that got one
    core.abort("a")

Each step: the scheduler picks rows (decodes and prefill chunks, within the token budget,
preempting when blocks run out), the batch builder lays them out in a bucketed shape, the
runner runs the forward over the paged pool and samples, and finished requests leave at
once (EOS, stop token ids, max_tokens, the context limit). Prompt logprobs are scored from the
prefill chunks (tp_jax/serving/prompt_logprobs.py); a max_tokens=0 request ends after its
prefill with them and no token. The engine knows no tokenizer:
stop strings and text belong to the front door, which aborts a request when its text stops.

Many hosts: the driver (process 0) schedules and broadcasts each step's plan; every other
process calls `follow()`, which runs the same steps until the driver's `release_followers()`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tp_jax.multihost.distributed import broadcast_bytes, is_driver, share_from_driver, to_global
from tp_jax.parallel.mesh import DP
from tp_jax.serving import prompt_logprobs, sampling, structured
from tp_jax.serving.batch import (MIN_BLOCKS, MIN_TOKENS, StepBatch, StepShape, bucket, build_batch, chunk_blocks,
                                  fine_bucket, prefill_layout, sample_offsets, sampled_rows)
from tp_jax.serving.draft_model import DraftModel
from tp_jax.serving.kv_pool import plan_pool
from tp_jax.serving.outputs import PromptLogprobs, SampleLogprobs, position_logprobs
from tp_jax.serving.penalties import Penalties
from tp_jax.serving.plan import StepPlan
from tp_jax.serving.request import Request
from tp_jax.serving.resolve import EngineSetup
from tp_jax.serving.runner import ModelRunner
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.scheduler import Scheduler, SchedulerConfig
from tp_jax.serving.speculative import SpecCounters, SpeculativeConfig, accepted_count, propose_ngram


log = logging.getLogger("tp_jax.engine")
_RELEASE = b"\x00"                    # a plan is an .npz (starts with b"PK"); this byte ends follow()


@dataclasses.dataclass
class EngineOutput:
    """What one step produced for one request: its new token (or, when aborted, nothing)."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]                          # the chosen tokens' logprobs
    new_top_logprobs: SampleLogprobs | None            # per new token: {id: Logprob}, chosen + top-N (outputs.py)
    finish_reason: str | None = None                   # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None      # with the first output, when asked for
    num_draft_tokens: int = 0                          # speculative decoding: drafts verified this step
    num_accepted_tokens: int = 0                       # ... and accepted (on a step's first output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCore:
    def __init__(self, model: nnx.Module, mesh: Mesh, config: EngineSetup, eos_token_ids=(), draft_model=None,
                 kv_scales=None):
        """`config`: the resolved configuration (`LLM.setup`; read, never restated). `draft_model`: the loaded
        draft (nnx.Module, on `mesh`) of a draft-model speculative config. `kv_scales`: the checkpoint's KV scales
        per layer (tp_jax/models/cache.py KVScales) that a float8 cache reads (`LLM.kv_scales`)."""
        self.config, self.mesh = config, mesh
        self.vocab_size = model.config.vocab_size
        self.eos = frozenset(int(t) for t in eos_token_ids)
        dp = mesh.shape[DP]
        self.microbatches = config.num_microbatches
        draft_layout = None if draft_model is None else draft_model.kv_layout()     # its pool: the same blocks
        scales = None if kv_scales is None else kv_scales.per_slot(model.layer_map)
        plan = lambda blocks: plan_pool(model.kv_layout(), mesh, config, num_gpu_blocks=blocks,   # noqa: E731
                                        draft_layout=draft_layout, scales=scales)
        # every process must build the same pool: the driver decides its size from its own budget
        self.pool = plan(share_from_driver(lambda: plan(config.num_gpu_blocks).num_blocks))
        log.info("KV cache (kv_cache_dtype %s): %s", config.kv_cache_dtype, self.pool.describe(config.max_model_len))
        self.lora = self.lora_slots = None
        if config.enable_lora:                         # the adapters' device slots, passed to every step
            from tp_jax.serving.lora import LoRASlots, LoRAWeights
            if jax.process_count() > 1:
                raise ValueError("enable_lora: LoRA adapters are served on one process; run a single host")
            self.lora = LoRAWeights(model, mesh, config.max_loras, config.max_lora_rank)
            self.lora_slots = LoRASlots(config.max_loras, config.max_cpu_loras or config.max_loras)
            self.lora_loaded: list[int | None] = [None] * config.max_loras      # the adapter each slot holds
        self.model = model
        self.scheduler = Scheduler(SchedulerConfig.of(config, self.pool.num_blocks, dp, self.pool.windows),
                                   self.lora_slots)
        self.kv_groups = len(self.pool.windows)
        replicated = NamedSharding(mesh, jax.P())
        self.penalties = Penalties(config.max_num_seqs * dp, self.vocab_size, lambda x: to_global(x, replicated))
        self.runner = ModelRunner(model, mesh, self.pool, self.microbatches, self.penalties, config.attention_backend,
                                  self.lora)
        from tp_jax.models.attention import SPLIT_K_BACKENDS
        self.split_k = SPLIT_K_BACKENDS.get(config.attention_backend, 0)   # > 0: the batch carries decode chunks
        spec = config.speculative_config
        if (spec is not None and spec.method == "draft_model") != (draft_model is not None):
            raise ValueError("EngineCore: pass draft_model exactly when speculative_config names a draft model")
        self.drafter = None if draft_model is None else DraftModel(
            draft_model, mesh, self.pool, self.microbatches, self.penalties, config.attention_backend, self.split_k)
        self.requests: dict[str, Request] = {}
        self.sleeping = 0                              # sleep level (serving/weights.py): no request is taken
        self.rng = np.random.default_rng(config.seed)
        self.spec = SpecCounters()                     # speculative decoding's totals (speculative_config)
        self.stats = {"steps": 0, "scheduled_tokens": 0, "generated_tokens": 0, "preemptions": 0, "max_running": 0,
                      "constrained_tokens": 0, "grammar_seconds": 0.0}     # structured outputs: rows, host time

    # --- requests -------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float | None = None, matcher=None, lora_request=None) -> Request:
        """Queue a request the front door prepared (LLMEngine.prepare: its id is new, its params are a
        SamplingParams with n == 1 and its prompt passed `check`); it joins the next step. `matcher`:
        the structured-outputs grammar state (serving/structured.py Matcher) compiled from
        `params.structured_outputs`."""
        ids = list(prompt_token_ids)
        room = self.config.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        words = sampling.key_words(params.seed, tuple(int(w) for w in self.rng.integers(0, 2**32, size=2)))
        req = Request(request_id, len(ids), ids, params, max_tokens, words,
                      time.monotonic() if arrival_time is None else arrival_time,
                      sample_floats=sampling.row_floats(params), matcher=matcher, lora=lora_request)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def check(self, prompt_token_ids, params: SamplingParams, where: str) -> None:
        """ValueError, naming `where`, for a request (token ids, one sample's SamplingParams) that this
        engine can never serve: its limits (vocabulary, max_model_len, max_logprobs)."""
        cfg = self.config
        if self.sleeping:
            raise ValueError(f"{where}: the engine is sleeping (level {self.sleeping}); wake it up first")
        if params.n != 1:
            raise ValueError(f"{where}: n={params.n}; the engine core runs one sequence per request (the front "
                             f"door fans n > 1 out into child requests)")
        ids = prompt_token_ids
        if len(ids) == 0:
            raise ValueError(f"{where} is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) > cfg.max_model_len or (len(ids) == cfg.max_model_len and params.max_tokens != 0):
            raise ValueError(f"{where} has {len(ids)} tokens, but max_model_len={cfg.max_model_len} leaves no "
                             f"room to generate; shorten it or raise max_model_len")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"{where}: logit_bias names token ids outside [0, {self.vocab_size}): {bad[:5]}")
        limit = min(cfg.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > limit:
                raise ValueError(f"{where}: {name}={getattr(params, name)} exceeds the limit of {limit} "
                                 f"(max_logprobs, and the vocabulary size {self.vocab_size})")

    def check_lora(self, lora_request, where: str) -> None:
        """ValueError for an adapter this engine cannot serve (LoRA off, a bad directory, config or rank); a good
        one is remembered (its header read, not its tensors)."""
        if lora_request is None:
            return
        from tp_jax.serving.lora import LoRARequest, read_adapter
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"{where}: lora_request must be a tp_jax.LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError(f"{where}: a lora_request needs LLM(..., enable_lora=True)")
        known = self.lora_slots.known.get(lora_request.lora_int_id)
        if known is not None and known.request == lora_request:
            return
        try:
            self.lora_slots.register(read_adapter(lora_request, self.model, self.config.max_lora_rank))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def _load_adapters(self) -> None:
        """Write the adapters the scheduler just gave slots into the device slots that do not hold them yet."""
        for slot, lora_id in enumerate(self.lora_slots.held):
            if lora_id is not None and self.lora_loaded[slot] != lora_id:
                adapter = self.lora_slots.known[lora_id]
                self.lora.load(slot, adapter, self.lora_slots.tensors(lora_id))
                self.lora_loaded[slot] = lora_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        self._finish(req, "abort", None)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule, run and sample one step; an output for each token a request got (several for a
        speculative row whose drafts stood), in order."""
        self._propose()
        out = self.scheduler.schedule()
        self._release_preempted(out.preempted)
        if out.empty:
            return []
        tables = [b.step_tables() for b in self.scheduler.blocks]
        if self.lora is not None:
            self._load_adapters()
        if self.drafter is not None:
            self._propose_with_draft_model(out, tables)
        batch = build_batch(out, tables, self.config.block_size, self.microbatches, split_k=self.split_k,
                            kv_groups=self.kv_groups)
        if self.drafter is not None:
            self.drafter.follow(batch)                   # the draft's pool gets the step's tokens too
        plan = self._plan(batch)
        plan.bias = self._logit_bias(batch)
        if jax.process_count() > 1:
            plan.bitmask = self._bitmask(batch)          # the followers need it in the plan
            broadcast_bytes(plan.to_bytes())
        # one process: the grammars' bitmasks are filled on the host while the device runs the forward
        tokens, chosen, ranks, top_ids, top_lp, scored = self._execute(plan, lambda: self._bitmask(batch))
        if plan.prompt is not None:
            prompt_logprobs.collect(plan.prompt, scored)
        self._verify(batch, tokens)
        self.scheduler.update(out)
        self.stats["steps"] += 1
        self.stats["scheduled_tokens"] += out.num_tokens
        self.stats["preemptions"] = self.scheduler.num_preemptions
        self.stats["max_running"] = max(self.stats["max_running"], sum(len(rows) for rows in out.rows))
        outputs = []
        for g, rows in enumerate(batch.rows):
            for i, row in sampled_rows(rows):
                if row.request.max_tokens == 0:
                    outputs.append(self._prompt_only(row.request))
                    continue
                first = len(outputs)
                for j in range(i, i + 1 + len(row.draft) - row.rejected):     # the drafts that stood, then one
                    if row.request.finished:                                   # EOS, a stop, max_tokens inside
                        break
                    outputs.append(self._append(row.request, int(tokens[g, j]), float(chosen[g, j]),
                                                int(ranks[g, j]), top_ids[g, j], top_lp[g, j]))
                if row.draft:
                    outputs[first].num_draft_tokens = len(row.draft)
                    outputs[first].num_accepted_tokens = len(row.draft) - row.rejected
        return outputs

    # --- speculative decoding (tp_jax/serving/speculative.py) ----------------------------------------
    def _propose(self) -> None:
        """Each running request's drafts for this step: none without a speculative config, when more
        than `disable_by_batch_size` requests run, or for a request that cannot use them."""
        spec = self.config.speculative_config
        if spec is None:
            return
        running = [req for rows in self.scheduler.running for req in rows]
        off = spec.disable_by_batch_size is not None and len(running) > spec.disable_by_batch_size
        for req in running:
            req.draft = [] if off else self._draft(req, spec)

    def _draft(self, req: Request, spec: SpeculativeConfig) -> list[int]:
        p = req.params
        if req.num_tokens - req.num_computed_tokens != 1 or sampling.has_penalties(p):
            return []                            # a prefill; penalties count outputs one step at a time
        k = min(spec.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                self.config.max_model_len - req.num_tokens)
        if k <= 0:
            return []
        if self.drafter is not None:             # placeholders: the draft model fills them once slots are reserved
            return [0] * k
        return self._cut(req, propose_ngram(req.token_ids, k, spec.prompt_lookup_max, spec.prompt_lookup_min))

    def _cut(self, req: Request, draft: list[int]) -> list[int]:
        """A constrained request's draft up to an end token, then up to where the grammar refuses it."""
        if req.matcher is not None and draft:
            ends = self.eos | set(req.params.stop_token_ids)
            draft = draft[:next((i for i, t in enumerate(draft) if t in ends), len(draft))]
            draft = draft[:req.matcher.valid_prefix(draft)]
        return draft

    def _propose_with_draft_model(self, out, tables) -> None:
        """Fill the scheduled rows' draft placeholders from the draft model (tp_jax/serving/draft_model.py);
        a constrained row's draft is cut as an n-gram one is, its row shortened (the spare slot's block is
        freed after the step)."""
        self.drafter.propose(out, tables, self.config.block_size)
        for row in (row for rows in out.rows for row in rows if row.draft):
            kept = self._cut(row.request, row.draft)
            row.num_tokens -= len(row.draft) - len(kept)
            row.draft = kept

    def _verify(self, batch, tokens) -> None:
        """Set each speculative row's `rejected` from the tokens its query rows sampled; add to the totals."""
        for g, rows in enumerate(batch.rows):
            for i, row in sampled_rows(rows):
                if row.draft:
                    a = accepted_count(row.draft, tokens[g, i:i + len(row.draft)])
                    row.rejected = len(row.draft) - a
                    self.spec.add(len(row.draft), a)

    def _plan(self, batch) -> StepPlan:
        g, r = batch.shape.groups, batch.shape.sample_rows
        floats = np.tile(np.asarray(sampling.GREEDY_ROW, np.float32), (g, r, 1))
        top_k, steps = np.zeros((g, r), np.int32), np.zeros((g, r), np.int32)
        words = np.zeros((g, r, 3), np.uint32)
        rows = np.full((g, r), self.penalties.scratch, np.int32)
        inits, logprobs, greedy, penalties = [], -1, True, False        # -1: no row asks for logprobs
        for gi, batch_rows in enumerate(batch.rows):
            for i, (row, j) in enumerate(zip(batch_rows, sample_offsets(batch_rows))):
                if row is None or not row.samples or row.request.max_tokens == 0:
                    continue
                req, p = row.request, row.request.params
                floats[gi, i], top_k[gi, i] = req.sample_floats, sampling.row_top_k(p, self.vocab_size)
                words[gi, i], steps[gi, i] = req.key_words, req.num_output_tokens + j     # j: a draft's row
                logprobs = max(logprobs, -1 if p.logprobs is None else p.logprobs)
                greedy &= p.greedy
                if sampling.has_penalties(p):
                    penalties = True
                    rows[gi, i], init = self.penalties.assign(req)
                    inits += [] if init is None else [init]
        return StepPlan(batch=batch, floats=floats, top_k=top_k, words=words, steps=steps, penalty_rows=rows,
                        num_logprobs=min(bucket(logprobs), self.vocab_size) if logprobs >= 0 else -1,
                        penalties=penalties,
                        all_greedy=greedy and not penalties, penalty_inits=inits,
                        prompt=prompt_logprobs.plan(batch, self.vocab_size))

    def _bitmask(self, batch) -> np.ndarray | None:
        """i32[G, R, ceil(V / 32)]: each constrained row's allowed tokens (all ones elsewhere); None when
        no row of the step is constrained, so unconstrained steps run exactly as before. A row short of its
        `min_tokens` has its end tokens (EOS, stop_token_ids) taken out."""
        sampled = [(gi, i, row) for gi, rows in enumerate(batch.rows) for i, row in sampled_rows(rows)]
        rows = [(gi, i, row) for gi, i, row in sampled if row.request.matcher is not None]
        short = [(gi, i, row) for gi, i, row in sampled
                 if row.request.num_output_tokens < row.request.params.min_tokens]
        if not rows and not short:
            return None
        t = time.perf_counter()
        r = batch.shape.sample_rows
        mask = np.full((batch.shape.groups, r, structured.bitmask_words(self.vocab_size)), -1, np.int32)
        structured.fill_bitmasks([(row.request.matcher, gi * r + i) for gi, i, row in rows if not row.draft],
                                 mask.reshape(-1, mask.shape[-1]))
        for gi, i, row in rows:                 # a speculative row: each query row's mask after the drafts before it
            if row.draft:
                row.request.matcher.fill_rows(row.draft, mask[gi, i:i + 1 + len(row.draft)])
        self._ban_end_tokens(mask, short)
        self.stats["grammar_seconds"] += time.perf_counter() - t
        self.stats["constrained_tokens"] += sum(1 + len(row.draft) for _, _, row in rows)
        return mask

    def _ban_end_tokens(self, mask: np.ndarray, short) -> None:
        """Clear the end tokens' bits in the query rows (i + j: after j drafts) still short of min_tokens."""
        for gi, i, row in short:
            p, done = row.request.params, row.request.num_output_tokens
            ends = sorted(({*self.eos} if not p.ignore_eos else set()) | set(p.stop_token_ids))
            words, bits = np.array(ends) // 32, np.array(ends) % 32
            for j in range(min(1 + len(row.draft or ()), p.min_tokens - done)):
                np.bitwise_and.at(mask[gi, i + j], words, ~(np.left_shift(1, bits).astype(np.int64)).astype(np.int32))

    def _logit_bias(self, batch) -> np.ndarray | None:
        """f32[G, R, V]: each row's logit_bias (zeros elsewhere); None when no row of the step has one."""
        sampled = [(gi, i, row) for gi, rows in enumerate(batch.rows) for i, row in sampled_rows(rows)
                   if row.request.params.logit_bias]
        if not sampled:
            return None
        bias = np.zeros((batch.shape.groups, batch.shape.sample_rows, self.vocab_size), np.float32)
        for gi, i, row in sampled:
            ids, values = zip(*row.request.params.logit_bias.items())
            bias[gi][i:i + 1 + len(row.draft or ()), list(ids)] = values
        return bias

    def _execute(self, plan: StepPlan, late_bitmask=None):
        """The device work of a step (every process runs it); the sampled rows as numpy."""
        return self.runner.execute(plan, late_bitmask)

    def _append(self, req: Request, token: int, logprob: float, rank: int, top_ids, top_lp) -> EngineOutput:
        req.token_ids.append(token)
        self.stats["generated_tokens"] += 1
        n = req.params.logprobs
        top = None if n is None else position_logprobs(token, logprob, rank, top_ids[:n], top_lp[:n])
        out = EngineOutput(req.request_id, [token], [logprob], None if top is None else [top],
                           num_cached_tokens=max(req.num_cached_tokens, 0))
        if req.params.prompt_logprobs is not None and req.num_output_tokens == 1:
            out.prompt_logprobs = req.prompt_logprobs
        reason, stop = self._advance_matcher(req, token) if req.matcher is not None else (None, None)
        if reason is None:
            reason, stop = self._check_stop(req, token)
        if reason is not None:
            self._finish(req, reason, stop)
            out.finish_reason, out.stop_reason = reason, stop
        return out

    def _prompt_only(self, req: Request) -> EngineOutput:
        """A max_tokens=0 request at the end of its prefill: its prompt logprobs, no token, finished."""
        out = EngineOutput(req.request_id, [], [], None if req.params.logprobs is None else [], "length",
                           num_cached_tokens=max(req.num_cached_tokens, 0), prompt_logprobs=req.prompt_logprobs)
        self._finish(req, "length", None)
        return out

    def _advance_matcher(self, req: Request, token: int):
        """Feed a constrained request's token to its grammar: ("stop", None) once the grammar is complete
        (nothing but an end token could follow), else (None, None). An end token (allowed only where the
        grammar accepts) and stop token ids are left to `_check_stop`."""
        t = time.perf_counter()
        end = (token in self.eos and not req.params.ignore_eos) or token in req.params.stop_token_ids
        ok = (end or req.matcher.consume(token)) and not req.matcher.error()
        done = req.matcher.done
        self.stats["grammar_seconds"] += time.perf_counter() - t
        if not ok:                                       # a matcher in error (e.g. a grammar past llguidance's limits)
            log.warning("request %s: its grammar failed at token %d and the request is ended (abort): %s",
                        req.request_id, token, req.matcher.error())
            return "abort", None
        return ("stop", None) if done and not end else (None, None)

    def _check_stop(self, req: Request, token: int):
        p = req.params
        if req.num_output_tokens < min(p.min_tokens, req.max_tokens):
            return None, None                    # end tokens are masked until then (_ban_end_tokens)
        if token in p.stop_token_ids:
            return "stop", token
        if token in self.eos and not p.ignore_eos:
            return "stop", None
        if req.num_output_tokens >= req.max_tokens:
            return "length", None
        return None, None

    def _finish(self, req: Request, reason: str, stop_reason) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        self.penalties.release(req.request_id)
        self.requests.pop(req.request_id, None)

    def _release_preempted(self, preempted: list[Request]) -> None:
        for req in preempted:                       # a preempted request reloads its penalty row when it resumes
            self.penalties.release(req.request_id)

    # --- many hosts -----------------------------------------------------------------------------
    def follow(self) -> None:
        """On a non-driver process: run the driver's steps until it calls `release_followers()`.

        Raises the driver's error (ValueError, naming process 0) if it released them with one."""
        while True:
            data = broadcast_bytes(None)
            if data[:1] == _RELEASE:
                if len(data) > 1:
                    raise ValueError(f"{data[1:].decode()} (raised on the driver, process 0)")
                return
            self._execute(StepPlan.from_bytes(data))

    def release_followers(self, error: str | None = None) -> None:
        """On the driver: end the other processes' `follow()`, optionally with the driver's error."""
        if jax.process_count() > 1 and is_driver():
            broadcast_bytes(_RELEASE + (error or "").encode())

    # --- warm-up and introspection ----------------------------------------------------------------
    def warmup_shapes(self) -> list[StepShape]:
        """Decode steps of every bucketed row count up to max_num_seqs (short contexts), and one full
        prefill chunk: the shapes most steps use. Others compile on first use (`compiled_shapes`)."""
        cfg, groups = self.config, len(self.scheduler.blocks) * self.microbatches
        rows = sorted({fine_bucket(n) for n in range(1, cfg.max_num_seqs + 1)})
        cb = chunk_blocks(cfg.block_size, self.split_k) if self.split_k else 0   # split-K: a chunk a row (short rows)
        shapes = [StepShape(groups, d, d, MIN_BLOCKS, d if cb else 0, cb, 0, 0, 0, self.kv_groups) for d in rows]
        chunk = cfg.max_num_batched_tokens                       # one prompt chunk, laid out as build_batch does
        shapes.append(StepShape(groups, fine_bucket(chunk, MIN_TOKENS), 0, 0, 0, 0, *prefill_layout([[chunk]]),
                                bucket(-(-chunk // cfg.block_size), MIN_BLOCKS), self.kv_groups))
        return shapes

    def warmup(self, shapes=None) -> list[StepShape]:
        """Compile the forward and the greedy sampler for each shape (default `warmup_shapes()`) by
        running an all-padding step (nothing is written); every process runs the same. Returns the
        shapes compiled so far, sorted."""
        for shape in self.warmup_shapes() if shapes is None else shapes:
            plan = self._plan(StepBatch.empty(shape))
            if jax.process_count() > 1:
                broadcast_bytes(plan.to_bytes())
            self._execute(plan)
        if self.drafter is not None:
            self.drafter.warmup(self.warmup_shapes() if shapes is None else shapes)
        return sorted(self.runner.compiled_shapes)

    def kv_usage(self) -> tuple[int, int]:
        """(KV blocks in use, blocks in all) over every dp replica's pool."""
        return sum(b.num_used for b in self.scheduler.blocks), self.pool.num_blocks * len(self.scheduler.blocks)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (vLLM's reset_prefix_cache); False while requests still run."""
        return all([b.reset_prefix_cache() for b in self.scheduler.blocks])

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found there) over every dp replica's pool."""
        blocks = self.scheduler.blocks
        return sum(b.prefix_queries for b in blocks), sum(b.prefix_hits for b in blocks)

    def prefix_cache_hit_rate(self) -> float:
        queries, hits = self.prefix_cache_counts()
        return hits / queries if queries else 0.0
