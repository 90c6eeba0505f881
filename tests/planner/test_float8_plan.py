"""The planner prices what `precision { matmul, all_gather }` and `compile = blocks` run: float8
products at the recipe's peak (planner/float8.py), emulated float8 on CPU no faster, FSDP2's float8
all-gathers (comm.fsdp_all_gather_bytes) and gather buffers, compiled blocks, and `meshc suggest`'s
matmul and compile choices."""

from __future__ import annotations

import attrs
import pytest

from meshllm_dsl import primitives
from meshllm_dsl.checker import check_text
from meshllm_dsl.ir import DTYPES, FP8_BYTES, PlanIR
from meshllm_dsl.parallel.devices import COMPILED_MATMUL, FLOAT8_MATMUL, PROFILES
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.comm import fsdp_all_gather_bytes
from meshllm_dsl.planner.float8 import float8_flops, product_seconds
from meshllm_dsl.planner.held import held_units
from meshllm_dsl.planner.report import report_json, report_text
from meshllm_dsl.planner.suggest import Candidate, plan_text, precision_choices

MODEL = """
model m = llama {
    vocab = 32000
    hidden = 2048
    layers = 4
    heads = 16
    kv_heads = 4
    ffn = 5632
}
"""


def _plan(device: str = "h100", precision: str = "", extra: str = "", zero: int = 3, data: int = 4) -> PlanIR:
    text = MODEL + f"""
mesh g {{
    axes data = {data}
    device = {device}
}}

plan train on g for m {{
    batch = {2 * data}
    seq = 2048
    layout {{ batch -> data }}
    {extra}
    precision {{ params = bf16, master = fp32, reduce = fp32{precision} }}
    optimizer adamw {{ zero {zero} over data }}
}}
"""
    result = check_text(text, "float8_test.mesh")
    assert result.ok, [e.message for e in result.errors]
    return result.plans["train"]


def _step(plan: PlanIR) -> float:
    return analyze(plan, PROFILES[plan.mesh.device or "h100"]).step.total_s


def test_float8_on_h100_is_faster_than_bf16_and_slower_than_twice() -> None:
    bf16 = _step(_plan())
    for recipe in ("fp8_tensorwise", "fp8_rowwise"):
        f8 = _step(_plan(precision=f", matmul = {recipe}"))
        assert bf16 / 2 < f8 < bf16, (recipe, bf16, f8)


def test_float8_without_the_recipe_is_the_bf16_plan() -> None:
    # Re-pricing a float8 plan with float8 = None (what `meshc plan` prints beside it) is the bf16 plan.
    plain, f8 = _plan(), _plan(precision=", matmul = fp8_tensorwise")
    assert _step(attrs.evolve(f8, float8=None)) == _step(plain)


def test_emulated_float8_on_cpu_is_no_faster() -> None:
    bf16 = _step(_plan("cpu", data=2))
    f8 = _step(_plan("cpu", ", matmul = fp8_tensorwise", data=2))
    assert f8 >= bf16


def test_converted_products_run_at_the_float8_peak() -> None:
    # A large block product: compute-bound, so its time is flops / (peak x mfu x factors) less the
    # last wave's idle SMs, which bf16 and float8 share. Converted / not: the ratio of the rates.
    for device, peak_of, recipe in (("h100", "fp8_tflops", "fp8_tensorwise"), ("b200", "mx_tflops", "mxfp8")):
        profile = PROFILES[device]
        plain, f8 = _plan(device), _plan(device, f", matmul = {recipe}")
        hu = next(h for h in held_units(f8, f8.stages[0]) if h.unit.name == "mlp")
        (up, *_) = primitives.of(hu.unit).work(f8, hu, 4096, 2048, 2, True).matmuls
        ratio = product_seconds(plain, profile, hu, up) / product_seconds(f8, profile, hu, up)
        assert ratio == pytest.approx(getattr(profile, peak_of) * FLOAT8_MATMUL / profile.tflops, rel=1e-9)


def test_compile_applies_the_fitted_matmul_factor_and_fewer_passes() -> None:
    eager, compiled = _plan(), _plan(extra="compile = blocks")
    profile = PROFILES["h100"]
    hu = next(h for h in held_units(compiled, compiled.stages[0]) if h.unit.name == "mlp")
    (up, *_) = primitives.of(hu.unit).work(compiled, hu, 4096, 2048, 2, True).matmuls
    ratio = product_seconds(eager, profile, hu, up) / product_seconds(compiled, profile, hu, up)
    assert ratio == pytest.approx(COMPILED_MATMUL, rel=1e-9)
    assert _step(compiled) < _step(eager)
    # Not on host-bound ranks: their compiled kernels are not measured.
    assert _step(_plan("cpu", extra="compile = blocks", data=2)) == _step(_plan("cpu", data=2))


