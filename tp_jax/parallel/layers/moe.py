"""The mixture-of-experts feed-forward block (vLLM's `FusedMoE`), in two layouts over the mesh.

    logits = x W_r (+ b_r)               router, replicated, float32 logits [T, E] (b_r: gpt-oss's router bias)
    s = softmax(logits)                  (`scoring="sigmoid"`: s = sigmoid(logits), DeepSeek-V3)
    c = s (+ b_c)                        selection scores (b_c: DeepSeek-V3's e_score_correction_bias)
    groups (n_group G, topk_group g): each group of E / G experts scored by max(c) (DeepSeek-V2's
        group_limited_greedy) or the sum of its top-2 c (V3); c = -inf outside the best g groups
    e = top_k(c); w = s[e]               the weights are the un-biased scores of the chosen experts
        (renormalize: w /= sum(w), Mixtral / norm_topk_prob; + 1e-20 under sigmoid); w *= routed_scaling_factor
    h = x W_gu,e (+ b_gu,e); g, u = halves of h (interleaved_gate_up: g = h[0::2], u = h[1::2], gpt-oss)
    a = silu(g) * u                      ("swigluoai", gpt-oss: g' = min(g, L), u' = clip(u, -L, L),
                                          a = (u' + 1) * g' * sigmoid(alpha g'), alpha = swiglu_alpha, L = swiglu_limit)
    y = sum_k w_k * (a W_d,e (+ b_d,e))  (+ sigmoid(x W_s) * shared(x), Qwen2-MoE; shared_gate=False: + shared(x),
                                          DeepSeek)

Layouts (vLLM's `enable_expert_parallel`, `FusedMoEParallelConfig`):

* TP (default): every rank holds every expert, each expert's intermediate dim split over tp
  like a dense MLP: `gate_up[E, D, 2F/tp]`, `down[E, F/tp, D]`; one psum over tp (shared
  expert's partial sum included). Expert biases: `gate_up_bias[E, 2F/tp]` split like gate_up's output,
  `down_bias[E, D]` whole on every rank and added on tp rank 0 only (the psum then counts it once).
  Interleaved gate/up split contiguously over the 2F rows: each rank takes whole (gate, up) pairs.
* EP: the dp x tp devices of a pipeline stage are one expert group of ep = dp * tp ranks; rank
  r (= dp_index * tp + tp_index) holds whole experts, vLLM's `determine_expert_map` order
  (E // ep each, the first E % ep ranks one more), padded to E_local = ceil(E / ep) slots with
  never-routed zero experts: `gate_up[ep * E_local, D, 2F]` split over ("dp", "tp"), biases alike (each
  added by the rank holding its expert). Tokens are dp-sharded: the block all-gathers them over dp, routes
  all of them, runs its local experts, reduce-scatters the partial sums back over dp and psums over tp
  (tp ranks hold other experts).

Dispatch (local): assignments (token, choice) are either
* "gather": each assignment multiplies its expert's weight gathered by index, `[A, D, 2F]`
  (reads only the routed experts: decode, where assignments <= local experts), or
* "ragged": assignments sorted by expert, one `jax.lax.ragged_dot` per projection (XLA's grouped
  GEMM on GPU/TPU; on CPU jax lowers it to a masked dot over every group, measured far slower
  than the others by scripts/bench_moe.py), or
* "dense": every local expert on every token as batched GEMMs, each token keeping its k experts'
  outputs: each local weight read once per tile of 32 tokens.
Each dispatch multiplies by its kernels through `_product`: a method whose kernel is a conversion (int8 values,
packed blocks: GPTQ, FP8, MXFP4, ...) builds it one tile of output columns at a time (`ExpertMethod.expert_tiles`),
so no dispatch holds the local experts converted to float at once (scripts/bench_moe_memory.py).
"auto": on CPU gather, for every step (the numeric contract, docs/design.md: what auto picks never depends on the
step's size). Gather's dots have one shape per assignment, so a token's numbers are its own whatever the step;
dense's batched dots over the experts gave a token other bits alone than among 32 others, and gather and dense
give a token other bits (tests/test_moe_dispatch.py), so choosing between them by the step's tokens, as auto
once did, moved a decode row's logprobs with its neighbours. Gather is the faster of the two for decode and
the slower for long prefill steps on CPU (scripts/bench_moe.py, docs/performance.md). Elsewhere: gather when
the step's assignments are at most the local experts, else ragged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel import collectives
from tp_jax.parallel.invariant import row_softmax, row_sum, row_tiled
from tp_jax.parallel.layers.base import ParallelModule, check_tp_size, default_kernel_init
from tp_jax.parallel.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tp_jax.parallel.layers.loading import ExpertParam, PartRows, ShardedParam, contiguous_rows
from tp_jax.parallel.layers.method import EXPERTS, UNQUANTIZED, ExpertMethod, LinearMethod, UnsupportedLayerError
from tp_jax.parallel.mesh import DP, TP

DISPATCHES = ("auto", "gather", "ragged", "dense")
GATHER_TILE_BYTES = 256 << 20                      # the most expert weight bytes one gathered tile copies
SCORINGS = ("softmax", "sigmoid")                  # the router's scores (vLLM's scoring_func)
GROUP_SCORES = ("max", "top2_sum")                 # a group's score: DeepSeek-V2's max, V3's sum of its top 2
ACTIVATIONS = ("silu", "swigluoai")                # the experts' SwiGLU: plain, or gpt-oss's clamped one


def expert_slots(num_experts: int, ep: int) -> np.ndarray:
    """[ep, ceil(E / ep)]: the experts rank r holds (vLLM's `determine_expert_map`), -1 = a padding slot."""
    base, extra = divmod(num_experts, ep)
    local = -(-num_experts // ep)
    slots = np.full((ep, local), -1, np.int64)
    for r in range(ep):
        start, n = r * base + min(r, extra), base + (r < extra)
        slots[r, :n] = np.arange(start, start + n)
    return slots


def routing_problem(num_experts: int, top_k: int, n_group: int | None, topk_group: int | None,
                    group_score: str) -> str | None:
    """What is wrong with a group-limited selection (None: nothing): G = n_group must divide E, 1 <= topk_group <= G,
    the kept groups must hold at least top_k experts, and a "top2_sum" group at least 2."""
    if n_group is None:
        return None if topk_group is None else f"topk_group={topk_group} needs n_group (the number of groups)"
    if not isinstance(n_group, int) or isinstance(n_group, bool) or n_group < 1 or num_experts % n_group:
        return f"n_group={n_group!r} must be a positive integer dividing num_experts={num_experts}"
    if not isinstance(topk_group, int) or isinstance(topk_group, bool) or not 1 <= topk_group <= n_group:
        return f"topk_group={topk_group!r} must be an integer between 1 and n_group={n_group}"
    if group_score not in GROUP_SCORES:
        return f"group_score={group_score!r}; choose one of {GROUP_SCORES}"
    size = num_experts // n_group
    if top_k > topk_group * size:
        return (f"top_k={top_k} exceeds the {topk_group * size} experts of the topk_group={topk_group} kept groups "
                f"({size} experts each)")
    if group_score == "top2_sum" and size < 2:
        return f"group_score='top2_sum' needs groups of at least 2 experts; n_group={n_group} leaves {size}"
    return None


class Experts(ParallelModule):
    """E experts' SwiGLU weights, stacked: `gate_up[E_slots, D, 2F_local]`, `down[E_slots, F_local, D]`.

    Args: `num_experts` E, `hidden_size` D, `intermediate_size` F (one expert's), `tp_size`,
    `ep_size` (None: the TP layout; k: whole experts over k = dp * tp ranks), `bias` (per-expert biases
    `gate_up_bias[E_slots, 2F_local]` split like gate_up's output, `down_bias[E_slots, D]`), `activation`
    (`ACTIVATIONS`: "silu", or gpt-oss's "swigluoai" with `swiglu_alpha`, `swiglu_limit`), `interleaved`
    (the checkpoint's gate and up are the even and odd rows of one fused tensor), `dtype`, `rngs`.
    Checkpoint parts per expert e: "gate.e", "up.e" `[F, D]` (interleaved: one "gate_up.e" `[2F, D]`) and
    "down.e" `[D, F]` (torch layout); biases: "gate.e", "up.e" `[F]` (interleaved: "gate_up.e" `[2F]`) and
    "down.e" `[D]`.
    `method`: an `ExpertMethod` (layers/method.py): `Unquantized` (the float kernels) or, after
    `use_method(Int8())`, int8 kernels of the same shapes with per-expert output-channel scales
    `gate_up_scale[E_slots, 2F_local]`, `down_scale[E_slots, D]` (layers/int8.py), or packed ones
    (`PackedExperts`, layers/packed.py: GPTQ / AWQ / FP8 / compressed-tensors, gpt-oss's MXFP4); the loader
    picks it like a linear layer's (kind EXPERTS). Biases stay float under any method (added after the scaled
    dot).
    """
    weight_name, weight_kind = "gate_up", EXPERTS

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, tp_size: int = 1,
                 ep_size: int | None = None, bias: bool = False, activation: str = "silu", swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, interleaved: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        name = type(self).__name__
        check_tp_size(tp_size, name)
        if activation not in ACTIVATIONS:
            raise ValueError(f"{name}: activation={activation!r}; choose one of {ACTIVATIONS}.")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp_size, self.ep_size = tp_size, ep_size
        self.use_bias, self.activation, self.interleaved = bias, activation, interleaved
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        if ep_size is None:
            if intermediate_size % tp_size:
                pairs = " (interleaved gate/up: each rank takes whole (gate, up) pairs)" if interleaved else ""
                raise ValueError(f"{name}: moe intermediate_size={intermediate_size} is not divisible "
                                 f"by tp={tp_size} (each expert's width splits over tp{pairs}); choose a tp that "
                                 f"divides {intermediate_size}, or enable expert parallelism "
                                 f"(enable_expert_parallel=True), which keeps each expert whole")
            self.slots, self.local_experts = None, num_experts
        else:
            self.slots = tuple(map(tuple, expert_slots(num_experts, ep_size).tolist()))
            self.local_experts = len(self.slots[0])
        self.method, self.param_dtype = UNQUANTIZED, jnp.dtype(dtype)
        init = default_kernel_init()
        for name, decl in self.statements().items():
            shape = self._global_shape(name)
            setattr(self, name, nnx.Param(init(rngs.params(), shape, dtype), out_sharding=decl.spec()))
        for name, decl in self.bias_statements().items():
            setattr(self, name, nnx.Param(jnp.zeros(self._global_shape(name), dtype), out_sharding=decl.spec()))

    def _global_shape(self, name: str) -> tuple[int, ...]:
        slots = self.num_experts if self.slots is None else len(self.slots) * self.local_experts
        d, f = self.hidden_size, self.intermediate_size
        return {"gate_up": (slots, d, 2 * f), "down": (slots, f, d),
                "gate_up_bias": (slots, 2 * f), "down_bias": (slots, d)}[name]

    def loading(self) -> dict[str, ShardedParam]:
        """The float statements, or, under a method (int8), the params it derives from them (values, scales);
        the biases' statements (float under any method)."""
        decl = {name + suffix: p.decl for name, d in self.statements().items()
                for suffix, p in self.method.expert_params(d, name, self._global_shape(name), self.param_dtype).items()}
        return {**decl, **self.bias_statements()}

    def use_method(self, method: LinearMethod) -> None:
        """Re-create the experts' params for `method` (int8) on a built (abstract) model, as
        `MethodLayer.use_method` does: leading axes a `Stack` added are kept; the new params hold zeros."""
        decl = self.statements()
        if not isinstance(method, ExpertMethod):
            raise UnsupportedLayerError(f"{method.describe()} cannot hold stacked experts: it is no ExpertMethod "
                                        f"(tp_jax/parallel/layers/method.py); leave the experts float")
        method.check(self, decl[self.weight_name])
        for name, d in decl.items():
            first = getattr(self, name)
            lead = first[...].ndim - 3
            lead_shape, lead_spec = tuple(first[...].shape[:lead]), tuple(first.get_metadata()["out_sharding"][:lead])
            for suffix in self.method.expert_params(d, name, self._global_shape(name), self.param_dtype):
                delattr(self, name + suffix)
            for suffix, p in method.expert_params(d, name, self._global_shape(name), self.param_dtype).items():
                setattr(self, name + suffix, nnx.Param(jnp.zeros(lead_shape + p.shape, p.dtype),
                                                       out_sharding=lead_spec + p.decl.spec()))
        self.method = method

    def _per_expert(self, bias: bool) -> tuple[dict[str, PartRows], dict[str, PartRows]]:
        """One expert's parts of (gate_up, down), of the kernels or (`bias`) of the biases, with their tp rows in
        the TP layout. Interleaved gate/up: one part whose 2F rows split contiguously (whole pairs per rank).
        down's bias is whole on every rank (added on tp rank 0: `_biased`)."""
        d, f = self.hidden_size, self.intermediate_size

        def rows(n: int) -> np.ndarray | None:
            return contiguous_rows(n, self.tp_size) if self.slots is None else None

        def part(out: int, inp: int) -> PartRows:
            return PartRows((out,) if bias else (out, inp), rows(out))
        gate_up = {"gate_up": part(2 * f, d)} if self.interleaved else {"gate": part(f, d), "up": part(f, d)}
        down = {"down": PartRows((d,))} if bias else {"down": PartRows((d, f), rows(f))}
        return gate_up, down

    def statements(self) -> dict[str, ExpertParam]:
        """The one statement of each float kernel's split (gate_up, down) over tp, or over dp x tp under EP."""
        gate_up, down = self._per_expert(bias=False)
        tp = self.slots is None
        kw = dict(slots=None, axes=()) if tp else dict(slots=np.asarray(self.slots), axes=(DP, TP))
        return {"gate_up": ExpertParam.build(gate_up, self.num_experts, split=0 if tp else None, transpose=True, **kw),
                "down": ExpertParam.build(down, self.num_experts, split=1 if tp else None, transpose=True, **kw)}

    def bias_statements(self) -> dict[str, ExpertParam]:
        """The biases' statements (none without `bias`): gate_up_bias split like gate_up's output, down_bias
        whole per expert (TP layout: on every rank), both over dp x tp with their experts under EP."""
        if not self.use_bias:
            return {}
        gate_up, down = self._per_expert(bias=True)
        tp = self.slots is None
        kw = dict(slots=None, axes=()) if tp else dict(slots=np.asarray(self.slots), axes=(DP, TP))
        return {"gate_up_bias": ExpertParam.build(gate_up, self.num_experts, split=0 if tp else None,
                                                  transpose=False, **kw),
                "down_bias": ExpertParam.build(down, self.num_experts, split=None, transpose=False, **kw)}

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
            dispatch = "gather" if jax.default_backend() == "cpu" or m * k <= self.local_experts else "ragged"
        run = {"gather": self._gather, "ragged": self._ragged, "dense": self._dense}[dispatch]
        return run(x, slot, held, w, k)

    def _swiglu(self, h: jax.Array) -> jax.Array:
        """h[..., 2F_local] float32 -> the activation [..., F_local] in the model's dtype (module doc)."""
        if self.interleaved:
            g, u = h[..., 0::2], h[..., 1::2]
        else:
            g, u = jnp.split(h, 2, axis=-1)
        if self.activation == "silu":
            return (jax.nn.silu(g) * u).astype(self.param_dtype)
        g = jnp.minimum(g, self.swiglu_limit)
        u = jnp.clip(u, -self.swiglu_limit, self.swiglu_limit)
        return ((u + 1.0) * (g * jax.nn.sigmoid(self.swiglu_alpha * g))).astype(self.param_dtype)

    def local_kernel_shape(self, name: str) -> tuple[int, int]:
        """[in, out] of one expert's kernel `name` on a rank (the intermediate width split over tp in the TP
        layout)."""
        d, f = self.hidden_size, self.local_width()
        return {"gate_up": (d, 2 * f), "down": (f, d)}[name]

    def local_width(self) -> int:
        """One expert's intermediate width on a rank: F under EP, F / tp in the TP layout."""
        return self.intermediate_size if self.slots is not None else self.intermediate_size // self.tp_size

    def _product(self, name: str, slot: jax.Array | None, experts: int, dot, rows: jax.Array | None = None):
        """`dot(kernel, inputs)` -> [..., out] float32 with kernel `name` of the experts `slot` (None: every local
        one), summed over the method's `expert_parts` (`inputs`: the slice of x's last axis a part multiplies),
        scaled by the method (`rows`: the slot of each product row, when it is not `slot`: ragged's sorted rows):
        built and multiplied in `expert_tiles` tiles of output columns (a kernel the method converts, int8 or
        packed, is never whole in float: each tile is built, multiplied and dropped), the tiles' products side
        by side. `experts`: how many experts' kernels one tile spans (sets its size)."""
        n = self.method.expert_tiles(self, name, experts)
        rows = slot if rows is None else rows

        def product(cols):
            parts = self.method.expert_parts(self, name, slot, self.param_dtype, cols)
            y = dot(*parts[0])
            for w, inputs in parts[1:]:
                y = y + dot(w, inputs)
            return self.method.expert_scaled(self, y, name, rows, cols)
        if n == 1:
            return product(None)
        size = self.local_kernel_shape(name)[1] // n

        def tile(i):
            return product((i * size, size))
        y = jax.lax.map(tile, jnp.arange(n))                                    # [n, ..., size]
        return jnp.moveaxis(y, 0, -2).reshape(*y.shape[1:-1], n * size)

    def _biased(self, y: jax.Array, name: str, slot: jax.Array | None = None) -> jax.Array:
        """y [..., out] (slot given: one row per slot; else [E_local, M, out]) plus kernel `name`'s bias, if any.
        down's bias in the TP layout on tp rank 0 only: the psum over tp would count it tp times."""
        if not self.use_bias:
            return y
        b = getattr(self, name + "_bias")[...].astype(jnp.float32)              # [E_local, out]
        if name == "down" and self.slots is None and self.tp_size > 1:
            b = jnp.where(collectives.axis_index(TP) == 0, b, jnp.zeros_like(b))
        return y + (b[slot] if slot is not None else b[:, None, :])

    def _gather(self, x, slot, held, w, k):
        """Each assignment's expert weights gathered by index, one matrix-vector product each (one shape per
        assignment: batch-invariant), in tiles of at most `gather_tile()` assignments (the gathered copies bounded)."""
        xs = jnp.repeat(x, k, axis=0)                                           # [A, D], token-major
        a, tile = xs.shape[0], self.gather_tile()
        if a <= tile:
            o = self._gather_rows(xs, slot)
        else:
            n = -(-a // tile)
            pad = lambda v: jnp.pad(v, ((0, n * tile - a),) + ((0, 0),) * (v.ndim - 1))  # noqa: E731
            o = jax.lax.map(lambda t: self._gather_rows(*t), (pad(xs).reshape(n, tile, -1),
                                                             pad(slot).reshape(n, tile)))
            o = o.reshape(n * tile, -1)[:a]
        return _combine(o.reshape(-1, k, o.shape[-1]), w.reshape(-1, k))

    def gather_tile(self) -> int:
        """Assignments per gathered tile: as many as GATHER_TILE_BYTES of their experts' weights in the model's dtype
        (what a float method's gather copies; a packed method's tiles are smaller: `_product`); a fixed number for
        the model, never the step's."""
        per = 3 * self.hidden_size * self.local_width() * jnp.dtype(self.param_dtype).itemsize   # gate, up, down
        return max(1, GATHER_TILE_BYTES // per)

    def _gather_rows(self, xs, slot):
        h = self._product("gate_up", slot, 1, lambda w, i: _dot("ad,adf->af", xs[:, i], w))
        a = self._swiglu(self._biased(h, "gate_up", slot))
        return self._biased(self._product("down", slot, 1, lambda w, i: _dot("af,afd->ad", a[:, i], w)), "down", slot)

    def _dense(self, x, slot, held, w, k):
        """Every local expert on every token as batched GEMMs (one read of the local weights per tile of rows),
        each token then keeping its k experts' outputs, added in its choice order (`_combine`); in tiles of a fixed
        number of rows (`row_tiled`), so a token's numbers never depend on the rows beside it."""
        m = x.shape[0]
        return row_tiled(self._dense_rows, x, slot.reshape(m, k), w.reshape(m, k))

    def _dense_rows(self, x, slot, w):
        m = x.shape[0]
        e = self.local_experts
        xe = jnp.broadcast_to(x, (e, *x.shape))                               # batched form: XLA:CPU's
        h = self._product("gate_up", None, e, lambda k, i: _dot("emd,edf->emf", xe[..., i], k))   # (md,edf: slower)
        a = self._swiglu(self._biased(h, "gate_up"))
        o = self._biased(self._product("down", None, e, lambda k, i: _dot("emf,efd->emd", a[..., i], k)), "down")
        # o: [E_local, M, D]
        return _combine(o[slot, jnp.arange(m)[:, None]], w)                     # [M, k, D] -> [M, D]

    def _ragged(self, x, slot, held, w, k):
        key = jnp.where(held, slot, self.local_experts)                         # not held: after every group
        order = jnp.argsort(key, stable=True)
        sizes = jnp.bincount(key, length=self.local_experts + 1)[:self.local_experts].astype(jnp.int32)
        tok = order // k
        xs = x[tok]                                                             # [A, D], expert-sorted
        sorted_slot = jnp.where(held, slot, 0)[order]
        e = self.local_experts
        h = self._product("gate_up", None, e, lambda k, i: _ragged_dot(xs[:, i], k, sizes), rows=sorted_slot)
        a = self._swiglu(self._biased(h, "gate_up", sorted_slot))
        o = self._product("down", None, e, lambda k, i: _ragged_dot(a[:, i], k, sizes), rows=sorted_slot)
        o = self._biased(o, "down", sorted_slot)
        o = jnp.where(held[order][:, None], o, 0.0) * w[order][:, None]
        return jnp.zeros((x.shape[0], o.shape[-1]), jnp.float32).at[tok].add(o)


def _dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(spec, x, w) accumulated in float32, x in the kernel's dtype (a packed method's "bf16" dot: bf16)."""
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32)


def _combine(o: jax.Array, w: jax.Array) -> jax.Array:
    """o[M, k, D] (each token's k expert outputs, float32), w[M, k] -> sum_j w_j o_j [M, D], added in choice order
    (gather's and dense's combination: a token's own numbers, whatever M)."""
    out = o[:, 0] * w[:, 0, None]
    for j in range(1, o.shape[1]):
        out = out + o[:, j] * w[:, j, None]
    return out


class Router(ReplicatedLinear):
    """The router W_r[E, D] (+ b_r[E], gpt-oss), replicated; `keep_float`: quantization leaves it float (as vLLM
    builds its gate without a quant config), since a quantized logit can change which experts run."""
    keep_float = True
    switched = False                             # route() reads the kernel itself: a switched Stack indexes it


class FusedMoE(ParallelModule):
    """The MoE feed-forward block: router, top-k, experts (+ an optional shared expert). See the module doc.

    Args:
      hidden_size D, intermediate_size F (one routed expert's), num_experts E, top_k.
      renormalize: divide the top-k weights by their sum (Mixtral; Qwen's and DeepSeek-V3's norm_topk_prob).
      scoring: "softmax" or "sigmoid" (`SCORINGS`; DeepSeek-V3). router_bias: the router has a bias (gpt-oss).
      correction_bias: a float32 `e_score_correction_bias[E]` added to the scores for the selection only
        (DeepSeek-V3's aux-loss-free balancing).
      n_group, topk_group, group_score: group-limited selection (None: off): the experts in n_group groups, the
        topk_group best groups by `group_score` ("max", DeepSeek-V2; "top2_sum", V3) kept.
      routed_scaling_factor: the routed experts' weights times this (DeepSeek).
      shared_intermediate_size: a dense shared expert of this width, or None; shared_gate: gated by
        sigmoid(x W_s) (Qwen2-MoE) or, False, added as is (DeepSeek's n_shared_experts, width F * n).
      expert_bias, activation, swiglu_alpha, swiglu_limit, interleaved_gate_up: the experts' (`Experts`;
        gpt-oss: True, "swigluoai", 1.702, 7.0, True).
      tp_size, dp_size: the mesh's tp and dp. expert_parallel: whole experts on the dp x tp ranks.
      dispatch: "auto", "gather", "ragged" or "dense" (see the module doc).
    Called on local tokens x[..., D] (dp-sharded, replicated over tp) -> y[..., D] the same way.
    Submodules: `gate` (router `[E, D]`, `gate.bias` `[E]`), `experts` (`Experts`), `shared_expert` (gate_up_proj,
    down_proj) and `shared_expert_gate` `[1, D]`; its own param `e_score_correction_bias` (part "weight" `[E]`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 renormalize: bool, scoring: str = "softmax", router_bias: bool = False, correction_bias: bool = False,
                 n_group: int | None = None, topk_group: int | None = None, group_score: str = "max",
                 routed_scaling_factor: float = 1.0, shared_intermediate_size: int | None = None,
                 shared_gate: bool = True, expert_bias: bool = False, activation: str = "silu",
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, interleaved_gate_up: bool = False,
                 tp_size: int = 1, dp_size: int = 1, expert_parallel: bool = False, dispatch: str = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        name = type(self).__name__
        check_tp_size(tp_size, name)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{name}: top_k={top_k} must be between 1 and num_experts={num_experts}.")
        if dispatch not in DISPATCHES:
            raise ValueError(f"{name}: dispatch={dispatch!r}; choose one of {DISPATCHES}.")
        if scoring not in SCORINGS:
            raise ValueError(f"{name}: scoring={scoring!r}; choose one of {SCORINGS}.")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{name}: activation={activation!r}; choose one of {ACTIVATIONS}.")
        problem = routing_problem(num_experts, top_k, n_group, topk_group, group_score)
        if problem:
            raise ValueError(f"{name}: {problem}.")
        self.num_experts, self.top_k, self.renormalize, self.dispatch = num_experts, top_k, renormalize, dispatch
        self.scoring, self.routed_scaling_factor = scoring, float(routed_scaling_factor)
        grouped = n_group is not None and topk_group < n_group              # all groups kept: plain top-k
        self.n_group, self.topk_group, self.group_score = (n_group, topk_group, group_score) if grouped else \
            (None, None, group_score)
        self.tp_size, self.dp_size, self.expert_parallel = tp_size, dp_size, expert_parallel
        self.gate = Router(hidden_size, num_experts, tp_size=tp_size, bias=router_bias, dtype=dtype, rngs=rngs)
        self.use_correction_bias = correction_bias
        if correction_bias:
            self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32),
                                                     out_sharding=self.loading()["e_score_correction_bias"].spec())
        self.experts = Experts(num_experts, hidden_size, intermediate_size, tp_size=tp_size,
                               ep_size=dp_size * tp_size if expert_parallel else None, bias=expert_bias,
                               activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                               interleaved=interleaved_gate_up, dtype=dtype, rngs=rngs)
        shared = gate = None
        if shared_intermediate_size:
            shared = SharedExpert(hidden_size, shared_intermediate_size, tp_size, dtype, rngs)
            if shared_gate:
                gate = ReplicatedLinear(hidden_size, 1, tp_size=tp_size, bias=False, dtype=dtype, rngs=rngs)
        self.shared_expert, self.shared_expert_gate = nnx.data(shared), nnx.data(gate)

    def loading(self) -> dict[str, ShardedParam]:
        """The block's own param: `e_score_correction_bias` (part "weight" `[E]`, float32, every rank), if any."""
        if not self.use_correction_bias:
            return {}
        return {"e_score_correction_bias": ShardedParam({"weight": PartRows((self.num_experts,))}, split=None)}

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x[M, D] -> (experts[M, k] int32, weights[M, k] float32): scores of float32 logits, (grouped) top-k."""
        logits = self.gate.method.apply_f32(self.gate, x)                      # batch-invariant (invariant.py)
        if self.gate.bias is not None:
            logits = logits + self.gate.bias[...].astype(jnp.float32)
        scores = row_softmax(logits) if self.scoring == "softmax" else jax.nn.sigmoid(logits)
        if not self.use_correction_bias and self.n_group is None:
            weights, experts = jax.lax.top_k(scores, self.top_k)
        else:
            choice = scores + self.e_score_correction_bias[...] if self.use_correction_bias else scores
            _, experts = jax.lax.top_k(self._kept_groups(choice), self.top_k)
            weights = jnp.take_along_axis(scores, experts, axis=-1)              # the un-biased scores
        if self.renormalize:
            total = row_sum(weights, keepdims=True)
            weights = weights / (total + 1e-20 if self.scoring == "sigmoid" else total)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return experts.astype(jnp.int32), weights

    def _kept_groups(self, choice: jax.Array) -> jax.Array:
        """choice[M, E] with -inf outside each row's `topk_group` best groups (all kept without groups)."""
        if self.n_group is None:
            return choice
        m, size = choice.shape[0], self.num_experts // self.n_group
        grouped = choice.reshape(m, self.n_group, size)
        score = grouped.max(axis=-1) if self.group_score == "max" else jnp.sum(jax.lax.top_k(grouped, 2)[0], -1)
        _, best = jax.lax.top_k(score, self.topk_group)                         # [M, topk_group]
        keep = jnp.any(best[:, :, None] == jnp.arange(self.n_group), axis=1)    # [M, G]
        return jnp.where(jnp.repeat(keep, size, axis=-1), choice, -jnp.inf)

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
            shared = self.shared_expert(t).astype(jnp.float32)                 # partial over tp: same psum
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(t).astype(jnp.float32)) * shared
            y = y + shared
        y = collectives.all_reduce(y, TP)
        return y.astype(dtype).reshape(shape)


class SharedExpert(nnx.Module):
    """The shared expert (Qwen2-MoE's, DeepSeek's): a SwiGLU MLP split over tp whose partial sum joins the routed
    experts'."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_size: int, dtype, rngs: nnx.Rngs):
        size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, (size, size), tp_size=tp_size, bias=False,
                                                       dtype=dtype, rngs=rngs)
        self.down_proj = RowParallelLinear(size, hidden_size, tp_size=tp_size, bias=False, reduce_results=False,
                                           dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(jax.nn.silu(gate) * up)


__all__ = ["FusedMoE", "Experts", "SharedExpert", "expert_slots", "routing_problem", "DISPATCHES", "SCORINGS",
           "GROUP_SCORES", "ACTIVATIONS"]
