"""Head planning (docs/design.md, "Heads that do not divide"): which attention heads live on which tp rank.

For (num_heads, num_kv_heads, tp) the plan gives every rank the same number of query
slots and KV slots. A slot holds a real head (its index) or padding (-1): padded
query heads carry zero weights and zero o_proj rows, so the sharded attention is exact.

* tp <= num_kv_heads: rank r holds KV heads [r*kv_local, (r+1)*kv_local) and all of their
  query heads; when tp does not divide num_kv_heads the last ranks get padded KV groups.
* tp > num_kv_heads: every rank holds one KV head, replicated over a contiguous run of
  ranks (vLLM's `kv_rank = tp_rank // replicas` when tp is a multiple of num_kv_heads);
  the head's query group is split across its replicas, padded to equal slot counts.

Within a rank, query slot s reads KV slot s // (q_local // kv_local).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """Which attention heads each tp rank holds; build it with `plan_heads(num_heads, num_kv_heads, tp)`.

    Fields: num_heads, num_kv_heads, tp; q_slots[tp][q_local] and kv_slots[tp][kv_local], the
    head index in each slot (-1 = padding). Derived: q_heads / kv_heads (as arrays), q_local,
    kv_local, group_local, kv_replicas, padded_q_heads, padded_kv_heads and the overheads.
    Row maps for layers: `expand_heads(plan.q_heads, head_dim)` (QKVParallelLinear uses them,
    and `RowParallelLinear.over_heads(plan, head_dim, ...)` builds the matching o_proj).
    Hashable (tuples, not arrays): layers keep it as static module metadata.
    """
    num_heads: int
    num_kv_heads: int
    tp: int
    q_slots: tuple[tuple[int, ...], ...]    # [tp][q_local]  query head per slot, -1 = padding
    kv_slots: tuple[tuple[int, ...], ...]   # [tp][kv_local] KV head per slot, -1 = padding

    @property
    def q_heads(self) -> np.ndarray:
        return np.array(self.q_slots, dtype=np.int64)

    @property
    def kv_heads(self) -> np.ndarray:
        return np.array(self.kv_slots, dtype=np.int64)

    @property
    def q_local(self) -> int:
        return len(self.q_slots[0])

    @property
    def kv_local(self) -> int:
        return len(self.kv_slots[0])

    @property
    def group_local(self) -> int:
        """Query slots per KV slot on one rank."""
        return self.q_local // self.kv_local

    @property
    def kv_replicas(self) -> int:
        """Most ranks holding one KV head (1 when tp <= num_kv_heads)."""
        held = self.kv_heads[self.kv_heads >= 0]
        return int(np.bincount(held).max())

    @property
    def padded_q_heads(self) -> int:
        return self.tp * self.q_local

    @property
    def padded_kv_heads(self) -> int:
        return self.tp * self.kv_local

    def q_overhead(self) -> float:
        """Extra q/o weight bytes over the unpadded model, as a fraction (0.0 = none)."""
        return self.padded_q_heads / self.num_heads - 1.0

    def kv_overhead(self) -> float:
        """Extra k/v weight and KV-cache bytes over the unpadded model, as a fraction."""
        return self.padded_kv_heads / self.num_kv_heads - 1.0

    def attention_param_overhead(self) -> float:
        """Extra q, k, v, o weight bytes as a fraction of the unpadded attention weights."""
        real = 2 * self.num_heads + 2 * self.num_kv_heads
        padded = 2 * self.padded_q_heads + 2 * self.padded_kv_heads
        return padded / real - 1.0

    def describe(self) -> str:
        return (f"heads {self.num_heads}q/{self.num_kv_heads}kv at tp={self.tp}: "
                f"{self.q_local}q/{self.kv_local}kv per rank, KV replicas {self.kv_replicas}, "
                f"q padding {self.q_overhead():.0%}, KV (cache) overhead {self.kv_overhead():.0%}, "
                f"attention weights +{self.attention_param_overhead():.0%}")


def plan_heads(num_heads: int, num_kv_heads: int, tp: int) -> HeadPlan:
    """The head layout for `tp` ranks; see the module docstring."""
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("tp", tp)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"plan_heads: {name}={v!r} must be a positive integer.")
    if num_heads % num_kv_heads:
        raise ValueError(f"plan_heads: num_heads={num_heads} is not a multiple of num_kv_heads="
                         f"{num_kv_heads}; each KV head must serve a whole group of query heads. "
                         f"Check the model config (num_attention_heads / num_key_value_heads).")
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        q, kv = _plan_split(num_kv_heads, group, tp)
    else:
        q, kv = _plan_replicate(num_kv_heads, group, tp)
    return HeadPlan(num_heads, num_kv_heads, tp, _tuples(q), _tuples(kv))


def _tuples(a: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in a)


def _plan_split(num_kv: int, group: int, tp: int) -> tuple[np.ndarray, np.ndarray]:
    kv_local = math.ceil(num_kv / tp)
    kv = np.arange(tp * kv_local).reshape(tp, kv_local)
    kv = np.where(kv < num_kv, kv, -1)
    q = kv[:, :, None] * group + np.arange(group)          # [tp, kv_local, group]
    q = np.where(kv[:, :, None] >= 0, q, -1)
    return q.reshape(tp, kv_local * group), kv


def _plan_replicate(num_kv: int, group: int, tp: int) -> tuple[np.ndarray, np.ndarray]:
    base, extra = divmod(tp, num_kv)
    replicas = [base + (h < extra) for h in range(num_kv)]   # contiguous runs of ranks
    q_local = max(math.ceil(group / r) for r in replicas)
    kv = np.repeat(np.arange(num_kv), replicas)[:, None]      # [tp, 1]
    q = np.full((tp, q_local), -1)
    rank = 0
    for h, r in enumerate(replicas):
        for i in range(r):
            heads = np.arange(i * q_local, min((i + 1) * q_local, group))
            q[rank, :heads.size] = h * group + heads
            rank += 1
    return q, kv


def plan_tables(num_heads: int, num_kv_heads: int, tps: tuple[int, ...]) -> str:
    """Markdown: a summary row per tp, then each tp's per-rank slots (docs/head_plan.md is this output)."""
    plans = [plan_heads(num_heads, num_kv_heads, tp) for tp in tps]
    lines = ["| tp | q slots / rank | KV slots / rank | KV replicas | padded q heads | padded KV heads "
             "| q/o weights | k/v weights, KV cache | attention weights |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        lines.append(f"| {p.tp} | {p.q_local} | {p.kv_local} | {p.kv_replicas} | {p.padded_q_heads} "
                     f"| {p.padded_kv_heads} | +{p.q_overhead():.0%} | +{p.kv_overhead():.0%} "
                     f"| +{p.attention_param_overhead():.0%} |")
    for p in plans:
        lines += ["", f"**tp = {p.tp}**: {p.describe()}", "", "| rank | query heads | KV heads |", "|---|---|---|"]
        for rank, (q, kv) in enumerate(zip(p.q_slots, p.kv_slots)):
            lines.append(f"| {rank} | {_slots(q)} | {_slots(kv)} |")
    return "\n".join(lines) + "\n"


def _slots(slots: tuple[int, ...]) -> str:
    return ", ".join("pad" if s < 0 else str(s) for s in slots)
