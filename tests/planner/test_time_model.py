"""The planner's step-time model for host-bound ranks: kernels, collective host time, shared cores.

The kernel table must match what the runtime dispatches (counted with runtime.profile.LiveBytes on
real training steps), and the device settings `kernel`, `collective_cpu` and `cores` must reach the
step time exactly as documented; GPU profiles, which set none of them, keep their old estimates.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from reference_jobs import profile_job

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.cli.plan import load_checked
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.planner.analyze import analyze, resolve_device
from meshllm_dsl.planner.held import held_units
from meshllm_dsl.planner.time import KERNELS, unit_kernels

ROOT = Path(__file__).resolve().parents[2]

SINGLE = """
mesh one { axes data = 1 }
model l = llama { vocab = 256, hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 128, dtype = fp32 }
plan p on one for l {
    batch = 4
    seq = 32
    microbatches = 2
}
"""

# A moe layer launches kernels per expert a rank holds: every expert without expert parallelism
# (data only), experts / 2 with `experts -> data` (and the all-to-all dispatch beside them).
MOE = """
mesh m {{ axes data = 2 }}
model mx = mixtral {{ vocab = 128, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, experts = 8, top_k = 2,
                     dtype = fp32 }}
plan p on m for mx {{
    batch = 2
    seq = 64
    layout {{ batch -> data{experts} }}
}}
"""
SPECS = {"moe_data2": MOE.format(experts=""), "moe_experts_data2": MOE.format(experts=", experts -> data")}

CPU = """
device box {
    like = cpu
    tflops = 0.05
    mfu = 1
    kernel = 8
    collective_cpu = 300
    cores = 2
    latency = 150
}
mesh m { axes pipeline = 2, tensor = 2
    device = box }
