"""`mlp(hidden, ffn, act)`: a block's feed-forward sublayer: up (and gate for SwiGLU) the column
layers, down the row layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from meshllm_dsl.ir import DTYPES, REPLICATE, Leaf, Placement, Tensor, Unit, UnitFlow
from meshllm_dsl.parallel import costs
from meshllm_dsl.parallel.costs import Work
from meshllm_dsl.parallel.flow import FlowSite, sublayer_flow
from meshllm_dsl.primitives import Built, Primitive
from meshllm_dsl.primitives.args import Arg, const

ACTIVATIONS = ("swiglu", "geglu_tanh", "gelu_tanh", "gelu", "relu", "silu")
# Gated activations: act(gate(x)) * up(x), as generated code calls act (GeGLU with tanh GELU among them).
GATED = {"swiglu": "F.silu({})", "geglu_tanh": "F.gelu({}, approximate=\"tanh\")"}
# The activation of a non-gated mlp, as generated code calls it.
_CALLS = {"gelu_tanh": "F.gelu({}, approximate=\"tanh\")", "gelu": "F.gelu({})", "relu": "F.relu({})",
               "silu": "F.silu({})"}

if TYPE_CHECKING:
    from meshllm_dsl.front.site import UnitSite
    from meshllm_dsl.ir import PlanIR
    from meshllm_dsl.parallel.costs import HeldUnit


@attrs.frozen
class Mlp(Primitive):
    def build(self, site: UnitSite) -> Built | None:
        """Its parameters (leaves) and attributes from the bound arguments; None after an error."""
        b, name, span, unit = site.b, site.name, site.span, site.unit
        hid, ffn = b["hidden"], b["ffn"]
        fu, hidu = unit("ffn"), unit("hidden")

        def lin(n: str, rows: int, cols: int, ru: tuple[str, int], cu: tuple[str, int]) -> Leaf:
            ps = [Tensor("weight", (rows, cols), ((ru,), (cu,)))]
            if b["bias"]:
                ps.append(Tensor("bias", (rows,), ((ru,),)))
            return Leaf(n, (name, n), "linear", tuple(ps), (cu,), (ru,), span=span)

        leaves = [lin("gate", ffn, hid, fu, hidu)] if b["act"] in GATED else []
        leaves += [lin("up", ffn, hid, fu, hidu), lin("down", hid, ffn, hidu, fu)]
        return {"hidden": hid, "ffn": ffn, "act": b["act"], "bias": b["bias"]}, leaves

    def _ffn_local(self, plan: PlanIR, hu: HeldUnit) -> int:
        up = next(leaf for leaf in hu.unit.leaves if leaf.name == "up")
        return int(hu.unit.attr("ffn")) // costs.axes_size(plan, hu.placement(up))  # type: ignore[arg-type]

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        e, f = DTYPES[plan.dtype], self._ffn_local(plan, hu)
        per_ffn = 4 if hu.unit.attr("act") in GATED else 2
        return e * local * int(hu.unit.attr("hidden")) + per_ffn * e * tokens * f  # type: ignore[arg-type]

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        e, f = DTYPES[plan.dtype], self._ffn_local(plan, hu)
        swiglu = hu.unit.attr("act") in GATED
        own = (4 if swiglu else 2) * e * tokens * f
        return max(own, (2 if swiglu else 1) * e * tokens * f + regather) if regather else own

    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        return linears + (k["swiglu"] if hu.unit.attr("act") in GATED else k["activation"]) + k["residual"]

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Work:
        return Work(costs.linear_matmuls(plan, hu, tokens))

    def flow(self, site: FlowSite) -> UnitFlow | None:
        return sublayer_flow(site, f"the {site.unit.attr('act')} activation", "the gated product", "ffn")

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        return dict(hidden=a["hidden"], ffn=a["ffn"], act=a["act"], bias=a["bias"])

    def core_lines(self, w: Any, attr: str, unit: Unit, a: Mapping[str, Any],
                   placement: Mapping[str, Placement], x: str) -> list[Any]:
        p_up = placement.get(f"{unit.name}.up", REPLICATE)
        f_local = a["ffn"] // w.n(p_up.axes) if p_up.sharded and p_up.rule == "column" else a["ffn"]
        if a["act"] in GATED:
            what = "SwiGLU" if a["act"] == "swiglu" else "GeGLU (tanh GELU)"
            gate = GATED[a["act"]].format(w.proj(attr, "gate", x))
            return [w.line(f"a = {gate} * {w.proj(attr, 'up', x)}", f"[b, s, {f_local}] {what}")]
        return [w.line("a = " + _CALLS[a["act"]].format(w.proj(attr, "up", x)), f"[b, s, {f_local}] {a['act']}")]


MLP = Mlp("mlp", sublayer=True, float8_linears=True, width_arg="hidden", args=(
    Arg("hidden", "dim"),
    Arg("ffn", "dim"),
    Arg("act", "choice", const("swiglu"), ACTIVATIONS),
    Arg("bias", "bool", const(False)),
))
