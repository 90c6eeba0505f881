"""Time: kernels per unit (host time), each unit's forward on a roofline, the model's flops per
token, the `compute` step of the analysis (planner/analyze.py's STEPS), and the step's time from every
rank class (step_time: the pipeline bubble, the exposed data-parallel collectives, hosts' shared cores).
The constants of the time model (kernel counts, the forward's kernel share, elementwise passes) are
module-level names here.
"""

from __future__ import annotations

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.ir import Collective, PlanIR, Repeat, Unit
from meshllm_dsl.parallel import layouts
from meshllm_dsl.parallel.collectives import spec
from meshllm_dsl.parallel.costs import HeldUnit, Work
from meshllm_dsl.parallel.devices import COMPILED_ELEMENTWISE_PASSES, DeviceProfile
from meshllm_dsl.parallel.placements import runs_fsdp
from meshllm_dsl.planner.float8 import cast_seconds, compiled, product_seconds
from meshllm_dsl.planner.rank import Rank, Setup, Time, recomputes_core, running_units
from meshllm_dsl.planner.recompute import core_rerun_seconds, recomputed_copies, rerun_seconds
from meshllm_dsl.planner.records import RankClass, StepTime
from meshllm_dsl.planner.schedule import schedule_cost

# ---------------------------------------------------------------- assumptions


# Of a unit's kernels, the share its forward launches (what `recompute = blocks` runs again):
# 756 of 1782 in a single-rank tiny Llama step, counted with runtime.profile.LiveBytes.
FORWARD_KERNEL_SHARE = 0.42

# What is not a matmul (norms, activations, rotary, residual adds, softmax without a fused kernel,
# the casts around them) is bound by memory bandwidth: a unit's forward moves the tensors it
# produces (its saved bytes, unit_activation_bytes) this many times through device memory, and its
# backward twice as many, like its matmuls. Fitted with the devices' matmul efficiencies
# (devices.A100_MATMUL, H100_MATMUL) to ../shared/calibration/published.md; nominally 2 (each
# tensor written once and read once), eager PyTorch moves more (upcasts, copies, masks).
ELEMENTWISE_PASSES = 5.0


# ---------------------------------------------------------------- kernels (host time)

