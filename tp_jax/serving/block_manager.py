"""The block manager of one dp replica's KV pool (vLLM v1's KVCacheManager + BlockPool), with prefix caching.

Blocks hold `block_size` tokens' keys and values. Each request owns a block table (its
blocks in token order); blocks are allocated on demand as it grows and freed when it ends.

Prefix caching: once a block is full and computed, it is registered under its content hash
(parent hash + token ids, see `Request.hashes_upto`). A new request whose leading blocks'
hashes are registered reuses those blocks (reference-counted) instead of recomputing them.
A freed block keeps its hash and waits in the free queue, least recently freed first; it is
evicted (hash dropped) only when a fresh block is needed and it is at the head. Freed
blocks that hold no cached content go to the head, so cached ones stay longest.

Sliding window (`window`: every layer sees only the latest `window` keys, vLLM's SlidingWindowManager for a
model with one kind of layer): after each step a request's blocks that no query still to come can see are freed
as a finished request's are (a cached one keeps its hash) and its table holds NULL_BLOCK in their place, so
a sequence holds about (window + the step's tokens) / block_size blocks however long it grows.

KV cache groups (`windows`: one entry per group, tp_jax/models/cache.py KVGroups; vLLM's hybrid KV cache
coordinator): one free pool shared by every group, and per request one table per group, all of the same length
(a group's entry i holds its layers' keys of tokens i * block_size ..). A full group (window None) keeps every
block; a sliding group frees what its window no longer reaches, as above. Admission and preemption count blocks
over all groups. Each group registers its own full blocks; a prefix-cache hit of n blocks needs every full
group's blocks 0 .. n - 1 and every sliding group's blocks within its window of position n * block_size (vLLM's
SlidingWindowManager.find_longest_cache_hit), its earlier entries NULL_BLOCK. One group is today's manager.
"""

from __future__ import annotations

import collections

from tp_jax.serving.request import Request

