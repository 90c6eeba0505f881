"""Lowering: a checked plan (PlanIR) -> the template context of one generated module.

Every decision about the generated code is made here: class per pipeline stage and per block class,
literal local shapes, the collectives each forward issues (from the checker's UnitFlow), shape
comments, the parameter map. The template only prints what this module hands it. Every identifier
that reaches the output was validated by the checker (names.identifier_problem), and every number is
printed from an int or float, so nothing in a spec can inject code.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.front.names import ranges
from meshllm_dsl.ir import (
    REPLICATE,
    BlockClass,
    Collective,
    Leaf,
    Placement,
    PlanIR,
    Repeat,
    Stage,
    Tensor,
    Unit,
    UnitFlow,
)
from meshllm_dsl.parallel.collectives import spec
from meshllm_dsl.parallel.layouts import column_partial_grad, seq_partial_grad
from meshllm_dsl.parallel.placements import runs_fsdp
from meshllm_dsl.primitives.embedding import EMBEDDING

TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32", "fp64": "torch.float64"}


@attrs.define
class Line:
    """One statement of generated code with an optional trailing comment."""

    code: str
    comment: str = ""

    def __str__(self) -> str:
        if not self.comment:
            return self.code
        if not self.code:
            return "# " + self.comment
        return f"{self.code}  # {self.comment}"


@attrs.define
class ClassDef:
    name: str
    doc: str
    init: list[Line]
    forward_args: str
    forward: list[Line]
    params: list[Line]  # body of the `params(prefix)` static method: dict entries


@attrs.define
class ModuleContext:
    header: list[str]
    axes: str
    model: str
    classes: list[ClassDef]
    stages: list[str]
    loss: list[Line]
    program: list[Line]
    # `import torch.nn.functional as F` only where a printed line calls it (a moe plan without tensor
    # parallelism calls none, and an unused import would fail lint in the user's tree).
    uses_functional: bool = False


def _axes_text(axes: Sequence[str]) -> str:
    return " x ".join(axes)


def _group_attr(axes: Sequence[str]) -> str:
    return "g_" + "_".join(axes)


def literal(obj: Any, indent: int = 0) -> str:
    """A deterministic Python literal for plain data (dicts keep insertion order)."""
    pad = "    " * indent
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        if all(not isinstance(v, (dict, list, tuple)) for v in obj.values()) and len(obj) <= 4:
            return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in obj.items()) + "}"
        inner = ",\n".join(f"{pad}    {literal(k)}: {literal(v, indent + 1)}" for k, v in obj.items())
        return "{\n" + inner + ",\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if not obj:
            return "[]" if isinstance(obj, list) else "()"
        if all(not isinstance(x, (dict, list, tuple)) for x in obj):
            body = ", ".join(literal(x) for x in obj)
            return f"[{body}]" if isinstance(obj, list) else (f"({body},)" if len(obj) == 1 else f"({body})")
        inner = ",\n".join(f"{pad}    {literal(x, indent + 1)}" for x in obj)
        open_, close = ("[", "]") if isinstance(obj, list) else ("(", ")")
        return open_ + "\n" + inner + ",\n" + pad + close
    if isinstance(obj, bool) or obj is None:
        return repr(obj)
    if isinstance(obj, (int, float)):
        return repr(obj)
    if isinstance(obj, str):
        # str repr escapes everything; spec strings never reach here unvalidated anyway
        return repr(obj)
    raise TypeError(f"cannot print {type(obj).__name__} as a literal")


# ---------------------------------------------------------------- the model description


def model_description(plan: PlanIR) -> dict[str, Any]:
    """The JSON-able model description the runtime's reference model and launcher read."""
    layers: list[dict[str, Any]] = []
    for item in plan.model.items:
        if isinstance(item, Repeat):
            layers.append({"name": item.name, "kind": "repeat", "count": item.count,
                           "body": [_unit_desc(u) for u in item.body]})
        else:
            layers.append(_unit_desc(item))
    # The family's name lets the runtime read its pack (meshllm_dsl/families) instead of guessing it
    # from the model's shape; a model built from primitives has none.
    family = {"family": plan.model.family} if plan.model.family is not None else {}
    return {"name": plan.model.name, **family, "dtype": plan.model.dtype, "layers": layers}


