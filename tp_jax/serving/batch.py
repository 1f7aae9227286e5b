"""One step's input: the scheduled rows as a flat token batch in a few bucketed shapes.

Groups: the step runs G = dp * M groups (M pipeline micro-batches per dp replica); group
g = replica * M + m holds only replica `replica`'s rows. Inside a group the N tokens are

    [ D decode rows, one token each | P prefill rows, T tokens each ]      N = D + P * T

(a row is one request's tokens this step; prefill rows shorter than T are padded). The
shape key (G, D, P, T, W) is bucketed: D, P and W (blocks per row) to powers of two, T to a
power of two >= 16, so a short list of programs is compiled once (`StepShape`).

Per group: ids, positions, slots [N] (slot = block * block_size + offset; -1 for padding),
block tables [D, W] and [P, W], and `logits_index` [D + P]: the token whose logits each row
samples from (its last). `rows[g][i]` is the ScheduledRow behind sample row i (None: padding).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tp_jax.serving.scheduler import ScheduledRow, SchedulerOutput

MIN_PREFILL_WIDTH = 16


def bucket(n: int, minimum: int = 1) -> int:
    """0 for 0, else the next power of two >= max(n, minimum)."""
    return 0 if n == 0 else max(minimum, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    groups: int
    decode_rows: int       # D
    prefill_rows: int      # P
    prefill_width: int     # T (0 when P = 0)
    blocks: int            # W, block-table width

    @property
    def tokens(self) -> int:
        return self.decode_rows + self.prefill_rows * self.prefill_width

    @property
    def sample_rows(self) -> int:
        return self.decode_rows + self.prefill_rows


@dataclasses.dataclass
class StepBatch:
    shape: StepShape
    ids: np.ndarray              # i32[G, N]
    positions: np.ndarray        # i32[G, N]
    slots: np.ndarray            # i32[G, N]
    decode_tables: np.ndarray    # i32[G, D, W]
    prefill_tables: np.ndarray   # i32[G, P, W]
    logits_index: np.ndarray     # i32[G, D + P]
    rows: list[list[ScheduledRow | None]]

    ARRAYS = ("ids", "positions", "slots", "decode_tables", "prefill_tables", "logits_index")

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.ARRAYS}


def _split(rows: list[ScheduledRow], m: int) -> list[tuple[list[ScheduledRow], list[ScheduledRow]]]:
    """A replica's rows into m micro-batches: decodes round-robin, prefills to the lightest group."""
    groups = [([], []) for _ in range(m)]
    decodes = [r for r in rows if r.num_tokens == 1]
    for i, r in enumerate(decodes):
        groups[i % m][0].append(r)
    load = [0] * m
    for r in sorted((r for r in rows if r.num_tokens > 1), key=lambda r: -r.num_tokens):
        g = load.index(min(load))
        groups[g][1].append(r)
        load[g] += r.num_tokens
    return groups


def build_batch(out: SchedulerOutput, tables: list[dict[str, list[int]]], block_size: int,
                microbatches: int) -> StepBatch:
    """`tables[replica][request_id]` is each scheduled request's block table."""
    groups = [(r, g) for r, rows in enumerate(out.rows) for g in _split(rows, microbatches)]
    rows_all = [row for _, (dec, pre) in groups for row in dec + pre]
    shape = StepShape(
        groups=len(groups),
        decode_rows=bucket(max(len(dec) for _, (dec, _) in groups)),
        prefill_rows=bucket(max(len(pre) for _, (_, pre) in groups)),
        prefill_width=bucket(max((r.num_tokens for _, (_, pre) in groups for r in pre), default=0),
                             MIN_PREFILL_WIDTH),
        blocks=bucket(max(-(-(r.start + r.num_tokens) // block_size) for r in rows_all)))
    g_n, n, d, p, t, w = shape.groups, shape.tokens, shape.decode_rows, shape.prefill_rows, \
        shape.prefill_width, shape.blocks
    ids, pos = np.zeros((g_n, n), np.int32), np.zeros((g_n, n), np.int32)
    slots = np.full((g_n, n), -1, np.int32)
    dec_tables, pre_tables = np.zeros((g_n, d, w), np.int32), np.zeros((g_n, p, w), np.int32)
    logits_index = np.zeros((g_n, d + p), np.int32)
    sample_rows: list[list[ScheduledRow | None]] = []
    for g, (replica, (dec, pre)) in enumerate(groups):
        mine: list[ScheduledRow | None] = [None] * (d + p)
        for i, row in enumerate(dec):
            _fill(row, tables[replica][row.request.request_id], block_size, i, ids[g], pos[g], slots[g],
                  dec_tables[g, i])
            logits_index[g, i] = i
            mine[i] = row
        for j, row in enumerate(pre):
            off = d + j * t
            _fill(row, tables[replica][row.request.request_id], block_size, off, ids[g], pos[g], slots[g],
                  pre_tables[g, j])
            logits_index[g, d + j] = off + row.num_tokens - 1
            mine[d + j] = row
        sample_rows.append(mine)
    return StepBatch(shape, ids, pos, slots, dec_tables, pre_tables, logits_index, sample_rows)


def _fill(row: ScheduledRow, table: list[int], block_size: int, off: int, ids, pos, slots, table_out) -> None:
    """Write one row's tokens at ids[off:], positions, slots, and its block table."""
    k, start = row.num_tokens, row.start
    positions = np.arange(start, start + k, dtype=np.int32)
    blocks = np.asarray(table, np.int32)
    ids[off:off + k] = row.request.token_ids[start:start + k]
    pos[off:off + k] = positions
    slots[off:off + k] = blocks[positions // block_size] * block_size + positions % block_size
    used = -(-(start + k) // block_size)
    table_out[:used] = blocks[:used]