def test_float8_all_gathers_narrow_exactly_the_converted_weights() -> None:
    plain = _plan(precision=", matmul = fp8_tensorwise")
    gathered = _plan(precision=", matmul = fp8_tensorwise, all_gather = fp8")
    assert plain.float8 is not None and gathered.float8 is not None and gathered.float8.gather
    # Per block: q, k, v, o, gate, up, down; ZeRO 3 with one microbatch gathers each block twice.
    h, kv, f = 2048, 512, 5632
    weights = 4 * (h * h + 2 * h * kv + h * h + 3 * h * f)
    narrowed = fsdp_all_gather_bytes(plain) - fsdp_all_gather_bytes(gathered)
    assert narrowed == 2 * weights * (DTYPES["bf16"] - FP8_BYTES)
    # The amax all-reduce: one a step, an fp32 per converted weight.
    comms = analyze(gathered, PROFILES["h100"]).ranks[0].comms
    (amax,) = [c for c in comms if c.op == "all_reduce"]
    assert (amax.calls, amax.payload_bytes) == (1, 4 * 7 * 4)
    # The planned bytes are what the report's all-gathers hand over.
    report = analyze(gathered, PROFILES["h100"])
    assert fsdp_all_gather_bytes(gathered) == pytest.approx(
        sum(c.payload_bytes for c in report.ranks[0].comms if c.op == "all_gather"), abs=64)


def test_float8_gather_buffers_are_one_byte_per_converted_element() -> None:
    plain = analyze(_plan(precision=", matmul = fp8_tensorwise"), PROFILES["h100"]).ranks[0]
    gathered = analyze(_plan(precision=", matmul = fp8_tensorwise, all_gather = fp8"), PROFILES["h100"]).ranks[0]
    h, kv, f = 2048, 512, 5632
    block = h * h + 2 * h * kv + h * h + 3 * h * f
    # ZeRO 3: the root and two blocks gathered at once; the root (embedding, head) stays bf16.
    assert plain.gather_buffer_bytes - gathered.gather_buffer_bytes == 2 * block * (DTYPES["bf16"] - FP8_BYTES)
    # torchao saves the layers' inputs in the params dtype: activations are unchanged.
    assert plain.activation_bytes_per_microbatch == gathered.activation_bytes_per_microbatch


def test_meshc_plan_reports_the_float8_share_and_the_step_without() -> None:
    plan = _plan(precision=", matmul = fp8_tensorwise", extra="compile = blocks")
    rep = analyze(plan, PROFILES["h100"])
    text = report_text(rep)
    converted, total = float8_flops(plan)
    assert f"float8           {converted / total:.0%} of matmul FLOPs in fp8_tensorwise (lm_head and the attention core in bf16)" in text
    assert "compiled         each block" in text
    data = report_json(rep)
    assert data["compile"] == "blocks"
    assert data["float8"]["matmul_flops_share"] == converted / total
    assert data["float8"]["step_s_without_float8"] == _step(attrs.evolve(plan, float8=None))
    assert report_json(analyze(_plan(), PROFILES["h100"]))["float8"] is None


def test_suggest_offers_the_recipes_the_device_has() -> None:
    model = check_text(MODEL, "m.mesh").models["m"]
    # compiled only, and the device's fastest float8 recipe: the variants priced slower are not searched
    assert precision_choices(model, PROFILES["h100"]) == [("", True), ("fp8_tensorwise", True)]
    assert precision_choices(model, PROFILES["b200"]) == [("", True), ("mxfp8", True)]
    assert precision_choices(model, PROFILES["a100"]) == [("", True)]
    assert precision_choices(model, PROFILES["cpu"]) == [("", False)]


@pytest.mark.parametrize("zero,matmul", [(3, "fp8_tensorwise"), (0, "fp8_rowwise"), (1, "fp8_tensorwise")])
def test_suggested_float8_plans_check_clean(zero: int, matmul: str) -> None:
    model = check_text(MODEL, "m.mesh").models["m"]
    c = Candidate(4, 1, 1, 1, "none", 1, zero, 1, matmul=matmul, compile=True)
    result = check_text(MODEL + plan_text(c, model, "h100", 8, 2048), "m.mesh")
    assert result.ok, [e.message for e in result.errors]
    plan = result.plans["suggested"]
    assert plan.compile == "blocks" and plan.float8 is not None and plan.float8.recipe == matmul
    assert plan.float8.gather == (zero == 3)
