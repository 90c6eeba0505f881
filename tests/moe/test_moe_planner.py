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
    """With a router loss each pipeline transfer carries 2 E + 3 fp32 floats beside the activations
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
    assert pipeline_bytes(", aux_loss_coef = 0.01") == [b + 4 * (2 * 6 + 3) * 4 for b in plain]  # 4 microbatches
    assert pipeline_bytes(", z_loss_coef = 0.01") == pipeline_bytes(", aux_loss_coef = 0.01")


def test_the_all_to_all_of_deepseek_v3_top8_of_256_over_64_ranks() -> None:
    """examples/deepseek_v3_671b.mesh: each rank's microbatch (one sequence of 4096 tokens) sends its
    top-8 rows of hidden 7168 in bf16 per all-to-all, 63 / 64 of them to other ranks, across hosts
    (64 ranks over 8 nodes); dispatch and combine forward and backward, and the forward's pair again
    where `recompute = ops` reruns the moe layers, per moe block of a stage and microbatch. (Node-limited
    routing, each token to at most 4 nodes with one copy per node, is not modelled: every row counts.)"""
    from meshllm_dsl.parallel.devices import PROFILES

    (plan,) = check_file(str(EXAMPLE.parent / "deepseek_v3_671b.mesh")).plans.values()
    assert plan.roles.expert == ("data",) and plan.mesh.size("data") == 64
    tokens = plan.batch // plan.mesh.size("replica", "data") // plan.microbatches * plan.seq
    per_call = tokens * 8 * 7168 * 2
    assert (tokens, per_call) == (4096, 448 * 2**20)
    report = planner.analyze(plan, PROFILES["h800"])
    for rank in report.ranks:
        blocks = sum(pc.stop - pc.start for s in rank.stages for pc in plan.stages[s].pieces if pc.item == "blocks")
        (a2a,) = [c for c in rank.comms if c.kind == "expert"]
        assert a2a.calls == plan.microbatches * (4 + 2) * blocks, rank.label
        assert a2a.payload_bytes == a2a.calls * per_call
        assert a2a.wire_bytes == a2a.calls * per_call * 63 // 64
        assert a2a.crosses_hosts
