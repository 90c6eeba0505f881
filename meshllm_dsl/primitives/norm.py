"""`rmsnorm(dim, eps)` (the runtime's RMSNorm) and `layernorm(dim, eps, bias)` (torch's): replicated
weights over the hidden width, applied to the residual stream as it is laid out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from meshllm_dsl.ir import DTYPES, Leaf, Placement, Unit, UnitFlow
from meshllm_dsl.parallel import costs
from meshllm_dsl.parallel.costs import Work
from meshllm_dsl.parallel.flow import FlowSite, R, seq_layout
from meshllm_dsl.primitives import Built, Primitive, TopSite
from meshllm_dsl.primitives.args import Arg, const

if TYPE_CHECKING:
    from meshllm_dsl.front.site import UnitSite
    from meshllm_dsl.ir import PlanIR
    from meshllm_dsl.parallel.costs import HeldUnit


@attrs.frozen
class Norm(Primitive):
    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        return k[self.kind]

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Work:
        return Work()  # elementwise: the planner charges it as memory traffic (its saved bytes)

    def flow(self, site: FlowSite) -> UnitFlow | None:
        return UnitFlow(R, R, ())  # weights replicated, applied token by token

    def seq_top_flow(self, unit: Unit, flow: UnitFlow, seq: tuple[str, ...], last: bool,
                     then: Unit | None) -> UnitFlow:
        q = seq_layout(seq)
        return UnitFlow(q, q, ())

    def top_lines(self, w: Any, site: TopSite) -> tuple[list[Any], str]:
        dim, plan = dict(site.unit.attrs)["dim"], site.plan
        shape = f"[b, s/{plan.sequence_size}, {dim}] Shard(seq)" if plan.roles.sequence else f"[b, s, {dim}]"
        return [w.line(f"x = self.{site.unit.name}(x)", shape)], site.cur


@attrs.frozen
class RMSNorm(Norm):
    def build(self, site: UnitSite) -> Built | None:
        leaf = Leaf(site.name, (site.name,), "rmsnorm", (site.vec("weight", "dim"),), span=site.span)
        return {"dim": site.b["dim"], "eps": site.b["eps"], "offset": site.b["offset"], "post": site.b["post"],
                "scale_fp32": site.b["scale_fp32"]}, [leaf]

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        # its input, and an fp32 reciprocal RMS per token
        return DTYPES[plan.dtype] * local * int(hu.unit.attr("dim")) + costs.FP32 * local  # type: ignore[arg-type]

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        # The runtime's RMSNorm backward (`_RMSNormFn`) computes in fp32 at least: beside the output
        # gradient, its upcast and one product of it, and in half precision the upcast input too
        # (an fp32 input is used as it is): 14 bytes per element in a bf16 model, 7x its dtype.
        e = DTYPES[plan.dtype]
        wide = max(e, costs.FP32)
        return (e + (2 if e >= costs.FP32 else 3) * wide) * (tokens // costs.seq_size(plan)) * int(hu.unit.attr("dim"))  # type: ignore[arg-type]

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        d = {"dim": a["dim"], "eps": a["eps"]}
        if a.get("offset"):
            d["offset"] = a["offset"]
        if a.get("post"):
            d["post"] = True
        if a.get("scale_fp32"):
            d["scale_fp32"] = True
        return d

    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        a = dict(unit.attrs)
        offset = f", offset={float(a['offset'])!r}" if a.get("offset") else ""
        what = f"x * ({float(a['offset'])!r} + weight) in fp32" if offset else ""
        if a.get("scale_fp32") and not offset:  # an offset norm scales in fp32 already
            offset, what = ", scale_fp32=True", "x * weight in fp32"
        return [w.line(f"self.{attr} = rt.RMSNorm({a['dim']}, eps={a['eps']!r}{offset})", what)]


@attrs.frozen
class LayerNorm(Norm):
    def build(self, site: UnitSite) -> Built | None:
        b = site.b
        params = [site.vec("weight", "dim")] + ([site.vec("bias", "dim")] if b["bias"] else [])
        leaf = Leaf(site.name, (site.name,), "layernorm", tuple(params), span=site.span)
        return {"dim": b["dim"], "eps": b["eps"], "bias": b["bias"]}, [leaf]

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        # its input, and an fp32 mean and rstd per token
        return DTYPES[plan.dtype] * local * int(hu.unit.attr("dim")) + 2 * costs.FP32 * local  # type: ignore[arg-type]

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        return 0  # nothing measured beyond what it saved

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        return {"dim": a["dim"], "eps": a["eps"], "bias": a["bias"]}

    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        a = dict(unit.attrs)
        return [w.line(f"self.{attr} = nn.LayerNorm({a['dim']}, eps={a['eps']!r}, bias={a['bias']})")]


RMSNORM = RMSNorm("rmsnorm", norm=True, args=(
    Arg("dim", "dim"), Arg("eps", "float", const(1e-5)),
    # x * (offset + weight), the product in fp32 before the cast: offset 1.0 for a weight stored as
    # its difference from one.
    Arg("offset", "float", const(0.0)),
    # In a block: normalises the output of the sublayer before it, ahead of the residual add
    # (x = x + post(sublayer(pre(x)))); otherwise the input of the sublayer after it.
    Arg("post", "bool", const(False)),
    # The scale applied in fp32 before the cast back, not after it as Llama's;
    # the same numbers in an fp32 model, a rounding apart in bf16 / fp16.
    Arg("scale_fp32", "bool", const(False)),
))
LAYERNORM = LayerNorm("layernorm", norm=True, args=(
    Arg("dim", "dim"), Arg("eps", "float", const(1e-5)), Arg("bias", "bool", const(True))))
