"""What the analysis' STEPS share (planner/analyze.py): the Setup every step reads, the Rank one
rank class (pipeline coordinate) is while the steps build it, with one frozen record per step (Params,
Saved, States, Peak, Traffic, Time), the drafts of the ranks before any step ran, and `rank_class`,
the report's row (records.RankClass) of a built Rank. Below every step module, so none of them imports
analyze.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.ir import DTYPES, PlanIR, Stage
from meshllm_dsl.parallel.costs import HeldUnit
from meshllm_dsl.parallel.devices import DeviceProfile, assumed_hosts
from meshllm_dsl.parallel.placements import defers_grad_sync, runs_fsdp
from meshllm_dsl.planner.held import held_units
from meshllm_dsl.planner.records import Comm, RankClass
from meshllm_dsl.planner.units import hidden_width, stage_label


@attrs.frozen
class Setup:
    """What every step reads: the plan (its mesh with the hosts the device implies), the device, and
    the figures of a training step that every pipeline coordinate shares."""

    plan: PlanIR
    device: DeviceProfile
    flash_attention: bool
    dtype_bytes: int  # the plan's (compute) dtype
    master_bytes: int  # the stored parameters' dtype: the master one with `precision`, else the plan's
    optimizer_k: int  # optimizer state bytes per parameter
    fsdp: bool  # the runtime's ZeRO 2 / 3, and ZeRO 1 with master weights, are FSDP2
    accumulates: bool  # FSDP2 keeps every unit's whole gradient between microbatches
    upcast: bool  # gradients are reduced in a dtype wider than the plan's
    micro_batch: int  # sequences per microbatch per data replica
    tokens: int  # one microbatch's tokens on a rank
    replicas: int  # ranks the gradients are averaged over (batch and context axes)
    hidden: int  # the residual stream's width


def setup_of(plan: PlanIR, device: DeviceProfile, flash_attention: bool) -> Setup:
    """The Setup of `plan` on `device`: its mesh spread over the hosts the device implies."""
    plan = attrs.evolve(plan, mesh=assumed_hosts(plan.mesh, device))
    w = DTYPES[plan.dtype]
    # The runtime's ZeRO 2 / 3, and ZeRO 1 with master weights, are FSDP2: master dtype at rest, no
    # extra fp32 copy.
    fsdp = runs_fsdp(plan)
    master = DTYPES[plan.master_dtype or plan.dtype]
    # What the runtime's AdamW holds: two moments shaped and typed like the parameter it steps, the
    # stored (master) one: FSDP2's sharded parameter at ZeRO 2 / 3 (and 1 with `precision`), the fp32
    # parameter autocast computes from at ZeRO 0 (runtime/train/amp.py). Without `precision` a bf16
    # plan has no fp32 copy anywhere: 2 + 2 + 4 = 8 bytes per parameter, not the ZeRO paper's mixed
    # precision K = 12 (``optimizer_bytes_per_param``), which `precision { master = fp32 }` gives.
    k = 2 * master
    dp, m = plan.data_size, plan.microbatches
    # FSDP2 keeps every unit's whole gradient between microbatches, in the reduce dtype: under torch's
    # PipelineStage (no sync until the last backward), and at ZeRO 1 (one reduce-scatter a step).
    accumulates = fsdp and (plan.pipeline_size > 1 or (defers_grad_sync(plan) and m > 1))
    micro_batch = plan.batch // (dp * m)
    cp = plan.context_size
    return Setup(
        plan, device, flash_attention, w, master, k, fsdp, accumulates,
        upcast=DTYPES[plan.reduce_dtype or plan.dtype] > w,
        micro_batch=micro_batch,
        tokens=micro_batch * plan.seq // cp,  # context parallelism: this rank's s / c of each sequence
        replicas=dp * cp,
        hidden=hidden_width(plan),
    )


@attrs.frozen
class StagePart:
    """What FSDP2 makes units of in one stage: its blocks, then its root if that holds parameters."""

    stage: Stage
    blocks: int  # blocks of the repeat the stage holds
    sharded: int  # local parameters FSDP2 shards (not the experts that expert axes split)
    root: int  # local parameters outside the blocks (the stage root's)
    expert_layers: int  # moe layers whose experts expert axes split (a unit of their own under FSDP2)
    float8: int = 0  # of `sharded`, the linear weights FSDP2 all-gathers in float8 (`all_gather = fp8`)


@attrs.frozen
class Params:
    """Parameters each device of the rank class holds, before ZeRO (the `parameters` step)."""

    total: int = 0  # global parameters of its stages (tied copies counted where they live)
    local: int = 0  # after tensor sharding
    replicated: int = 0  # of which replicated over the sharding axes
    root: int = 0  # outside the repeated blocks (FSDP2's stage roots)
    largest_block: int = 0  # one block of the largest block class
    tensors: int = 0  # parameter tensors (zero_grad, optimizer and sync kernels are per tensor)
    experts: int = 0  # split over expert axes: their gradients skip those axes' reduction
    largest_expert_layer: int = 0  # the most of them one moe layer holds (FSDP2's unit, when it shards them)
    stages: tuple[StagePart, ...] = ()
    float8: int = 0  # linear weights FSDP2 all-gathers in float8 (`all_gather = fp8`), all stages
    float8_tensors: int = 0  # those weight tensors (one fp32 amax each, all-reduced once a step)
    largest_block_float8: int = 0  # of `largest_block`, at least this many gathered in float8

    @property
    def dense(self) -> int:
        """What ZeRO shards over every ZeRO axis: all but the experts."""
        return self.local - self.experts


@attrs.frozen
class Saved:
    """What one microbatch's forward leaves for its backward on a device (the `activations` step)."""

    per_microbatch: int = 0
    per_stage: tuple[int, ...] = ()  # each stage's (virtual stage's) share of it
    rise: int = 0  # the most a backward holds beyond the saved activations (backward_rise)
    first_rise: int = 0  # the same in the step's first backward, which makes the gradient accumulators
    recomputed: int = 0  # a block (or attention core) being recomputed, held until its backward is done


