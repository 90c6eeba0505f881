"""Hypothesis-drawn moe plans, with and without expert parallelism: the checker's verdict is the
one the drawn plan's structure says (experts dividing over the expert axes, ZeRO 1 refused with
them), and every accepted plan computes what the unsharded model computes on the shared pool of
gloo ranks (logits, loss, every gathered gradient, parameters after AdamW steps).

Default profile: a few plans, derandomized (the same every run) so the suite stays fast and
deterministic; `pytest --hypothesis-profile=thorough` draws fresh ones (`MESHLLM_MOE_PLANS=N`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from reference_jobs import compare_job  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402

THOROUGH = settings.get_current_profile_name() == "thorough"
N_PLANS = int(os.environ.get("MESHLLM_MOE_PLANS", "60" if THOROUGH else "4"))
PLANS = settings(max_examples=N_PLANS, deadline=None, derandomize=not THOROUGH, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@attrs.frozen
class MoePlan:
    family: str  # mixtral | qwen2_moe | qwen3_moe
    experts: int
    top_k: int
    data: int
    tensor: int
    pipeline: int
    expert_parallel: bool
    zero: int

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def expected(self) -> set[str]:
        """The codes the checker must give: none for a plan that fits."""
        if not self.expert_parallel:
            return set()
        return {"E0301"} if self.experts % self.data else set()

    def text(self) -> str:
        axes = [(n, s) for n, s in (("pipeline", self.pipeline), ("data", self.data), ("tensor", self.tensor)) if s > 1]
        axes = axes or [("one", 1)]
        shared = ", shared_ffn = 16" if self.family == "qwen2_moe" else ""
        model = (f"model m = {self.family} {{ vocab = 32, hidden = 16, layers = 2, heads = 4, kv_heads = 2, ffn = 8"
                 f"{shared}, experts = {self.experts}, top_k = {self.top_k}, dtype = fp32 }}")
        layout = ["batch -> data"] if self.data > 1 else []
        if self.expert_parallel:
            layout.append("experts -> data")
        rules = ""
        if self.tensor > 1:
            layout += ["heads -> tensor", "kv_heads -> tensor", "ffn -> tensor", "vocab -> tensor"]
            layout += ["shared_ffn -> tensor"] if self.family == "qwen2_moe" else []
            routers = "{router,shared_router}" if self.family == "qwen2_moe" else "router"
            rules = f"    shard blocks.*.mlp.{routers} replicate\n"
        body = f"    batch = {2 * self.data * self.pipeline}\n    seq = 4\n"
        if layout:
            body += f"    layout {{ {', '.join(layout)} }}\n" + rules
        if self.pipeline > 1:
            body += f"    microbatches = {self.pipeline}\n    stages over pipeline balanced\n"
        if self.zero:
            body += f"    optimizer adamw {{ zero {self.zero} }}\n"
        mesh = ", ".join(f"{n} = {s}" for n, s in axes)
        return f"mesh m {{ axes {mesh} }}\n{model}\nplan p on m for m {{\n{body}}}\n"


@st.composite
def moe_plans(draw: Any) -> MoePlan:
    family = draw(st.sampled_from(["mixtral", "qwen2_moe", "qwen3_moe"]))
    experts = draw(st.sampled_from([2, 3, 4, 6, 8]))
    data = draw(st.sampled_from([1, 2, 4]))
    tensor = draw(st.sampled_from([1, 2]))
    pipeline = draw(st.sampled_from([1, 2]))
    while data * tensor * pipeline > 8:
        data //= 2
    ep = data > 1 and draw(st.booleans())
    zero = draw(st.sampled_from([0, 0, 1, 3])) if data > 1 else 0
    return MoePlan(family, experts, draw(st.integers(1, min(2, experts))), data, tensor, pipeline, ep, zero)


@PLANS
@given(spec=moe_plans())
# The few derandomized draws need not hold an accepted expert-parallel plan: these always run.
@example(spec=MoePlan("qwen2_moe", 4, 2, 2, 1, 2, True, 0))  # EP x pipeline, shared expert
@example(spec=MoePlan("mixtral", 4, 2, 2, 2, 1, True, 3))  # EP x tensor x ZeRO 3
def test_drawn_moe_plans_check_and_equal_the_reference(spec: MoePlan, pool: Any, tmp_path_factory: Any) -> None:
    text = spec.text()
    note(text)
    result = check_text(text, "drawn.mesh")
    codes = {d.code for d in result.errors}
    assert codes == spec.expected, (codes, spec)
    if codes:
        return
    (plan,) = result.plans.values()
    assert plan.roles.expert == (("data",) if spec.expert_parallel else ())
    code = render_plan(plan, "drawn.mesh", text)
    local = spec.experts // spec.data if spec.expert_parallel else spec.experts
    assert f"self.mlp.gate = rt.StackedLinear({local}, 16," in code
    path = Path(tmp_path_factory.mktemp("moe_drawn")) / "plan.py"
    path.write_text(code)
    for rank_errs in pool.run(compare_job, spec.devices, str(path), 1):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (dtype, worst, errs[worst], spec)


def test_the_generator_draws_plans_with_and_without_expert_parallelism() -> None:
    seen: set[bool] = set()

    @settings(max_examples=40, derandomize=True, database=None)
    @given(spec=moe_plans())
    def draw(spec: MoePlan) -> None:
        seen.add(spec.expert_parallel)

    draw()
    assert seen == {True, False}
