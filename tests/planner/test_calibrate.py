"""`meshc calibrate`: its calibration plans are valid for every rank count, the declaration it writes
is accepted by the checker and reaches the planner, and its host-time arithmetic inverts the
planner's host-time model (a run the model describes exactly is recovered exactly)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.cli.plan import load_checked
from meshllm_dsl.planner.analyze import analyze, resolve_device
from meshllm_dsl.planner.calibrate import _host_costs, calibration_specs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ranks", range(1, 9))
def test_calibration_plans_check_for_every_rank_count(ranks: int) -> None:
    specs = calibration_specs(ranks)
    assert "base" in specs and "base_gpt2" in specs
    assert ("pipeline" in specs) == (ranks % 2 == 0) and ("fsdp" in specs) == (ranks > 1)
    for name, text in specs.items():
        result = check_text(text, f"{name}.mesh")
        assert result.ok, (name, [d.message for d in result.errors])
        (plan,) = result.plans.values()
        assert plan.mesh.devices == ranks
        assert (plan.pipeline_size > 1) == (name == "pipeline") and (plan.zero == 3) == (name == "fsdp")
        assert (plan.model.value("positions") is not None) == (name == "base_gpt2")  # GPT-2's learned positions


def test_host_costs_invert_the_model() -> None:
    # Runs built from known costs: 10 us per kernel, 400 us per collective call, 700 us per pipeline
    # action (4 per rank: 2 microbatches x forward / backward), 1,500 us per FSDP2 collective.
    def run(kernels: int, calls: float, p2p: float = 0, fsdp: float = 0, actions: int = 0,
            charged: float | None = None) -> dict[str, float]:
        charged = calls if charged is None else charged
        cpu = (kernels * 10 + charged * 400 + actions * 700 + fsdp * 1500) * 1e-6
        return {"cpu": cpu, "kernels": kernels, "calls": calls, "collective_cpu": calls * 400e-6,
                "p2p_calls": p2p, "fsdp_calls": fsdp}

    runs = {
        "base": [run(1300, 24), run(1300, 24)],
        # 6 pipeline waits measured, 2 send / recv calls charged by the planner.
        "pipeline": [run(700, 10, p2p=6, actions=4, charged=6), run(800, 12, p2p=6, actions=4, charged=8)],
        "fsdp": [run(1500, 40, fsdp=30), run(1500, 40, fsdp=30)],
    }
    costs = _host_costs(runs)
    assert costs == pytest.approx({"kernel": 10, "collective_cpu": 400, "stage_cpu": 700, "fsdp_cpu": 1500})
    # A GPT-2 base whose kernels cost 14 us: `kernel` is the two families' mean, the calls pooled.
    gpt2 = [dict(r, cpu=r["cpu"] + 4e-6 * r["kernels"]) for r in runs["base"]]
    costs = _host_costs({**runs, "base_gpt2": gpt2})
    assert costs["kernel"] == pytest.approx(12) and costs["collective_cpu"] == pytest.approx(400)
    assert (costs["kernel_llama"], costs["kernel_gpt2"]) == pytest.approx((10, 14))


def test_calibrate_writes_a_device_the_planner_uses(tmp_path: Path) -> None:
    out = tmp_path / "devices.mesh"
    proc = subprocess.run([sys.executable, "-m", "meshllm_dsl", "calibrate", "--ranks", "2", "--device", "here",
                           "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    for key in ("tflops", "kernel", "cores", "latency", "collective_cpu", "stage_cpu", "fsdp_cpu"):
        assert f"    {key} = " in text, key
    spec = tmp_path / "t.mesh"
    spec.write_text('include "devices.mesh"\n' + calibration_specs(2)["pipeline"].replace(
        "axes pipeline = 2", "axes pipeline = 2\n    device = here"))
    loaded = load_checked(str(spec))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    (plan,) = loaded.result.plans.values()
    device, assumed = resolve_device(plan, loaded.devices)
    assert not assumed and device.name == "here"
    assert device.kernel_us and device.collective_cpu_us and device.stage_cpu_us and device.fsdp_cpu_us
    rep = analyze(plan, device)
    # Two ranks on a machine of at least two cores do not time-share; every host term is in the step.
    rc = rep.ranks[0]
    assert rc.compute_s > rc.kernels * device.kernel_us * 1e-6 + 4 * device.stage_cpu_us * 1e-6 * 0.999
