"""The scheduler (vLLM v1's shape): waiting and running queues, a token budget per step, preemption.

Each step, per dp replica (each has its own block pool and sequences):
1. Running requests, oldest first, get their next tokens: one for a decode, up to the rest
   of the token budget for a prompt still being prefilled (chunked prefill). When the pool
   has no block for one, the newest running request is preempted: its blocks are freed and
   it goes back to the front of the waiting queue, keeping its outputs (it recomputes them
   later; prefix caching often finds them still cached).
2. Waiting requests, first come first served, join while the replica has sequence slots
   (`max_num_seqs`), token budget (`max_num_batched_tokens`) and blocks, and no request was
   preempted there this step. A request goes to the replica that holds most of its prefix,
   then the one with most free blocks. Its cached prefix blocks are not recomputed.
A request joins at the step after it arrives; finished ones leave at once (`finish`).
"""

from __future__ import annotations

import collections
import dataclasses

from tp_jax.serving.block_manager import BlockManager
from tp_jax.serving.request import Request, Status


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler reads: the resolved setup's limits and the pool the engine built (`of`); no defaults of
    its own (EngineArgs holds them)."""
    max_num_seqs: int                 # running sequences per replica
    max_num_batched_tokens: int       # tokens per step per replica
    block_size: int
    num_blocks: int                   # per replica: the pool's
    num_replicas: int                 # dp: the mesh's
    enable_prefix_caching: bool
    windows: tuple[int | None, ...] = (None,)   # the pool's (PoolShape.windows): each KV cache group's sliding
    #                                            window, blocks older than it freed (None: full attention)

    @classmethod
    def of(cls, setup, num_blocks: int, num_replicas: int,
           windows: tuple[int | None, ...] = (None,)) -> SchedulerConfig:
        return cls(setup.max_num_seqs, setup.max_num_batched_tokens, setup.block_size, num_blocks, num_replicas,
                   setup.enable_prefix_caching, windows)


@dataclasses.dataclass
class ScheduledRow:
    """`num_tokens` tokens of `request`, from position `start`, this step. A speculative row is a decode
    (the newest token) followed by its `draft` tokens: 1 + len(draft) tokens, each sampled
    (tp_jax/serving/speculative.py); after the step `rejected` says how many drafts did not stand."""
    request: Request
    start: int
    num_tokens: int
    draft: list[int] = dataclasses.field(default_factory=list)
    rejected: int = 0

    @property
    def samples(self) -> bool:
        """The row reaches the request's newest token, so its logits give the next one."""
        return self.start + self.num_tokens - len(self.draft) == self.request.num_tokens

    @property
    def decodes(self) -> bool:
        """One token a query row: a decode, or a speculative row (its drafts too)."""
        return self.num_tokens == 1 + len(self.draft)

    def token_ids(self) -> list[int]:
        return self.request.token_ids[self.start:self.start + self.num_tokens - len(self.draft)] + self.draft


