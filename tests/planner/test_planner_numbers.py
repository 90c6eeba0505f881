"""The planner's numbers: parameter counts, bytes, ZeRO, activations, KV cache, bubble, communication."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.ir import PlanIR
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.formulas import (
    bubble_fraction,
    kv_bytes_per_token,
    optimizer_bytes_per_param,
    zero_per_device,
)
from meshllm_dsl.planner.report import report_text
from meshllm_dsl.planner.schedule import rank_moments
from meshllm_dsl.planner.warnings import plan_warnings
from meshllm_dsl.views.svg import simulated_idle

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def plan_of(name: str, plan: str = "train") -> PlanIR:
    result = check_file(EXAMPLES / name)
    assert result.ok, result.diagnostics
    return result.plans[plan]


def llama_text(hidden: int, layers: int, heads: int, ffn: int, kv: int | None = None, axes: str = "tensor = 1") -> str:
    kv_line = f"kv_heads = {kv}" if kv else ""
    return f"""
mesh m {{ axes {axes} }}
model llama = llama {{ vocab = 32000, hidden = {hidden}, layers = {layers}, heads = {heads}, ffn = {ffn} {kv_line} }}
plan p on m for llama {{ batch = 1, seq = 4096 }}
"""


@pytest.mark.parametrize(
    ("hidden", "layers", "heads", "ffn", "kv", "params"),
    [
        (4096, 32, 32, 11008, None, 6_738_415_616),
        (5120, 40, 40, 13824, None, 13_015_864_320),
        (8192, 80, 64, 28672, 8, 68_976_648_192),
    ],
    ids=["7b", "13b", "70b"],
)
def test_llama2_parameter_counts(hidden: int, layers: int, heads: int, ffn: int, kv: int | None, params: int) -> None:
    result = check_text(llama_text(hidden, layers, heads, ffn, kv))
    assert result.ok, result.diagnostics
    rep = analyze(result.plans["p"], PROFILES["h100"])
    assert rep.plan.model.numel == params
    assert sum(rc.params_local for rc in rep.ranks) == params  # one device holds it all


def test_70b_weights_in_bf16() -> None:
    plan = plan_of("llama2_70b.mesh")
    weight_bytes = plan.model.numel * 2
    assert weight_bytes == 137_953_296_384
    assert f"{weight_bytes / 1e9:.2f}" == "137.95"
    assert f"{weight_bytes / 2**30:.2f}" == "128.48"
    # Every rank's weights add up to the model: 2 pipeline stages x 4 tensor shards (+ replicated norms).
    rep = analyze(plan)
    replicated = sum(rc.params_replicated for rc in rep.ranks)
    sharded = sum(rc.params_local - rc.params_replicated for rc in rep.ranks)
    assert sharded * 4 + replicated == plan.model.numel


def test_70b_kv_cache() -> None:
    plan = plan_of("llama2_70b.mesh")
    assert kv_bytes_per_token(plan) == 327_680 == 2 * 80 * 8 * 128 * 2
    rep = analyze(plan)
    # Per device: 40 layers, 8 kv heads / 4 tensor shards, at batch 16 x seq 4096.
    for rc in rep.ranks:
        assert rc.kv_cache_bytes == 2 * 40 * 2 * 128 * 4096 * 16 * 2
    assert sum(rc.kv_cache_bytes for rc in rep.ranks) * 4 == 327_680 * 16 * 4096


def test_optimizer_bytes_per_parameter() -> None:
    # ZeRO paper: mixed-precision Adam keeps K = 12 bytes (fp32 master, m, v): 2 + 2 + 12 = 16.
    assert optimizer_bytes_per_param("adamw", "bf16") == 12
    assert optimizer_bytes_per_param("adam", "fp16") == 12
    assert optimizer_bytes_per_param("adamw", "fp32") == 8  # 4 + 4 + 8 = 16 as well
    assert optimizer_bytes_per_param("sgd", "bf16") == 4  # master weights only
    assert optimizer_bytes_per_param("sgd", "fp32") == 0


def test_zero_formulas_match_the_paper() -> None:
    # ZeRO paper figure 1: Psi = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB per device.
    psi, nd = 7_500_000_000, 64
    totals = [sum(zero_per_device(psi, z, nd, 2, 2, 12)) / 1e9 for z in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert zero_per_device(psi, 1, nd, 2, 2, 12) == (2 * psi, 2 * psi, 12 * -(-psi // nd))
    assert zero_per_device(psi, 3, nd, 2, 2, 12) == tuple(b * -(-psi // nd) for b in (2, 2, 12))
    assert zero_per_device(10, 3, 3, 2, 2, 12) == (8, 8, 48)  # padded: ceil(10 / 3) = 4


def test_zero_in_a_plan() -> None:
    plan = plan_of("llama2_70b_2x8.mesh")  # ZeRO-1 over data = 2
    rep = analyze(plan)
    for rc in rep.ranks:
        assert rc.weight_bytes == 2 * rc.params_local
        assert rc.grad_bytes == 2 * rc.params_local
        # bf16 without `precision`: the runtime's AdamW moments are bf16 (2 x 2 bytes), no fp32 master.
        assert rc.optimizer_bytes == 4 * -(-rc.params_local // 2)


def test_bubble_formula() -> None:
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 22)
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    assert analyze(plan_of("seed_pipeline_12.mesh", "pipeline12")).bubble == pytest.approx(2 / 8)


@pytest.mark.parametrize(("schedule", "p", "m"), [("gpipe", 3, 6), ("gpipe", 4, 2), ("1f1b", 4, 8), ("1f1b", 2, 2)])
def test_simulated_schedule_has_the_formula_bubble(schedule: str, p: int, m: int) -> None:
    assert simulated_idle(schedule, p, m, 1) == pytest.approx(bubble_fraction(schedule, p, m))


def test_interleaving_shrinks_the_simulated_bubble() -> None:
    assert simulated_idle("interleaved_1f1b", 4, 8, 2) < simulated_idle("1f1b", 4, 8, 1)


def test_in_flight_microbatches() -> None:
    """The most (chunk) forwards a rank holds, from torch's order: the closed forms' totals."""
    def most(schedule: str, p: int, r: int, m: int, v: int) -> int:
        return max(sum(mo.held) for mo in rank_moments(schedule, p, v, m, r))

    assert [most("1f1b", 4, r, 8, 1) for r in range(4)] == [4, 3, 2, 1]  # min(m, p - r)
    assert most("gpipe", 4, 0, 8, 1) == 8
    # Interleaved: 2 (p - r - 1) + (v - 1) p + 1 chunk forwards = L (1 + (p - 1) / (p v)) layers' worth,
    # but not spread evenly: rank 0 holds 7 of stage 0 and 4 of stage 4 (tests/planner/test_schedule_order.py).
    assert [most("interleaved_1f1b", 4, r, 8, 2) for r in range(4)] == [6 + 4 + 1, 9, 7, 5]
    assert most("gpipe", 1, 0, 8, 1) == 1


def test_llama_block_activations_per_microbatch() -> None:
    """The saved tensors of one Llama block, counted by hand (no dropout, fused attention)."""
    plan = plan_of("tiny_llama.mesh")  # fp32, tensor 2, batch 8 / (data 2 x 2 microbatches) = 2 x seq 32
    rep = analyze(plan)
    e, n, h, f, t = 4, 2 * 32, 64, 128, 2
    hq, hk, d = 4 // t, 2 // t, 16
    block = (
        2 * (e * n * h + 4 * n)  # two RMSNorms: input + fp32 rstd
        + e * n * h + e * n * (hq + 2 * hk) * d + e * n * hq * d + 4 * n * hq  # attention
        + 2 * e * 32 * d  # rotary cos and sin, [s, 1, d] each
        + e * n * h + 4 * e * n * f // t  # SwiGLU MLP
    )
    first = 8 * n + 2 * block  # token ids + blocks 0-1
    last = 2 * block + (e * n * h + 4 * n) + e * n * h + 4 * n * 256 // t  # + final norm + head input + fp32 logits
    assert [rc.activation_bytes_per_microbatch for rc in rep.ranks] == [first, last]
    assert [rc.in_flight for rc in rep.ranks] == [2, 1]


def test_70b_per_layer_activations_match_korthikanti_without_dropout() -> None:
    # sbh (10 + 24 / t) with 16-bit activations, minus what Llama does not keep (dropout masks) and
    # what fused attention does not keep (s^2 terms), plus GQA's smaller k / v and SwiGLU's 4 x ffn.
    rep = analyze(plan_of("llama2_70b.mesh"))
    s, b, h, t = 4096, 2, 8192, 4
    per_layer = (rep.ranks[0].activation_bytes_per_microbatch - 8 * s * b) / 40
    korthikanti = s * b * h * (10 + 24 / t)
    assert 0.95 < per_layer / korthikanti < 1.1


def test_tensor_collectives_per_step() -> None:
    rep = analyze(plan_of("llama2_70b.mesh"))
    rc = rep.ranks[0]
    ar = next(c for c in rc.comms if c.kind == "tensor" and c.op == "all_reduce")
    # 40 blocks x (2 copy_to + 2 reduce_from) + the vocab-parallel embedding's all-reduce, per microbatch.
    assert ar.calls == (40 * 4 + 1) * 8
    act = 2 * 2 * 4096 * 8192
    assert ar.payload_bytes == ar.calls * act
    assert ar.wire_bytes == ar.calls * (2 * 3 * act // 4)
    assert not ar.crosses_hosts


def test_data_parallel_reduction_volume() -> None:
    rep = analyze(plan_of("llama2_7b.mesh"))  # data 2 x tensor 4, ZeRO-1: reduce-scatter + all-gather
    rc = rep.ranks[0]
    ops = {c.op: c for c in rc.comms if c.kind == "data"}
    assert set(ops) == {"reduce_scatter", "all_gather"}
    assert ops["reduce_scatter"].payload_bytes == 2 * rc.params_local
    assert ops["reduce_scatter"].wire_bytes == 2 * rc.params_local // 2


def test_step_time_parts() -> None:
    rep = analyze(plan_of("llama2_70b.mesh"))
    st = rep.step
    # The standard count (not 6 x all parameters): 6 (N - N_embedding) + 12 l h q t per token,
    # norm weights left out (not matmuls).
    n_matmul = 68_976_648_192 - 32000 * 8192 - 8192 * (2 * 80 + 1)
    assert st.model_flops == (6 * n_matmul + 12 * 80 * 64 * 128 * 4096) * 16 * 4096
    assert st.bubble_s == pytest.approx((st.compute_s + st.tensor_s + st.pipeline_s) * (2 - 1) / 8)
    assert st.total_s == pytest.approx(st.compute_s + st.tensor_s + st.pipeline_s + st.bubble_s + st.data_s)


def test_tied_head_holds_a_copy_of_the_embedding() -> None:
    rep = analyze(plan_of("seed_pipeline_12.mesh", "pipeline12"))
    assert [rc.params_global for rc in rep.ranks] == [s.numel for s in rep.plan.stages]
    assert any(c.kind == "tied" for c in rep.ranks[-1].comms)


def test_warnings() -> None:
    codes = {d.code for d in plan_warnings(analyze(plan_of("llama2_70b.mesh")))}
    assert "W0801" in codes  # 70B with full AdamW states does not fit 8 x 80 GB
    codes = {d.code for d in plan_warnings(analyze(plan_of("seed_pipeline_12.mesh", "pipeline12")))}
    assert {"W0805", "W0806"} <= codes
    # 64-wide layers on 2-way tensor parallelism: on a GPU communication dominates the step; on the
    # built-in cpu profile (host time per kernel, ranks sharing 2 cores) the collectives are 10 ms of
    # 370, so only the over-sharding (W0802) is left to say.
    codes = {d.code for d in plan_warnings(analyze(plan_of("tiny_llama.mesh"), PROFILES["h100"]))}
    assert {"W0802", "W0803"} <= codes
    codes = {d.code for d in plan_warnings(analyze(plan_of("tiny_llama.mesh")))}
    assert "W0802" in codes and "W0803" not in codes
    assert not plan_warnings(analyze(plan_of("llama2_7b.mesh")))


def test_tensor_axis_across_hosts_warns_with_its_cost() -> None:
    text = """
