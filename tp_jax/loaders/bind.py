"""Matching a model's params with its name table and a checkpoint, checked before any byte is read.

`bind(model, table)` checks the model against its table:
* every module that holds a param can be loaded (a `ParallelModule`; a plain Flax layer
  gets a message naming the parallel layer to use) and declares that param;
* every entry matches a param, names a part that param declares, and is the only one
  for that part; stacked params (`Stack`) take `{i}` names, others do not;
* every param has an entry for each of its parts; a param a linear method derives from the
  layer's weight (int8 scales, GGUF blocks: `DerivedParam.reads`) takes the weight's entries.

`check_source(bindings, source, table, num_layers)` then checks the checkpoint, reading
headers only: every tensor the model needs is there with the declared shape (in the
entry's layout, at its row offset), and every tensor of the checkpoint is taken by an
entry or listed as ignored, so a checkpoint that does not match its config (more layers,
another vocab, stray tensors) is refused, naming the tensors.

Every message names the param path, the entry and the checkpoint tensor involved.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import NamedTuple

from flax import nnx

from tp_jax.loaders.kv_scales import is_kv_scale
from tp_jax.parallel.layers import Entry, ParallelModule, ShardedParam, Stack, WeightShapeError, WeightTable
from tp_jax.parallel.layers.method import DerivedParam
from tp_jax.parallel.layers.table import TensorView, as_lazy, template_regex

MAX_LISTED = 8
# A plain Flax layer found in a model -> the tp_jax layer that loads (and shards) the same thing.
REPLACEMENTS = {
    "Linear": "ColumnParallelLinear / RowParallelLinear (split over tp) or ReplicatedLinear",
    "LinearGeneral": "ColumnParallelLinear / RowParallelLinear (split over tp) or ReplicatedLinear",
    "Embed": "VocabParallelEmbedding (token table) or ReplicatedEmbedding (small tables such as positions)",
    "LayerNorm": "tp_jax.LayerNorm",
    "RMSNorm": "tp_jax.RMSNorm",
}


class NameTableError(ValueError):
    """A name table that does not fit the model (or a model layer that cannot be loaded)."""


class MissingWeightError(KeyError):
    """Tensors the model needs that the checkpoint does not hold."""

    def __str__(self):
        return str(self.args[0])


class CheckpointMismatchError(ValueError):
    """A checkpoint holding tensors the model does not take (more layers than the config, stray tensors)."""


@dataclasses.dataclass
class Binding:
    """One model param, its declaration and the table entries that fill its parts."""
    path: str
    module: ParallelModule
    name: str
    decl: ShardedParam
    entries: dict[str, Entry]          # part -> entry
    stacked: bool
    key: tuple = ()                    # the path as nnx's flat state spells it
    layer_map: tuple[int, ...] | None = None     # its Stack's own slot -> layer map (None: the model's)

    def layers(self, num_layers: int) -> list[int | None]:
        """The checkpoint layers this param reads ([None]: not stacked)."""
        if not self.stacked:
            return [None]
        return list(range(num_layers)) if self.layer_map is None else sorted(i for i in self.layer_map if i >= 0)

    def tensor_names(self, layer: int | None) -> dict[str, str]:
        return {p: e.name(layer) for p, e in self.entries.items()}

    def tensors(self, source, layer: int | None) -> dict[str, TensorView]:
        """part -> the part's tensor in the declared layout (lazy: nothing is read)."""
        out = {}
        for part, e in self.entries.items():
            name = e.name(layer)
            t = as_lazy(source.get(name), name)
            rows = None if e.offset is None else self.decl.parts[part].hf_shape[0]
            out[part] = TensorView(t, e.layout, e.offset or 0, rows, e.index)
        return out


def as_table(table: WeightTable | Sequence[Entry]) -> WeightTable:
    return table if isinstance(table, WeightTable) else WeightTable(tuple(table))


class _Param(NamedTuple):
    module: nnx.Module          # the module owning the param
    attr: str                   # its attribute name there
    stacked: bool               # under a Stack (one slot per layer)
    key: tuple                  # the path as nnx's flat state spells it
    layer_map: tuple[int, ...] | None = None     # the Stack's own slot -> layer map, if it has one


def _params(model: nnx.Module) -> dict[str, _Param]:
    """Dotted param path -> _Param, for every nnx.Param of `model`."""
    out = {}
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        module, stacked, layer_map = model, False, None
        for p in path[:-1]:
            module = module[p] if isinstance(p, int) else getattr(module, str(p))
            if isinstance(module, Stack):
                stacked, layer_map = True, module.layer_map
        out[".".join(str(p) for p in path)] = _Param(module, str(path[-1]), stacked, tuple(path), layer_map)
    return out


