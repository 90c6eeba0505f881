"""`meshc suggest` at scale (issue 25): the pruned search gives the full search's answer, its lower
bounds hold for every candidate, a 530B model on 2,520 devices gets a sane plan, `--headroom` is
kept, and the status line says how far the search is (through a pty: tests/cli/test_progress.py)."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import attrs
import pytest

from meshllm_dsl.cli.main import main
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.planner import suggest as planner_suggest
from meshllm_dsl.planner.records import PlanReport
from meshllm_dsl.planner.suggest import (
    DEFAULT_HEADROOM,
    bubble_scale,
    compute_floor_s,
    suggest,
    suggestion_json,
    suggestion_text,
)
from meshllm_dsl.progress import StatusLine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MT_NLG = Path(__file__).parent / "mt_nlg_530b.mesh"

# (file, model, devices, device, batch, seq): GPU profiles, where the bounds rule most candidates
# out, and the CPU profile at 8 and 512 devices.
SEARCHES = [
    ("llama2_70b.mesh", "llama2_70b", 8, "h100", 16, 4096),
    ("llama2_7b.mesh", "llama2_7b", 8, "a100", 16, 4096),
    ("tiny_llama.mesh", "tiny_llama", 512, "cpu", 512, 32),
]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _search(spec: tuple[str, str, int, str, int, int], **kw: object) -> planner_suggest.SuggestResult:
    f, model, devices, device, batch, seq = spec
    return suggest(str(EXAMPLES / f), model, devices=devices, device=PROFILES[device], batch=batch, seq=seq, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", SEARCHES, ids=lambda s: f"{s[1]}-{s[2]}-{s[3]}")
def test_pruned_search_finds_what_the_full_search_finds(spec, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The same ranked plans, texts, reasons, times and peaks with and without the bounds (with the
    default headroom; test_headroom_is_left_free moves it); and every report the full search made
    obeys the bounds."""
    reports: list[PlanReport] = []
    real = planner_suggest.analyze

    def recording(plan, device):  # type: ignore[no-untyped-def]
        rep = real(plan, device)
        reports.append(rep)
        return rep

    fast = _search(spec, top=5)
    monkeypatch.setattr(planner_suggest, "analyze", recording)
    full = _search(spec, top=5, prune=False)
    monkeypatch.setattr(planner_suggest, "analyze", real)
    assert fast.ranked, spec
    assert suggestion_json(fast)["suggestions"] == suggestion_json(full)["suggestions"]
    assert full.analysed == full.enumerated
    if spec[3] != "cpu":  # on a GPU profile the bounds do rule candidates out
        assert fast.analysed < full.enumerated, (fast.analysed, full.enumerated)
    # The bounds, on every candidate the full search analysed: the step is no faster than the
    # compute floor stretched by the bubble, and the states (which StateBound carries over
    # microbatches and recomputation) are the same for every variant of a structure and ZeRO stage.
    floor = compute_floor_s(reports[0])
    states: dict[tuple[object, ...], int] = {}
    for rep in reports:
        plan = rep.plan
        c = planner_suggest.Candidate(plan.data_size, plan.pipeline_size, 1, plan.microbatches,
                                      plan.schedule if plan.pipeline_size > 1 else "none", plan.virtual, plan.zero, 1)
        assert compute_floor_s(rep) == pytest.approx(floor)
        assert rep.step.total_s >= floor * (1 + bubble_scale(c)) * (1 - 1e-9), plan
        key = (plan.mesh.axes, plan.schedule, plan.virtual, plan.roles.sequence, plan.zero, plan.master_dtype)
        held = max(r.weight_bytes + r.grad_bytes + r.optimizer_bytes for r in rep.ranks)
        assert states.setdefault(key, held) == held, plan
    # ... and recomputing part of what another variant recomputes is never slower (the bound
    # planner_suggest._slower_than_the_runner_up skips the analyses by).
    step = {(rep.plan.mesh.axes, rep.plan.schedule, rep.plan.virtual, rep.plan.roles, rep.plan.zero, rep.plan.master_dtype,
             rep.plan.microbatches, rep.plan.recompute if rep.plan.recompute_every == 1 else
             f"{rep.plan.recompute} every {rep.plan.recompute_every}"): rep.step.total_s for rep in reports}
    for (*rest, remat), t in step.items():
        c = planner_suggest.Candidate(1, 1, 1, 1, "none", 1, 0, 1, remat)
        for less in planner_suggest._recomputes_less(c):
            assert step.get((*rest, less), 0.0) <= t * (1 + 1e-9), (rest, remat, less)


