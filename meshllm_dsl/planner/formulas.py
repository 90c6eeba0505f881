"""The planner's closed forms, each a figure of a whole plan or step from its sizes alone: ZeRO's and
FSDP2's bytes per device (optimizer_bytes_per_param, zero_per_device, fsdp_per_device,
fsdp_gather_bytes), the pipeline bubble (bubble_fraction and the report's formula of it), a pipeline
stage's action string and the FSDP2 collectives it implies, and the KV cache (inference's, and context
parallelism's gathered keys / values per layer). Nothing here reads a Setup or a Rank.
"""

from __future__ import annotations

from meshllm_dsl import primitives
from meshllm_dsl.ir import (
    DTYPES,
    FP8_BYTES,
    SPLIT_BACKWARD,
    PlanIR,
    Repeat,
    placement_of,
    stage_coord,
)
from meshllm_dsl.parallel.costs import FP32, HeldUnit
from meshllm_dsl.planner.schedule import rank_order, schedule_cost

# Optimizer state bytes per parameter, beyond the weights and gradients in the training dtype.
# Adam(W) in mixed precision (Rajbhandari et al. 2020, "ZeRO", section 3.1): fp32 master weights,
# fp32 momentum and fp32 variance = K = 12 bytes, so 2 + 2 + 12 = 16 bytes per parameter.
# In fp32 the weights are their own master copy: m and v only, K = 8 (4 + 4 + 8 = 16 again).


def optimizer_bytes_per_param(optimizer: str, dtype: str) -> int:
    """ZeRO's K: bytes of optimizer state per parameter (excludes the weight and its gradient)."""
    width = DTYPES[dtype]
    master = FP32 if width < FP32 else 0  # mixed precision keeps an fp32 copy of every weight
    moments = 2 * max(width, FP32) if optimizer in ("adam", "adamw") else 0  # m and v, at least fp32
    return master + moments