def bind(model: nnx.Module, table: WeightTable | Sequence[Entry]) -> list[Binding]:
    """A Binding per param of `model`, or NameTableError listing every mismatch with the table."""
    table = as_table(table)
    params, problems, decls = _params(model), [], {}
    for path, p in params.items():
        problem = _loadable(path, p.module, p.attr)
        if problem:
            problems.append(problem)
        else:
            decls[path] = p.module.loading()[p.attr]
    filled: dict[str, dict[str, Entry]] = {}
    for e in table.entries:
        problem = _check_entry(e, params, decls, filled.get(e.param, {}))
        if problem:
            problems.append(problem)
        else:
            filled.setdefault(e.param, {})[e.part] = e
    for path, decl in decls.items():
        have = filled.get(_reads(path, decl), {})
        missing = [p for p in decl.parts if p not in have]
        if not have:
            problems.append(f"param {path!r} ({type(params[path].module).__name__}.{params[path].attr}) is filled by "
                            f"no entry: add Entry(hf=<checkpoint tensor>, "
                            f"param={path!r}, part={next(iter(decl.parts))!r})"
                            + (f" and the parts {list(decl.parts)[1:]}" if len(decl.parts) > 1 else ""))
        elif missing:
            problems.append(f"param {path!r} needs parts {list(decl.parts)}; the table fills {list(have)} "
                            f"(from {sorted({e.hf for e in have.values()})}) but not {missing}: add "
                            f"Entry(hf=<checkpoint tensor>, param={path!r}, part={missing[0]!r})")
    if problems:
        raise NameTableError(_listing(f"the name table does not fit {type(model).__name__}", problems))
    return [Binding(path, params[path].module, params[path].attr, decl, filled[_reads(path, decl)],
                    params[path].stacked, params[path].key, params[path].layer_map) for path, decl in decls.items()]


def _reads(path: str, decl: ShardedParam) -> str:
    """The param whose entries fill `path`: itself, or the weight a method derived it from."""
    if isinstance(decl, DerivedParam) and decl.reads:
        return path.rsplit(".", 1)[0] + "." + decl.reads if "." in path else decl.reads
    return path


def _loadable(path: str, module, attr: str) -> str | None:
    if not isinstance(module, ParallelModule):
        cls = type(module)
        use = REPLACEMENTS.get(cls.__name__, "a tp_jax parallel layer, or your own ParallelModule with a "
                                               "loading() declaration (see tp_jax/parallel/layers/norm.py)")
        return (f"param {path!r} belongs to {cls.__module__}.{cls.__qualname__}, which tp_jax cannot load or "
                f"shard: build that layer with {use}")
    declared = module.loading()
    if attr not in declared:
        return (f"param {path!r}: {type(module).__name__}.loading() does not declare {attr!r} "
                f"(it declares {sorted(declared)})")
    return None


def _check_entry(e: Entry, params, decls, filled: dict[str, Entry]) -> str | None:
    if e.param not in params:
        near = difflib.get_close_matches(e.param, list(params), n=3, cutoff=0.5)
        return (f"{e} matches no param of the model (checkpoint tensor {e.hf!r})"
                + (f"; did you mean {near}?" if near else ""))
    if e.param not in decls:
        return None                                     # its module is reported already
    decl, module = decls[e.param], params[e.param].module
    if _reads(e.param, decl) != e.param:
        return (f"{e}: param {e.param!r} is derived by {type(module).__name__}'s method from "
                f"{_reads(e.param, decl)!r}; give the entry to that param")
    if e.part not in decl.parts:
        return (f"{e}: param {e.param!r} ({type(module).__name__}) has no part {e.part!r}; its parts are "
                f"{list(decl.parts)} (checkpoint tensor {e.hf!r})")
    if e.part in filled:
        return (f"{e}: part {e.part!r} of param {e.param!r} is already filled by {filled[e.part].hf!r}; "
                f"one entry per part")
    stacked = params[e.param].stacked
    if e.stacked != stacked:
        need = "must carry '{i}' (the param is stacked by a Stack)" if stacked else \
            "must not carry '{i}' (the param is not under a Stack)"
        return f"{e}: the checkpoint name {e.hf!r} {need}; param {e.param!r}"
    if e.layout == "in_out" and len(decl.parts[e.part].hf_shape) != 2:
        return f"{e}: layout='in_out' applies to 2-D weights; param {e.param!r} part {e.part!r} is 1-D"
    return None


def _listing(head: str, problems: list[str]) -> str:
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return f"{head} ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  " + "\n  ".join(
        problems[:MAX_LISTED]) + more


# --- the checkpoint against the bindings (headers only) ----------------------------------------