def test_the_fastest_plan_that_fits_may_recompute_every_other_block_or_selected_ops() -> None:
    """Llama 2 7B on 8 A100s with 10 GiB each: nothing fits without recomputation, and recomputing
    every other block beats recomputing every block (and torchtitan's selected ops) on the same
    schedule; a zero-bubble schedule (issue 39) beats 1F1B on the same layout."""
    dev = attrs.evolve(PROFILES["a100"], memory_gib=10.0)
    res = suggest(str(EXAMPLES / "llama2_7b.mesh"), "llama2_7b", devices=8, device=dev, batch=16, seq=4096, top=8)
    got = [(r.report.plan.recompute, r.report.plan.recompute_every) for r in res.ranked]
    assert got[0] == ("blocks", 2) and "recompute = blocks every 2" in res.ranked[0].text, [r.candidate.key() for r in res.ranked]
    assert all(r.report.plan.recompute != "none" for r in res.ranked)
    best = res.ranked[0].candidate
    assert best.schedule == "interleaved_zb"
    one_f_one_b = [r for r in res.ranked if r.candidate != best and attrs.evolve(r.candidate, schedule="interleaved_zb") == best]
    assert one_f_one_b and one_f_one_b[0].candidate.schedule == "1f1b"  # the same plan on 1F1B: slower


def test_530b_on_2520_devices_is_sane() -> None:
    """Megatron-Turing NLG 530B on 315 hosts of 8 A100s: the search finishes (it analyses a small
    share of its candidates) and its best plan fits with the headroom left, keeps the tensor axis
    in a host and pipelines the 105 layers."""
    res = suggest(str(MT_NLG), "mt_nlg_530b", devices=2520, device=PROFILES["a100"], batch=1920, seq=2048, top=1)
    assert res.enumerated > 3000 and res.analysed < res.enumerated / 10, (res.analysed, res.enumerated)
    best = res.best
    assert best is not None
    c = best.candidate
    assert c.data * c.pipeline * c.tensor == 2520
    assert 1 < c.tensor <= 8 and 8 % c.tensor == 0  # within a host of 8
    assert c.pipeline > 1 and c.hosts == 315
    memory = PROFILES["a100"].memory_bytes
    assert best.report.peak_training_bytes <= memory - int(DEFAULT_HEADROOM * memory)
    assert res.headroom_bytes == int(DEFAULT_HEADROOM * memory)
    assert f"with {planner_suggest.fmt_bytes(res.headroom_bytes)} free" in suggestion_text(res)


def test_headroom_is_left_free(capsys: pytest.CaptureFixture[str]) -> None:
    """With the headroom the unconstrained winner's peak leaves too little, that winner is not
    offered and every plan that is leaves the headroom."""
    spec = SEARCHES[0]
    memory = PROFILES["h100"].memory_bytes
    tight = _search(spec, top=3, headroom_bytes=0)
    assert tight.best is not None
    headroom = memory - tight.best.report.peak_training_bytes + 1
    roomy = _search(spec, top=3, headroom_bytes=headroom)
    assert roomy.ranked and roomy.headroom_bytes == headroom
    assert tight.best.candidate not in {r.candidate for r in roomy.ranked}
    assert all(r.report.peak_training_bytes <= memory - headroom for r in roomy.ranked)
    # The flag, in GiB; its default; and a value out of range is one line, exit 2.
    argv = ["suggest", str(EXAMPLES / spec[0]), "--devices", "8", "--device", "h100", "--format", "json"]
    code, out, _ = run([*argv, "--headroom", "2.5"], capsys)
    data = json.loads(out)
    assert code == 0 and data["headroom_bytes"] == int(2.5 * 2**30) and data["suggestions"]
    assert all(s["peak_training_bytes"] <= memory - 2.5 * 2**30 for s in data["suggestions"])
    code, out, _ = run(argv, capsys)
    assert json.loads(out)["headroom_bytes"] == int(DEFAULT_HEADROOM * memory)
    code, out, _ = run(["suggest", "--help"], capsys)  # says the default planner_suggest uses
    assert code == 0 and f"default {DEFAULT_HEADROOM:.0%}".replace("%", " %") in " ".join(out.split())
    for bad in ("80", "-1", "nan"):
        code, _, err = run([*argv, "--headroom", bad], capsys)
        assert code == 2 and err.count("\n") == 1 and "--headroom" in err and "80 GiB" in err, err


def test_status_line_counts_candidates_and_shows_the_best_so_far() -> None:
    stream = io.StringIO()
    ticks = itertools.count()
    status = StatusLine("meshc suggest", stream, tty=True, clock=lambda: float(next(ticks)), tick=0)
    res = _search(SEARCHES[0], top=1, status=status)
    shown = stream.getvalue()
    assert f"meshc suggest: searching: candidate 1 of {res.enumerated}" in shown
    assert "best so far" in shown and "per step: data " in shown
    assert shown.endswith("\r\x1b[K")


def test_bubble_bound_is_the_schedules_own_bubble() -> None:
    """bubble_scale is the planner's own bubble for the schedules whose closed form it uses."""
    from meshllm_dsl.planner.schedule import schedule_cost

    base = planner_suggest.Candidate(2, 4, 1, 8, "1f1b", 1, 0, 1)
    for c in (base, attrs.evolve(base, schedule="gpipe"), attrs.evolve(base, microbatches=12),
              attrs.evolve(base, pipeline=3, microbatches=5, schedule="gpipe")):
        assert bubble_scale(c) == pytest.approx(schedule_cost(c.schedule, c.pipeline, 1, c.microbatches).bubble_over_busy)