def zero_per_device(params: int, zero: int, shards: int, weight_bytes: int, grad_bytes: int,
                    k: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per device under ZeRO stage `zero` over `shards`.

    ZeRO paper, figure 1, with Psi parameters on the device and N_d = shards:
      stage 0: (2 + 2 + K) Psi     stage 1: 2 Psi + 2 Psi + K Psi / N_d
      stage 2: 2 Psi + (2 + K) Psi / N_d     stage 3: (2 + 2 + K) Psi / N_d
    A sharded buffer is padded to a multiple of N_d (as DeepSpeed and FSDP pad the flat buffer), so
    the per-device share is ceil(Psi / N_d).
    """
    part = -(-params // shards) if shards > 1 else params
    w = weight_bytes * (part if zero >= 3 else params)
    g = grad_bytes * (part if zero >= 2 else params)
    o = k * (part if zero >= 1 else params)
    return w, g, o


def fsdp_per_device(params: int, shards: int, master_bytes: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per device at rest under ZeRO 2 / 3 as the runtime
    runs them (FSDP2): every parameter is stored sharded over the data ranks in the master dtype
    (the plan's dtype without `precision`), its gradient too, and AdamW's two moments are shaped
    like it. With `precision { params = bf16, master = fp32 }` that is 4 + 4 + 8 bytes per parameter
    / N_d, plus the bf16 compute copy FSDP2 all-gathers (``fsdp_gather_bytes``): 18 in all.
    FSDP2 chunks each parameter along dim 0, so the share is Psi / N_d when those dims divide.
    """
    part = -(-params // shards) if shards > 1 else params
    return master_bytes * part, master_bytes * part, 2 * master_bytes * part


def fsdp_gather_bytes(zero: int, compute_bytes: int, local: int, top: int, largest_block: int,
                      float8: int = 0, block_float8: int = 0) -> int:
    """The compute-dtype copy FSDP2 all-gathers at the peak: ZeRO-2 (and ZeRO-1 with master weights)
    keeps every unit gathered from its forward to its backward (all ``local`` parameters); ZeRO-3 frees each block after its forward,
    so the stage root (``top``: embedding, final norm, head, kept for backward) and two blocks (the
    one running and the one prefetched) are gathered at once (no more than the stage has).
    `all_gather = fp8`: of those, ``float8`` (of a block ``block_float8``; the root has none: the
    head stays in the params dtype) are gathered in float8, FP8_BYTES each."""
    narrow = compute_bytes - FP8_BYTES
    if zero in (1, 2):
        return compute_bytes * local - narrow * float8
    if local <= top + 2 * largest_block:
        return compute_bytes * local - narrow * float8
    return compute_bytes * (top + 2 * largest_block) - narrow * 2 * block_float8


# The schedules whose bubble has the closed form below; the others' comes from their simulated order.
CLOSED_FORM_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of a pipelined step: (p - 1) / (m + p - 1), divided by v when interleaved.

    GPipe and 1F1B have the same bubble (1F1B only lowers the activation memory); interleaving v
    virtual stages per rank shrinks it v-fold (Narayanan et al. 2021, section 2.2). Looped BFS and
    the zero-bubble schedules have no closed form that holds over torch's orders (their idle time
    is measured in planner/schedule.py's IDLE_NOTES): theirs is the simulated order's.
    """
    if stages <= 1:
        return 0.0
    if schedule not in CLOSED_FORM_SCHEDULES:
        return schedule_cost(schedule, stages, virtual, microbatches).bubble
    frac = (stages - 1) / (microbatches + stages - 1)
    return frac / virtual if schedule == "interleaved_1f1b" else frac


def stage_actions(schedule: str, stages: int, index: int, microbatches: int, pipeline: int | None = None) -> str:
    """The order in which pipeline stage `index` of `stages` (on `pipeline` ranks, one stage each
    when not given) runs its microbatches' forwards (F), backwards (B) and, split, input (I) and
    weight (W) backwards: torch's own, from planner/schedule.rank_order (GPipe: every forward, then
    every backward; 1F1B: min(m, n - i) forwards, then alternating, then the drain; interleaved:
    whole rounds of one chunk, so a rank's first chunk runs FFBB where 1F1B would run FBFB). The
    stage sits on the rank its schedule's placement puts it (a V for zbv / dualpipev)."""
    p = pipeline or stages
    order = rank_order(schedule, p, stages // p, microbatches, stage_coord(index, p, placement_of(schedule)))
    return "".join(a[0] for a in order if a is not None and a[1] == index)


def fsdp_unit_collectives(zero: int, actions: str | None, microbatches: int, defer: bool = False) -> tuple[int, int]:
    """All-gathers and reduce-scatters FSDP2 runs per unit (a block, or a stage's root) in a step.

    Without a pipeline the runtime's microbatch loop runs forward and backward per microbatch, and
    FSDP2 gathers for each forward, again for each backward with ZeRO-3 (reshard after forward), and
    reduce-scatters after each backward. Under a pipeline schedule (`actions`), torch's PipelineStage
    keeps units gathered after every backward but the last and reduce-scatters once; a forward
    gathers only what ZeRO-3's reshard-after-forward released. ZeRO 1 with master weights (``defer``)
    does the same in the runtime's own loop: once a step. Counted on gloo ranks:
    tests/planner/test_time_model.py, tests/integration/test_distributed_optimizer.py."""
    if actions is None and defer:
        return 1, 1
    if actions is None:
        return (2 if zero >= 3 else 1) * microbatches, microbatches
    gathers, gathered = 0, False
    # The step's last weight gradient (a B, or a split backward's W) is what the reduce-scatter waits for.
    last = max(actions.rfind("B"), actions.rfind("W"))
    for i, action in enumerate(actions):
        if not gathered:
            gathers += 1
            gathered = True
        if action == "F":
            gathered = zero < 3
        elif i == last:
            gathered = False
    return gathers, 1


def kv_bytes_per_token(plan: PlanIR) -> int:
    """KV cache bytes per token for the whole model in the plan's dtype (every attention unit)."""
    total = 0
    for item in plan.model.items:
        units = item.body if isinstance(item, Repeat) else (item,)
        count = item.count if isinstance(item, Repeat) else 1
        for u in units:
            if primitives.of(u).caches_kv:
                total += count * primitives.of(u).cached_values(u) * DTYPES[plan.dtype]
    return total


def kv_cache_bytes(plan: PlanIR, seq: int) -> int:
    """KV cache bytes of one sequence of `seq` positions, whole model, in the plan's dtype: a
    sliding-window layer holds no more than its window, the others every position."""
    total = 0
    for item in plan.model.items:
        units = item.body if isinstance(item, Repeat) else (item,)
        indices = range(item.count) if isinstance(item, Repeat) else range(1)
        for u in units:
            if primitives.of(u).caches_kv:
                positions = sum(primitives.of(u).cached_positions(u, i, seq) for i in indices)
                total += primitives.of(u).cached_values(u) * DTYPES[plan.dtype] * positions
    return total


def kv_gather_bytes_per_layer(plan: PlanIR) -> int:
    """Context parallelism: bytes one attention layer's K / V all-gather hands over per microbatch,
    the whole sequence's (attention: [mb, s, kv_heads / t, head_dim] each of k and v; mla: its normed
    latent and rotary key, [mb, s, kv_lora_rank + qk_rope_head_dim]; each rank sends its s / c)."""
    if plan.context_size == 1:
        return 0
    micro = plan.batch // (plan.data_size * plan.microbatches)
    for rep in plan.model.repeats:
        for u in rep.body:
            if primitives.of(u).caches_kv:
                hu = HeldUnit(u, f"{rep.name}.0.", 1, plan.block_class(rep.name, 0).placements, None)
                return micro * plan.seq * primitives.of(u).gathered_values(plan, hu) * DTYPES[plan.dtype]
    return 0


def bubble_formula(plan: PlanIR, bubble: float) -> str:
    """How `plan report` explains the bubble: the closed form, and where torch's order (which the
    number comes from) differs from it, the closed form's value as the reference. The schedules
    without a closed form say the order's unit costs instead."""
    p, m, v = plan.pipeline_size, plan.microbatches, plan.virtual
    if plan.schedule not in CLOSED_FORM_SCHEDULES:
        split = " (forward = input backward = weight backward, full backward = 2 x forward)" if plan.schedule in SPLIT_BACKWARD else (
            " (backward = 2 x forward)")
        return f" in torch's {plan.schedule} order with p = {p}, m = {m}, v = {v}" + split
    closed = bubble_fraction(plan.schedule, p, m, v)
    formula = f"(p - 1) / (m + p - 1){' / v' if v > 1 else ''} with p = {p}, m = {m}" + (f", v = {v}" if v > 1 else "")
    if abs(closed - bubble) < 5e-4:
        return f" = {formula}"
    return f" in torch's {plan.schedule} order (the closed form {formula} gives {closed:.1%})"