NULL_BLOCK = -1          # a table entry whose block was freed (out of the window); the batch reads block 0 there


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,)):
        """`windows`: each KV cache group's sliding window (None: full attention); one entry: one table per
        sequence (every layer's window, or none)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.windows = tuple(windows)
        self.prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.group_of = [0] * num_blocks                 # the group whose cache a hashed block is registered in
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.group_cached: list[dict[bytes, int]] = [{} for _ in self.windows]
        self.group_tables: list[dict[str, list[int]]] = [{} for _ in self.windows]
        self.group_dropped: list[dict[str, int]] = [{} for _ in self.windows]   # leading blocks freed (window)
        self.cached, self.tables = self.group_cached[0], self.group_tables[0]   # one group: today's names
        self.num_registered: dict[str, int] = {}       # leading blocks of a request already hashed/registered
        self.prefix_queries = 0                          # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                             # of which found

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def step_tables(self) -> dict[str, list[int] | list[list[int]]]:
        """Each request's block table (one group), or its tables, one per group (what `build_batch` reads)."""
        if self.num_groups == 1:
            return self.tables
        return {rid: [t[rid] for t in self.group_tables] for rid in self.tables}

    def _first_seen(self, g: int, num_blocks: int) -> int:
        """The first block of group g that a query at position num_blocks * block_size can see."""
        w = self.windows[g]
        return 0 if w is None else max(0, (num_blocks * self.block_size - w + 1) // self.block_size)

    def computed_blocks(self, req: Request) -> list[list[int]]:
        """Per group, the cached blocks that hold req's leading tokens (at most num_tokens - 1 of them: the
        last token is always computed, so its logits exist; a sliding group's entries out of its window
        NULL_BLOCK). Empty while req still collects prompt logprobs: cached blocks have no logits
        (tp_jax/serving/prompt_logprobs.py)."""
        if not self.prefix_caching or req.scoring_prompt:
            return [[] for _ in self.windows]
        hashes = req.hashes_upto((req.num_tokens - 1) // self.block_size, self.block_size)
        found = [[c.get(h) for h in hashes] for c in self.group_cached]
        n = len(hashes)
        for g, w in enumerate(self.windows):
            if w is None or self.num_groups == 1:          # one group keeps today's rule: every leading block
                n = min(n, next((i for i, b in enumerate(found[g]) if b is None), n))
        while n and not all(None not in found[g][self._first_seen(g, n):n]
                            for g, w in enumerate(self.windows) if w is not None):
            n -= 1
        return [[NULL_BLOCK] * self._first_seen(g, n) + found[g][self._first_seen(g, n):n]
                for g in range(self.num_groups)]

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self, req: Request, num_tokens: int, hits: list[list[int]] | None = None) -> bool:
        """Give req blocks for its first `num_tokens` tokens in every group, starting with `hits` (from
        `computed_blocks`, first admission only). False, and nothing changed, if too few are free."""
        rid, blocks = req.request_id, -(-num_tokens // self.block_size)
        hits = hits or [[] for _ in self.windows]
        tables = [t.get(rid, []) for t in self.group_tables]
        need = [max(blocks - len(t) - len(h), 0) for t, h in zip(tables, hits)]
        reclaimed = sum(1 for h in hits for b in h if b != NULL_BLOCK and self.ref[b] == 0)   # cached, free queue
        if sum(need) > self.num_free - reclaimed:
            return False
        for g, (table, h) in enumerate(zip(tables, hits)):
            table = self.group_tables[g].setdefault(rid, table)
            for b in h:
                if b != NULL_BLOCK:
                    if self.ref[b] == 0:
                        del self.free_queue[b]
                    self.ref[b] += 1
                table.append(b)
            lead = next((i for i, b in enumerate(h) if b != NULL_BLOCK), len(h))     # out of its window
            if lead:
                self.group_dropped[g][rid] = lead
            for _ in range(need[g]):
                table.append(self._fresh())
        if hits[0]:
            self.num_registered[rid] = len(hits[0])
        return True

    def _fresh(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        if self.hash_of[b] is not None:                             # evict its cached content
            cached = self.group_cached[self.group_of[b]]
            if cached.get(self.hash_of[b]) == b:
                del cached[self.hash_of[b]]
            self.hash_of[b] = None
        self.ref[b] = 1
        return b

    def register_full_blocks(self, req: Request) -> None:
        """Register req's computed, full blocks under their hashes, in each group (after a step)."""
        if not self.prefix_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size   # accepted drafts: next time
        done = self.num_registered.get(req.request_id, 0)
        if full <= done:
            return
        hashes = req.hashes_upto(full, self.block_size)
        for g, cached in enumerate(self.group_cached):
            table = self.group_tables[g][req.request_id]
            for i, h in enumerate(hashes[done:], start=done):
                b = table[i]
                if b != NULL_BLOCK and self.hash_of[b] is None and h not in cached:
                    cached[h] = b
                    self.hash_of[b], self.group_of[b] = h, g
        self.num_registered[req.request_id] = full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free req's blocks past its first `num_tokens` tokens (a rejected speculative run's): never
        registered, they go to the head of the free queue."""
        for tables in self.group_tables:
            table = tables.get(req.request_id, [])
            while len(table) > -(-num_tokens // self.block_size):
                b = table.pop()
                if b == NULL_BLOCK:
                    continue
                self.ref[b] -= 1
                if self.ref[b] == 0:
                    self.free_queue[b] = None
                    self.free_queue.move_to_end(b, last=False)

    def free(self, req: Request) -> None:
        """Release req's blocks, last first, so a prefix outlives its tail in the cache."""
        self.num_registered.pop(req.request_id, None)
        for tables, dropped in zip(self.group_tables, self.group_dropped):
            dropped.pop(req.request_id, None)
            for b in reversed(tables.pop(req.request_id, [])):
                if b != NULL_BLOCK:
                    self._release(b)

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free_queue[b] = None
            if self.hash_of[b] is None:
                self.free_queue.move_to_end(b, last=False)

    def slide(self, req: Request) -> None:
        """In each sliding group, free req's leading blocks that no query from its next token on can see: block i
        holds positions up to (i + 1) * block_size - 1, and a query at p >= num_computed_tokens sees keys above
        p - window."""
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            table, dropped = self.group_tables[g].get(req.request_id, []), self.group_dropped[g]
            gone = min(max(0, (req.num_computed_tokens - w + 1) // self.block_size), len(table))
            for i in range(dropped.get(req.request_id, 0), gone):
                if table[i] != NULL_BLOCK:
                    self._release(table[i])
                table[i] = NULL_BLOCK
            dropped[req.request_id] = max(dropped.get(req.request_id, 0), gone)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks, weight swaps); only when no request holds blocks."""
        if self.tables:
            return False
        for cached in self.group_cached:
            cached.clear()
        self.hash_of = [None] * self.num_blocks
        return True

    def count_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens
