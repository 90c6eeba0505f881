"""`linear(in, out, bias, tie)`: a top-level projection, in practice the language-model head; may
be tied to an embedding's weight (then it reads that table, one parameter)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import E0304, E0309
from meshllm_dsl.ir import DTYPES, REPLICATE, Collective, Leaf, Placement, Tensor, Unit, UnitFlow
from meshllm_dsl.parallel import costs
from meshllm_dsl.parallel.collectives import spec
from meshllm_dsl.parallel.costs import Work
from meshllm_dsl.parallel.flow import FlowSite, linear_flow, seq_layout, under_seq
from meshllm_dsl.primitives import Built, Primitive, TopSite
from meshllm_dsl.primitives.args import Arg, const
from meshllm_dsl.primitives.embedding import EMBEDDING


def tied_with_own_bias(unit: Unit) -> bool:
    """A linear tied to another unit's weight that keeps a bias of its own. Weight and bias then live
    on different modules, so no fused column call (rt.copy_to_linear, rt.gather_seq_linear) takes
    the layer whole: codegen issues the collective and the layer apart, and the planner counts that."""
    return any(leaf.tie is not None and any(t.name == "bias" for t in leaf.params) for leaf in unit.leaves)

if TYPE_CHECKING:
    from meshllm_dsl.front.site import UnitSite
    from meshllm_dsl.ir import PlanIR
    from meshllm_dsl.parallel.costs import HeldUnit


@attrs.frozen
class Linear(Primitive):
    def build(self, site: UnitSite) -> Built | None:
        """Its parameters (leaves) and attributes from the bound arguments; None after an error."""
        b, name, span, unit, r, decl = site.b, site.name, site.span, site.unit, site.r, site.decl
        params: list[Tensor] = []
        tie = b["tie"] if b["tied"] else None
        if tie is not None and b["bias"]:
            r.error(E0309, f"a bias on the tied head `{name}` is not supported yet", decl.call.span,
                    label="tie and bias", help=f"drop `bias = true`, or untie `{name}` (remove `tie = {tie.name}`)")
            return None
        if tie is not None:
            if primitives.of(tie) is not EMBEDDING or tie.leaves[0].params[0].shape != (b["out"], b["in"]):
                r.error(E0304, f"`{name}` cannot be tied to `{tie.name}`", decl.call.span,
                        label=f"a ({b['out']}, {b['in']}) weight",
                        help=f"tie needs an embedding of shape ({b['out']}, {b['in']}); `{tie.name}` is a {tie.kind}"
                        f" of shape {tie.leaves[0].params[0].shape}")
                return None
        else:
            params.append(Tensor("weight", (b["out"], b["in"]), ((unit("out"),), (unit("in"),))))
        if b["bias"]:
            params.append(site.vec("bias", "out"))
        leaves = [Leaf(name, (name,), "linear", tuple(params), (unit("in"),), (unit("out"),),
                       tie=tie.name if tie is not None else None, span=span)]
        return {"in": b["in"], "out": b["out"], "bias": b["bias"], "tie": tie.name if tie else None,
                "softcap": b["softcap"]}, leaves

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        unit = hu.unit
        e = DTYPES[plan.dtype]
        p = hu.placement(unit.leaves[0])
        n_in, n_out = int(unit.attr("in")), int(unit.attr("out"))  # type: ignore[arg-type]
        gathered_here = plan.sequence_size > 1 and p.rule == "column" and p.axes == plan.roles.sequence  # else saved whole
        saved = e * (local if gathered_here else tokens) * (n_in // costs.axes_size(plan, p) if p.rule == "row" and p.sharded else n_in)
        if hu.last:
            # Logits: the paper's output layer keeps them in fp32 for the cross entropy, 4 sbv / t.
            v_local = n_out // costs.axes_size(plan, p) if p.rule == "column" and p.sharded else n_out
            saved += costs.FP32 * tokens * v_local
            if unit.attr("softcap"):  # tanh keeps its output, the logits before the cap too
                saved += 2 * e * tokens * v_local
        return saved

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        if hu.last and plan.roles.loss_parallel and regather:
            return regather  # the logits' gradient is the loss's saved softmax, rewritten in place
        if hu.last and not plan.roles.loss_parallel:
            p = hu.placement(hu.unit.leaves[0])
            n_out = int(hu.unit.attr("out"))  # type: ignore[arg-type]
            v_local = n_out // costs.axes_size(plan, p) if p.rule == "column" and p.sharded else n_out
            return 2 * costs.FP32 * tokens * v_local
        return 0  # nothing measured beyond what it saved

    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        return linears

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Work:
        return Work(costs.linear_matmuls(plan, hu, tokens))  # a tied head multiplies by the table it reads

    def flops_per_token(self, unit: Unit, seq: int) -> int:
        # From its dims, not its leaves: a tied head holds no weight of its own but multiplies by the table.
        return 2 * int(unit.attr("in")) * int(unit.attr("out"))  # type: ignore[arg-type]

    def flow(self, site: FlowSite) -> UnitFlow | None:
        return linear_flow(site)

    def seq_top_flow(self, unit: Unit, flow: UnitFlow, seq: tuple[str, ...], last: bool,
                     then: Unit | None) -> UnitFlow:
        if not last:
            return flow  # a top-level linear between blocks: refused by the checker (E0410)
        q = seq_layout(seq)
        ops = list(flow.collectives)
        gathered = under_seq(ops[0], seq) if ops else None  # a head split over `seq`: its f
        if gathered is not None:
            return UnitFlow(q, flow.output, (gathered, *ops[1:]))
        # The head is not split over `seq`: its input gradient is whole on every rank of `seq`.
        return UnitFlow(q, flow.output, (Collective("gather_seq_split", seq, "input"), *ops))

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        d = {"in": a["in"], "out": a["out"], "bias": a["bias"], "tie": a["tie"]}
        if a.get("softcap"):
            d["softcap"] = a["softcap"]
        return d

    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        a = dict(unit.attrs)
        p = placement.get(unit.name, REPLICATE)
        if unit.leaves[0].tie is not None:
            w_shape = (a["out"], a["in"])
            local = w_shape[0] // w.n(p.axes) if p.sharded else w_shape[0]
            bias = [w.line(f"self.{attr}.bias = nn.Parameter(torch.empty({local}))")] if a["bias"] else []
            if tied_here:
                # the head reads the embedding's own weight: one parameter, no copy to keep in sync
                return [w.line(f"self.{attr} = nn.Module()", f"uses {unit.leaves[0].tie}.weight"), *bias] if bias else []
            return [w.line(f"self.{attr} = nn.Module()"),
                    w.line(f"self.{attr}.weight = nn.Parameter(torch.empty({local}, {a['in']}))",
                           f"tied to {unit.leaves[0].tie}.weight: a copy whose gradient the runtime sums "
                           "with the first stage's")] + bias
        out_f, in_f = w.plan.local_shape(unit.leaves[0].params[0], p)
        how = f"{p.rule}({', '.join(p.axes)})" if p.sharded else "replicated"
        return [w.line(f"self.{attr} = nn.Linear({in_f}, {out_f}, bias={a['bias']})", how)]

    def top_lines(self, w: Any, site: TopSite) -> tuple[list[Any], str]:
        plan, item, flow, p, held = site.plan, site.unit, site.flow, site.placement, site.held
        a = dict(item.attrs)
        leaf = item.leaves[0] if item.leaves else None
        lines: list[Any] = []
        is_head = item is plan.model.items[-1]
        fused = False  # the head inside rt.gather_seq_linear
        fused_f = False  # the head inside rt.copy_to_linear
        whole = not tied_with_own_bias(item)  # a fused call can take the layer
        if plan.roles.sequence and flow is not None:
            # Gather and head in one step (keeps this rank's slice for backward).
            fused = len(flow.collectives) == 1 and spec(flow.collectives[0].op).fused is not None and whole
            if not fused:
                lines += w.seq_lines(flow, a["in"])
        elif p.sharded and p.rule == "column":
            # f and the layer in one call (backward overlaps the all-reduce with the weight gradient).
            fused_f = whole
            if not fused_f:
                lines.append(w.collective_line(Collective("copy_to", p.axes, "input"), a["in"]))
        out_local = a["out"] // plan.mesh.size(*p.axes) if p.sharded and p.rule == "column" else a["out"]
        # A tied head uses the embedding's module where this stage holds it.
        owner = leaf.tie if leaf is not None and leaf.tie is not None and leaf.tie in held else item.name
        if leaf is not None and leaf.tie is not None:
            bias = f", self.{item.name}.bias" if a["bias"] else ""
            call = f"F.linear(x, self.{owner}.weight{bias})"
        else:
            call = f"self.{item.name}(x)"
        what = f"Shard(vocab) over {w.axes_text(p.axes)}: {out_local} of {a['out']}" if p.sharded else "Replicate"
        if fused or fused_f:
            # The collective in front of the layer, with the layer inside its call.
            c = flow.collectives[0] if fused else Collective("copy_to", p.axes, "input")  # type: ignore[union-attr]
            f = spec(c.op).fused
            assert f is not None
            lines.append(w.line(f"{'logits' if is_head else 'x'}, = rt.{f.runtime}(x, {w.group(c.axes)}, self.{owner})",
                                f.head.format(dim=a["in"], out=out_local, what=what, n=w.n(c.axes),
                                              axes=w.axes_text(c.axes))))
        else:
            lines.append(w.line(f"{'logits' if is_head else 'x'} = {call}", f"[b, s, {out_local}] {what}"))
        if not is_head:
            return lines, site.cur
        if a.get("softcap"):  # before the padding mask: a masked logit must stay the lowest value
            cap = float(a["softcap"])
            lines.append(w.line(f"logits = torch.tanh(logits / {cap!r}) * {cap!r}", f"final logits soft-capped at {a['softcap']}"))
        used = w.vocab_used()
        if used is not None:
            start = (f"{w.group_index(p.axes)} * {out_local}" if p.sharded and p.rule == "column" else "0")
            lines.append(w.line(f"logits = rt.mask_vocab(logits, {start}, {used})",
                                f"rows {used}.. of {a['out']} are padding: never a token, never predicted"))
        return lines, "logits"


LINEAR = Linear("linear", width_arg="in", args=(
    # `tie = embed` shares the embedding's weight; `tied = false` turns that off (a family parameter
    # can then choose: `linear(hidden, vocab, tie = embed, tied = tie_embeddings)`).
    Arg("in", "dim"), Arg("out", "dim"), Arg("bias", "bool", const(False)), Arg("tie", "layer", const(None)),
    Arg("tied", "bool", const(True)),
    # The model's head only: logits become tanh(x / softcap) * softcap (a final logit soft-cap).
    Arg("softcap", "float", const(None))))
