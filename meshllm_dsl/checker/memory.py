"""Memory techniques a plan asks for: activation recomputation (E0409)."""

from __future__ import annotations

from meshllm_dsl import ast
from meshllm_dsl.checker.context import (
    PlanContext,
)
from meshllm_dsl.names import or_list


class MemoryRules(PlanContext):
    def recompute(self, given: ast.Setting | None) -> str:
        """`recompute = none | blocks | attention`: which activations backward recomputes."""
        from meshllm_dsl.ir import RECOMPUTE

        if given is None:
            return "none"
        v = given.value
        if not (isinstance(v, ast.Name) and v.value in RECOMPUTE):
            self.error("E0203", "unknown recompute region", v.span, label="not a region",
                       help=f"use one of {or_list(RECOMPUTE)}: `blocks` recomputes each block of the repeat in "
                            "backward, `attention` only the attention core")
            return "none"
        region = v.value
        rep = self.model.repeat
        if region == "blocks" and rep is None:
            self.error("E0409", "`recompute = blocks` needs a repeated block stack", v.span,
                       label="no blocks to recompute", help=f"model `{self.model.name}` has no `repeat`: remove the setting")
        elif region == "attention" and (rep is None or not any(u.kind == "attention" for u in rep.body)):
            self.error("E0409", "`recompute = attention` needs attention inside the repeated blocks", v.span,
                       label="no attention to recompute",
                       help=f"model `{self.model.name}` has no attention in a `repeat`: use `recompute = blocks` or remove the setting")
        return region