@attrs.frozen
class States:
    """Weights, gradients and optimizer states per device after ZeRO (the `states` step), and the
    compute-dtype copies and gradient accumulators FSDP2 or autocast add to them."""

    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    gather: int = 0  # compute-dtype copies of the weights while they run (FSDP2's gathered units, casts)
    accum: int = 0  # pipelined (or ZeRO 1) FSDP2: unsharded gradients accumulated between microbatches


@attrs.frozen
class Peak:
    """The moment of the step the device holds the most (the `peak` step)."""

    in_flight: int = 0  # microbatches (chunk forwards when interleaved) whose activations are held
    activations: int = 0
    transient: int = 0  # stage outputs kept for backward and one unit's backward working set
    gather: int = 0
    accum: int = 0


@attrs.frozen
class Traffic:
    """The collectives a device runs in a step (the `communication` step)."""

    comms: tuple[Comm, ...] = ()
    fsdp_events: int = 0  # FSDP2 all-gathers and reduce-scatters of units


@attrs.frozen
class Time:
    """A device's time in a step beyond its collectives (the `compute` step)."""

    compute_s: float = 0.0  # recomputation, kernels' host time and the framework's included
    recompute_s: float = 0.0
    kernels: int = 0
    kernel_s: float = 0.0
    host_s: float = 0.0  # compute_s plus its collectives' host time


@attrs.frozen
class Rank:
    """One rank class while STEPS build it: where it sits, the units it holds, and each step's record
    (empty, all zeros, until that step ran)."""

    coord: int
    ranks: tuple[int, ...]
    stages: tuple[Stage, ...]
    units: tuple[tuple[HeldUnit, ...], ...]  # per stage, what it holds (held_units)
    params: Params = Params()
    kv_cache: int = 0  # inference: the KV cache at the plan's batch and seq
    saved: Saved = Saved()
    states: States = States()
    peak: Peak = Peak()
    traffic: Traffic = Traffic()
    time: Time = Time()


def rank_drafts(setup: Setup) -> Iterator[Rank]:
    """A Rank per pipeline coordinate: which ranks sit at it, the stages they run and what those hold."""
    plan, mesh = setup.plan, setup.plan.mesh
    coords = sorted({s.coord for s in plan.stages}) or [0]
    if plan.roles.pipeline:
        # From the axis' stride (the ranks at coordinate c are runs of `stride` ranks): mesh.coords
        # for every rank at every coordinate was 90 % of the time of a 2,520-device analysis.
        stride, size = mesh.stride(plan.roles.pipeline), mesh.size(plan.roles.pipeline)
        rank_sets = {c: tuple(b + c * stride + j for b in range(0, mesh.devices, stride * size) for j in range(stride))
                     for c in coords}
    else:
        rank_sets = {0: tuple(range(mesh.devices))}
    for c in coords:
        stages = tuple(s for s in plan.stages if s.coord == c)
        yield Rank(c, rank_sets[c], stages, tuple(tuple(held_units(plan, s)) for s in stages))


def running_units(rank: Rank) -> Iterator[HeldUnit]:
    """The units the rank runs, in forward order: a tied copy is a copy of weights, with no
    activations or collectives of its own."""
    return (hu for units in rank.units for hu in units if not hu.tied_copy)


def recomputes_core(plan: PlanIR, hu: HeldUnit) -> bool:
    """`recompute = attention`: backward reruns the core of this block unit (none at the top level)."""
    return bool(hu.prefix) and plan.recompute == "attention" and primitives.of(hu.unit).recomputed_core


def expert_shards(plan: PlanIR, params: Params) -> int:
    """ZeRO ranks holding the same experts (the ZeRO axes that do not split them)."""
    return plan.expert_zero_size if params.experts else 1


def rank_class(setup: Setup, rank: Rank) -> RankClass:
    """The report's row of a rank class the STEPS have built."""
    plan, params, st, pk, t = setup.plan, rank.params, rank.states, rank.peak, rank.time
    return RankClass(
        coord=rank.coord, stages=tuple(s.index for s in rank.stages),
        label="; ".join(stage_label(plan, s) for s in rank.stages), ranks=rank.ranks,
        params_global=params.total, params_local=params.local, params_replicated=params.replicated,
        weight_bytes=st.weights, grad_bytes=st.grads, optimizer_bytes=st.optimizer, gather_buffer_bytes=pk.gather,
        activation_bytes_per_microbatch=rank.saved.per_microbatch, in_flight=pk.in_flight,
        activation_bytes=pk.activations, transient_bytes=pk.transient, grad_accum_bytes=pk.accum,
        kv_cache_bytes=rank.kv_cache, comms=rank.traffic.comms, compute_s=t.compute_s, dtype_bytes=setup.dtype_bytes,
        recompute_s=t.recompute_s, kernels=t.kernels, kernel_s=t.kernel_s, host_s=t.host_s,
    )
