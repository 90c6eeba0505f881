"""`rmsnorm(dim, eps)` (the runtime's RMSNorm) and `layernorm(dim, eps, bias)` (torch's): replicated
weights over the hidden width, applied to the residual stream as it is laid out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from meshllm_dsl import layouts
from meshllm_dsl.ir import Layout, Placement, Unit, UnitFlow
from meshllm_dsl.primitives import Primitive, TopSite


@attrs.frozen
class Norm(Primitive):
    def flow(self, site: layouts.FlowSite) -> UnitFlow | None:
        return UnitFlow(layouts.R, layouts.R, ())  # weights replicated, applied token by token

    def seq_top_flow(self, unit: Unit, flow: UnitFlow, seq: tuple[str, ...], last: bool,
                     then: Unit | None) -> UnitFlow:
        q = Layout("Q", seq)
        return UnitFlow(q, q, ())

    def top_lines(self, w: Any, site: TopSite) -> tuple[list[Any], str]:
        dim, plan = dict(site.unit.attrs)["dim"], site.plan
        shape = f"[b, s/{plan.sequence_size}, {dim}] Shard(seq)" if plan.roles.sequence else f"[b, s, {dim}]"
        return [w.line(f"x = self.{site.unit.name}(x)", shape)], site.cur


@attrs.frozen
class RMSNorm(Norm):
    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        return {"dim": a["dim"], "eps": a["eps"]}

    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        a = dict(unit.attrs)
        return [w.line(f"self.{attr} = rt.RMSNorm({a['dim']}, eps={a['eps']!r})")]


@attrs.frozen
class LayerNorm(Norm):
    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        return {"dim": a["dim"], "eps": a["eps"], "bias": a["bias"]}

    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        a = dict(unit.attrs)
        return [w.line(f"self.{attr} = nn.LayerNorm({a['dim']}, eps={a['eps']!r}, bias={a['bias']})")]


RMSNORM = RMSNorm("rmsnorm", norm=True)
LAYERNORM = LayerNorm("layernorm", norm=True)
