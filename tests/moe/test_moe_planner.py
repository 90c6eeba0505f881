"""The planner on a moe layer: parameters count every expert, flops only the top_k each token uses."""

from __future__ import annotations

from pathlib import Path

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.planner import analyze as planner

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


def test_pipeline_sends_carry_the_routing_statistics_of_the_router_losses() -> None:
    """With a router loss each pipeline transfer carries 2 E + 2 fp32 floats beside the activations
    (runtime/train/program.py sends them on): counted in the pipeline's bytes, and nothing without one."""
    base = ("mesh m { axes pipeline = 2 }\nmodel x = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, "
            "kv_heads = 2, ffn = 48, experts = 6, top_k = 2, dtype = fp32ROUTING }\nplan p on m for x {\n"
            "    batch = 8\n    seq = 8\n    microbatches = 4\n    stages over pipeline balanced\n}\n")

    def pipeline_bytes(routing: str) -> list[int]:
        result = check_text(base.replace("ROUTING", routing), "m.mesh")
        assert result.ok, [d.message for d in result.diagnostics]
        rep = planner.analyze(next(iter(result.plans.values())))
        return [c.payload_bytes for rc in rep.ranks for c in rc.comms if c.kind == "pipeline"]

    plain = pipeline_bytes("")
    assert pipeline_bytes(", aux_loss_coef = 0.01") == [b + 4 * (2 * 6 + 2) * 4 for b in plain]  # 4 microbatches
    assert pipeline_bytes(", z_loss_coef = 0.01") == pipeline_bytes(", aux_loss_coef = 0.01")
