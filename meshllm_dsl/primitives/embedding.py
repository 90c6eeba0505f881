"""`embedding(num, dim)`: token ids -> [b, s, dim] rows of a table, optionally vocab-parallel (each
rank holds a slice of the rows, looks up the ids it owns and the ranks sum); and `positional(num,
dim)`, GPT-2's learned position table added to the residual stream, always replicated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import E0304
from meshllm_dsl.ir import (
    DTYPES,
    REPLICATE,
    Collective,
    Leaf,
    LeafKind,
    Placement,
    Tensor,
    Unit,
    UnitFlow,
)
from meshllm_dsl.parallel.costs import Work
from meshllm_dsl.parallel.dtensor import Layout
from meshllm_dsl.parallel.flow import FlowSite, R, seq_layout, under_seq
from meshllm_dsl.primitives import Built, Primitive, TopSite
from meshllm_dsl.primitives.args import Arg, const


def _table(a: Mapping[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {"num": a["num"], "dim": a["dim"]}
    if a.get("used"):
        d["used"] = a["used"]
    if a.get("scaled"):
        d["scaled"] = True
    return d

if TYPE_CHECKING:
    from meshllm_dsl.front.site import UnitSite
    from meshllm_dsl.ir import PlanIR
    from meshllm_dsl.parallel.costs import HeldUnit


def _table_leaf(site: UnitSite, kind: LeafKind) -> tuple[list[Leaf], dict[str, Any]]:
    b, name, unit = site.b, site.name, site.unit
    w = Tensor("weight", (b["num"], b["dim"]), ((unit("num"),), (unit("dim"),)))
    return [Leaf(name, (name,), kind, (w,), (unit("dim"),), (unit("num"),), span=site.span)], {"num": b["num"], "dim": b["dim"]}


@attrs.frozen
class Embedding(Primitive):
    def build(self, site: UnitSite) -> Built | None:
        """Its parameters (leaves) and attributes from the bound arguments; None after an error."""
        b, name, r, decl = site.b, site.name, site.r, site.decl
        leaves, attrs_ = _table_leaf(site, "embedding")
        used = b.get("used")
        if used is not None and used != b["num"]:
            if not (float(used).is_integer() and 1 <= used < b["num"]):
                r.error(E0304, f"`{name}`: used = {used} must be a whole number of rows in 1..{b['num']}",
                        decl.call.span, label="padded rows past the real vocabulary")
                return None
            attrs_["used"] = int(used)
        attrs_["scaled"] = b["scaled"]
        return attrs_, leaves

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        return 8 * tokens  # the int64 token ids (and, vocab-parallel, a mask derived from them)

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        return 0  # nothing measured beyond what it saved

    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        sharded = any(hu.placement(leaf).sharded for leaf in hu.unit.leaves)
        return k["vocab_parallel_embedding" if sharded else "embedding"]

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Work:
        # A lookup, not a matmul (6 N counts no embedding parameters): each token's row read, the
        # [tokens, dim] output written.
        return Work(lookup_bytes=2 * DTYPES[plan.dtype] * tokens * int(hu.unit.attr("dim")))  # type: ignore[arg-type]

    def flow(self, site: FlowSite) -> UnitFlow | None:
        p = site.pl(site.unit.name)
        if p.sharded:  # each rank looks up the ids it holds rows for, zeros elsewhere: the ranks sum
            return UnitFlow(R, R, (Collective("reduce_from", p.axes, "output"),),
                            ((site.unit.name, Layout.partial(p.axes)),))
        return UnitFlow(R, R, ())

    def seq_top_flow(self, unit: Unit, flow: UnitFlow, seq: tuple[str, ...], last: bool,
                     then: Unit | None) -> UnitFlow:
        if then is not None and isinstance(primitives.of(then), Positional):
            return flow  # summed in full; the positions are added, then the sum is split (Megatron too)
        q = seq_layout(seq)
        ops = list(flow.collectives)
        summed = under_seq(ops[-1], seq) if ops else None  # a vocab-parallel sum over `seq`
        if summed is not None:
            return UnitFlow(R, q, (*ops[:-1], summed), flow.inside)
        return UnitFlow(R, q, (*ops, Collective("split_seq", seq, "output")), flow.inside)

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        return _table(a)

    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        a = dict(unit.attrs)
        p = placement.get(unit.name, REPLICATE)
        if p.sharded:
            local = a["num"] // w.n(p.axes)
            idx = "mesh.index(" + ", ".join(repr(x) for x in p.axes) + ")"
            return [w.line(f"self.{attr} = rt.VocabParallelEmbedding({local}, {a['dim']}, start={idx} * {local})",
                           f"vocab_parallel({', '.join(p.axes)}): rows [start, start + {local}) of {a['num']}")]
        return [w.line(f"self.{attr} = nn.Embedding({a['num']}, {a['dim']})", "replicated")]

    def top_lines(self, w: Any, site: TopSite) -> tuple[list[Any], str]:
        a, p = dict(site.unit.attrs), site.placement
        lines = [w.line(f"x = self.{site.unit.name}({site.cur})",
                        f"[b, s, {a['dim']}]" + (f" Partial over {w.axes_text(p.axes)}" if p.sharded else ""))]
        if a.get("scaled"):
            lines.append(w.line(f"x = x * torch.tensor({a['dim'] ** 0.5!r}).to(x.dtype)",
                                f"times sqrt({a['dim']}) rounded to the model dtype (Gemma)"))
        if site.flow is not None:
            lines += w.seq_lines(site.flow, a["dim"])
        return lines, "x"


@attrs.frozen
class Positional(Primitive):
    def build(self, site: UnitSite) -> Built | None:
        leaves, attrs_ = _table_leaf(site, "positional")
        return attrs_, leaves

    def position_limit(self, unit: Unit) -> int | None:
        return int(unit.attr("num"))  # type: ignore[arg-type]

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        return 0  # a lookup added to the residual stream: nothing saved but the position ids

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        return 0  # nothing measured beyond what it saved

    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        return k["positional"]

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Work:
        # Each position's row read, added to the stream: read and written.
        return Work(lookup_bytes=3 * DTYPES[plan.dtype] * tokens * int(hu.unit.attr("dim")))  # type: ignore[arg-type]

    def flow(self, site: FlowSite) -> UnitFlow | None:
        return UnitFlow(R, R, ())  # replicated table added to the stream

    def seq_top_flow(self, unit: Unit, flow: UnitFlow, seq: tuple[str, ...], last: bool,
                     then: Unit | None) -> UnitFlow:
        return UnitFlow(R, seq_layout(seq), (Collective("split_seq", seq, "output"),))

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        return _table(a)

    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        a = dict(unit.attrs)
        return [w.line(f"self.{attr} = nn.Embedding({a['num']}, {a['dim']})", "learned positions, replicated")]

    def top_lines(self, w: Any, site: TopSite) -> tuple[list[Any], str]:
        a = dict(site.unit.attrs)
        lines = [w.line(f"x = x + self.{site.unit.name}({w.positions('x')})", f"[b, s, {a['dim']}]")]
        if site.flow is not None:
            lines += w.seq_lines(site.flow, a["dim"])
        return lines, site.cur


EMBEDDING = Embedding("embedding", vocab_rows=True, args=(
    # `used`: rows that are real tokens when `num` is padded (e.g. 50257 of 50304): the head's logits
    # past it are masked out of the softmax, the loss, the argmax and exported weights.
    Arg("num", "dim"), Arg("dim", "dim"), Arg("used", "float", const(None)),
    # `scaled`: rows times sqrt(dim), that factor rounded to the model dtype first (as HF does).
    Arg("scaled", "bool", const(False))))
POSITIONAL = Positional("positional", args=(Arg("num", "dim"), Arg("dim", "dim")))
