"""Communication: the cost of one collective over a group of the mesh (a ring's bus bandwidth and
latency in or across hosts, _link / comm_over), what each unit issues per microbatch (unit_collectives,
forward_collectives, expert parallelism's all-to-all), and the `communication` step of the analysis
(planner/analyze.py's STEPS): every collective of a step per rank class, layer by layer, context,
pipeline, tied weights and data parallelism (all-reduce, ZeRO, FSDP2 and HSDP).
"""

from __future__ import annotations

import functools
import math

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.ir import DTYPES, FP8_BYTES, MeshIR, PlanIR
from meshllm_dsl.parallel import layouts
from meshllm_dsl.parallel.collectives import WirePrimitive, ring_bytes, spec
from meshllm_dsl.parallel.costs import FP32, HeldUnit, expert_token_split, routed_tokens, seq_size
from meshllm_dsl.parallel.devices import DeviceProfile, group_crosses_hosts
from meshllm_dsl.parallel.placements import defers_grad_sync, gather_stage
from meshllm_dsl.planner.formulas import fsdp_unit_collectives, stage_actions
from meshllm_dsl.planner.rank import (
    Params,
    Rank,
    Setup,
    StagePart,
    Traffic,
    expert_shards,
    rank_drafts,
    running_units,
    setup_of,
)
from meshllm_dsl.planner.recompute import recomputed_copies
from meshllm_dsl.planner.records import Comm
from meshllm_dsl.planner.units import tied_sync_numel

# ---------------------------------------------------------------- communication

# Per-collective launch + synchronisation latency of a ring, per step of it (an all-reduce takes
# 2 (n - 1) steps, an all-gather or reduce-scatter n - 1): NCCL-tests' small-message all-reduce is
# ~10 us on 8 NVLink GPUs (14 steps) and ~25 us across an InfiniBand network of as many.
LATENCY_INTRA_S = 10e-6 / 14
LATENCY_INTER_S = 25e-6 / 14


def forward_collectives(hu: HeldUnit) -> list[tuple[tuple[str, ...], WirePrimitive, int | None]]:
    """What of unit_collectives runs in the forward (listed first in its spec's wire, when its
    forward moves data): what recomputing the unit's forward issues again."""
    if hu.flow is None:
        return []
    record = primitives.of(hu.unit)
    return [(c.axes, spec(c.op).wire[0], record.collective_width(hu.unit, c)) for c in hu.flow.collectives
            if spec(c.op).wire and spec(c.op).forward not in ("identity", "split", "split(seq)")]



@functools.lru_cache(maxsize=4096)
def axes_cross_hosts(mesh: MeshIR, axes: tuple[str, ...]) -> bool:
    # The answer depends only on the mesh, so compute it once.
    return group_crosses_hosts(mesh, axes)