# Framework kernels (operators dispatched, views included) the runtime launches per microbatch,
# forward + backward, by piece of a unit; counted with runtime.profile.LiveBytes on the runtime's own
# layers (tests/planner/test_time_model.py checks whole steps against the count). On a host whose
# cores run the model (CPU ranks), each kernel costs its dispatch, autograd and Python time whatever
# its size, which is what small models spend their step on; `device { kernel = US }` prices them.
# A collective's own count is its record's (meshllm_dsl/parallel/collectives.py).
KERNELS = {
    "linear": 13,  # forward t, mm, view; backward two mm with their transposes, the grad accumulation
    "bias": 3,  # the add; backward its reduction over tokens and the accumulation
    "split_qkv": 2,  # a fused qkv projection split into q, k and v
    "heads": 2,  # q, k or v viewed as heads, and back in backward
    "rotary": 29,  # positions, cos / sin, x cos + roll(x) sin of q and k (one Function), forward and backward
    "attention_core": 14,  # SDPA with its layout transposes, forward and backward
    "residual": 1,  # the residual add (its backward passes the gradient through)
    "rmsnorm": 21,  # the runtime's autograd Function: 7 forward, 14 backward
    "layernorm": 5,  # one fused kernel forward, its backward and the accumulations
    "swiglu": 6,  # silu(gate) * up
    "activation": 2,  # gelu / relu / silu of a plain MLP
    "embedding": 3,
    "vocab_parallel_embedding": 11,  # mask the ids outside the shard, look up, zero the masked rows
    "positional": 7,  # position ids, lookup, add
    "cross_entropy": 10,
    "vocab_parallel_cross_entropy": 44,  # each shard's log-sum-exp and target logit, one all-gather, combined
    # moe (primitives/moe.py; 1 to 4 ranks, 4 and 8 experts): the router linear is a "linear"
    "moe_routing": 20,  # fp32 softmax, top-k, renormalised; the rows sorted by expert, the combine's index_add
    "expert": 56,  # per expert with rows: its rows gathered, three matmuls, SwiGLU, weighted
    # expert parallelism (runtime/moe/dispatch.py): the counts exchanged, dispatch and combine
    # all-to-alls and their permutations; per local expert its matmuls and SwiGLU (rows gathered
    # once for all), and per (source rank, local expert) a piece of the expert-major permutation
    "expert_dispatch": 20,
    "expert_parallel_expert": 40,
    "expert_dispatch_piece": 10,
    # the grouped path (runtime/moe/grouped.py: one torch._grouped_mm per projection for every local
    # expert at once): the rows gathered, the offsets, three grouped matmuls, SwiGLU, weighted, forward
    # and backward, whatever the experts (fitted to `meshc run --profile` of tests/planner/test_time_model.py's
    # moe plans: 655 and 848 kernels a step, planned 655 and 849)
    "experts_grouped": 47,
    "expert_parallel_grouped": 44,
}
# Per parameter tensor and step: zero its gradient; AdamW's update (torch's fused kernel); on
# data-parallel ranks its share of the flattened all-reduce.
KERNELS_ZERO_GRAD = 1
KERNELS_ADAMW = 1  # fused AdamW (runtime/train/program.py): one kernel per tensor
KERNELS_GRAD_SYNC = 4
# Per FSDP2 all-gather or reduce-scatter of a unit: its copy-in / copy-out, casts and views (24 per
# event on a 4-block Llama over data 2, ZeRO-3, microbatches 1 vs 2; 22 with ZeRO-2); FSDP2 then
# needs no flattened gradient all-reduce (KERNELS_GRAD_SYNC).
KERNELS_FSDP = 24
# Per pipeline action (a stage's forward or backward of a microbatch) of an FSDP2 stage root: its
# hooks' casts and views, whatever the root holds (7-12 measured on 1F1B and interleaved stages,
# pipeline 2 and 4).
KERNELS_FSDP_ACTION = 9
# Per step: the microbatch losses stacked and averaged, the global loss reduced, the schedule's
# bookkeeping (19 in a single-rank step, 23-33 on pipelined ranks).
KERNELS_STEP = 20


def _fused_saving(unit: Unit, c: Collective) -> int:
    """Kernels a fused call (collectives.Fused, e.g. `rt.copy_to_linear`) saves against collective
    `c` then the column layers one by one. Codegen fuses `c` with the column layers that follow it,
    unless no fused call can take the layer (layouts.tied_head_with_own_bias)."""
    fused = spec(c.op).fused
    if c.where != "input" or fused is None or fused.kernels_saved is None or layouts.tied_head_with_own_bias(unit):
        return 0
    columns = [leaf for leaf in unit.leaves if primitives.of_leaf(leaf) is primitives.linear.LINEAR]
    if primitives.of(unit).sublayer:
        columns = columns[:-1]  # the row layer that closes the unit runs after
    biased = sum(1 for leaf in columns if any(t.name == "bias" for t in leaf.params))
    return fused.kernels_saved(len(columns), biased)


def unit_kernels(plan: PlanIR, hu: HeldUnit) -> int:
    """Kernels one copy of the unit launches per microbatch, forward and backward."""
    unit, k = hu.unit, KERNELS
    linears = [leaf for leaf in unit.leaves if primitives.of_leaf(leaf) is primitives.linear.LINEAR]
    biases = sum(1 for leaf in linears if any(t.name == "bias" for t in leaf.params))
    n = primitives.of(unit).kernels(plan, hu, k, len(linears) * k["linear"] + biases * k["bias"])
    if hu.flow is not None:
        n += sum(spec(c.op).kernels - _fused_saving(unit, c) for c in hu.flow.collectives)
    if hu.last:
        n += k["vocab_parallel_cross_entropy" if plan.roles.loss_parallel else "cross_entropy"]
    return n


