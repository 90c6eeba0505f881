"""A `device` declaration as `meshc calibrate` writes it: measured mfu and latency reach the planner."""

from __future__ import annotations

from pathlib import Path

from meshllm_dsl.cli_plan import load_checked
from meshllm_dsl.planner import analyze, resolve_device

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
    assert rc.compute_s == 6 * rc.params_local * plan.batch * plan.seq / (0.0275e12 * 1)
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