def _members_per_host(mesh: MeshIR, axes: tuple[str, ...]) -> int:
    """How many ranks of a group along `axes` share a host (hosts hold consecutive ranks): along
    each axis, the coordinates whose offset stays inside the host, multiplied over the axes."""
    per_host = mesh.devices_per_host
    return max(1, math.prod(min(a.size, -(-per_host // mesh.stride(a.name))) for a in mesh.axes if a.name in axes))


def _link(plan: PlanIR, device: DeviceProfile, axes: tuple[str, ...], op: WirePrimitive = "all_reduce",
          n: int | None = None) -> tuple[float, float, bool]:
    """(bus bandwidth in bytes/s, latency in s, crosses hosts) of one `op` over the group along `axes`.

    In a host the ring reaches the device's fraction of its link for that algorithm
    (DeviceProfile.bus_efficiency). Across hosts NCCL runs a ring per NIC, so a group with k
    members in each host moves k NICs' worth (NVIDIA's DGX A100: 8 x 24 = 192 GB/s all-reduce),
    but never more than the ring inside the host; a group of one rank per host has one NIC. A
    measured `latency` (meshc calibrate) is per call; otherwise each of the ring's steps costs
    LATENCY_INTRA_S / LATENCY_INTER_S."""
    crosses = axes_cross_hosts(plan.mesh, axes)
    n = n if n is not None else plan.mesh.size(*axes)
    if op == "send_recv":  # one peer: its link (a pipeline send), one NIC across hosts
        bandwidth = (device.inter_gbps if crosses else device.intra_gbps) * 1e9
    elif crosses:
        ring = device.intra_gbps * 1e9 * device.bus_fraction("all_gather")  # no NVLink SHARP across hosts
        bandwidth = min(ring, _members_per_host(plan.mesh, axes) * device.inter_gbps * 1e9)
    else:
        bandwidth = device.intra_gbps * 1e9 * device.bus_fraction(op)
    if device.latency_us is not None:
        return bandwidth, device.latency_us * 1e-6, crosses
    steps = 2 * (n - 1) if op == "all_reduce" else (n - 1) if op in ("all_gather", "reduce_scatter", "all_to_all") else 1
    return bandwidth, steps * (LATENCY_INTER_S if crosses else LATENCY_INTRA_S), crosses


def hsdp_replica_comm(plan: PlanIR, device: DeviceProfile, calls: int, size: int) -> list[Comm]:
    """HSDP's all-reduce across replicas of each reduce-scattered gradient shard (`size` bytes
    before the scatter over the shard group, so size / shards per call); none without replicas."""
    replicas = plan.roles.batch_replicate if plan.zero else ()
    if not replicas or plan.mesh.size(*replicas) == 1:
        return []
    return [comm_over(plan, device, replicas, "data", "all_reduce", calls, size // plan.zero_size)]


def comm_over(plan: PlanIR, device: DeviceProfile, axes: tuple[str, ...], kind: str, op: WirePrimitive, calls: int,
          size: int, group: int | None = None) -> Comm:
    """`calls` collectives of `size` bytes each over the group along `axes`."""
    n = group if group is not None else plan.mesh.size(*axes)
    bw, lat, crosses = _link(plan, device, axes, op, n)
    wire = calls * ring_bytes(op, size, n)
    seconds = wire / bw + calls * lat if n > 1 else 0.0
    return Comm(" x ".join(axes), kind, op, calls, calls * size, wire, seconds, crosses)


# Expert parallelism's all-to-alls per moe layer and microbatch, forward then backward (one primitive).
EXPERT_WIRE = spec("expert_all_to_all").wire
assert len(set(EXPERT_WIRE)) == 1 and len(EXPERT_WIRE) % 2 == 0, EXPERT_WIRE


def expert_all_to_all(plan: PlanIR, hu: HeldUnit, tokens: int) -> tuple[tuple[str, ...], int] | None:
    """A moe unit under expert parallelism: (expert axes, bytes of one all-to-all's input) for
    `tokens` of this rank, each of its top_k (token, choice) rows a hidden vector; None otherwise.
    Each call of the registered `expert_all_to_all` (dispatch, combine and their backwards:
    collectives.py) moves that much (runtime/moe/dispatch.py); the [experts] count exchange before
    the dispatch is negligible and not counted."""
    if not primitives.of(hu.unit).routes_experts or not plan.roles.expert:
        return None
    gate = next(lf for lf in hu.unit.leaves if lf.name == "gate")
    axes = hu.placement(gate).experts
    if not axes:
        return None
    # Over tensor axes each of their ranks sends 1 / |axes| of the tokens (expert_token_split).
    tokens = routed_tokens(plan, hu, tokens)
    return axes, DTYPES[plan.dtype] * tokens * int(hu.unit.attr("top_k")) * int(hu.unit.attr("hidden"))  # type: ignore[arg-type]


def unit_collectives(hu: HeldUnit) -> list[tuple[tuple[str, ...], WirePrimitive, int | None]]:
    """(axes, op, width) per microbatch, forward and backward, for one copy of the unit (width: the
    features per token it carries where they are not the residual stream's, primitives' collective_width).

    Megatron's operators (ir.Collective): copy_to is identity forward / all-reduce backward,
    reduce_from all-reduce forward / identity backward, split_to split forward / all-gather backward,
    gather_from all-gather forward / split backward. Sequence parallelism's: gather_seq all-gathers
    forward, and in backward all-gathers the kept slice again and reduce-scatters the input gradient;
    reduce_scatter_seq reduce-scatters forward, all-gathers backward; split_seq and gather_seq_split
    move data in one direction only (collectives.CollectiveSpec.wire). Sizes are the full
    activation (act_bytes) unless a width says otherwise.
    """
    out: list[tuple[tuple[str, ...], WirePrimitive, int | None]] = []
    if hu.flow is None:
        return out
    record = primitives.of(hu.unit)
    for c in hu.flow.collectives:
        out += [(c.axes, op, record.collective_width(hu.unit, c)) for op in spec(c.op).wire]
    return out


@attrs.define
class _Calls:
    """What the units a rank runs issue per microbatch, counted for the communication step."""

    # (axes, op, features per token) -> calls
    tensor: dict[tuple[tuple[str, ...], WirePrimitive, int], int] = attrs.Factory(dict)
    recompute: dict[tuple[tuple[str, ...], WirePrimitive, int], int] = attrs.Factory(dict)  # rerun forwards'
    expert: dict[tuple[tuple[str, ...], int], int] = attrs.Factory(dict)  # (expert axes, bytes per call): calls
    # context parallelism: k and v (mla: its latents) one microbatch's forward all-gathers, bytes per call -> calls
    kv_gathers: dict[int, int] = attrs.Factory(dict)
    kv_regathers: dict[int, int] = attrs.Factory(dict)  # the same gathers again in recomputed blocks' forwards
    route_gathers: dict[int, int] = attrs.Factory(dict)  # context parallelism: capacity ids gathered, bytes -> calls
    router_sums: int = 0  # context parallelism: the load-balancing loss's [experts] sums (bytes)
    seq_counts: int = 0  # context parallelism: the sequence-wise loss's per-sequence counts, all layers (bytes)
    balance_loads: int = 0  # `balance_rate`: the moe layers' int64 [experts] loads summed after each step (bytes)
    seq_grads: int = 0  # sequence parallelism: gradient elements summed over the tensor axes once a step
    holds_head: bool = False


def _unit_calls(setup: Setup, rank: Rank) -> _Calls:
    """The collectives the rank's units issue, unit by unit (a recomputed copy's forward ones again)."""
    plan, cp, micro, w = setup.plan, setup.plan.context_size, setup.micro_batch, setup.dtype_bytes
    calls = _Calls()
    for hu in running_units(rank):
        rc = recomputed_copies(plan, hu)
        for axes, op, width in unit_collectives(hu):
            key = (axes, op, width or setup.hidden)
            calls.tensor[key] = calls.tensor.get(key, 0) + hu.count
        for axes, op, width in forward_collectives(hu) if rc else ():
            key = (axes, op, width or setup.hidden)
            calls.recompute[key] = calls.recompute.get(key, 0) + rc
        if cp > 1 and primitives.of(hu.unit).caches_kv:
            # Context parallelism: k and v ([mb, s, kv / t, d] each for attention; mla's latent and
            # rotary key together, [mb, s, r + rope]) once gathered, every copy.
            kind = primitives.of(hu.unit)
            n = kind.gathered_tensors()
            size = micro * plan.seq * kind.gathered_values(plan, hu) * w // n
            calls.kv_gathers[size] = calls.kv_gathers.get(size, 0) + n * hu.count
            if rc:
                calls.kv_regathers[size] = calls.kv_regathers.get(size, 0) + n * rc
        if cp > 1 and primitives.of(hu.unit).routes_experts:
            a = dict(hu.unit.attrs)
            if a.get("capacity"):
                # Each router's ids [mb, s / cp, k] int64 gathered to the whole sequences' order
                # before counting capacity (runtime/parallel/context.py), again when backward recomputes.
                size = 8 * micro * plan.seq * int(a["top_k"])  # type: ignore[arg-type]
                calls.route_gathers[size] = calls.route_gathers.get(size, 0) + hu.count + rc
            if a.get("aux_loss_coef") or a.get("seq_aux_loss"):
                calls.router_sums = FP32 * int(a["experts"])  # type: ignore[arg-type]
            if a.get("seq_aux_loss"):
                # The sequence-wise loss: each sequence's [mb, experts] pair counts summed over the
                # context axes per layer, forward only (runtime/moe/routing.py RouterLosses.statistics).
                calls.seq_counts += hu.count * FP32 * micro * int(a["experts"])  # type: ignore[arg-type]
        if primitives.of(hu.unit).routes_experts and hu.unit.attr("balance_rate"):
            calls.balance_loads += hu.count * 8 * int(hu.unit.attr("experts"))  # type: ignore[arg-type]
        a2a = expert_all_to_all(plan, hu, setup.tokens)
        if a2a is not None:
            # dispatch and combine, each again in backward; the forward's rerun with the block's
            n = len(EXPERT_WIRE) * hu.count + len(EXPERT_WIRE) // 2 * rc
            calls.expert[a2a] = calls.expert.get(a2a, 0) + n
        split = expert_token_split(plan, hu)
        if split:
            # The routed outputs [b*s, h] all-gathered over the split axes forward (again when
            # recomputed), the tokens' gradients [b*s, h] backward; the routing weights' gradients
            # [b*s, top_k] too (counted in the plan's dtype; fp32 with weights_fp32 at bf16 is twice).
            for width, n in ((setup.hidden, 2 * hu.count + rc), (int(hu.unit.attr("top_k")), hu.count)):  # type: ignore[arg-type]
                for op in spec("gather_from").wire:
                    calls.tensor[(split, op, width)] = calls.tensor.get((split, op, width), 0) + n
        calls.seq_grads += hu.count * sum(t.numel for lf in hu.unit.leaves for t in lf.params
                                          if layouts.seq_partial_grad(plan, hu.unit, lf, t))
        calls.holds_head |= hu.last
    return calls


def communication(setup: Setup, rank: Rank) -> Rank:
    """Adds `traffic`: every collective a device runs in the step, from its units' calls and
    `params` (what the gradient reduction moves)."""
    calls = _unit_calls(setup, rank)
    comms = _layer_comms(setup, calls) + _context_comms(setup, rank, calls) + _stream_comms(setup, calls)
    comms += _pipeline_comms(setup, rank) + _balance_comms(setup, calls)
    data, fsdp_events = _data_comms(setup, rank.params)
    return attrs.evolve(rank, traffic=Traffic(tuple(comms + data), fsdp_events))


def _balance_comms(setup: Setup, calls: _Calls) -> list[Comm]:
    """Auxiliary-loss-free balancing (`balance_rate`, runtime/moe/routing.py `balance`): after each
    optimizer step one all-reduce of this rank's moe layers' expert loads, int64 [experts] each side
    by side, over every axis but the pipeline's (the ranks that routed tokens to the same layers)."""
    plan = setup.plan
    axes = tuple(a.name for a in plan.mesh.axes if a.name != plan.roles.pipeline and a.size > 1)
    if not calls.balance_loads or not axes:
        return []
    return [comm_over(plan, setup.device, axes, "data", "all_reduce", 1, calls.balance_loads)]


def _layer_comms(setup: Setup, calls: _Calls) -> list[Comm]:
    """The tensor-parallel collectives inside the layers, and expert parallelism's all-to-alls."""
    plan, device, m = setup.plan, setup.device, setup.plan.microbatches
    comms = []
    for (axes, op, width), n in sorted(calls.tensor.items()):
        # A recomputed block's forward runs its forward collectives again (Megatron's full recomputation).
        n += calls.recompute.get((axes, op, width), 0)
        comms.append(comm_over(plan, device, axes, "tensor", op, n * m, setup.dtype_bytes * setup.tokens * width))
    for (axes, size), n in sorted(calls.expert.items()):
        comms.append(comm_over(plan, device, axes, "expert", EXPERT_WIRE[0], n * m, size))
    return comms


def _context_comms(setup: Setup, rank: Rank, calls: _Calls) -> list[Comm]:
    """Context parallelism's K / V gathers and the moe layers' routing over whole sequences."""
    plan, device, m, axes = setup.plan, setup.device, setup.plan.microbatches, setup.plan.roles.context
    comms = []
    for size, n in sorted(calls.kv_gathers.items()):
        # K and V (mla: its latents) all-gathered over the context axes in each attention's forward
        # (again when backward recomputes the block), reduce-scattered in its backward: per layer
        # and microbatch 2 calls each way of [mb, s, kv / t, d], or mla's one of [mb, s, r + rope]
        # (runtime/parallel/context.py).
        comms.append(comm_over(plan, device, axes, "context", "all_gather", (n + calls.kv_regathers.get(size, 0)) * m, size))
        comms.append(comm_over(plan, device, axes, "context", "reduce_scatter", n * m, size))
    for size, n in sorted(calls.route_gathers.items()):
        comms.append(comm_over(plan, device, axes, "context", "all_gather", n * m, size))
    if calls.router_sums:
        # The load-balancing loss over whole sequences: per microbatch its [experts] assignment
        # counts and probability sums summed over the context axes, and the sums' gradient in
        # backward (the row count, one scalar, is not counted).
        comms.append(comm_over(plan, device, axes, "context", "all_reduce", 3 * m, calls.router_sums))
    if calls.seq_counts:
        layers = sum(hu.count for hu in running_units(rank) if primitives.of(hu.unit).routes_experts)
        comms.append(comm_over(plan, device, axes, "context", "all_reduce", layers * m, calls.seq_counts // layers))
    return comms


def _stream_comms(setup: Setup, calls: _Calls) -> list[Comm]:
    """Sequence parallelism's partial gradients, and the vocab-parallel loss's statistics."""
    plan, device, w = setup.plan, setup.device, setup.dtype_bytes
    comms = []
    if calls.seq_grads:
        # The norms' (and row biases') partial gradients, coalesced into one all-reduce per step.
        comms.append(comm_over(plan, device, plan.roles.sequence, "tensor", "all_reduce", 1, w * calls.seq_grads))
    if calls.holds_head and plan.roles.loss_parallel:
        # Vocab-parallel cross entropy: one all-gather per microbatch of each shard's log-sum-exp
        # and target logit, 2 fp32 per token from each of the loss group's ranks.
        n_loss = plan.mesh.size(*plan.roles.loss)
        comms.append(comm_over(plan, device, plan.roles.loss, "loss", "all_gather", plan.microbatches,
                           n_loss * 2 * FP32 * setup.tokens))
    return comms


def _pipeline_comms(setup: Setup, rank: Rank) -> list[Comm]:
    """The pipeline's sends between stages, and the sync of weights tied across them."""
    plan, device, w = setup.plan, setup.device, setup.dtype_bytes
    if not (plan.roles.pipeline and plan.pipeline_size > 1):
        return []
    from meshllm_dsl.planner import moe as planner_moe

    act_size = w * setup.tokens * setup.hidden
    # A boundary between two stages of this rank (the turn of a V) passes activations in memory.
    coord = {s.index: s.coord for s in plan.stages}
    sends = sum((s.index < len(plan.stages) - 1 and coord[s.index + 1] != s.coord)
                + (s.index > 0 and coord[s.index - 1] != s.coord) for s in rank.stages)
    comms = [comm_over(plan, device, (plan.roles.pipeline,), "pipeline", "send_recv", sends * plan.microbatches,
                   act_size // seq_size(plan) + planner_moe.router_statistics_bytes(plan), group=2)]
    tied = tied_sync_numel(plan, list(rank.stages))
    if tied:
        comms.append(comm_over(plan, device, (plan.roles.pipeline,), "tied", "all_reduce", 1, w * tied, group=2))
    return comms


def _data_comms(setup: Setup, params: Params) -> tuple[list[Comm], int]:
    """The gradient reduction over the batch (and context) ranks, and ZeRO's collectives; with the
    FSDP2 all-gathers and reduce-scatters of units they count."""
    plan = setup.plan
    if setup.replicas <= 1:
        return [], 0
    # ZeRO's collectives run within a shard group; with HSDP the shards' gradients are then
    # all-reduced across the replicas (hsdp_replica_comm). Context ranks average like batch ones.
    data_axes = plan.roles.batch_shard if plan.zero else plan.roles.replicas
    reduce_w = DTYPES[plan.reduce_dtype or plan.dtype]
    if setup.fsdp:
        return _fsdp_comms(setup, params, data_axes, reduce_w)
    if plan.zero >= 1:
        return _zero_comms(setup, params, data_axes, reduce_w), 0
    comms = [comm_over(plan, setup.device, data_axes, "data", "all_reduce", 1, reduce_w * params.dense)]
    rest = tuple(a for a in data_axes if a not in plan.roles.expert)
    if params.experts and rest:
        # the experts' gradients, reduced only over the batch axes that replicate them
        comms.append(comm_over(plan, setup.device, rest, "data", "all_reduce", 1, reduce_w * params.experts))
    return comms, 0


def _fsdp_rounds(setup: Setup, params: Params, reduce_w: int) -> tuple[int, int, int, int, int, int]:
    """FSDP2's all-gathers and reduce-scatters of the step over its units, as often as
    fsdp_unit_collectives says: (gathers, bytes gathered, scatters, bytes reduced, the experts' own
    units' gathers and scatters)."""
    plan, w, m, p_size = setup.plan, setup.dtype_bytes, setup.plan.microbatches, setup.plan.pipeline_size
    gathers = gathered_b = scatters = scattered_b = e_gathers = e_scatters = 0
    for part in params.stages:
        units = part.blocks + (part.root > 0)  # runtime/parallel/fsdp.py: each block, then the stage root if it holds parameters
        actions = stage_actions(plan.schedule, len(plan.stages), part.stage.index, m, p_size) if p_size > 1 else None
        g, r = fsdp_unit_collectives(gather_stage(plan), actions, m, defers_grad_sync(plan))
        gathers, gathered_b = gathers + g * units, gathered_b + g * fsdp_unit_gather_bytes(w, part)
        scatters, scattered_b = scatters + r * units, scattered_b + r * reduce_w * part.sharded
        e_gathers, e_scatters = e_gathers + g * part.expert_layers, e_scatters + r * part.expert_layers
    return gathers, gathered_b, scatters, scattered_b, e_gathers, e_scatters


def _fsdp_comms(setup: Setup, params: Params, data_axes: tuple[str, ...], reduce_w: int) -> tuple[list[Comm], int]:
    """FSDP2, unit by unit: parameters gathered in the compute dtype, gradients reduce-scattered in
    the reduce dtype, as often as fsdp_unit_collectives says; the moe layers' experts a unit of
    their own over the ZeRO axes replicating them, or left out and all-reduced."""
    plan, device, w = setup.plan, setup.device, setup.dtype_bytes
    gathers, gathered_b, scatters, scattered_b, e_gathers, e_scatters = _fsdp_rounds(setup, params, reduce_w)
    comms = [comm_over(plan, device, data_axes, "data", "all_gather", gathers, gathered_b // max(1, gathers)),
             comm_over(plan, device, data_axes, "data", "reduce_scatter", scatters, scattered_b // max(1, scatters))]
    comms += hsdp_replica_comm(plan, device, scatters, scattered_b // max(1, scatters))
    if params.float8_tensors:
        # torchao's precompute_float8_dynamic_scale_for_fsdp after the optimizer step: every float8-gathered
        # weight's amax (fp32, one per tensor), maxed over the shard group in one all-reduce.
        comms.append(comm_over(plan, device, data_axes, "data", "all_reduce", 1, FP32 * params.float8_tensors))
    events = gathers + scatters
    rest = tuple(a for a in plan.roles.replicas if a not in plan.roles.expert)
    if params.experts and expert_shards(plan, params) > 1:
        # each moe layer's experts, a unit of their own over the ZeRO axes replicating them
        shard = tuple(a for a in data_axes if a not in plan.roles.expert)
        per_unit = params.experts // max(1, sum(part.expert_layers for part in params.stages))
        comms.append(comm_over(plan, device, shard, "data", "all_gather", e_gathers, w * per_unit))
        comms.append(comm_over(plan, device, shard, "data", "reduce_scatter", e_scatters, reduce_w * per_unit))
        events += e_gathers + e_scatters
    elif params.experts and rest:
        # the experts FSDP2 leaves out: all-reduced over the batch axes that replicate them
        comms.append(comm_over(plan, device, rest, "data", "all_reduce", 1, reduce_w * params.experts))
    return comms, events


def fsdp_unit_gather_bytes(compute_bytes: int, part: StagePart) -> int:
    """Bytes one rank's shards of a stage's FSDP2 units hand to one round of all-gathers (before the
    gather multiplies them by the group): the params dtype, or FP8_BYTES for the weights gathered in
    float8 (`all_gather = fp8`)."""
    return compute_bytes * part.sharded - (compute_bytes - FP8_BYTES) * part.float8


def fsdp_all_gather_bytes(plan: PlanIR, device: DeviceProfile | None = None) -> int:
    """The bytes FSDP2's all-gathers of a training step return on one rank of the busiest pipeline
    coordinate: every unit's gathered parameters (the all-gathers' outputs, before any padding to a
    multiple of the shard group), as often as the step gathers them, in the params dtype, or
    FP8_BYTES per element for the weights gathered in float8 (`all_gather = fp8`); the moe experts'
    own units included. What a test wrapping torch.distributed.all_gather_into_tensor sums of its
    output tensors' `numel() * element_size()` over a step (each rank sends 1 / N of it). 0 without
    FSDP2. `device`: the plan's mesh's, or h100 when it names none (it decides only the hosts)."""
    from meshllm_dsl.planner.analyze import resolve_device
    from meshllm_dsl.planner.memory import parameters

    if device is None:
        device, _ = resolve_device(plan)
    setup = setup_of(plan, device, True)
    if not setup.fsdp or setup.replicas <= 1:
        return 0
    reduce_w = DTYPES[plan.reduce_dtype or plan.dtype]
    most = 0
    for rank in rank_drafts(setup):
        params = parameters(setup, rank).params
        _, gathered, _, _, e_gathers, _ = _fsdp_rounds(setup, params, reduce_w)
        if params.experts and expert_shards(plan, params) > 1:
            per_unit = params.experts // max(1, sum(part.expert_layers for part in params.stages))
            gathered += e_gathers * setup.dtype_bytes * per_unit
        most = max(most, gathered)
    return most


def _zero_comms(setup: Setup, params: Params, data_axes: tuple[str, ...], reduce_w: int) -> list[Comm]:
    """ZeRO 1 without master weights: gradients reduce-scattered to their owners, updated weights
    all-gathered back."""
    plan, device, dense = setup.plan, setup.device, params.dense
    comms = [comm_over(plan, device, data_axes, "data", "reduce_scatter", 1, reduce_w * dense)]
    comms += hsdp_replica_comm(plan, device, 1, reduce_w * dense)
    comms.append(comm_over(plan, device, data_axes, "data", "all_gather", 1, reduce_w * dense))
    rest = tuple(a for a in plan.roles.replicas if a not in plan.roles.expert)
    if params.experts and rest:
        # the experts' gradients, reduced only over the batch axes that replicate them;
        # their ZeRO shards' updates gathered back within the ranks holding the same experts
        comms.append(comm_over(plan, device, rest, "data", "all_reduce", 1, reduce_w * params.experts))
        shard = tuple(a for a in data_axes if a not in plan.roles.expert)
        if shard:
            comms.append(comm_over(plan, device, shard, "data", "all_gather", 1, reduce_w * params.experts))
    return comms
