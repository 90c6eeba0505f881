"""The static planner: memory per device, communication per step, pipeline bubble and step time.

Everything here is computed from the checker's results (ir.PlanIR): the parameters of every layer with
their global shapes, each layer's placement, the stage map and the collectives each unit issues
(UnitFlow). Nothing is re-derived from the syntax tree, and nothing imports torch.

Model of a training step, per device ("rank class" = one pipeline coordinate: every tensor and data
rank at that coordinate holds the same amount, since the checker guarantees whole-unit shards):

  memory   = weights + gradients + optimizer states (ZeRO over the plan's zero axes)
             + activations of the microbatches in flight under the schedule
             + transients at the peak (stage outputs the pipeline keeps, one unit's backward
               gradients); checked against the runtime by bench/activation_memory.py
  time     = (compute + exposed tensor / pipeline communication) x (1 + bubble)
             + data-parallel gradient reduction
  compute  = per microbatch, each unit's forward x 3 (backward is twice the forward), plus what
             `recompute` runs again: every matmul (primitives' Work) on a roofline, the slower of
             its flops at the device's matmul rate (less a last wave's idle SMs) and its bytes
             through memory; lookups and elementwise work as memory traffic; a float8 layer's
             products at the recipe's peak and its casts as memory traffic, a compiled block's
             products faster and its elementwise work fused (planner/float8.py)
  MFU      = the standard 6 (N - N_embedding) + 12 l h q t flops per token (model_flops_per_token)
             over the step time and the devices' peak

The steps live in modules of their own (planner/memory.py, comm.py, time.py; what they share in
rank.py, units.py and formulas.py), the report in report.py, the warnings in warnings.py; this module
holds STEPS and `analyze`. The constants (MFU in parallel/costs.py, collective latencies in comm.py,
kernel counts and memory passes in time.py) are module-level names so a reader can see and change
every assumption; the GPU profiles' fitted figures and their sources are in devices.py.
"""

from __future__ import annotations

from collections.abc import Callable

from meshllm_dsl.ir import PlanIR
from meshllm_dsl.parallel.devices import DEFAULT_PROFILE, PROFILES, DeviceProfile, assumed_hosts
from meshllm_dsl.planner.comm import communication
from meshllm_dsl.planner.formatting import fmt_bytes, fmt_seconds
from meshllm_dsl.planner.formulas import kv_bytes_per_token
from meshllm_dsl.planner.memory import activations, kv_cache, parameters, peak, states
from meshllm_dsl.planner.rank import Rank, Setup, rank_class, rank_drafts, setup_of
from meshllm_dsl.planner.records import PlanReport
from meshllm_dsl.planner.report import expert_layer_comm, report_json, report_text
from meshllm_dsl.planner.time import compute, model_flops_per_token, step_time
from meshllm_dsl.planner.warnings import plan_warnings

# Kept importable from here for `from meshllm_dsl.planner import analyze as planner` users
# (tests/moe's planner.<name>) and interop/import_hf.py; everything else imports the module named.
__all__ = [
    "STEPS", "PlanReport", "Rank", "Setup", "analyze", "expert_layer_comm", "fmt_bytes", "fmt_seconds",
    "model_flops_per_token", "plan_warnings", "report_json", "report_text", "resolve_device",
]


def resolve_device(plan: PlanIR, extra: dict[str, DeviceProfile] | None = None,
                   override: str | None = None) -> tuple[DeviceProfile, bool]:
    profiles = {**PROFILES, **(extra or {})}
    name = override or plan.mesh.device
    if name is None:
        return profiles[DEFAULT_PROFILE], True
    return profiles[name], False


# ---------------------------------------------------------------- the analysis, step by step
#
# `analyze` runs STEPS once per rank class (pipeline coordinate), in order: each step reads the
# plan's Setup and what the steps before it added to the Rank, and adds its own record. Then
# `rank_class` makes the report's row of each, and `step_time` the step from the slowest of them.
#
# Per rank class, in order (each reads what those before it added to the Rank):
#   parameters     what each device holds before ZeRO, per stage and in all
#   kv_cache       inference's KV cache at the plan's batch and seq
#   activations    what a microbatch saves for backward, and a backward's rise above it
#   states         weights, gradients and optimizer states after ZeRO (reads parameters)
#   peak           the step's peak in the schedule's order (reads activations, states)
#   communication  every collective of the step (reads parameters)
#   compute        compute, kernels and host time (reads parameters, states, communication)
STEPS: tuple[Callable[[Setup, Rank], Rank], ...] = (parameters, kv_cache, activations, states, peak, communication, compute)


def analyze(plan: PlanIR, device: DeviceProfile | None = None, *, device_assumed: bool = False,
            flash_attention: bool = True) -> PlanReport:
    """Memory, communication and time of one training step of `plan` on `device`: STEPS for each
    rank class, then the step's time from the slowest of them."""
    if device is None:
        device, device_assumed = resolve_device(plan)
    hosts_assumed = assumed_hosts(plan.mesh, device) != plan.mesh
    setup = setup_of(plan, device, flash_attention)
    classes = []
    for rank in rank_drafts(setup):
        for step in STEPS:
            rank = step(setup, rank)
        classes.append(rank_class(setup, rank))
    bubble, step = step_time(setup, classes)
    return PlanReport(setup.plan, device, device_assumed, setup.micro_batch, bubble, tuple(classes), step,
                      kv_bytes_per_token(setup.plan), setup.optimizer_k, hosts_assumed, flash_attention)