def check_source(bindings: list[Binding], source, table: WeightTable | Sequence[Entry], num_layers: int) -> None:
    """Every needed tensor present with its declared shape, every checkpoint tensor used (KV cache scales by the
    pool: tp_jax/loaders/kv_scales.py): before any read."""
    table = as_table(table)
    missing, wrong, used, rows_used = [], [], set(), {}
    for b in bindings:
        for layer in b.layers(num_layers):
            for part, e in b.entries.items():
                name = e.name(layer)
                if name not in source:
                    missing.append(name)
                    continue
                used.add(name)
                shape = tuple(as_lazy(source.get(name), name).shape)
                if e.index is not None:
                    if not shape or not 0 <= e.index < shape[0]:
                        wrong.append(f"tensor {name!r} has shape {shape}; entry {e.index} of its leading dimension "
                                     f"was expected (param {b.path!r} part {part!r})")
                        continue
                    shape = shape[1:]
                problem = _shape_problem(b, part, e, name, shape)
                if problem:
                    wrong.append(problem)
                elif e.offset is not None:
                    rows = shape[::-1][0] if e.layout == "in_out" else shape[0]
                    span = (e.offset, e.offset + b.decl.parts[part].hf_shape[0])
                    key = name if e.index is None else f"{name}[{e.index}]"
                    rows_used.setdefault(key, (rows, []))[1].append(span)
    if missing:
        raise MissingWeightError(_missing_message(missing, bindings, source, num_layers))
    if wrong:
        raise WeightShapeError(wrong[0] if len(wrong) == 1 else _listing("tensors with the wrong shape", wrong))
    unused = [n for n in source.keys() if n not in used and not table.is_ignored(n) and not is_kv_scale(n)]
    if unused:
        raise CheckpointMismatchError(_unused_message(unused, bindings, num_layers))
    _check_rows_covered(rows_used)


def _shape_problem(b: Binding, part: str, e: Entry, name: str, stored: tuple[int, ...]) -> str | None:
    expected = tuple(b.decl.parts[part].hf_shape)
    shape = stored[::-1] if e.layout == "in_out" else stored
    where = f"(param {b.path!r} part {part!r}, {e})"
    if e.offset is not None:
        if len(shape) != len(expected) or shape[1:] != expected[1:] or e.offset + expected[0] > shape[0]:
            return (f"tensor {name!r} has shape {stored}; rows [{e.offset}, {e.offset + expected[0]}) of a "
                    f"{expected[1:]} tensor were expected {where}; does the checkpoint match config.json?")
        return None
    if shape == expected:
        return None
    if len(shape) == 2 and shape[::-1] == expected:
        other = "out_in" if e.layout == "in_out" else "in_out"
        return (f"tensor {name!r} has shape {stored}, expected {expected} {where}; its transpose fits: the "
                f"checkpoint stores it the other way round, declare layout={other!r} in its Entry")
    return (f"tensor {name!r} has shape {stored}, expected {expected} {where}; does the checkpoint match "
            f"config.json?")


def _stacked_layers(names, bindings: list[Binding]) -> list[int]:
    """Layer indices of `names` that match a stacked entry's template."""
    regexes = {template_regex(e.hf) for b in bindings if b.stacked for e in b.entries.values()}
    return sorted({int(m.group("i")) for n in names for r in regexes if (m := r.fullmatch(n))})


def _missing_message(missing, bindings, source, num_layers) -> str:
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    msg = f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {missing[:5]}{more}"
    have = _stacked_layers(source.keys(), bindings)
    if have and max(have) + 1 < num_layers:
        msg += (f"; the checkpoint has layers 0..{max(have)} ({max(have) + 1} layers) but config.json says "
                f"{num_layers}: the config does not match the weights")
    return msg


def _unused_message(unused, bindings, num_layers) -> str:
    more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
    msg = (f"the checkpoint holds {len(unused)} tensor(s) that no param takes: {unused[:5]}{more}. "
           f"The checkpoint does not match its config or the model's name table")
    extra = [i for i in _stacked_layers(unused, bindings) if i >= num_layers]
    if extra:
        msg += (f"; it has layers up to {max(extra)} ({max(extra) + 1} layers) but config.json says "
                f"num_hidden_layers={num_layers}")
    return msg


def _check_rows_covered(rows_used: dict[str, tuple[int, list[tuple[int, int]]]]) -> None:
    """A fused tensor (entries with offsets) must be read whole: rows no part takes mean a wrong table."""
    for name, (size, spans) in rows_used.items():
        covered = set()
        for lo, hi in spans:
            covered.update(range(lo, hi))
        if len(covered) != size:
            free = sorted(set(range(size)) - covered)
            raise CheckpointMismatchError(f"rows {free[0]}..{free[-1]} of fused tensor {name!r} ({size} rows in the "
                                          f"declared layout) feed no part; its entries take rows {sorted(spans)}")
