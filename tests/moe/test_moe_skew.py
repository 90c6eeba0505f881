"""The planner's mixture-of-experts model (meshllm_dsl/planner/moe.py): active parameters, routed
pairs at capacity, and `skew = F` per expert-parallel rank, with the checker's range checks."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.planner import analyze as planner
from meshllm_dsl.planner import moe as planner_moe

ROOT = Path(__file__).resolve().parents[2]


def _example() -> planner.PlanReport:
    (plan,) = check_file(str(ROOT / "examples" / "mixtral_8x7b.mesh")).plans.values()
    return planner.analyze(plan)


def test_mixtral_8x7b_parameters_and_active_parameters() -> None:
    rep = _example()
    plan = rep.plan
    assert plan.model.numel == 46_702_792_704  # Mixtral 8x7B's 46.7B
    per_expert = 3 * 4096 * 14336
    assert planner_moe.active_parameters(plan) == 46_702_792_704 - 32 * (8 - 2) * per_expert == 12_879_925_248
    text = planner.report_text(rep)
    assert "active          12,879,925,248 (12.88B) per token" in text


def test_skew_shares_per_expert_parallel_degree() -> None:
    # degree 1: the one rank holds every expert and gets every pair whatever the skew
    for f in (1 / 8, 0.4, 1.0):
        assert planner_moe.rank_shares(f, 8, 1) == pytest.approx((1.0, 0.0))
    # degree 4 (2 experts per rank): balanced 1 / 4 each; skewed, the busiest rank's share grows
    assert planner_moe.rank_shares(1 / 8, 8, 4) == pytest.approx((0.25, 0.25))
    busiest, other = planner_moe.rank_shares(0.4, 8, 4)
    assert busiest == pytest.approx(0.4 + 0.6 / 7) and other == pytest.approx(2 * 0.6 / 7)
    assert busiest + 3 * other == pytest.approx(1.0)
    # pairs with a capacity: each expert capped at degree x its per-source-rank capacity
    b, o = planner_moe.rank_pairs(0.4, 8, 4, 1000, 150)
    assert b == pytest.approx(600 + 4000 * 0.6 / 7) and o == pytest.approx(2 * 4000 * 0.6 / 7)


def test_routed_pairs_at_capacity() -> None:
    assert planner_moe.routed_pairs(1000, 2, 8, 0.0) == 2000  # dropless
    assert planner_moe.routed_pairs(1000, 2, 8, 1.25) == 2000  # room for the balanced load
    assert planner_moe.routed_pairs(1000, 2, 8, 0.5) == 8 * math.ceil(0.5 * 2000 / 8) == 1000


def test_activations_at_capacity_in_the_planner() -> None:
    text = (ROOT / "examples" / "mixtral_8x7b.mesh").read_text().replace("    recompute = blocks\n", "")
    full = planner.analyze(next(iter(check_text(text.replace("capacity = 1.25", "capacity = 0"), "a.mesh").plans.values())))
    half = planner.analyze(next(iter(check_text(text.replace("capacity = 1.25", "capacity = 0.5"), "b.mesh").plans.values())))
    # without recompute every block's routed activations, at 2 x 4096 tokens x top 2 per microbatch
    pairs = 2 * 4096 * 2
    per_pair = 2 * (2 * 4096 + 4 * 14336 // 8)  # bf16: gathered input + output, gate / up / silu / product
    saved_full = full.ranks[0].activation_bytes_per_microbatch
    saved_half = half.ranks[0].activation_bytes_per_microbatch
    assert saved_full - saved_half == 32 * (pairs - pairs // 2) * per_pair  # each of the 32 blocks, at half capacity


def test_skew_in_the_example_report() -> None:
    rep = _example()
    sk = planner_moe.skew_report(rep)
    assert sk is not None and sk.degree == 1 and sk.experts == 8
    pairs = 2 * 4096 * 2  # per layer and microbatch on a rank
    cap = math.ceil(1.25 * 2 * 4096 * 2 / 8)
    kept = min(0.4 * pairs, cap) + 7 * min(0.6 * pairs / 7, cap)
    assert sk.dropped_share == pytest.approx(1 - kept / pairs)
    (row,) = sk.ranks
    assert row.pairs == pytest.approx(kept) and row.wait_s == 0
    text = planner.report_text(rep)
    assert "expert-parallel degree 1" in text and "moves no work between ranks" in text
    assert f"capacity drops {sk.dropped_share:.1%}" in text
    assert not [d for d in planner.plan_warnings(rep) if d.code == "W0807"]  # degree 1: nobody waits


def _expert_parallel(capacity: str, skew: str) -> str:
    """The example with its experts split over `data` (4 ranks, 2 experts each; EP takes no ZeRO yet)."""
    text = (ROOT / "examples" / "mixtral_8x7b.mesh").read_text()
    return (text.replace("batch -> data, heads", "batch -> data, experts -> data, heads")
            .replace("        zero 3 over data\n", "").replace("capacity = 1.25", f"capacity = {capacity}")
            .replace("skew = 0.4", f"skew = {skew}"))


def test_skew_with_expert_parallel_ranks_warns_by_how_much() -> None:
    text = _expert_parallel("0", "0.4")
    (plan,) = check_text(text, "ep.mesh").plans.values()
    rep = planner.analyze(plan)
    sk = planner_moe.skew_report(rep)
    assert sk is not None and sk.degree == 4
    busiest, others = sk.ranks
    pairs = 2 * 4096 * 2  # per layer and microbatch on a rank; the group of 4 routes 4x that
    assert busiest.pairs == pytest.approx(4 * pairs * (0.4 + 0.6 / 7))
    assert others.pairs == pytest.approx(4 * pairs * 2 * 0.6 / 7)
    assert busiest.peak_bytes > rep.ranks[0].training_bytes > others.peak_bytes
    assert others.wait_s == pytest.approx(busiest.step_s - others.step_s) and others.wait_s > 0
    (w,) = [d for d in planner.plan_warnings(rep) if d.code == "W0807"]
    assert f"wait {planner.fmt_seconds(others.wait_s)} per step" in w.message
    assert f"{sk.wait_share:.0%} of the" in w.message and sk.wait_share > planner_moe.SKEW_WAIT_WARN
    assert text[w.span.start:w.span.end].startswith("skew")
    # balanced routing: every rank alike, nobody waits
    (even,) = check_text(_expert_parallel("0", "0.125"), "even.mesh").plans.values()
    sk_even = planner_moe.skew_report(planner.analyze(even))
    assert sk_even is not None and all(r.pairs == pytest.approx(pairs) and r.wait_s == pytest.approx(0) for r in sk_even.ranks)
    # a capacity caps the busiest expert at 4 source ranks x its capacity
    (capped,) = check_text(_expert_parallel("1.25", "0.4"), "cap.mesh").plans.values()
    b, _ = planner_moe.skew_report(planner.analyze(capped)).ranks
    assert b.pairs == pytest.approx(4 * math.ceil(1.25 * pairs / 8) + 4 * pairs * 0.6 / 7)
    # and a rank that no longer fits is told by how much
    small = attrs.evolve(rep.device, memory_gib=rep.ranks[0].training_bytes / 2**30 * 1.01)
    rep2 = planner.analyze(plan, small)
    (fit,) = [d for d in planner.plan_warnings(rep2) if d.code == "W0807" and "more than the" in d.message]
    over = planner_moe.skew_report(rep2).ranks[0].peak_bytes - small.memory_bytes
    assert f"{planner.fmt_bytes(over)} more than" in fit.message


def dispatch_rows_job(ctx, choices: list[list[int]]) -> list[int]:  # type: ignore[no-untyped-def]
    """Rows the dispatch and the combine all-to-all of runtime/moe/dispatch.py bring this rank from
    the other rank of a group of 2 (experts 0-1 on rank 0, 2-3 on rank 1), each routing `choices` [T, k]."""
    import torch

    from meshllm_dsl.runtime.moe import dispatch as moe_dispatch

    group = ctx.mesh((("data", 2),)).group("data")
    received: list[int] = []
    plain = moe_dispatch._all_to_all

    def counted(x, out_splits, in_splits, g):  # type: ignore[no-untyped-def]
        received.append(sum(out_splits) - out_splits[ctx.rank])
        return plain(x, out_splits, in_splits, g)

    gen = torch.Generator().manual_seed(ctx.rank)
    idx = torch.tensor(choices)
    x, weights = torch.randn(len(choices), 8, generator=gen), torch.rand(idx.shape, generator=gen)
    gate, up, down = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), torch.randn(8, 2, 6, generator=gen)
    moe_dispatch._all_to_all = counted
    try:
        moe_dispatch.experts_parallel(x, idx, weights, gate, up, down, group)
    finally:
        moe_dispatch._all_to_all = plain
    return received


def test_the_all_to_all_rows_under_skew_are_the_measured_ones(pool) -> None:  # type: ignore[no-untyped-def]
    # 6 tokens x top 2 of 4 experts on each of 2 ranks: expert 0 takes half the pairs (skew 0.5), the
    # others 2 each, as the planner's skew assumes; the rank holding expert 0 receives twice the rows
    choices = [[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]]
    (dispatch0, combine0), (dispatch1, combine1) = pool.run(dispatch_rows_job, 2, choices)
    busiest, other = planner_moe.rank_pairs(0.5, 4, 2, 12, None)
    assert [dispatch0, dispatch1] == [planner_moe.received_rows(busiest, 2), planner_moe.received_rows(other, 2)] == [8, 4]
    assert [combine0, combine1] == [4, 8]  # the combine returns each rank's rows: the busiest sends 8
    # balanced routing: 12 pairs, half of them from the other rank
    assert planner_moe.received_rows(planner_moe.routed_pairs(6, 2, 4, 0.0), 2) == 6


def test_skew_stretches_every_expert_all_to_all_by_the_busiest_rank_s_rows() -> None:
    text = _expert_parallel("0", "0.4")
    (plan,) = check_text(text, "ep.mesh").plans.values()
    rep = planner.analyze(plan)
    sk = planner_moe.skew_report(rep)
    busiest, others = sk.ranks
    assert sk.a2a_factor == pytest.approx(busiest.pairs / busiest.balanced_pairs) and sk.a2a_factor > 1.5
    expert_s = sum(c.seconds for c in rep.ranks[0].comms if c.kind == "expert")
    assert sk.a2a_extra_s == pytest.approx((sk.a2a_factor - 1) * expert_s) and sk.a2a_extra_s > 0
    assert busiest.received_rows == pytest.approx(busiest.pairs * 3 / 4)  # 4 ranks: 1 / 4 its own
    (w,) = [d for d in planner.plan_warnings(rep) if d.code == "W0807"]
    assert f"all-to-alls take {sk.a2a_factor:.2f}x their balanced time" in w.message
    assert f"receives {busiest.received_rows:,.0f} rows" in w.message
    assert f"{sk.a2a_factor:.2f}x its balanced time" in planner.report_text(rep)


@pytest.mark.parametrize("value, code, words", [
    ("0.1", "E0307", "less than 1 / experts = 0.125"),
    ("1.5", "E0307", "out of range"),
    ("0.6", "E0307", "more than 1 / top_k = 0.5"),  # Mixtral's top 2: one expert takes at most half the pairs
    ("0", "E0307", "out of range"),
])
def test_skew_range_is_checked(value: str, code: str, words: str) -> None:
    text = (ROOT / "examples" / "mixtral_8x7b.mesh").read_text().replace("skew = 0.4", f"skew = {value}")
    (d,) = [d for d in check_text(text, "s.mesh").diagnostics if d.is_error]
    assert d.code == code and words in d.message
    assert text[d.span.start:d.span.end] == value


def test_skew_needs_moe_layers() -> None:
    text = (ROOT / "examples" / "tiny_llama.mesh").read_text()
    text = text.replace("    batch = ", "    skew = 0.5\n    batch = ", 1)
    (d,) = [d for d in check_text(text, "l.mesh").diagnostics if d.is_error]
    assert d.code == "E0203" and "`skew` applies to a model with moe layers" in d.message


def test_lsp_hover_and_completion_know_the_routing_settings() -> None:
    from meshllm_dsl.lsp import completion
    from meshllm_dsl.lsp.analysis import Analysis

    path = ROOT / "examples" / "mixtral_8x7b.mesh"
    text = path.read_text()
    a = Analysis(str(path), text)

    def hover_at(word: str) -> str:
        got = a.hover(text.index(word) + len(word) - len(word.lstrip()) + 1)
        assert got is not None, word
        return got[0]

    assert "load-balancing loss" in hover_at("aux_loss_coef = 0.02")
    assert "capacity factor" in hover_at("capacity = 1.25") and "(default `0.0`)" in hover_at("capacity = 1.25")
    assert "busiest expert" in hover_at("\n    skew = 0.4")
    # a plan setting being typed offers `skew`; a mixtral model's settings offer the routing ones
    at = text.index("    skew = 0.4")
    plan_items = {i.label for i in completion.complete(Analysis(str(path), text[:at] + "    sk\n" + text[at:]), at + 6)}
    assert "skew" in plan_items
    at = text.index("    capacity = 1.25")
    model_items = {i.label for i in completion.complete(Analysis(str(path), text[:at] + "    z\n" + text[at:]), at + 5)}
    assert "z_loss_coef" in model_items and "aux_loss_coef" not in model_items  # given already


def test_plan_json_carries_active_parameters_and_the_skew() -> None:
    d = planner.report_json(_example())
    assert d["active_parameters"] == 12_879_925_248
    assert d["skew"]["skew"] == 0.4 and d["skew"]["degree"] == 1 and d["skew"]["ranks"][0]["role"] == "busiest"
