"""One step's input: the scheduled rows as a packed flat token batch in a few bucketed shapes.

Groups: the step runs G = dp * M groups (M pipeline micro-batches per dp replica); group
g = replica * M + m holds only replica `replica`'s rows. Inside a group the N tokens are

    [ D decode rows, one token each | the prefill rows' tokens, back to back | padding ]

(a row is one request's tokens this step). The dense layers see only these N tokens; for
attention the prefill tokens are gathered into a [P, T] layout (`prefill_index`): each row in
chunks of T = min(its bucketed length, PREFILL_CHUNK) queries, every chunk with its row's block
table (a chunk sees the keys its row wrote this step, at earlier positions, as the row itself
would). Chunks bound the padded queries and the [P, T, context] scores, which XLA:CPU
materializes and whose size, once past its caches, sets a prefill step's time: 6 prompts of
12-150 tokens as 8 rows of 256 took far longer than 12 chunks of 64 (scripts/bench_attention.py).
Decode rows are also laid out split-K for attention (the decode side of flash-decoding): each row's
context in chunks of DECODE_CHUNK positions, every chunk a virtual row with its own short block
table (`chunk_tables` [Rv, Cb]), its decode row (`chunk_row`; D for padding) and its first
position (`chunk_start`), built when the attention backend reads them (`split_k`, "bf16"), on
every step: a row's chunks follow from its own length, so its numbers never depend on the step's
other rows (a width gate on the step's longest row would). A backend that attends split-K then
reads only the blocks a row uses, not its bucketed table width (scripts/bench_attention.py
--decode, docs/performance.md).
The shape key (G, N, D, Wd, Rv, Cb, P, T, Wp) is bucketed, so a short list of programs is compiled
once (`StepShape`): N (>= 16), D and P, which the dense layers or the attention pay for, to
2^k or 3 * 2^k (at most a third padding); T (>= 16) and the block-table widths Wd, Wp (>= 8)
to powers of two.

Per group: ids, positions, slots [N] (slot = block * block_size + offset; -1 for padding),
block tables [D, Wd] and [P, Wp], the chunks' chunk_tables [Rv, Cb], chunk_row and chunk_start
[Rv], prefill_index [P, T] (N for padding), and `logits_index` [D + P]: the token whose logits
each sample row samples from. Sample row i < D is decode row i; a prefill row samples at its last
chunk's row, D + (that chunk), from its last token, and the other chunks' sample rows are padding.
`rows[g][i]` is the ScheduledRow behind sample row i (None: padding). A speculative row (a decode
and its drafts, tp_jax/serving/speculative.py) is 1 + k consecutive decode rows, each one token at
its own position with the same block table; each samples (`sample_offsets` numbers them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tp_jax.models.attention import SPLIT_K_BACKENDS
from tp_jax.serving.scheduler import ScheduledRow, SchedulerOutput

MIN_TOKENS = 16               # steps with a prefill; a decode-only step pays for its rows alone
MIN_PREFILL_WIDTH = 16
MIN_BLOCKS = 8                # short contexts share one table width (fewer compiled shapes)
PREFILL_CHUNK = 64            # the most queries of one prefill attention row (a power of two)
DECODE_CHUNK = SPLIT_K_BACKENDS["bf16"]   # positions of a decode row's split-K chunk (rounded up to whole blocks)


def chunk_blocks(block_size: int, positions: int = DECODE_CHUNK) -> int:
    """Cb, the blocks of one decode chunk: `positions` (the backend's, tp_jax/models/attention.py SPLIT_K_BACKENDS),
    at least one block."""
    return max(1, positions // block_size)


def decode_chunk_count(lengths: list[list[int]], block_size: int, positions: int = DECODE_CHUNK) -> int:
    """Rv for each group's decode row lengths (positions, the new token's included): the most chunks of a group."""
    span = chunk_blocks(block_size, positions) * block_size
    return fine_bucket(max((sum(-(-n // span) for n in group) for group in lengths), default=0))


def bucket(n: int, minimum: int = 1) -> int:
    """0 for 0, else the next power of two >= max(n, minimum)."""
    return 0 if n == 0 else max(minimum, 1 << (n - 1).bit_length())


def fine_bucket(n: int, minimum: int = 1) -> int:
    """0 for 0, else the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 * 2^k) >= max(n, minimum):
    at most a third of the bucket is padding: for the dims the dense layers pay for (tokens, decode rows)."""
    if n == 0:
        return 0
    n = max(n, minimum)
    p = bucket(n)
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= n else p


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    groups: int
    tokens: int            # N
    decode_rows: int       # D
    decode_blocks: int     # Wd (0 when D = 0)
    decode_chunks: int     # Rv, the split-K chunks of the decode rows (0 when D = 0)
    chunk_blocks: int      # Cb (0 when D = 0)
    prefill_rows: int      # P
    prefill_width: int     # T (0 when P = 0)
    prefill_blocks: int    # Wp (0 when P = 0)
    kv_groups: int = 1     # K, the pool's KV cache groups: slots and tables carry a K axis when K > 1

    @property
    def sample_rows(self) -> int:
        return self.decode_rows + self.prefill_rows


@dataclasses.dataclass
class StepBatch:
    shape: StepShape
    ids: np.ndarray              # i32[G, N]
    positions: np.ndarray        # i32[G, N]
    slots: np.ndarray            # i32[G, N]          (with K KV cache groups: [G, K, N], and each table's [G, K, ...])
    decode_tables: np.ndarray    # i32[G, D, Wd]
    chunk_tables: np.ndarray     # i32[G, Rv, Cb]
    chunk_row: np.ndarray        # i32[G, Rv]: the decode row of each chunk (D: padding)
    chunk_start: np.ndarray      # i32[G, Rv]: the chunk's first position
    prefill_tables: np.ndarray   # i32[G, P, Wp]
    prefill_index: np.ndarray    # i32[G, P, T]
    logits_index: np.ndarray     # i32[G, D + P]
    rows: list[list[ScheduledRow | None]]
    lora_slots: np.ndarray | None = None    # i32[G, N]: each token's adapter slot (-1: none); not packed

    ARRAYS = ("ids", "positions", "slots", "decode_tables", "chunk_tables", "chunk_row", "chunk_start",
              "prefill_tables", "prefill_index", "logits_index")

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.ARRAYS}

    def packed(self) -> np.ndarray:
        """Every array in one i32[G, L] buffer (one transfer per step); `unpack` reverses it."""
        g = self.shape.groups
        return np.concatenate([getattr(self, k).reshape(g, -1) for k in self.ARRAYS], axis=1)

    @classmethod
    def empty(cls, s: StepShape) -> StepBatch:
        """An all-padding step of shape `s` (writes nothing, samples nothing): for warm-up."""
        g, n, d, p, rv = s.groups, s.tokens, s.decode_rows, s.prefill_rows, s.decode_chunks
        k = () if s.kv_groups == 1 else (s.kv_groups,)
        z = lambda *shape: np.zeros(shape, np.int32)                                # noqa: E731
        return cls(s, z(g, n), z(g, n), np.full((g, *k, n), -1, np.int32), z(g, *k, d, s.decode_blocks),
                   z(g, *k, rv, s.chunk_blocks), np.full((g, rv), d, np.int32), z(g, rv),
                   z(g, *k, p, s.prefill_blocks), np.full((g, p, s.prefill_width), n, np.int32), z(g, d + p),
                   [[None] * (d + p) for _ in range(g)])


def packed_layout(s: StepShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, per-group shape) of each array in `StepBatch.packed`, in order."""
    n, d, p, rv = s.tokens, s.decode_rows, s.prefill_rows, s.decode_chunks
    k = () if s.kv_groups == 1 else (s.kv_groups,)
    return [("ids", (n,)), ("positions", (n,)), ("slots", (*k, n)), ("decode_tables", (*k, d, s.decode_blocks)),
            ("chunk_tables", (*k, rv, s.chunk_blocks)), ("chunk_row", (rv,)), ("chunk_start", (rv,)),
            ("prefill_tables", (*k, p, s.prefill_blocks)), ("prefill_index", (p, s.prefill_width)),
            ("logits_index", (d + p,))]


