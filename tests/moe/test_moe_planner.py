"""The planner on a moe layer: parameters count every expert, flops only the top_k each token uses."""

from __future__ import annotations

from pathlib import Path

from meshllm_dsl import planner
from meshllm_dsl.checker import check_file, check_text

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_mixtral.mesh"


def _plan(experts: int, top_k: int):  # type: ignore[no-untyped-def]
    text = EXAMPLE.read_text().replace("experts = 4", f"experts = {experts}").replace("top_k = 2", f"top_k = {top_k}")
    result = check_text(text, "m.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    return next(iter(result.plans.values()))


def test_parameters_count_every_expert() -> None:
    plan = next(iter(check_file(str(EXAMPLE)).plans.values()))
    h, f, e, layers = 64, 96, 4, 2
    attn = 64 * 64 + 2 * 32 * 64 + 64 * 64
    moe = e * h + 3 * e * f * h
    assert plan.model.numel == 256 * 64 * 2 + 64 + layers * (attn + moe + 2 * 64)


def test_flops_count_the_experts_a_token_uses_and_the_router() -> None:
    h, f, s, layers = 64, 96, 32, 2
    dense = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64) + 4 * s * 16 * 4  # attention's linears and core
    for experts, top_k in ((4, 2), (8, 2), (8, 1)):
        moe = 2 * h * experts + top_k * 3 * 2 * h * f
        want = 3 * (layers * (dense + moe) + 2 * 64 * 256)
        assert planner.model_flops_per_token(_plan(experts, top_k)) == want
