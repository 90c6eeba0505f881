"""`mlp(hidden, ffn, act)`: a block's feed-forward sublayer: up (and gate for SwiGLU) the column
layers, down the row layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from meshllm_dsl import layouts, planner
from meshllm_dsl.ir import REPLICATE, Placement, Unit, UnitFlow
from meshllm_dsl.primitives import Primitive

# The activation of a non-gated mlp, as generated code calls it.
ACTIVATIONS = {"gelu_tanh": "F.gelu({}, approximate=\"tanh\")", "gelu": "F.gelu({})", "relu": "F.relu({})",
               "silu": "F.silu({})"}

if TYPE_CHECKING:
    from meshllm_dsl.ir import PlanIR
    from meshllm_dsl.planner import HeldUnit


@attrs.frozen
class Mlp(Primitive):
    def _ffn_local(self, plan: PlanIR, hu: HeldUnit) -> int:
        up = next(leaf for leaf in hu.unit.leaves if leaf.name == "up")
        return int(hu.unit.attr("ffn")) // planner.axes_size(plan, hu.placement(up))  # type: ignore[arg-type]

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        e, f = planner.DTYPES[plan.dtype], self._ffn_local(plan, hu)
        per_ffn = 4 if hu.unit.attr("act") == "swiglu" else 2
        return e * local * int(hu.unit.attr("hidden")) + per_ffn * e * tokens * f  # type: ignore[arg-type]

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        e, f = planner.DTYPES[plan.dtype], self._ffn_local(plan, hu)
        swiglu = hu.unit.attr("act") == "swiglu"
        own = (4 if swiglu else 2) * e * tokens * f
        return max(own, (2 if swiglu else 1) * e * tokens * f + regather) if regather else own

    def kernels(self, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        return linears + (k["swiglu"] if hu.unit.attr("act") == "swiglu" else k["activation"]) + k["residual"]

    def flow(self, site: layouts.FlowSite) -> UnitFlow | None:
        return layouts.sublayer_flow(site, f"the {site.unit.attr('act')} activation", "the gated product")

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        return dict(hidden=a["hidden"], ffn=a["ffn"], act=a["act"], bias=a["bias"])

    def core_lines(self, w: Any, attr: str, unit: Unit, a: Mapping[str, Any],
                   placement: Mapping[str, Placement], x: str) -> list[Any]:
        p_up = placement.get(f"{unit.name}.up", REPLICATE)
        f_local = a["ffn"] // w.n(p_up.axes) if p_up.sharded and p_up.rule == "column" else a["ffn"]
        if a["act"] == "swiglu":
            return [w.line(f"a = F.silu({w.proj(attr, 'gate', x)}) * {w.proj(attr, 'up', x)}", f"[b, s, {f_local}] SwiGLU")]
        return [w.line("a = " + ACTIVATIONS[a["act"]].format(w.proj(attr, "up", x)), f"[b, s, {f_local}] {a['act']}")]


MLP = Mlp("mlp", sublayer=True)
