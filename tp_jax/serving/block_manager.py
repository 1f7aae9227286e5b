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
"""

from __future__ import annotations

import collections

from tp_jax.serving.request import Request

NULL_BLOCK = -1          # a table entry whose block was freed (out of the window); the batch reads block 0 there


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self.prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}       # leading blocks of a request already hashed/registered
        self.num_dropped: dict[str, int] = {}          # leading blocks of a request freed (out of the window)
        self.prefix_queries = 0                          # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                             # of which found

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def computed_blocks(self, req: Request) -> list[int]:
        """The cached blocks that hold req's leading tokens (at most num_tokens - 1 of them: the
        last token is always computed, so its logits exist). None while req still collects prompt
        logprobs: cached blocks have no logits (tp_jax/serving/prompt_logprobs.py)."""
        if not self.prefix_caching or req.scoring_prompt:
            return []
        hits = []
        for h in req.hashes_upto((req.num_tokens - 1) // self.block_size, self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self, req: Request, num_tokens: int, hits: list[int] = ()) -> bool:
        """Give req blocks for its first `num_tokens` tokens, starting with `hits` (from
        `computed_blocks`, first admission only). False, and nothing changed, if too few are free."""
        table = self.tables.get(req.request_id, [])
        need = -(-num_tokens // self.block_size) - len(table) - len(hits)
        reclaimed = sum(1 for b in hits if self.ref[b] == 0)          # cached blocks now in the free queue
        if need > self.num_free - reclaimed:
            return False
        table = self.tables.setdefault(req.request_id, table)
        for b in hits:
            if self.ref[b] == 0:
                del self.free_queue[b]
            self.ref[b] += 1
            table.append(b)
        if hits:
            self.num_registered[req.request_id] = len(hits)
        for _ in range(max(need, 0)):
            b, _ = self.free_queue.popitem(last=False)
            if self.hash_of[b] is not None:                             # evict its cached content
                if self.cached.get(self.hash_of[b]) == b:
                    del self.cached[self.hash_of[b]]
                self.hash_of[b] = None
            self.ref[b] = 1
            table.append(b)
        return True

    def register_full_blocks(self, req: Request) -> None:
        """Register req's computed, full blocks under their hashes (after a step)."""
        if not self.prefix_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size   # accepted drafts: next time
        done = self.num_registered.get(req.request_id, 0)
        if full <= done:
            return
        table = self.tables[req.request_id]
        for i, h in enumerate(req.hashes_upto(full, self.block_size)[done:], start=done):
            b = table[i]
            if b != NULL_BLOCK and self.hash_of[b] is None and h not in self.cached:
                self.cached[h] = b
                self.hash_of[b] = h
        self.num_registered[req.request_id] = full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free req's blocks past its first `num_tokens` tokens (a rejected speculative run's): never
        registered, they go to the head of the free queue."""
        table = self.tables.get(req.request_id, [])
        while len(table) > -(-num_tokens // self.block_size):
            b = table.pop()
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_queue[b] = None
                self.free_queue.move_to_end(b, last=False)

    def free(self, req: Request) -> None:
        """Release req's blocks, last first, so a prefix outlives its tail in the cache."""
        self.num_registered.pop(req.request_id, None)
        self.num_dropped.pop(req.request_id, None)
        for b in reversed(self.tables.pop(req.request_id, [])):
            if b != NULL_BLOCK:
                self._release(b)

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free_queue[b] = None
            if self.hash_of[b] is None:
                self.free_queue.move_to_end(b, last=False)

    def slide(self, req: Request) -> None:
        """Free req's leading blocks that no query from its next token on can see (sliding window only): block i
        holds positions up to (i + 1) * block_size - 1, and a query at p >= num_computed_tokens sees keys above
        p - window."""
        if self.window is None:
            return
        table = self.tables.get(req.request_id, [])
        gone = max(0, (req.num_computed_tokens - self.window + 1) // self.block_size)
        for i in range(self.num_dropped.get(req.request_id, 0), min(gone, len(table))):
            self._release(table[i])
            table[i] = NULL_BLOCK
        self.num_dropped[req.request_id] = max(self.num_dropped.get(req.request_id, 0), min(gone, len(table)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks, weight swaps); only when no request holds blocks."""
        if self.tables:
            return False
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
        return True

    def count_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens
