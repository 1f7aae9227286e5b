"""Penalty state, one owner: which row each penalized request holds, and the rows on the devices.

Repetition / presence / frequency penalties (sampling.py `apply_penalties`) read, per row, a
prompt-token mask and output-token counts. They live on the devices while a request runs, as
two arrays bool[S + 1, V] and i32[S + 1, V] (S = max_num_seqs x dp rows; the last row is a
scratch row that padding rows of a step read and write):

* `assign(req)` (the driver, while planning a step): the request's row, and the first time
  (it starts or resumes running) the (row, prompt ids, output ids) the plan carries to load it;
* `load(...)` (every process, before the step's forward): write those rows;
* `add_sampled(counts, rows, tokens)` (inside the jitted penalized sampler, runner.py): count
  each row's sampled token;
* `release(request_id)` (the driver, when a request finishes or is preempted): free its row.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np


class Penalties:
    def __init__(self, num_slots: int, vocab_size: int, put: Callable[[np.ndarray], jax.Array]):
        """`put`: host array -> a device array replicated over the mesh."""
        self.num_slots, self.vocab_size, self.put = num_slots, vocab_size, put
        self.free = list(range(num_slots))[::-1]
        self.rows: dict[str, int] = {}            # request id -> its row, while it runs
        self.state: tuple[jax.Array, jax.Array] | None = None      # (mask, counts), created on first use

    @property
    def scratch(self) -> int:
        """The row that padding (and unpenalized) rows of a step point at."""
        return self.num_slots

    # --- the driver: rows ---------------------------------------------------------------------
    def assign(self, req) -> tuple[int, tuple[int, list[int], list[int]] | None]:
        """(row, load or None) for a penalized request in this step; `load` is (row, prompt ids, output ids)
        when the row is new to it (it starts running, or runs again after a preemption)."""
        row = self.rows.get(req.request_id)
        if row is not None:
            return row, None
        row = self.rows[req.request_id] = self.free.pop()
        return row, (row, req.token_ids[:req.prompt_len], req.output_token_ids)

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free.append(row)

    # --- every process: the device rows -----------------------------------------------------------
    def load(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Write a request's prompt-token mask and output counts into `row`."""
        if self.state is None:
            shape = (self.num_slots + 1, self.vocab_size)
            self.state = (self.put(np.zeros(shape, bool)), self.put(np.zeros(shape, np.int32)))
        mask = np.zeros(self.vocab_size, bool)
        mask[np.asarray(prompt_ids, np.int64)] = True
        counts = np.bincount(np.asarray(output_ids, np.int64), minlength=self.vocab_size).astype(np.int32)
        self.state = _set_row(*self.state, self.put(np.int32(row)), self.put(mask), self.put(counts))


@jax.jit
def _set_row(mask, counts, row, mask_row, counts_row):
    return mask.at[row].set(mask_row), counts.at[row].set(counts_row)


def add_sampled(counts: jax.Array, rows: jax.Array, tokens: jax.Array) -> jax.Array:
    """counts[rows[i], tokens[i]] += 1 (traceable): each row's new output token; padding rows point at
    the scratch row."""
    return counts.at[rows, tokens].add(1)