@dataclasses.dataclass
class SchedulerOutput:
    rows: list[list[ScheduledRow]]             # per replica
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for rows in self.rows for r in rows)

    @property
    def empty(self) -> bool:
        return not any(self.rows)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, lora=None):
        """`lora`: the LoRA slot table (tp_jax/serving/lora.py LoRASlots) when adapters are served: a request
        with an adapter is admitted only once its adapter holds a device slot."""
        self.cfg, self.lora = cfg, lora
        self.blocks = [BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.windows)
                       for _ in range(cfg.num_replicas)]
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[list[Request]] = [[] for _ in range(cfg.num_replicas)]
        self.num_preemptions = 0

    # --- queues -----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """End req (stopped, length, aborted): out of its queue, blocks freed."""
        if req.status is Status.RUNNING:
            self.running[req.replica].remove(req)
            self.blocks[req.replica].free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status, req.finish_reason, req.stop_reason = Status.FINISHED, reason, stop_reason

    @property
    def num_running(self) -> int:
        return sum(len(r) for r in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    # --- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        n = self.cfg.num_replicas
        out = SchedulerOutput([[] for _ in range(n)], [])
        budget = [self.cfg.max_num_batched_tokens] * n
        for r in range(n):
            self._schedule_running(r, out, budget)
        blocked = [any(p.replica == r for p in out.preempted) for r in range(n)]
        in_use = {q.lora_slot for rows in self.running for q in rows if q.lora is not None}
        while self.waiting:
            req = self.waiting[0]
            choice = self._pick_replica(req, budget, blocked)
            if choice is None:
                break
            slot = None if req.lora is None else self.lora.slot_for(req.lora.lora_int_id, in_use)
            if req.lora is not None and slot is None:
                break                                    # every adapter slot serves running requests
            r, hits = choice
            computed = len(hits[0]) * self.cfg.block_size
            count = min(req.num_tokens - computed, budget[r])
            if not self.blocks[r].allocate(req, computed + count, hits):
                break                                    # first come, first served: nobody overtakes it
            self.waiting.popleft()
            if slot is not None:
                self.lora.assign(slot, req.lora.lora_int_id)
                req.lora_slot = slot
                in_use.add(slot)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
                self.blocks[r].count_prefix_lookup(req.prompt_len, computed)
            req.status, req.replica, req.num_computed_tokens = Status.RUNNING, r, computed
            self.running[r].append(req)
            out.rows[r].append(ScheduledRow(req, computed, count))
            budget[r] -= count
        return out

    def _schedule_running(self, r: int, out: SchedulerOutput, budget: list[int]) -> None:
        running, blocks = self.running[r], self.blocks[r]
        i = 0
        while i < len(running) and budget[r] > 0:
            req = running[i]
            count = min(req.num_tokens - req.num_computed_tokens, budget[r])
            draft = req.draft[:budget[r] - 1] if count == 1 else []        # drafts only on a decode, in budget
            if draft and not blocks.allocate(req, req.num_computed_tokens + count + len(draft)):
                draft = []                                                  # no room: decode without them
            while not blocks.allocate(req, req.num_computed_tokens + count):
                victim = running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return
            out.rows[r].append(ScheduledRow(req, req.num_computed_tokens, count + len(draft), draft))
            budget[r] -= count + len(draft)
            i += 1

    def _preempt(self, req: Request) -> None:
        self.running[req.replica].remove(req)
        self.blocks[req.replica].free(req)
        req.status, req.num_computed_tokens = Status.PREEMPTED, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _pick_replica(self, req: Request, budget: list[int], blocked: list[bool]):
        """(replica, its cached prefix blocks) with room for req, or None."""
        best = None
        for r in range(self.cfg.num_replicas):
            if blocked[r] or budget[r] <= 0 or len(self.running[r]) >= self.cfg.max_num_seqs:
                continue
            hits = self.blocks[r].computed_blocks(req)
            rank = (len(hits[0]), self.blocks[r].num_free, -len(self.running[r]))
            if best is None or rank > best[0]:
                best = (rank, r, hits)
        return None if best is None else best[1:]

    def update(self, out: SchedulerOutput) -> None:
        """After the step ran (and speculative rows were verified, `rejected` set): the scheduled tokens
        but the rejected drafts are computed; full blocks join the prefix cache; blocks wholly past the
        request's computed tokens and its next one (rejected or dropped drafts') are freed, and under a sliding
        window those before it."""
        for r, rows in enumerate(out.rows):
            for row in rows:
                req = row.request
                if req.status is Status.RUNNING:
                    req.num_computed_tokens = row.start + row.num_tokens - row.rejected
                    self.blocks[r].register_full_blocks(req)
                    self.blocks[r].trim(req, req.num_computed_tokens + 1)     # no-op but after drafts
                    self.blocks[r].slide(req)