model g = gpt2 { vocab = 256, hidden = 64, layers = 4, heads = 4, positions = 64 }
plan p on m for g {
    batch = 4
    seq = 32
    microbatches = 2
    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }
    stages over pipeline balanced
}
"""


def _plan(text: str):  # type: ignore[no-untyped-def]
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    return plan


def _loaded(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "t.mesh"
    path.write_text(text)
    loaded = load_checked(str(path))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    (plan,) = loaded.result.plans.values()
    return plan, resolve_device(plan, loaded.devices)[0]


def test_unit_kernels_of_a_llama_block() -> None:
    plan = _plan(SINGLE)
    counts = {hu.unit.name: unit_kernels(plan, hu) for st in plan.stages for hu in held_units(plan, st)}
    k = KERNELS
    assert counts["attn_norm"] == k["rmsnorm"] == 21
    # q, k, v, o projections, q / k / v as heads, SDPA, rotary and the residual add.
    assert counts["attn"] == 4 * k["linear"] + 3 * k["heads"] + k["attention_core"] + k["rotary"] + k["residual"]
    assert counts["mlp"] == 3 * k["linear"] + k["swiglu"] + k["residual"]
    assert counts["embed"] == k["embedding"]
    assert counts["lm_head"] == k["linear"] + k["cross_entropy"]  # the last unit carries the loss


def test_step_kernels_add_the_per_tensor_work() -> None:
    plan = _plan(SINGLE)
    rc = analyze(plan, PROFILES["cpu"]).ranks[0]
    per_mb = sum(unit_kernels(plan, hu) * hu.count for st in plan.stages for hu in held_units(plan, st))
    tensors = 1 + 2 * 9 + 2  # embed, 9 per block, final norm and head
    from meshllm_dsl.planner.time import KERNELS_ADAMW, KERNELS_STEP, KERNELS_ZERO_GRAD

    # zero_grad and fused AdamW per tensor, no data sync
    assert rc.kernels == 2 * per_mb + KERNELS_STEP + tensors * (KERNELS_ZERO_GRAD + KERNELS_ADAMW) == 2 * per_mb + 20 + tensors * 2


def test_gpu_profiles_have_no_host_terms() -> None:
    (plan,) = check_file(str(ROOT / "examples" / "tiny_llama.mesh")).plans.values()
    rep = analyze(plan, PROFILES["h100"])
    assert rep.step.shared_s == 0 and all(rc.kernel_s == 0 for rc in rep.ranks)
    assert rep.step.total_s == rep.step.critical_s


def test_kernel_time_enters_compute(tmp_path: Path) -> None:
    plan, dev = _loaded(tmp_path, CPU)
    assert (dev.kernel_us, dev.collective_cpu_us, dev.cores) == (8, 300, 2)
    # Per token and device (tensor 2): 6 flops per weight of the linear layers (qkv, o, up, down;
    # the tied head on the last stage; the embeddings are lookups) and 12 s d per local head of
    # the attention core, two blocks per stage.
    blocks = 2 * (6 * (3 * 64 * 64 + 64 * 64 + 2 * 256 * 64) // 2 + 12 * 32 * 16 * 2)
    head = 6 * 256 * 64 // 2
    for rc in analyze(plan, dev).ranks:
        flops_s = (blocks + head * (rc.coord == 1)) * plan.batch * plan.seq / 0.05e12
        assert rc.kernel_s == pytest.approx(rc.kernels * 8e-6)
        assert rc.compute_s == pytest.approx(flops_s + rc.kernel_s)
        calls = sum(c.calls for c in rc.comms)
        assert rc.host_s == pytest.approx(rc.compute_s + calls * 300e-6)


def test_ranks_time_sharing_cores_bound_the_step(tmp_path: Path) -> None:
    plan, dev = _loaded(tmp_path, CPU)
    rep = analyze(plan, dev)
    # 4 ranks on 2 cores: the host's work over its cores, then the pipeline's fill and drain (GPipe,
    # p = 2, m = 2: half the busy time), in which the two ranks of one stage have a core each.
    work = sum(rc.host_s * len(rc.ranks) for rc in rep.ranks) / 2
    fill = (2 - 1) / 2 * max(rc.host_s for rc in rep.ranks)
    assert rep.step.shared_s == pytest.approx(work + fill)
    assert rep.step.total_s == max(rep.step.shared_s, rep.step.critical_s) == rep.step.shared_s
    # A core per rank: nothing is shared, the critical path alone.
    own = analyze(plan, attrs.evolve(dev, cores=4.0))
    assert own.step.shared_s == 0 and own.step.total_s == own.step.critical_s == rep.step.critical_s
    # Fewer cores, longer step, in proportion.
    half = analyze(plan, attrs.evolve(dev, cores=1.0))
    assert half.step.shared_s == pytest.approx(2 * rep.step.shared_s)


def test_host_terms_in_the_report(tmp_path: Path) -> None:
    from meshllm_dsl.planner.report import report_json, report_text

    plan, dev = _loaded(tmp_path, CPU)
    rep = analyze(plan, dev)
    text = report_text(rep)
    assert "kernels x 8 us" in text and "4 ranks per host on 2 cores" in text
    data = report_json(rep)
    assert data["step"]["shared_s"] == rep.step.shared_s and data["ranks"][0]["kernels"] == rep.ranks[0].kernels


def _planned_and_profiled(text: str, plan, pool, tmp_path: Path):  # type: ignore[no-untyped-def]
    """(rank, its planned RankClass, its `meshc run --profile` report) for every rank of `plan`,
    compiled from `text` and run once on the pool's gloo ranks."""
    from meshllm_dsl.codegen.emit import render_plan

    path = tmp_path / "gen.py"
    path.write_text(render_plan(plan, "t.mesh", text))
    rep = analyze(plan, PROFILES["cpu"])
    reports = pool.run(profile_job, plan.mesh.devices, str(path), str(tmp_path / "profile"))
    for rank, got in enumerate(reports):
        coord = plan.mesh.coords(rank).get(plan.roles.pipeline, 0) if plan.roles.pipeline else 0
        yield rank, next(rc for rc in rep.ranks if rc.coord == coord), got


