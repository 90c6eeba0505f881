"""A `device` declaration as `meshc calibrate` writes it: measured mfu and latency reach the planner."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm_dsl.cli.plan import load_checked
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.planner.analyze import analyze, resolve_device
from meshllm_dsl.views.profile_report import UNCALIBRATED, compare, report_text

SPEC = """
device calibrated {
    memory = 2.9
    tflops = 0.0275
    mfu = 1
    intra = 0.16
    inter = 0.16
    per_host = 64
    latency = 900.5
}
mesh m { axes tensor = 2
    device = calibrated }
model l = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }
plan p on m for l {
    batch = 4
    seq = 8
    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""


def test_measured_mfu_and_latency_are_used(tmp_path: Path) -> None:
    path = tmp_path / "cal.mesh"
    path.write_text(SPEC)
    loaded = load_checked(str(path))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    (plan,) = loaded.result.plans.values()
    device, assumed = resolve_device(plan, loaded.devices)
    assert not assumed and device.mfu == 1 and device.latency_us == 900.5
    rep = analyze(plan, device)
    rc = rep.ranks[0]
    # Per token and device (tensor 2): 6 flops per linear weight (q, k, v, o, gate, up, down and
    # the head; the embedding is a lookup) and the attention core's 12 s d per local head.
    linear = 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 64 * 32) // 2 + 64 * 32 // 2
    core = 2 * 12 * 8 * 8 * 2
    assert rc.compute_s == pytest.approx((6 * linear + core) * plan.batch * plan.seq / (0.0275e12 * 1), rel=1e-12)
    ar = next(c for c in rc.comms if c.kind == "tensor" and c.op == "all_reduce")
    assert ar.seconds >= ar.calls * 900.5e-6


def test_calibrated_settings_stay_optional(tmp_path: Path) -> None:
    path = tmp_path / "cal.mesh"
    path.write_text(SPEC.replace("    mfu = 1\n", "").replace("    latency = 900.5\n", ""))
    loaded = load_checked(str(path))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    (plan,) = loaded.result.plans.values()
    device, _ = resolve_device(plan, loaded.devices)
    assert device.mfu is None and device.latency_us is None


# --- the built-in `cpu` profile ----------------------------------------------------------------

ROOT = Path(__file__).parents[2]

# `meshc run EXAMPLE --profile` step times (rank 0's timed step), recorded as data: the built-in
# profile's defaults (meshllm_dsl.parallel.devices.CPU_DEFAULTS) come from the same machine and day.
CPU_MEASURED = {
    "machine": "project build machine: 2 cores of an AMD EPYC, Debian 12, torch 2.13 CPU, gloo; shared (load average ~9)",
    "date": "2026-12-01",
    "step_s": {"tiny_llama.mesh": 0.3381, "tiny_gpt2.mesh": 0.2387},
}


def _example_plan(name: str):  # type: ignore[no-untyped-def]
    loaded = load_checked(str(ROOT / "examples" / name))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    (plan,) = loaded.result.plans.values()
    return plan, loaded


@pytest.mark.parametrize("name", sorted(CPU_MEASURED["step_s"]))
def test_builtin_cpu_profile_plans_the_examples_within_2x_of_a_measured_step(name: str) -> None:
    plan, loaded = _example_plan(name)
    device, assumed = resolve_device(plan, loaded.devices)
    assert device is PROFILES["cpu"] and not assumed
    ratio = analyze(plan, device).step.total_s / CPU_MEASURED["step_s"][name]
    assert 0.5 <= ratio <= 2.0, ratio


def _measured_rank(plan) -> dict:  # type: ignore[no-untyped-def]
    """One rank's `--profile` file, as runtime.profile.profile_train writes it (figures arbitrary)."""
    coords = plan.mesh.coords(0)
    memory = dict.fromkeys(("weights", "gradients", "optimizer", "activations_per_microbatch",
                            "activations_and_temporaries_peak"), 1 << 20)
    return {"rank": 0, "coords": coords, "stages": [0], "memory": memory, "step_s": 0.3, "compute_s": 0.1,
            "pipeline_wait_s": 0.05, "cpu_s": 0.06, "kernels": 850, "collectives": []}


def test_profile_report_says_the_builtin_cpu_profile_is_not_calibrated(tmp_path: Path) -> None:
    plan, loaded = _example_plan("tiny_llama.mesh")
    text = report_text(compare(plan, [_measured_rank(plan)], analyze(plan, PROFILES["cpu"])))
    assert UNCALIBRATED in text and "meshc calibrate" in text
    # A `device cpu` from `meshc calibrate` replaces the defaults: no note.
    (tmp_path / "devices.mesh").write_text(SPEC.split("mesh m")[0].replace("device calibrated", "device cpu"))
    spec = tmp_path / "tl.mesh"
    spec.write_text('include "devices.mesh"\n' + (ROOT / "examples" / "tiny_llama.mesh").read_text())
    own = load_checked(str(spec))
    assert own.ok, [d.message for d in own.diagnostics]
    (plan,) = own.result.plans.values()
    device, _ = resolve_device(plan, own.devices)
    assert device.name == "cpu" and device != PROFILES["cpu"]
    text = report_text(compare(plan, [_measured_rank(plan)], analyze(plan, device)))
    assert UNCALIBRATED not in text and "calibrat" not in text.split("\n", 1)[1]