def unpack(packed, s: StepShape) -> dict:
    """The arrays of a packed [B, L] buffer (numpy or jax; B groups, or the local ones under shard_map)."""
    out, off = {}, 0
    for name, shape in packed_layout(s):
        size = int(np.prod(shape))
        out[name] = packed[:, off:off + size].reshape(packed.shape[0], *shape)
        off += size
    return out


def _split(rows: list[ScheduledRow], m: int) -> list[tuple[list[ScheduledRow], list[ScheduledRow]]]:
    """A replica's rows into m micro-batches: decodes round-robin (a speculative row's query rows stay
    together: each reads the keys the ones before it write), prefills to the lightest group."""
    groups = [([], []) for _ in range(m)]
    decodes = [r for r in rows if r.decodes]
    for i, r in enumerate(decodes):
        groups[i % m][0].append(r)
    load = [0] * m
    for r in sorted((r for r in rows if not r.decodes), key=lambda r: -r.num_tokens):
        g = load.index(min(load))
        groups[g][1].append(r)
        load[g] += r.num_tokens
    return groups


def prefill_layout(lengths: list[list[int]], chunk: int = PREFILL_CHUNK) -> tuple[int, int]:
    """(P, T) for each group's prefill row lengths: T the chunk width, P the most chunks of a group."""
    longest = max((k for group in lengths for k in group), default=0)
    if longest == 0:
        return 0, 0
    t = min(bucket(longest, MIN_PREFILL_WIDTH), chunk)
    return fine_bucket(max(sum(-(-k // t) for k in group) for group in lengths)), t


def _blocks(rows: list[ScheduledRow], block_size: int) -> int:
    return bucket(max((-(-(r.start + r.num_tokens) // block_size) for r in rows), default=0), MIN_BLOCKS)


def build_batch(out: SchedulerOutput, tables: list[dict[str, list]], block_size: int,
                microbatches: int, chunk: int = PREFILL_CHUNK, split_k: int = 0, kv_groups: int = 1) -> StepBatch:
    """`tables[replica][request_id]` is each scheduled request's block table (with `kv_groups` K > 1 KV cache
    groups, its K tables: BlockManager.step_tables; slots and tables then get a K axis); `chunk` the most queries
    of a prefill attention row (a power of two; scripts/bench_attention.py compares them); `split_k`:
    the positions of a decode chunk (> 0: also the decode rows' split-K chunks, for the backends that read
    them, tp_jax/models/attention.py SPLIT_K_BACKENDS), on every step with decode rows; 0: Rv = Cb = 0."""
    groups = [(r, g) for r, rows in enumerate(out.rows) for g in _split(rows, microbatches)]
    decodes = [row for _, (dec, _) in groups for row in dec]
    prefills = [row for _, (_, pre) in groups for row in pre]
    p, t = prefill_layout([[r.num_tokens for r in pre] for _, (_, pre) in groups], chunk)
    wd = _blocks(decodes, block_size)
    split_k = split_k if decodes else 0
    queries = [[(row, j) for row in dec for j in range(row.num_tokens)] for _, (dec, _) in groups]
    s = StepShape(
        groups=len(groups),
        tokens=fine_bucket(max(len(q) + sum(r.num_tokens for r in pre) for q, (_, (_, pre)) in zip(queries, groups)),
                           MIN_TOKENS if prefills else 1),
        decode_rows=fine_bucket(max(len(q) for q in queries)),
        decode_blocks=wd,
        decode_chunks=decode_chunk_count([[r.start + j + 1 for r, j in q] for q in queries], block_size, split_k)
        if split_k else 0,
        chunk_blocks=chunk_blocks(block_size, split_k) if split_k else 0,
        prefill_rows=p, prefill_width=t, prefill_blocks=_blocks(prefills, block_size), kv_groups=kv_groups)
    g_n, n, d, p, kv = s.groups, s.tokens, s.decode_rows, s.prefill_rows, kv_groups
    ids, pos = np.zeros((g_n, n), np.int32), np.zeros((g_n, n), np.int32)
    slots = np.full((g_n, kv, n), -1, np.int32)                    # a K axis while filling, dropped for K = 1
    dec_tables = np.zeros((g_n, kv, d, s.decode_blocks), np.int32)
    chunk_tables = np.zeros((g_n, kv, s.decode_chunks, s.chunk_blocks), np.int32)
    chunk_row = np.full((g_n, s.decode_chunks), d, np.int32)
    chunk_start = np.zeros((g_n, s.decode_chunks), np.int32)
    pre_tables = np.zeros((g_n, kv, p, s.prefill_blocks), np.int32)
    per_group = (lambda t: [t]) if kv == 1 else (lambda t: t)          # noqa: E731
    pre_index = np.full((g_n, p, s.prefill_width), n, np.int32)
    logits_index = np.zeros((g_n, d + p), np.int32)
    lora_slots = np.full((g_n, n), -1, np.int32)
    sample_rows: list[list[ScheduledRow | None]] = []
    for g, (replica, (dec, pre)) in enumerate(groups):
        mine: list[ScheduledRow | None] = [None] * (d + p)
        for i, (row, j) in enumerate(queries[g]):              # a speculative row: one query row per token
            for k, table in enumerate(per_group(tables[replica][row.request.request_id])):
                _fill(row, table, block_size, i, ids[g], pos[g], slots[g, k], dec_tables[g, k, i], j)
            logits_index[g, i] = i
            lora_slots[g, i] = row.request.lora_slot
            mine[i] = row
        for k in range(kv if split_k else 0):
            split_decode_rows([r.start + j + 1 for r, j in queries[g]], dec_tables[g, k], block_size,
                              chunk_tables[g, k], chunk_row[g], chunk_start[g])
        off, j = len(queries[g]), 0
        for row in pre:
            first = j
            for k, table in enumerate(per_group(tables[replica][row.request.request_id])):
                _fill(row, table, block_size, off, ids[g], pos[g], slots[g, k], pre_tables[g, k, first])
            for c in range(0, row.num_tokens, t):                               # the row's chunks
                pre_index[g, j, :min(t, row.num_tokens - c)] = np.arange(off + c, off + min(c + t, row.num_tokens))
                pre_tables[g, :, j] = pre_tables[g, :, first]
                j += 1
            lora_slots[g, off:off + row.num_tokens] = row.request.lora_slot
            off += row.num_tokens
            logits_index[g, d + j - 1] = off - 1
            mine[d + j - 1] = row
        sample_rows.append(mine)
    if kv == 1:
        slots, dec_tables, chunk_tables, pre_tables = (x[:, 0] for x in (slots, dec_tables, chunk_tables, pre_tables))
    return StepBatch(s, ids, pos, slots, dec_tables, chunk_tables, chunk_row, chunk_start, pre_tables, pre_index,
                     logits_index, sample_rows, lora_slots)


def sample_offsets(rows: list[ScheduledRow | None]) -> list[int]:
    """For one group's sample rows: each row's token within its ScheduledRow (0 but for the query rows
    of a speculative row, which follow each other: 0, 1, ..., k)."""
    out = []
    for i, row in enumerate(rows):
        out.append(out[-1] + 1 if i and row is not None and rows[i - 1] is row else 0)
    return out


def sampled_rows(rows: list[ScheduledRow | None]) -> list[tuple[int, ScheduledRow]]:
    """(first sample row, ScheduledRow) of each row that samples this step: a speculative row once, at its
    newest token's query row (its drafts' rows follow it)."""
    return [(i, row) for i, (row, j) in enumerate(zip(rows, sample_offsets(rows)))
            if row is not None and row.samples and j == 0]


def split_decode_rows(lengths: list[int], tables: np.ndarray, block_size: int, chunk_tables: np.ndarray,
                      chunk_row: np.ndarray, chunk_start: np.ndarray) -> None:
    """Lay decode rows with lengths[i] positions (the new token's included) and block tables[i] out as
    split-K chunks of Cb = chunk_tables.shape[1] blocks, in row order, into the three arrays. The caller
    fills them with padding first (chunk_row = D, the step's decode row count): the chunks past the
    last row's stay padding."""
    cb = chunk_tables.shape[1]
    v = 0
    for i, n in enumerate(lengths):
        used = tables[i, :-(-n // block_size)]
        for b in range(0, len(used), cb):
            chunk_tables[v, :len(used[b:b + cb])] = used[b:b + cb]
            chunk_row[v], chunk_start[v] = i, b * block_size
            v += 1


def _fill(row: ScheduledRow, table: list[int], block_size: int, off: int, ids, pos, slots, table_out,
          query: int | None = None) -> None:
    """Write one row's tokens at ids[off:], positions, slots, and its block table; `query`: only its
    token `query` (one query row of a speculative row), with the table up to that token."""
    k, start = row.num_tokens, row.start
    tokens = row.token_ids()
    if query is not None:
        k, start, tokens = 1, start + query, tokens[query:query + 1]
    positions = np.arange(start, start + k, dtype=np.int32)
    blocks = np.asarray(table, np.int32)
    ids[off:off + k] = tokens
    pos[off:off + k] = positions
    slots[off:off + k] = blocks[positions // block_size] * block_size + positions % block_size
    used = -(-(start + k) // block_size)
    table_out[:used] = np.maximum(blocks[:used], 0)          # a block freed out of the window (-1): block 0, unseen
