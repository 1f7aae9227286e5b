"""The mixture-of-experts feed-forward block (vLLM's `FusedMoE`), in two layouts over the mesh.

    logits = x W_r                      router, replicated, float32 logits [T, E]
    p = softmax(logits); w, e = top_k(p)   (renormalize: w /= sum(w), Mixtral / norm_topk_prob)
    y = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))   (+ sigmoid(x W_s) * shared(x), Qwen2-MoE)

Layouts (vLLM's `enable_expert_parallel`, `FusedMoEParallelConfig`):

* TP (default): every rank holds every expert, each expert's intermediate dim split over tp
  like a dense MLP: `gate_up[E, D, 2F/tp]`, `down[E, F/tp, D]`; one psum over tp (shared
  expert's partial sum included).
* EP: the dp x tp devices of a pipeline stage are one expert group of ep = dp * tp ranks; rank
  r (= dp_index * tp + tp_index) holds whole experts, vLLM's `determine_expert_map` order
  (E // ep each, the first E % ep ranks one more), padded to E_local = ceil(E / ep) slots with
  never-routed zero experts: `gate_up[ep * E_local, D, 2F]` split over ("dp", "tp"). Tokens are
  dp-sharded: the block all-gathers them over dp, routes all of them, runs its local experts,
  reduce-scatters the partial sums back over dp and psums over tp (tp ranks hold other experts).

Dispatch (local): assignments (token, choice) are either
* "gather": each assignment multiplies its expert's weight gathered by index, `[A, D, 2F]`
  (reads only the routed experts: decode, where assignments <= local experts), or
* "ragged": assignments sorted by expert, one `jax.lax.ragged_dot` per projection (XLA's grouped
  GEMM on GPU/TPU; on CPU jax lowers it to a masked dot over every group, measured far slower
  than the others by scripts/bench_moe.py), or
* "dense": every local expert on every token as batched GEMMs, weighted by the routing matrix
  (zero where not routed): each local weight read once; for large steps on CPU.
"auto": gather when the step's assignments are at most the local experts (decode: cost follows
the routed experts, not the total), else dense on CPU and ragged elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel import collectives
from tp_jax.parallel.invariant import row_softmax
from tp_jax.parallel.layers.base import ParallelModule, check_tp_size, default_kernel_init
from tp_jax.parallel.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tp_jax.parallel.layers.loading import ExpertParam, PartRows, ShardedParam, contiguous_rows
from tp_jax.parallel.layers.method import EXPERTS, UNQUANTIZED, LinearMethod, Unquantized, UnsupportedLayerError
from tp_jax.parallel.mesh import DP, TP

DISPATCHES = ("auto", "gather", "ragged", "dense")


def expert_slots(num_experts: int, ep: int) -> np.ndarray:
    """[ep, ceil(E / ep)]: the experts rank r holds (vLLM's `determine_expert_map`), -1 = a padding slot."""
    base, extra = divmod(num_experts, ep)
    local = -(-num_experts // ep)
    slots = np.full((ep, local), -1, np.int64)
    for r in range(ep):
        start, n = r * base + min(r, extra), base + (r < extra)
        slots[r, :n] = np.arange(start, start + n)
    return slots


class Experts(ParallelModule):
    """E experts' SwiGLU weights, stacked: `gate_up[E_slots, D, 2F_local]`, `down[E_slots, F_local, D]`.

    Args: `num_experts` E, `hidden_size` D, `intermediate_size` F (one expert's), `tp_size`,
    `ep_size` (None: the TP layout; k: whole experts over k = dp * tp ranks), `dtype`, `rngs`.
    Checkpoint parts per expert e: "gate.e", "up.e" `[F, D]` and "down.e" `[D, F]` (torch layout).
    `method`: `Unquantized` (the float kernels) or, after `use_method(Int8())`, int8 kernels of the same
    shapes with per-expert output-channel scales `gate_up_scale[E_slots, 2F_local]`, `down_scale[E_slots, D]`
    (layers/int8.py); the loader picks it like a linear layer's (kind EXPERTS).
    """
    weight_name, weight_kind = "gate_up", EXPERTS

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, tp_size: int = 1,
                 ep_size: int | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        check_tp_size(tp_size, type(self).__name__)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp_size, self.ep_size = tp_size, ep_size
        if ep_size is None:
            if intermediate_size % tp_size:
                raise ValueError(f"{type(self).__name__}: moe intermediate_size={intermediate_size} is not divisible "
                                 f"by tp={tp_size} (each expert's width splits over tp); choose a tp that divides "
                                 f"{intermediate_size}, or enable expert parallelism (enable_expert_parallel=True), "
                                 f"which keeps each expert whole")
            self.slots, self.local_experts = None, num_experts
        else:
            self.slots = tuple(map(tuple, expert_slots(num_experts, ep_size).tolist()))
            self.local_experts = len(self.slots[0])
        self.method, self.param_dtype = UNQUANTIZED, jnp.dtype(dtype)
        init = default_kernel_init()
        for name, decl in self.statements().items():
            shape = self._global_shape(name)
            setattr(self, name, nnx.Param(init(rngs.params(), shape, dtype), out_sharding=decl.spec()))

    def _global_shape(self, name: str) -> tuple[int, int, int]:
        slots = self.num_experts if self.slots is None else len(self.slots) * self.local_experts
        d, f = self.hidden_size, self.intermediate_size
        return (slots, d, 2 * f) if name == "gate_up" else (slots, f, d)

    def loading(self) -> dict[str, ShardedParam]:
        """The float statements, or, under a method (int8), the params it derives from them (values, scales)."""
        decl = self.statements()
        if isinstance(self.method, Unquantized):
            return decl
        return {name + suffix: p.decl for name, d in decl.items()
                for suffix, p in self.method.expert_params(d, name, self._global_shape(name)).items()}

    def use_method(self, method: LinearMethod) -> None:
        """Re-create the experts' params for `method` (int8) on a built (abstract) model, as
        `MethodLayer.use_method` does: leading axes a `Stack` added are kept; the new params hold zeros."""
        decl = self.statements()
        method.check(self, decl[self.weight_name])
        if not hasattr(method, "expert_params"):
            raise UnsupportedLayerError(f"{method.describe()} cannot hold stacked experts; leave them float")
        for name, d in decl.items():
            first = getattr(self, name)
            lead = first[...].ndim - 3
            lead_shape, lead_spec = tuple(first[...].shape[:lead]), tuple(first.get_metadata()["out_sharding"][:lead])
            for suffix in ("", *self.method.suffixes, "_scale"):
                if hasattr(self, name + suffix):
                    delattr(self, name + suffix)
            for suffix, p in method.expert_params(d, name, self._global_shape(name)).items():
                setattr(self, name + suffix, nnx.Param(jnp.zeros(lead_shape + p.shape, p.dtype),
                                                       out_sharding=lead_spec + p.decl.spec()))
        self.method = method

    def statements(self) -> dict[str, ExpertParam]:
        """The one statement of each float param's split (gate_up, down) over tp, or over dp x tp under EP."""
        d, f, tp = self.hidden_size, self.intermediate_size, self.tp_size
        if self.slots is None:
            tp_rows = contiguous_rows(f, tp)
            gate_up = {"gate": PartRows((f, d), tp_rows), "up": PartRows((f, d), tp_rows)}
            down = {"down": PartRows((d, f), tp_rows)}
            kw = dict(slots=None, axes=())
            splits = (0, 1)
        else:
            gate_up = {"gate": PartRows((f, d)), "up": PartRows((f, d))}
            down = {"down": PartRows((d, f))}
            kw = dict(slots=np.asarray(self.slots), axes=(DP, TP))
            splits = (None, None)
        return {"gate_up": ExpertParam.build(gate_up, self.num_experts, split=splits[0], transpose=True, **kw),
                "down": ExpertParam.build(down, self.num_experts, split=splits[1], transpose=True, **kw)}

    def load_global(self, tensors):
        """Global values from whole tensors `{param: {part: tensor}}` (tests): every rank's block, concatenated."""
        ranks = self.tp_size if self.slots is None else len(self.slots)
        out = {}
        for name, decl in self.loading().items():
            blocks = [decl.block(r, tensors[getattr(decl, "reads", "") or name]) for r in range(ranks)]
            out[name] = blocks[0] if decl.param_dim is None else np.concatenate(blocks, axis=decl.param_dim)
        return out

    def local_slot(self, experts: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Global expert ids -> (this rank's slot, held here?) (inside shard_map)."""
        if self.slots is None:
            return experts, jnp.ones(experts.shape, bool)
        slot_of = np.full(self.num_experts, 0, np.int32)
        for r, row in enumerate(self.slots):
            for j, e in enumerate(row):
                if e >= 0:
                    slot_of[e] = r * self.local_experts + j
        rank = collectives.axis_index(DP) * self.tp_size + collectives.axis_index(TP)
        local = jnp.asarray(slot_of)[experts] - rank * self.local_experts
        held = (local >= 0) & (local < self.local_experts)
        return jnp.where(held, local, 0), held

    def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array, dispatch: str = "auto") -> jax.Array:
        """x[M, D], experts / weights [M, k] -> this rank's partial sum y[M, D] (float32)."""
        m, k = experts.shape
        slot, held = self.local_slot(experts.reshape(-1))
        w = jnp.where(held, weights.reshape(-1), 0.0)
        if dispatch == "auto":
            dispatch = "gather" if m * k <= self.local_experts else \
                "dense" if jax.default_backend() == "cpu" else "ragged"
        run = {"gather": self._gather, "ragged": self._ragged, "dense": self._dense}[dispatch]
        return run(x, slot, held, w, k)

    def _swiglu(self, h: jax.Array) -> jax.Array:
        g, u = jnp.split(h, 2, axis=-1)
        return (jax.nn.silu(g) * u).astype(self.param_dtype)

    def _kernel(self, name: str, slot: jax.Array | None = None) -> jax.Array:
        """This rank's stacked kernel `name` (its experts `slot`, or all), in the model's dtype (int8 cast)."""
        if hasattr(self.method, "expert_kernel"):                           # packed: dequantized (layers/packed.py)
            return self.method.expert_kernel(self, name, slot, self.param_dtype)
        w = getattr(self, name)[...]
        return (w if slot is None else w[slot]).astype(self.param_dtype)

    def _scaled(self, y: jax.Array, name: str, slot: jax.Array | None = None) -> jax.Array:
        """y [..., out] (slot given: one row per slot) times the per-expert output-channel scales of an int8
        kernel (exact for per-output-channel scales); unchanged for a float one."""
        if isinstance(self.method, Unquantized) or hasattr(self.method, "expert_kernel"):
            return y
        s = getattr(self, name + "_scale")[...]                                  # [E_local, out]
        return y * (s[slot] if slot is not None else s[:, None, :])

    def _gather(self, x, slot, held, w, k):
        xs = jnp.repeat(x, k, axis=0)                                           # [A, D], token-major
        h = jnp.einsum("ad,adf->af", xs, self._kernel("gate_up", slot), preferred_element_type=jnp.float32)
        h = self._scaled(h, "gate_up", slot)
        o = jnp.einsum("af,afd->ad", self._swiglu(h), self._kernel("down", slot), preferred_element_type=jnp.float32)
        o = self._scaled(o, "down", slot)
        return (o * w[:, None]).reshape(-1, k, o.shape[-1]).sum(axis=1)

    def _dense(self, x, slot, held, w, k):
        """Every local expert on every token, weighted by a [M, E_local] routing matrix (zero where not
        routed): one read of the local weights as batched GEMMs, for large steps on CPU."""
        m = x.shape[0]
        route = jnp.zeros((m, self.local_experts), jnp.float32).at[jnp.repeat(jnp.arange(m), k), slot].add(w)
        xe = jnp.broadcast_to(x, (self.local_experts, *x.shape))               # batched form: XLA:CPU's
        h = jnp.einsum("emd,edf->emf", xe, self._kernel("gate_up"),          # (md,edf measured slower)
                       preferred_element_type=jnp.float32)
        o = jnp.einsum("emf,efd->emd", self._swiglu(self._scaled(h, "gate_up")), self._kernel("down"),
                       preferred_element_type=jnp.float32)
        o = self._scaled(o, "down")
        return jnp.einsum("emd,me->md", o, route)

    def _ragged(self, x, slot, held, w, k):
        key = jnp.where(held, slot, self.local_experts)                         # not held: after every group
        order = jnp.argsort(key, stable=True)
        sizes = jnp.bincount(key, length=self.local_experts + 1)[:self.local_experts].astype(jnp.int32)
        tok = order // k
        xs = x[tok]                                                             # [A, D], expert-sorted
        sorted_slot = jnp.where(held, slot, 0)[order]
        h = jax.lax.ragged_dot(xs, self._kernel("gate_up"), sizes, preferred_element_type=jnp.float32)
        h = self._scaled(h, "gate_up", sorted_slot)
        o = jax.lax.ragged_dot(self._swiglu(h), self._kernel("down"), sizes, preferred_element_type=jnp.float32)
        o = self._scaled(o, "down", sorted_slot)
        o = jnp.where(held[order][:, None], o, 0.0) * w[order][:, None]
        return jnp.zeros((x.shape[0], o.shape[-1]), jnp.float32).at[tok].add(o)


class Router(ReplicatedLinear):
    """The router W_r[E, D], replicated; `keep_float`: quantization leaves it float (as vLLM builds its gate
    without a quant config), since a quantized logit can change which experts run."""
    keep_float = True
    switched = False                             # route() reads the kernel itself: a switched Stack indexes it


class FusedMoE(nnx.Module):
    """The MoE feed-forward block: router, top-k, experts (+ an optional gated shared expert).

    Args:
      hidden_size D, intermediate_size F (one routed expert's), num_experts E, top_k.
      renormalize: divide the top-k probabilities by their sum (Mixtral; Qwen's norm_topk_prob).
      shared_intermediate_size: a dense shared expert of this width gated by sigmoid(x W_s)
        (Qwen2-MoE), or None.
      tp_size, dp_size: the mesh's tp and dp. expert_parallel: whole experts on the dp x tp ranks.
      dispatch: "auto", "gather", "ragged" or "dense" (see the module doc).
    Called on local tokens x[..., D] (dp-sharded, replicated over tp) -> y[..., D] the same way.
    Submodules: `gate` (router `[E, D]`), `experts` (`Experts`), `shared_expert` (gate_up_proj,
    down_proj) and `shared_expert_gate` `[1, D]`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 renormalize: bool, shared_intermediate_size: int | None = None, tp_size: int = 1,
                 dp_size: int = 1, expert_parallel: bool = False, dispatch: str = "auto", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        name = type(self).__name__
        check_tp_size(tp_size, name)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{name}: top_k={top_k} must be between 1 and num_experts={num_experts}.")
        if dispatch not in DISPATCHES:
            raise ValueError(f"{name}: dispatch={dispatch!r}; choose one of {DISPATCHES}.")
        self.num_experts, self.top_k, self.renormalize, self.dispatch = num_experts, top_k, renormalize, dispatch
        self.tp_size, self.dp_size, self.expert_parallel = tp_size, dp_size, expert_parallel
        self.gate = Router(hidden_size, num_experts, tp_size=tp_size, bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, tp_size=tp_size,
                               ep_size=dp_size * tp_size if expert_parallel else None, dtype=dtype, rngs=rngs)
        shared = gate = None
        if shared_intermediate_size:
            shared = SharedExpert(hidden_size, shared_intermediate_size, tp_size, dtype, rngs)
            gate = ReplicatedLinear(hidden_size, 1, tp_size=tp_size, bias=False, dtype=dtype, rngs=rngs)
        self.shared_expert, self.shared_expert_gate = nnx.data(shared), nnx.data(gate)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x[M, D] -> (experts[M, k] int32, weights[M, k] float32): softmax over float32 logits, top-k."""
        if isinstance(self.gate.method, Unquantized):
            logits = jnp.dot(x, self.gate.kernel[...], preferred_element_type=jnp.float32)
        else:
            logits = self.gate.method.apply(self.gate, x).astype(jnp.float32)
        weights, experts = jax.lax.top_k(row_softmax(logits), self.top_k)
        if self.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return experts.astype(jnp.int32), weights

    def __call__(self, x: jax.Array) -> jax.Array:
        shape, dtype = x.shape, x.dtype
        t = x.reshape(-1, shape[-1])                                            # [M, D] this replica's tokens
        ep_gather = self.expert_parallel and self.dp_size > 1
        tokens = collectives.all_gather(t, DP, dim=0) if ep_gather else t     # EP: every replica's tokens
        experts, weights = self.route(tokens)
        y = self.experts(tokens, experts, weights, self.dispatch)               # partial sum, float32
        if ep_gather:
            y = collectives.reduce_scatter(y, DP, dim=0)                         # back to this replica's rows
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(t).astype(jnp.float32))
            y = y + gate * self.shared_expert(t).astype(jnp.float32)           # partial over tp: same psum
        y = collectives.all_reduce(y, TP)
        return y.astype(dtype).reshape(shape)


class SharedExpert(nnx.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP split over tp whose partial sum joins the routed experts'."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_size: int, dtype, rngs: nnx.Rngs):
        size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, (size, size), tp_size=tp_size, bias=False,
                                                       dtype=dtype, rngs=rngs)
        self.down_proj = RowParallelLinear(size, hidden_size, tp_size=tp_size, bias=False, reduce_results=False,
                                           dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(jax.nn.silu(gate) * up)


__all__ = ["FusedMoE", "Experts", "SharedExpert", "expert_slots", "DISPATCHES"]