mesh two {
    axes tensor = 4, data = 2
    hosts = 2
    device = h100
}
model m = llama { vocab = 32000, hidden = 4096, layers = 4, heads = 32, ffn = 11008 }
plan p on two for m {
    batch = 8
    seq = 2048
    layout { batch -> data, heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""
    result = check_text(text)
    assert result.ok
    rep = analyze(result.plans["p"])
    assert any(c.crosses_hosts and c.kind == "tensor" for c in rep.ranks[0].comms)
    diags = [d for d in plan_warnings(rep) if d.code == "W0804"]
    assert len(diags) == 1 and diags[0].span is not None and diags[0].span.text.startswith("tensor")


def test_recompute_keeps_block_inputs_and_adds_forward_compute() -> None:
    """`recompute = blocks`: each block keeps its input only, one block's tensors are rebuilt at a time,
    and the step does the blocks' forward again; `attention` drops the core's fp32 log-sum-exp."""
    text = (EXAMPLES / "tiny_llama.mesh").read_text()
    base = analyze(plan_of("tiny_llama.mesh"))
    e, n, h, f, t = 4, 2 * 32, 64, 128, 2
    hq, hk, d = 4 // t, 2 // t, 16
    block = (2 * (e * n * h + 4 * n) + e * n * h + e * n * (hq + 2 * hk) * d + e * n * hq * d + 4 * n * hq
             + 2 * e * 32 * d + e * n * h + 4 * e * n * f // t)
    for mode in ("blocks", "attention"):
        result = check_text(text.replace("    batch = 8", f"    batch = 8\n    recompute = {mode}"), "t.mesh")
        assert result.ok, [d.message for d in result.errors]
        rep = analyze(next(iter(result.plans.values())))
        for before, after in zip(base.ranks, rep.ranks):
            if mode == "attention":
                assert before.activation_bytes_per_microbatch - after.activation_bytes_per_microbatch == 2 * 4 * n * (4 // 2)
            else:
                assert after.transient_bytes == before.transient_bytes + block
                assert after.activation_bytes_per_microbatch == before.activation_bytes_per_microbatch - 2 * block + 2 * e * n * h
            assert after.recompute_s > 0 and after.compute_s == pytest.approx(before.compute_s + after.recompute_s)


def test_70b_trains_on_64_h100s() -> None:
    """The seed's model, trained for real: examples/llama2_70b_train.mesh fits in 80 GiB per H100 at a
    global batch of 256 sequences of 4096, with 18 bytes per parameter (fp32 master weights) sharded by
    ZeRO-3 and activations cut by sequence parallelism; without SP and ZeRO-3 the same plan needs more memory."""
    result = check_file(EXAMPLES / "llama2_70b_train.mesh")
    assert result.ok, [d.message for d in result.errors]
    plan = result.plans["train_64"]
    assert (plan.mesh.devices, plan.batch, plan.seq) == (64, 256, 4096)
    assert (plan.zero, plan.master_dtype, plan.roles.sequence) == (3, "fp32", ("tensor",))
    rep = analyze(plan, PROFILES["h100"])
    assert rep.fits and rep.peak_training_bytes <= 80 * 2**30
    assert "18 bytes per parameter" in report_text(rep)
    plain = analyze(attrs.evolve(plan, zero=1, roles=attrs.evolve(plan.roles, sequence=()), master_dtype=None, reduce_dtype=None), PROFILES["h100"])
    assert plain.peak_training_bytes > rep.peak_training_bytes


def test_texts_name_only_what_the_plan_has() -> None:
    """W0803's help names the collectives the step has (a data-parallel plan is not told to use fewer
    tensor-parallel devices), and parameters ZeRO 3 shards are not called whole copies."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.planner.report import report_text

    text = """
mesh dp {
    axes data = 64
    hosts = 8
    device = h100
}
model m = llama { vocab = 256, hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 128 }
plan p on dp for m {
    batch = 64
    seq = 16
    layout { batch -> data }
    optimizer adamw { zero 3 over data }
}
"""
    result = check_text(text)
    assert result.ok, result.diagnostics
    report = analyze(result.plans["p"])
    (w,) = [d for d in plan_warnings(report) if d.code == "W0803"]
    assert "tensor" not in (w.help or "") and "data replica" in (w.help or "")
    out = report_text(report)
    assert "whole copies" not in out and "ZeRO-3 shards them over data" in out
    tiny = [d for d in plan_warnings(analyze(plan_of("tiny_llama.mesh"), PROFILES["h100"])) if d.code == "W0803"]
    assert tiny and "tensor-parallel" in (tiny[0].help or "")