# ---------------------------------------------------------------- compute time (a roofline per matmul)




@attrs.frozen
class UnitTime:
    forward_s: float  # one copy's forward for one microbatch
    core_s: float  # of which the attention core's products (what `recompute = attention` reruns)
    cast_s: float = 0.0  # one copy's float8 casts per microbatch, forward and backward (planner/float8.py)


def elementwise_passes(plan: PlanIR, device: DeviceProfile, hu: HeldUnit) -> float:
    """How many times a unit's non-matmul work moves the tensors it produces: fewer in a compiled block."""
    return COMPILED_ELEMENTWISE_PASSES if compiled(plan, device, hu) else ELEMENTWISE_PASSES


def unit_forward_time(plan: PlanIR, device: DeviceProfile, hu: HeldUnit, tokens: int, seq: int, micro: int,
                      flash_attention: bool = True) -> UnitTime:
    """A unit's forward on one device: its matmuls (product_seconds: the params dtype's or a float8
    recipe's roofline), its lookups and the memory traffic of what it computes without a matmul,
    elementwise_passes over the tensors it produces; and apart, its float8 casts."""
    record = primitives.of(hu.unit)
    work: Work = record.work(plan, hu, tokens, seq, micro, flash_attention)
    times = [product_seconds(plan, device, hu, mm) for mm in work.matmuls]
    memory = 0.0
    if device.hbm_gbps:
        produced = record.saved_bytes(plan, hu, tokens, tokens // plan.sequence_size, seq, micro, flash_attention)
        memory = (work.lookup_bytes + elementwise_passes(plan, device, hu) * produced) / (device.hbm_gbps * 1e9)
    core = sum(t for t, mm in zip(times, work.matmuls) if mm.core)
    casts = sum(cast_seconds(plan, device, hu, mm) for mm in work.matmuls)
    return UnitTime(sum(times) + memory, core, casts)


def model_flops_per_token(plan: PlanIR) -> float:
    """Training flops per token by the standard count: 6 (N - N_embedding) + 12 l h q t (PaLM,
    Chowdhery et al. 2022, appendix B; torchtitan's get_num_flop_per_token; Megatron's
    96 B s l h^2 (1 + s / 6h + V / 16 l h) with its recomputation taken out), three times the
    forward's matrix products of the whole model: every linear layer's 2 flops per weight and
    token (a tied head's too, as Megatron counts its logit layer), the attention core's 4 s d per
    head and token over every key position, with no halving for the causal mask. Lookups (the
    embedding, positions) are not matmuls; biases and norm weights, which 6 N includes, are a few
    in ten thousand of N and are not counted. Recomputation is not counted either: MFU by this
    convention compares with torchtitan's and PaLM's."""
    seq, total = plan.seq, 0
    for item in plan.model.items:
        units, count = (item.body, item.count) if isinstance(item, Repeat) else ((item,), 1)
        for unit in units:
            whole = HeldUnit(unit, "", 1, (), None)  # unsharded: the whole layer's products
            work = primitives.of(unit).work(plan, whole, seq, seq, 1, True)
            total += count * sum(mm.flops for mm in work.matmuls)
    return 3 * total / seq


def compute(setup: Setup, rank: Rank) -> Rank:
    """Adds `time`: the device's compute, kernels and host time in the step, from its units, `params`,
    `states` and `traffic`.

    Compute: every microbatch's forward, and its backward at twice the forward (the gradients
    of both operands of every product: 6 flops per parameter and token in all), the forwards
    `recompute` runs again, and the optimizer step reading and writing its states once.
    Kernels: every microbatch's forward and backward, then per parameter tensor the gradient
    zeroing, the data-parallel sync and AdamW's update (of this rank's share under ZeRO).
    ZeRO-1 (ZeroRedundancyOptimizer) updates whole tensors, a share of them per rank; FSDP2's
    optimizer updates every tensor's local shard."""
    plan, device, m = setup.plan, setup.device, setup.plan.microbatches
    forward_s, rerun_s, kernels_mb, rerun_kernels, cast_s = _forward_time(setup, rank)
    st, tensors, events = rank.states, rank.params.tensors, rank.traffic.fsdp_events
    compute_s = (3 * forward_s + rerun_s + cast_s) * m
    if device.hbm_gbps:
        compute_s += 2 * (st.weights + st.grads + st.optimizer) / (device.hbm_gbps * 1e9)
    optim_tensors = -(-tensors // plan.zero_size) if plan.zero == 1 and not setup.fsdp else tensors
    actions = 2 * m * len(rank.stages) if plan.pipeline_size > 1 else 0  # stage forwards and backwards
    kernels = ((kernels_mb + rerun_kernels) * m + KERNELS_STEP + tensors * KERNELS_ZERO_GRAD
               + (tensors * KERNELS_GRAD_SYNC if setup.replicas > 1 and not setup.fsdp else 0) + events * KERNELS_FSDP
               + (actions * KERNELS_FSDP_ACTION if events else 0) + optim_tensors * KERNELS_ADAMW)
    kernel_s = kernels * (device.kernel_us or 0.0) * 1e-6
    recompute_s = rerun_s * m + rerun_kernels * m * (device.kernel_us or 0.0) * 1e-6
    # The framework's Python beyond its kernels: the schedule's per-action work (p2p set-up,
    # stage bookkeeping, its backward call) and FSDP2's hooks around each collective.
    framework_s = (actions * (device.stage_cpu_us or 0.0) + events * (device.fsdp_cpu_us or 0.0)) * 1e-6
    compute_s += kernel_s + framework_s
    host_s = compute_s + sum(c.calls * (device.collective_cpu_us or 0.0) * 1e-6 for c in rank.traffic.comms)
    return attrs.evolve(rank, time=Time(compute_s, recompute_s, kernels, kernel_s, host_s))


def _forward_time(setup: Setup, rank: Rank) -> tuple[float, float, int, int, float]:
    """One microbatch's forward on the rank (matmuls, lookups, memory traffic) and its kernels, with
    what backward runs of them again under `recompute`, and its float8 casts (forward and backward):
    (forward s, rerun s, kernels, rerun kernels, cast s)."""
    plan, device, tokens, seq, micro, flash = (setup.plan, setup.device, setup.tokens, setup.plan.seq,
                                               setup.micro_batch, setup.flash_attention)
    forward_s = rerun_s = cast_s = 0.0
    kernels = rerun_kernels = 0
    for hu in running_units(rank):
        unit_kernels_n = unit_kernels(plan, hu)
        kernels += unit_kernels_n * hu.count
        unit_time = unit_forward_time(plan, device, hu, tokens, seq, micro, flash)
        forward_s += hu.count * unit_time.forward_s
        cast_s += hu.count * unit_time.cast_s
        rc = recomputed_copies(plan, hu)  # `blocks` / `ops` [every N]: copies rerun in backward
        if rc:
            rerun_s += rc * rerun_seconds(plan, device, hu, unit_time.forward_s, tokens, seq, micro, flash)
            rerun_kernels += round(FORWARD_KERNEL_SHARE * unit_kernels_n) * rc
        elif recomputes_core(plan, hu):
            # the core's forward again, with what its region reruns before it (mla: kv_b)
            core_s, products = core_rerun_seconds(plan, device, hu, unit_time.core_s, tokens, seq, micro, flash)
            rerun_s += hu.count * core_s
            rerun_kernels += (KERNELS["attention_core"] // 2 + products) * hu.count
    return forward_s, rerun_s, kernels, rerun_kernels, cast_s


def _busy_s(rc: RankClass) -> float:
    """A rank's work per step that the pipeline bubble stretches: compute, and the collectives inside it and its sends."""
    return rc.compute_s + rc.comm_seconds(("tensor", "expert", "loss", "pipeline", "tied"))


def step_time(setup: Setup, classes: list[RankClass]) -> tuple[float, StepTime]:
    """The pipeline bubble and the step's time, from every rank class.

    The bubble of torch's own action order, simulated with unit-cost forwards and backwards of
    twice that (split into input and weight backwards of one unit each for the zero-bubble
    schedules); bubble_fraction's closed form is printed beside it as the reference. They agree for
    GPipe and 1F1B; for interleaved the closed form divides the fraction, not the idle time, by v.
    The step is the order's makespan in those units: busy x (1 + idle / busy), busy being every
    rank's m v (F + I + W) (schedule_cost takes v, and the V placement, from the schedule).
    The pipeline advances at the pace of its slowest rank; its per-microbatch work (compute plus
    the tensor collectives inside it plus its sends) is what the bubble stretches: the bubble is
    (p - 1) / (v m) of the busy time. The data-parallel reduction runs once after the last
    backward; we assume no overlap (torch's explicit post-backward reduction, and an upper bound)."""
    plan, device, p_size = setup.plan, setup.device, setup.plan.pipeline_size
    order = schedule_cost(plan.schedule, p_size, plan.virtual, plan.microbatches) if p_size > 1 else None
    slow = max(classes, key=_busy_s)
    scale = order.bubble_over_busy if order else 0.0  # (p - 1) / (v m) when m is a multiple of p
    step = StepTime(
        compute_s=slow.compute_s,
        tensor_s=slow.comm_seconds(("tensor", "loss")),
        expert_s=slow.comm_seconds(("expert",)),
        pipeline_s=slow.comm_seconds(("pipeline", "tied")),
        bubble_s=_busy_s(slow) * scale,
        data_s=max(exposed_data_seconds(plan, device, rc) for rc in classes),
        model_flops=model_flops_per_token(plan) * plan.batch * plan.seq,
        tokens=plan.batch * plan.seq,
        shared_s=shared_host_seconds(plan, device, classes, scale),
        context_s=slow.comm_seconds(("context",)),
    )
    return (order.bubble if order else 0.0), step


def exposed_data_seconds(plan: PlanIR, device: DeviceProfile, rc: RankClass) -> float:
    """The data-parallel collectives' time on the step's critical path. The gradient all-reduce (and
    ZeRO-1's reduce-scatter / all-gather) runs after the last backward: all of it. FSDP2's
    collectives run unit by unit during forward and backward; on a GPU they go on their own stream
    and FSDP2 prefetches the next unit's gather (torchtitan relies on this), so only what exceeds the
    rank's compute is exposed. Host-bound ranks (a device with `kernel`) overlap nothing."""
    data = rc.comm_seconds(("data",))
    return max(0.0, data - rc.compute_s) if fsdp_overlaps_compute(plan, device) else data


def fsdp_overlaps_compute(plan: PlanIR, device: DeviceProfile) -> bool:
    """FSDP2 (ZeRO 2 / 3, ZeRO 1 with master weights) on a device that runs its collectives beside the compute (not host-bound)."""
    return runs_fsdp(plan) and device.kernel_us is None


def shared_host_seconds(plan: PlanIR, device: DeviceProfile, classes: list[RankClass], scale: float = 0.0) -> float:
    """The step when a host's ranks outnumber its cores: the host time of all its ranks (compute,
    kernels, framework, collective calls) over its cores, since a rank waiting in a collective
    leaves its core to the others; then the pipeline's fill and drain, `scale` (the bubble over the
    busy time) of the slowest rank's host time, in which only about half the ranks have work (one
    stage of two; on average p / 2 of p), so they time-share the cores less. Measured on gloo:
    bench/planner_vs_run.py. 0 without `cores` or when every rank has a core of its own."""
    if device.cores is None or plan.mesh.devices_per_host <= device.cores:
        return 0.0
    work = sum(rc.host_s * len(rc.ranks) for rc in classes) / (plan.mesh.hosts * device.cores)
    fill = scale * max(rc.host_s for rc in classes) * max(1.0, plan.mesh.devices_per_host / 2 / device.cores)
    return work + fill