@pytest.mark.parametrize("name", ["single_llama", "tiny_gpt2", "tiny_llama", *SPECS])
def test_planned_kernels_match_the_runtime(name: str, pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    text = SINGLE if name == "single_llama" else SPECS.get(name) or (ROOT / "examples" / f"{name}.mesh").read_text()
    for rank, rc, got in _planned_and_profiled(text, _plan(text), pool, tmp_path):
        assert rc.kernels == pytest.approx(got["kernels"], rel=0.1), (rank, rc.kernels, got["kernels"])
        assert got["steps"] == 1 and got["cpu_s"] > 0 and (tmp_path / "profile" / f"rank{rank}.json").exists()


def test_recomputation_launches_the_forward_kernels_again() -> None:
    from meshllm_dsl.planner.time import FORWARD_KERNEL_SHARE

    base = analyze(_plan(SINGLE), PROFILES["cpu"]).ranks[0].kernels
    blocks_plan = _plan(SINGLE.replace("microbatches = 2", "microbatches = 2\n    recompute = blocks"))
    per_block = sum(round(FORWARD_KERNEL_SHARE * unit_kernels(blocks_plan, hu))
                    for st in blocks_plan.stages for hu in held_units(blocks_plan, st) if hu.prefix)
    assert analyze(blocks_plan, PROFILES["cpu"]).ranks[0].kernels == base + 2 * 2 * per_block  # 2 blocks, 2 microbatches
    attn = _plan(SINGLE.replace("microbatches = 2", "microbatches = 2\n    recompute = attention"))
    assert analyze(attn, PROFILES["cpu"]).ranks[0].kernels == base + 2 * 2 * KERNELS["attention_core"] // 2


FSDP = """
mesh m {{ axes {axes} }}
model l = llama {{ vocab = 128, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }}
plan p on m for l {{
    batch = 8
    seq = 16
    microbatches = {m}
    layout {{ batch -> data }}
    {pipeline}
    optimizer adamw {{ zero {zero} over data }}
}}
"""
PIPELINED = "stages over pipeline {}balanced\n    schedule {}"


@pytest.mark.parametrize(("zero", "schedule", "m", "p", "v"), [
    (3, None, 2, 1, 1), (2, None, 2, 1, 1), (3, "gpipe", 2, 2, 1), (3, "1f1b", 4, 2, 1), (2, "1f1b", 4, 2, 1),
    (3, "gpipe", 1, 2, 1), (3, "1f1b", 4, 4, 1),
    (3, "interleaved_1f1b", 4, 2, 2), (3, "interleaved_1f1b", 4, 4, 2), (3, "interleaved_1f1b", 4, 2, 3),
    (2, "interleaved_1f1b", 4, 2, 3), (3, "interleaved_1f1b", 2, 2, 4),
])
def test_planned_fsdp_collectives_match_the_runtime(zero: int, schedule: str | None, m: int, p: int, v: int,  # type: ignore[no-untyped-def]
                                                     pool, tmp_path: Path) -> None:
    """FSDP2 gathers and reduce-scatters unit by unit, as often as the schedule makes it: the
    planner's calls per step (and kernels) are what the runtime issues on real gloo ranks."""
    text = FSDP.format(axes=f"data = 2, pipeline = {p}" if schedule else "data = 2", m=m, zero=zero,
                       pipeline=PIPELINED.format(f"virtual {v} " if v > 1 else "", schedule)
                       if schedule else "")
    # At least one block per (virtual) stage.
    plan = _plan(text.replace("layers = 4", f"layers = {max(4 if p <= 2 else 2 * p, p * v)}"))
    for rank, rc, got in _planned_and_profiled(text, plan, pool, tmp_path):
        planned = {c.op: c.calls for c in rc.comms if c.kind == "data"}
        measured = {c["op"]: c["calls"] for c in got["collectives"] if c["op"].endswith("_single")}
        assert measured == {"all_gather_single": planned["all_gather"],
                            "reduce_scatter_single": planned["reduce_scatter"]}, (rank, planned, measured)
        assert rc.kernels == pytest.approx(got["kernels"], rel=0.1), (rank, rc.kernels, got["kernels"])


def test_schedule_actions_and_fsdp_counts() -> None:
    from meshllm_dsl.planner.formulas import fsdp_unit_collectives, stage_actions

    assert stage_actions("gpipe", 2, 0, 2) == "FFBB"
    assert stage_actions("1f1b", 2, 0, 4) == "FFBFBFBB"  # torch's Schedule1F1B: p - i forwards first
    assert stage_actions("1f1b", 2, 1, 4) == "FBFBFBFB"
    assert stage_actions("1f1b", 4, 0, 2) == "FFBB"
    # ZeRO-3 reshards after each forward; the pipeline keeps units gathered from a backward on.
    assert fsdp_unit_collectives(3, "FFBFBFBB", 4) == (5, 1)
    assert fsdp_unit_collectives(3, "FFBB", 2) == (3, 1)
    assert fsdp_unit_collectives(2, "FFBFBFBB", 4) == (1, 1)
    # The runtime's own microbatch loop: every microbatch gathers and reduce-scatters.
    assert fsdp_unit_collectives(3, None, 4) == (8, 4)
    assert fsdp_unit_collectives(2, None, 4) == (4, 4)


def test_framework_host_time_enters_compute(tmp_path: Path) -> None:
    """`stage_cpu` per pipeline action (2 per microbatch and stage) and `fsdp_cpu` per FSDP2
    collective reach each rank's compute and host time exactly; a zero-cost device adds nothing."""
    text = CPU.replace("    cores = 2\n", "    cores = 2\n    stage_cpu = 500\n    fsdp_cpu = 700\n")
    plan, dev = _loaded(tmp_path, text)
    assert (dev.stage_cpu_us, dev.fsdp_cpu_us) == (500, 700)
    without = analyze(plan, attrs.evolve(dev, stage_cpu_us=None, fsdp_cpu_us=None))
    for rc, base in zip(analyze(plan, dev).ranks, without.ranks):
        assert rc.compute_s - base.compute_s == pytest.approx(2 * 2 * 500e-6)  # m = 2, one stage per rank
    fsdp = FSDP.format(axes="data = 2", m=2, zero=3, pipeline="")
    plan, dev = _loaded(tmp_path, fsdp.replace("mesh m {", "device box { like = cpu, fsdp_cpu = 700, stage_cpu = 500 }\nmesh m {")
                        .replace("axes data = 2 }", "axes data = 2\n    device = box }"))
    (rc,) = analyze(plan, dev).ranks
    (base,) = analyze(plan, attrs.evolve(dev, fsdp_cpu_us=None)).ranks
    events = sum(c.calls for c in rc.comms if c.kind == "data")
    assert events == 5 * 2 * 3  # 4 blocks + the root, 2 microbatches, gather x 2 + reduce-scatter
    assert rc.compute_s - base.compute_s == pytest.approx(events * 700e-6)


def test_fsdp_collectives_overlap_compute_on_gpus_only(tmp_path: Path) -> None:
    """On a GPU, FSDP2's per-unit collectives run beside the compute: only their excess is on the
    critical path. Host-bound ranks and ZeRO-1's post-backward collectives overlap nothing."""
    from meshllm_dsl.planner.time import exposed_data_seconds

    text = FSDP.format(axes="data = 2", m=2, zero=3, pipeline="")
    plan = _plan(text)
    for device in (PROFILES["h100"], attrs.evolve(PROFILES["h100"], intra_gbps=1e-4, inter_gbps=1e-4)):
        rep = analyze(plan, device)
        (rc,) = rep.ranks
        data = rc.comm_seconds(("data",))
        assert rep.step.data_s == exposed_data_seconds(plan, device, rc) == max(0.0, data - rc.compute_s)
    slow_links = analyze(plan, attrs.evolve(PROFILES["h100"], intra_gbps=1e-4, inter_gbps=1e-4))
    assert slow_links.step.data_s > 0  # links slow enough that the gathers outlast the compute
    host = analyze(plan, attrs.evolve(PROFILES["h100"], kernel_us=8.0))
    assert host.step.data_s == host.ranks[0].comm_seconds(("data",))
    zero1 = _plan(text.replace("zero 3", "zero 1"))
    rep = analyze(zero1, PROFILES["h100"])
    assert rep.step.data_s == rep.ranks[0].comm_seconds(("data",)) > 0