def _unit_desc(u: Unit) -> dict[str, Any]:
    return {"name": u.name, "kind": u.kind, **primitives.of(u).describe(dict(u.attrs))}


# ---------------------------------------------------------------- parameters


def _shard_dims(t: Tensor, p: Placement) -> tuple[tuple[int, tuple[str, ...]], ...]:
    return p.split_dims(t)


def _spec(full_local: str, t: Tensor, p: Placement, local_expr: str | None = None,
          partial_grad: tuple[str, ...] = ()) -> Line:
    dims = _shard_dims(t, p)
    # repr of tuples of ints and validated identifiers is exactly the Python literal we want
    dims_text = repr(tuple((d, tuple(axes)) for d, axes in dims))
    seg = f", segments={tuple(t.segments)!r}" if t.segments and dims and dims[0][0] == 0 else ""
    if partial_grad:
        seg += f", partial_grad={tuple(partial_grad)!r}"
    local = local_expr if local_expr is not None else "prefix + " + repr(full_local)
    return Line(f"prefix + {full_local!r}: rt.ShardSpec({local}, {tuple(t.shape)!r}, {dims_text}{seg}),")


# ---------------------------------------------------------------- code for units


class _UnitWriter:
    """Writes __init__ and forward lines of one unit (in a block or at top level)."""

    def __init__(self, plan: PlanIR, groups: dict[tuple[str, ...], str]) -> None:
        self.plan = plan
        self.groups = groups  # axes -> attribute name holding the process group
        self.indices: dict[tuple[str, ...], str] = {}  # axes -> attribute holding mesh.index(axes)
        self.projected: set[str] = set()  # column layers of the current sublayer already applied
        self.block_index = 0  # the first block of the class being written (its per-block settings)
        self.context_used = False  # forward reads this rank's part of the sequence (`self.ctx`)

    def group(self, axes: tuple[str, ...]) -> str:
        self.groups.setdefault(axes, _group_attr(axes))
        return "self." + self.groups[axes]

    def group_lines(self) -> list[Line]:
        """__init__ lines binding every process group the class's forward uses."""
        return [Line(f"self.{attr} = mesh.group({', '.join(repr(a) for a in axes)})",
                     f"{_axes_text(axes)}: {self.plan.mesh.size(*axes)} ranks") for axes, attr in self.groups.items()] + [
            Line(f"self.{attr} = mesh.index({', '.join(repr(a) for a in axes)})", "this rank's index over "
                 + _axes_text(axes)) for axes, attr in self.indices.items()] + self._context_lines()

    def _context_lines(self) -> list[Line]:
        cp = self.plan.roles.context
        if not self.context_used:
            return []
        n = self.plan.mesh.size(*cp)
        return [Line(f"self.ctx = rt.ContextShard(mesh, {tuple(cp)!r})",
                     f"context parallel over {_axes_text(cp)}: sequence chunks i and {2 * n - 1} - i of {2 * n}")]

    def positions(self, x: str) -> str:
        """The call giving the positions of this rank's `s` tokens of `x`: global ones under context parallelism."""
        if self.plan.roles.context:
            self.context_used = True
            return f"self.ctx.positions(s, {x}.device)"
        return f"rt.positions(s, {x}.device)"

    def attention(self) -> str:
        """The attention function: over every context rank's keys and values under context parallelism."""
        if self.plan.roles.context:
            self.context_used = True
            return "self.ctx.attention"
        return "rt.attention"

    def capacity_keep(self, x: str) -> str:
        """The `keep=` of a capacity-dropping router: under context parallelism capacity counts the
        whole sequences' tokens in position order (runtime/parallel/context.py); '' otherwise."""
        if self.plan.roles.context:
            self.context_used = True
            return f", keep=self.ctx.capacity_keep({x}.shape[0])"
        return ""

    def group_index(self, axes: tuple[str, ...]) -> str:
        """An __init__-bound attribute holding this rank's index over ``axes``."""
        attr = "i_" + "_".join(axes)
        self.indices[axes] = attr
        return "self." + attr

    def n(self, axes: tuple[str, ...]) -> int:
        return self.plan.mesh.size(*axes) if axes else 1

    def line(self, code: str, comment: str = "") -> Line:
        return Line(code, comment)

    def axes_text(self, axes: Sequence[str]) -> str:
        return _axes_text(axes)

    def collective_line(self, c: Collective, dim: int, x: str = "x") -> Line:
        return _collective_line(self, c, dim, x)

    def seq_lines(self, flow: UnitFlow, dim: int) -> list[Line]:
        return _seq_lines(self, flow, dim)

    def vocab_used(self) -> int | None:
        return _vocab_used(self.plan.model)

    def unit_init(self, attr: str, unit: Unit, placement: dict[str, Placement], tied_here: bool = False) -> list[Line]:
        """__init__ lines for a unit; `tied_here`: a tied head whose weight's owner is on this stage."""
        return primitives.of(unit).init_lines(self, attr, unit, placement, tied_here)

    def composite_init(self, attr: str, unit: Unit, placement: Mapping[str, Placement]) -> list[Line]:
        """A plain container module holding the unit's linear layers, so parameter names read attn.q.weight."""
        lines = [Line(f"self.{attr} = nn.Module()")]
        for leaf in unit.leaves:
            p = placement.get(f"{unit.name}.{leaf.name}", REPLICATE)
            w = leaf.params[0]
            out_f, in_f = self.plan.local_shape(w, p)
            has_bias = any(t.name == "bias" for t in leaf.params)
            if p.sharded:
                what = self._unit_words(unit, leaf, p)
                comment = f"{p.rule}({', '.join(p.axes)}): {what}"
            else:
                comment = "replicated"
            lines.append(Line(f"self.{attr}.{leaf.name} = nn.Linear({in_f}, {out_f}, bias={has_bias})", comment))
            for t in (t for t in leaf.params[1:] if t.name != "bias"):
                # a scale applied to the layer's output (attention's q / k norm)
                n = self.plan.local_shape(t, p)[0]
                lines.append(Line(f"self.{attr}.{leaf.name}.{t.name} = nn.Parameter(torch.ones({n}))",
                                  "split with the layer" if p.tensor_dim(t) is not None else "replicated"))
        return lines

    def _unit_words(self, unit: Unit, leaf: Leaf, p: Placement) -> str:
        n = self.n(p.axes)
        units = leaf.in_units if p.rule == "row" else leaf.out_units
        return ", ".join(dict.fromkeys(f"{c // n} of {c} {name}" for name, c in units))

    # -- forward
    def sublayer(self, attr: str, unit: Unit, flow: UnitFlow, placement: dict[str, Placement], x: str) -> list[Line]:
        """Forward of attention / mlp on input `x` (normed, replicated); result in `out`."""
        a = dict(unit.attrs)
        lines: list[Line] = []
        hidden = a["hidden"]
        for c in flow.collectives:
            fused = spec(c.op).fused
            if c.where != "input" or fused is None:
                continue
            # The column layers run inside the collective's call: a name per layer output for the
            # code below. copy_to_linear all-reduces the input gradient while backward computes the
            # weight gradients; gather_seq_linear keeps only this rank's slice of the shared input.
            names = [leaf.name for leaf in unit.leaves[:-1]]
            layers = ", ".join(f"self.{attr}.{name}" for name in names)
            target = names[0] + "," if len(names) == 1 else ", ".join(names)
            self.projected = set(names)
            lines.append(Line(f"{target} = rt.{fused.runtime}({x}, {self.group(c.axes)}, {layers})",
                              fused.columns.format(dim=hidden, n=self.n(c.axes), axes=_axes_text(c.axes))))
            if fused.gathers_sequence and primitives.of(unit).reads_sequence:
                lines.append(Line(f"b, s, _ = {names[0]}.shape", "this rank's two chunks of the sequence over "
                                  f"{_axes_text(self.plan.roles.context)}" if self.plan.roles.context else "the whole sequence"))
        # In front of a row layer fed a replicated input, this rank's slice of it.
        split = next((c for c in flow.collectives if c.where == "input" and spec(c.op).fused is None), None)
        reduce = next((c for c in flow.collectives if c.where == "output"), None)  # the row layer's sum
        lines += primitives.of(unit).core_lines(self, attr, unit, a, placement, x)
        self.projected = set()
        out_leaf = unit.leaves[-1]
        p_out = placement.get(f"{unit.name}.{out_leaf.name}", REPLICATE)
        src = "a"
        if split is not None and p_out.rule == "row":
            lines.append(_collective_line(self, split, out_leaf.params[0].shape[1], "a"))
        has_bias = len(out_leaf.params) > 1
        if reduce is not None:
            lines.append(Line(f"out = F.linear({src}, self.{attr}.{out_leaf.name}.weight)",
                              f"[b, s, {hidden}] Partial over {_axes_text(reduce.axes)}"))
            bias = f" + self.{attr}.{out_leaf.name}.bias" if has_bias else ""
            summed, n = spec(reduce.op), self.n(reduce.axes)
            if summed.closes_row is None:
                raise AssertionError(f"{reduce.op} does not sum a row layer's output (collectives.py: closes_row)")
            lines.append(Line(f"out = {summed.call('out', self.group(reduce.axes))}{bias}",
                              summed.closes_row.format(dim=hidden, local=hidden // n, n=n, axes=_axes_text(reduce.axes))))
        else:
            lines.append(Line(f"out = self.{attr}.{out_leaf.name}({src})", f"[b, s, {hidden}]"))
        return lines

    def proj(self, attr: str, name: str, x: str) -> str:
        """Column layer `name` applied to `x`, or the name of its output computed already."""
        return name if name in self.projected else f"self.{attr}.{name}({x})"

    def local_heads(self, unit: Unit, leaf_name: str, count: int, placement: Mapping[str, Placement]) -> int:
        p = placement.get(f"{unit.name}.{leaf_name}", REPLICATE)
        return count // self.n(p.axes) if p.sharded else count


# ---------------------------------------------------------------- classes


def _block_class(plan: PlanIR, rep: Repeat, cls: BlockClass, name: str) -> ClassDef:
    groups: dict[tuple[str, ...], str] = {}
    w = _UnitWriter(plan, groups)
    w.block_index = cls.indices[0]
    placement = dict(cls.placements)
    init: list[Line] = []
    sp, cp = plan.roles.sequence, plan.roles.context
    # Under context parallelism `s` is this rank's two chunks of the sequence, split further by sp.
    residual = f"Shard(seq) over {_axes_text((*cp, *sp))}" if sp or cp else "Replicate"
    stream = f"the residual stream; s: this rank's chunks over {_axes_text(cp)}" if cp else "the residual stream"
    if sp:
        # b and s are bound after the attention's gather: the whole sequence, not this rank's slice.
        forward: list[Line] = [Line("", f"x: [b, s/{plan.mesh.size(*sp)}, {_model_hidden(plan)}] {residual} ({stream})")]
    else:
        forward = [Line("b, s, _ = x.shape", f"x: [b, s, {_model_hidden(plan)}] {residual} ({stream})")]
    params: list[Line] = []
    pending_norm: str | None = None
    for unit in rep.body:
        init += w.unit_init(unit.name, unit, placement)
        for leaf in unit.leaves:
            p = placement.get(".".join(leaf.path[0:]) if len(leaf.path) == 1 else f"{unit.name}.{leaf.name}", REPLICATE)
            local_base = leaf.path[0] if len(leaf.path) == 1 else f"{unit.name}.{leaf.name}"
            for t in leaf.params:
                partial = seq_partial_grad(plan, unit, leaf, t) + column_partial_grad(p, t)
                params.append(_spec(f"{local_base}.{t.name}", t, p, partial_grad=partial))
        prim = primitives.of(unit)
        if prim.norm and dict(unit.attrs).get("post"):
            # a post norm: the sublayer's output, before the residual add (Gemma)
            if not forward or forward[-1].code != "x = x + out":
                raise AssertionError(f"post norm {unit.name} follows no sublayer")
            forward.insert(len(forward) - 1, Line(f"out = self.{unit.name}(out)", "post norm"))
        elif prim.norm:
            forward.append(Line(f"h = self.{unit.name}(x)"))
            pending_norm = unit.name
        elif prim.sublayer:
            src = "h" if pending_norm else "x"
            forward += prim.sublayer_lines(w, unit.name, unit, cls.flow(unit.name), placement, src)
            forward.append(Line("x = x + out", f"residual add: {residual}"))
            pending_norm = None
        else:
            raise AssertionError(f"{unit.kind} inside a repeat")
    if pending_norm:
        forward.append(Line("x = h"))
    forward.append(Line("return x"))
    forward = forward if sp else _trim_shape_line(forward)
    idx = cls.indices
    doc = f"Blocks {ranges(idx, ', ')} of `{rep.name}`: " + ", ".join(f"{u.name} ({u.kind})" for u in rep.body) + "."
    return ClassDef(name, doc, w.group_lines() + init, "x: torch.Tensor", forward, params)


def _per_block_variants(rep: Repeat, classes: tuple[BlockClass, ...]) -> list[BlockClass]:
    """The block classes split where blocks of one class print differently (a sliding window on
    some blocks only, Gemma's alternation: a record's block_variant), in block order."""
    out: list[BlockClass] = []
    for cls in classes:
        groups: dict[tuple[object, ...], list[int]] = {}
        for i in cls.indices:
            key = tuple(primitives.of(u).block_variant(u, i) for u in rep.body)
            groups.setdefault(key, []).append(i)
        out += [attrs.evolve(cls, indices=tuple(idx)) for idx in groups.values()]
    return sorted(out, key=lambda c: c.indices[0])


def _block_loop(plan: PlanIR, name: str, stream: str) -> list[Line]:
    """The stage's loop over its blocks, each wrapped in `rt.recompute` (full recomputation: the
    block keeps only its input, backward reruns its forward, tensor-parallel collectives included)
    or `rt.recompute_ops` (torchtitan's selective op: it also keeps its attention outputs and
    every other matmul output) where the plan recomputes it: every block, or with `every N`
    blocks N - 1, 2 N - 1, ..."""
    wrap = {"blocks": "rt.recompute", "ops": "rt.recompute_ops"}.get(plan.recompute)
    if wrap is None:
        return [Line(f"for block in self.{name}.values():"), Line("    x = block(x)", stream)]
    recomputed = f"    x = {wrap}(block, x)"
    what = "recomputed in backward" if plan.recompute == "blocks" else "all but its attention and every other matmul output recomputed"
    n = plan.recompute_every
    if n == 1:
        return [Line(f"for block in self.{name}.values():"), Line(recomputed, f"{stream}; {what}")]
    return [Line(f"for i, block in self.{name}.items():"),
            Line(f"    if (int(i) + 1) % {n} == 0:", f"blocks {n - 1}, {2 * n - 1}, ... (every {n}): {what}"),
            Line("    " + recomputed, stream),
            Line("    else:"),
            Line("        x = block(x)", stream)]


def _stage_class(plan: PlanIR, stage: Stage, block_names: dict[int, str]) -> ClassDef:
    groups: dict[tuple[str, ...], str] = {}
    w = _UnitWriter(plan, groups)
    top = dict(plan.top_placements)
    flows = dict(plan.top_flows)
    model = plan.model
    first = stage.index == 0
    init: list[Line] = []
    forward: list[Line] = []
    params: list[Line] = []
    hidden = _model_hidden(plan)
    if first:
        forward.append(Line("b, s = tokens.shape", "tokens: [b, s] int64"))
        cur = "tokens"
    else:
        sp_in = f"[b, s/{plan.sequence_size}, {hidden}] Shard(seq)" if plan.roles.sequence else f"[b, s, {hidden}]"
        forward.append(Line("b, s, _ = x.shape", f"x: {sp_in} from the previous stage"))
        cur = "x"
    held = {pc.item for pc in stage.pieces}
    for pc in stage.pieces:
        item = model.item(pc.item)
        if isinstance(item, Repeat):
            assert pc.start is not None and pc.stop is not None
            runs = _class_runs(block_names, pc.start, pc.stop)
            if len(runs) == 1:
                (cls_name, a, b), = runs
                init.append(Line(f"self.{item.name} = nn.ModuleDict({{str(i): {cls_name}(mesh) for i in {_range(a, b)}}})",
                                 f"blocks {a} to {b - 1} of {item.count}"))
            else:
                entries = ", ".join(f'"{i}": {block_names[i]}(mesh)' for i in range(pc.start, pc.stop))
                init.append(Line(f"self.{item.name} = nn.ModuleDict({{{entries}}})",
                                 f"blocks {pc.start} to {pc.stop - 1} of {item.count}"))
            stream = f"[b, s/{plan.sequence_size}, {hidden}] Shard(seq)" if plan.roles.sequence else f"[b, s, {hidden}]"
            forward += _block_loop(plan, item.name, stream)
            for cls_name, a, b in runs:
                params.append(Line(f"**{{k: v for i in {_range(a, b)} "
                                   f"for k, v in {cls_name}.params(f\"{{prefix}}{item.name}.{{i}}.\").items()}},"))
            cur = "x"
            continue
        assert isinstance(item, Unit)
        tie = item.leaves[0].tie if item.leaves else None
        init += w.unit_init(item.name, item, top, tied_here=tie is not None and tie in held)
        flow = flows.get(item.name)
        p = top.get(item.name, REPLICATE)
        leaf = item.leaves[0] if item.leaves else None
        if leaf is not None:
            if leaf.tie is not None:
                tied = model.item(leaf.tie)
                assert isinstance(tied, Unit)
                t = tied.leaves[0].params[0]
                local = f"prefix + {item.name + '.weight'!r}"
                if leaf.tie not in held:
                    params.append(_spec(f"{leaf.tie}.weight", t, p, local))
                for t2 in leaf.params:
                    params.append(_spec(f"{item.name}.{t2.name}", t2, p))
            else:
                for lf in item.leaves:
                    for t in lf.params:
                        base = lf.path[0] if len(lf.path) == 1 else f"{item.name}.{lf.name}"
                        params.append(_spec(f"{base}.{t.name}", t, p, partial_grad=seq_partial_grad(plan, item, lf, t)))
        lines, cur = primitives.of(item).top_lines(w, primitives.TopSite(plan, item, flow, p, cur, frozenset(held)))
        forward += lines
    forward.append(Line(f"return {cur if cur != 'tokens' else 'x'}"))
    forward = _trim_shape_line(forward)
    pieces = ", ".join(pc.item + (f"[{pc.start}:{pc.stop}]" if pc.start is not None else "") for pc in stage.pieces)
    where = f"pipeline coordinate {stage.coord}" if plan.roles.pipeline else "every rank"
    doc = f"Stage {stage.index} ({where}): {pieces}."
    arg = "tokens: torch.Tensor" if first else "x: torch.Tensor"
    return ClassDef(f"Stage{stage.index}", doc, w.group_lines() + init, arg, forward, params)


def _collective_line(w: _UnitWriter, c: Collective, dim: int, x: str = "x") -> Line:
    """`x = rt.<op>(x, group)` for collective `c` on an activation `dim` wide."""
    s, n = spec(c.op), w.n(c.axes)
    return Line(f"{x} = {s.call(x, w.group(c.axes))}", s.line.format(dim=dim, local=dim // n, n=n, axes=_axes_text(c.axes)))


def _seq_lines(w: _UnitWriter, flow: UnitFlow, dim: int) -> list[Line]:
    """The collectives of a top-level unit's flow (embedding sums, sequence parallelism's scatter
    after the embedding and gather before the head), in order."""
    return [_collective_line(w, c, dim) for c in flow.collectives]


def _vocab_used(model: Any) -> int | None:
    for item in model.items:
        if isinstance(item, Unit) and primitives.of(item) is EMBEDDING:
            used = dict(item.attrs).get("used")
            return int(used) if used else None
    return None


def _range(a: int, b: int) -> str:
    return f"range({b})" if a == 0 else f"range({a}, {b})"


def _class_runs(block_names: dict[int, str], start: int, stop: int) -> list[tuple[str, int, int]]:
    """Maximal runs [a, b) of consecutive blocks generated by the same class."""
    runs: list[tuple[str, int, int]] = []
    for i in range(start, stop):
        if runs and runs[-1][0] == block_names[i] and runs[-1][2] == i:
            runs[-1] = (runs[-1][0], runs[-1][1], i + 1)
        else:
            runs.append((block_names[i], i, i + 1))
    return runs


def _trim_shape_line(forward: list[Line]) -> list[Line]:
    """Bind only the batch / sequence sizes the forward body uses (no unused variables)."""
    first, rest = forward[0], forward[1:]
    body = "\n".join(line.code for line in rest)
    uses_b = re.search(r"\bb\b", body) is not None
    uses_s = re.search(r"\bs\b", body) is not None
    target, arg = first.code.split(" = ")
    names = [n.strip() for n in target.split(",")]
    names[0] = names[0] if uses_b else "_"
    names[1] = names[1] if uses_s else "_"
    if not uses_b and not uses_s:
        return [Line("", first.comment), *rest]
    return [Line(f"{', '.join(names)} = {arg}", first.comment), *rest]


def _model_hidden(plan: PlanIR) -> int:
    for item in plan.model.items:
        if isinstance(item, Unit) and primitives.of(item) is EMBEDDING:
            return int(dict(item.attrs)["dim"])  # type: ignore[arg-type]
    return 0


def docstring_text(text: str) -> str:
    """`text` as it may stand inside a generated \"\"\"docstring\"\"\": it reads the same, and no quote,
    backslash or control character in it (a file name is arbitrary bytes) can end the string or
    start an escape. Non-ASCII is escaped too, so generated files are ASCII whatever the input."""
    return text.encode("unicode_escape").decode("ascii").replace('"', '\\"')


def lower(plan: PlanIR, source_path: str, source_text: str) -> ModuleContext:
    digest = hashlib.sha256(source_text.encode()).hexdigest()
    mesh = plan.mesh
    header = [
        f"Plan `{plan.name}` of {docstring_text(source_path)} (sha256 {digest[:16]}), generated by meshc. Do not edit.",
        "",
        f"Mesh `{mesh.name}`: {' x '.join(f'{a.name} {a.size}' for a in mesh.axes)} = {mesh.devices} ranks"
        " (rank order: last axis varies fastest).",
        f"Model `{plan.model.name}`: {plan.model.numel:,} parameters.",
        f"Pipeline: {len(plan.stages)} stage(s)" + (f" over `{plan.roles.pipeline}`, schedule {plan.schedule}, "
                                                   f"{plan.microbatches} microbatches" if plan.roles.pipeline else "") + ".",
        f"Data parallel over: {_axes_text(plan.roles.batch) or 'none'}; ZeRO stage {plan.zero}"
        + (f" over {_axes_text(plan.roles.batch_shard)}, replicated over {_axes_text(plan.roles.batch_replicate)} (HSDP)"
           if plan.zero and plan.roles.batch_replicate else "") + ".",
        *([f"Context parallel over: {_axes_text(plan.roles.context)}: each rank holds sequence chunks i and "
           f"{2 * mesh.size(*plan.roles.context) - 1} - i of {2 * mesh.size(*plan.roles.context)} (causal load balance), "
           "keys and values all-gathered in attention."] if plan.roles.context else []),
        *([f"Precision: compute in {plan.dtype}, master weights and optimizer states in {plan.master_dtype}, "
           f"gradients reduced in {plan.reduce_dtype} ("
           + ("FSDP2 MixedPrecisionPolicy" if runs_fsdp(plan) else "torch.autocast, fp32 parameters") + ")."] if plan.master_dtype else []),
        "",
        f"Run: torchrun --nproc-per-node {mesh.devices} THIS_FILE --steps 10",
    ]
    classes: list[ClassDef] = []
    block_names: dict[int, str] = {}
    rep = plan.model.repeat
    if rep is not None:
        block_classes = _per_block_variants(rep, plan.block_classes)
        for k, cls in enumerate(block_classes):
            name = f"Block{k}" if len(block_classes) > 1 else "Block"
            classes.append(_block_class(plan, rep, cls, name))
            for i in cls.indices:
                block_names[i] = name
    stage_classes = [_stage_class(plan, s, block_names) for s in plan.stages]
    classes += stage_classes
    loss = _loss_lines(plan)
    program = [
        Line("model=MODEL,"),
        Line("axes=AXES,"),
        Line(f"stages=({', '.join(c.name for c in stage_classes)},),"),
        Line("loss=make_loss,"),
        Line(f"pipeline_axis={plan.roles.pipeline!r},"),
        Line(f"batch_axes={tuple(plan.roles.batch)!r},"),
        Line(f"schedule={plan.schedule!r},"),
        Line(f"microbatches={plan.microbatches},"),
        Line(f"batch={plan.batch},"),
        Line(f"seq={plan.seq},"),
        Line(f"zero={plan.zero},"),
        # HSDP: ZeRO shards over these batch axes only and replicates over the others.
        *([Line(f"zero_axes={tuple(plan.roles.batch_shard)!r},")]
          if plan.zero and (plan.roles.batch_replicate or plan.roles.batch_shard != plan.roles.batch) else []),
        *([Line(f"seq_axes={tuple(plan.roles.sequence)!r},")] if plan.roles.sequence else []),
        *([Line(f"context_axes={tuple(plan.roles.context)!r},")] if plan.roles.context else []),
        Line(f"optimizer={literal(_adamw_kwargs(plan))},"),
        # With `precision` the parameters the runtime keeps are the master weights.
        Line(f"dtype={TORCH_DTYPES[plan.master_dtype or plan.dtype]},"),
    ]
    if plan.master_dtype is not None:
        program.append(Line(f"param_dtype={TORCH_DTYPES[plan.dtype]},"))
        program.append(Line(f"reduce_dtype={TORCH_DTYPES[plan.reduce_dtype or plan.dtype]},"))
    if mesh.hosts > 1:
        # The runtime checks at start-up that each group the planner keeps in a host is on one node.
        program.append(Line(f"hosts={mesh.hosts},"))
    axes = "(" + ", ".join(f"({a.name!r}, {a.size})" for a in mesh.axes) + ("," if len(mesh.axes) == 1 else "") + ")"
    printed = [line.code for c in classes for line in (*c.init, *c.forward, *c.params)]
    printed += [line.code for line in (*loss, *program)]
    uses_functional = any(_FUNCTIONAL.search(code) for code in printed)
    return ModuleContext(header, axes, literal(model_description(plan)), classes, [c.name for c in stage_classes],
                         loss, program, uses_functional)


_FUNCTIONAL = re.compile(r"\bF\.")


def _adamw_kwargs(plan: PlanIR) -> dict[str, Any]:
    """The plan's optimizer settings: torch.optim.AdamW's keyword arguments, and the training loop's
    (`clip`, `warmup`, `decay_steps`, `min_lr`: runtime/train/program.py LOOP_SETTINGS)."""
    given = dict(plan.optimizer_settings)
    out: dict[str, Any] = {}
    if "lr" in given:
        out["lr"] = given["lr"]
    if "beta1" in given or "beta2" in given:
        out["betas"] = (given.get("beta1", 0.9), given.get("beta2", 0.999))
    for key in ("weight_decay", "eps", "clip", "min_lr"):
        if key in given:
            out[key] = given[key]
    for key in ("warmup", "decay_steps"):  # step counts: integers in generated code
        if key in given:
            out[key] = int(given[key])  # type: ignore[call-overload]
    return out


def _loss_lines(plan: PlanIR) -> list[Line]:
    if plan.roles.loss_parallel:
        axes = plan.roles.loss
        head = plan.model.items[-1]
        vocab = int(dict(head.attrs)["out"]) if isinstance(head, Unit) else 0  # type: ignore[arg-type]
        local = vocab // plan.mesh.size(*axes)
        return [
            Line(f"group = mesh.group({', '.join(repr(a) for a in axes)})"),
            Line(f"start = mesh.index({', '.join(repr(a) for a in axes)}) * {local}", f"this rank's vocab rows [start, start + {local})"),
            Line(""),
            Line("def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:"),
            Line(f"    # logits: [b, s, {local}] Shard(vocab) over {_axes_text(axes)}; the full logits are never gathered"),
            Line("    return rt.vocab_parallel_cross_entropy(logits, targets, group, start)"),
            Line(""),
            Line("return loss"),
        ]
    return [
        Line("def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:"),
        Line("    return rt.cross_entropy(logits, targets)", "logits: [b, s, vocab] Replicate"),
        Line(""),
        Line("return loss"),
    ]
