"""`mlp(hidden, ffn, act)`: a block's feed-forward sublayer: up (and gate for SwiGLU) the column
layers, down the row layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from meshllm_dsl import layouts
from meshllm_dsl.ir import REPLICATE, Placement, Unit, UnitFlow
from meshllm_dsl.primitives import Primitive

# The activation of a non-gated mlp, as generated code calls it.
ACTIVATIONS = {"gelu_tanh": "F.gelu({}, approximate=\"tanh\")", "gelu": "F.gelu({})", "relu": "F.relu({})",
               "silu": "F.silu({})"}


@attrs.frozen
class Mlp(Primitive):
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
