"""The memory steps of the analysis (planner/analyze.py's STEPS): `parameters` (what each device
holds before ZeRO), `kv_cache` (inference's cache), `activations` (what a microbatch saves for
backward and a backward's rise above it), `states` (weights, gradients and optimizer states after
ZeRO or FSDP2) and `peak` (the step's peak in the schedule's order).
"""

from __future__ import annotations

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.ir import DTYPES, FP8_BYTES, Repeat
from meshllm_dsl.parallel.costs import HeldUnit, seq_size
from meshllm_dsl.parallel.placements import gather_stage
from meshllm_dsl.planner.float8 import float8_weights
from meshllm_dsl.planner.formulas import fsdp_gather_bytes, fsdp_per_device, zero_per_device
from meshllm_dsl.planner.rank import (
    Params,
    Peak,
    Rank,
    Saved,
    Setup,
    StagePart,
    States,
    expert_shards,
    recomputes_core,
    running_units,
)
from meshllm_dsl.planner.recompute import BLOCKWISE, kept_bytes, recomputed_copies, recomputed_in
from meshllm_dsl.planner.schedule import rank_moments
from meshllm_dsl.planner.units import (
    backward_rise,
    expert_split_params,
    leaf_tensors,
    local_numel,
    stage_output_bytes,
    unit_activation_bytes,
    unit_backward_bytes,
    unit_local_params,
)


def parameters(setup: Setup, rank: Rank) -> Rank:
    """Adds `params`: what each device at the coordinate holds, per stage and in all."""
    plan = setup.plan
    total = local = replicated = root = tensors = experts = largest_expert_layer = f8 = f8_tensors = 0
    block_params: dict[str, int] = {}  # per block class: the parameters of one block
    block_f8: dict[str, int] = {}  # per block class: of those, at least this many gathered in float8
    parts = []
    for stage, units in zip(rank.stages, rank.units):
        stage_root = stage_sharded = expert_layers = stage_f8 = 0
        for hu in units:
            g, lo, re = unit_local_params(plan, hu)
            split = expert_split_params(plan, hu)
            f8_elements, f8_weights, f8_fewest = float8_weights(plan, hu)
            stage_f8, f8, f8_tensors = stage_f8 + f8_elements, f8 + f8_elements, f8_tensors + f8_weights
            total += g * hu.count
            local += lo * hu.count
            stage_sharded += (lo - split) * hu.count  # what FSDP2 shards: not the experts
            stage_root += 0 if hu.prefix else lo
            replicated += re * hu.count
            if hu.prefix:
                block_params[hu.prefix] = block_params.get(hu.prefix, 0) + lo
                block_f8[hu.prefix] = block_f8.get(hu.prefix, 0) + f8_fewest
            else:
                root += lo * hu.count
            tensors += leaf_tensors(hu) * hu.count
            if hu.tied_copy:
                continue
            experts += hu.count * split
            if split:
                largest_expert_layer = max(largest_expert_layer, split)
                expert_layers += hu.count
        blocks = sum((pc.stop or 0) - (pc.start or 0) for pc in stage.pieces
                     if isinstance(plan.model.item(pc.item), Repeat))
        parts.append(StagePart(stage, blocks, stage_sharded, stage_root, expert_layers, stage_f8))
    largest = max(block_params, key=lambda prefix: (block_params[prefix], -block_f8[prefix]), default=None)
    params = Params(total, local, replicated, root, block_params.get(largest, 0), tensors, experts,  # type: ignore[arg-type]
                    largest_expert_layer, tuple(parts), f8, f8_tensors, block_f8.get(largest, 0))  # type: ignore[arg-type]
    return attrs.evolve(rank, params=params)


def kv_cache(setup: Setup, rank: Rank) -> Rank:
    """Adds `kv_cache`: what every caching unit keeps on a device (attention's k / v heads, mla's latent), at
    the plan's batch and seq."""
    plan = setup.plan
    batch = plan.batch // plan.data_size
    total = 0
    for hu in running_units(rank):
        record = primitives.of(hu.unit)
        if record.caches_kv:
            # a sliding-window layer caches at most its window (primitives' cached_positions)
            positions = sum(record.cached_positions(hu.unit, i, plan.seq) for i in hu.indices or (0,))
            total += ((positions if hu.indices else hu.count * positions) * record.local_cached_values(plan, hu)
                      * batch * setup.dtype_bytes)
    return attrs.evolve(rank, kv_cache=total)


def activations(setup: Setup, rank: Rank) -> Rank:
    """Adds `saved`: what one microbatch keeps for backward, per stage, and how far a backward rises
    above it."""
    plan, w = setup.plan, setup.dtype_bytes
    per_mb, per_stage = 0, []
    rebuilt: dict[str, int] = {}  # recompute: what one block (or attention core) rebuilds in backward
    rise = first_rise = 0
    for units in rank.units:
        at_start = per_mb
        walk: list[tuple[str, int, int, int, int]] = []  # the stage's units, for backward_rise
        for hu in units:
            if hu.tied_copy:
                continue
            saved = _kept_for_backward(setup, hu, rebuilt)
            per_mb += hu.count * saved
            grads = w * unit_local_params(plan, hu)[1] if setup.accumulates else 0
            walk.append((hu.prefix, hu.count, saved, _backward_work(setup, hu), grads))
        per_stage.append(per_mb - at_start)
        rise = max(rise, backward_rise(walk, upcast=setup.upcast))
        first_rise = max(first_rise, backward_rise(walk, first=True, upcast=setup.upcast))
    if plan.recompute in BLOCKWISE:
        rec = [recomputed_in(plan, stage) for stage in rank.stages]
        blocks_here = sum(rec)
        per_mb += blocks_here * w * (setup.tokens // seq_size(plan)) * setup.hidden  # each checkpointed block keeps its input
        extra = per_mb - sum(per_stage)  # the kept block inputs, shared out by each stage's blocks
        per_stage = [a + extra * blocks // max(1, blocks_here) for a, blocks in zip(per_stage, rec)]
    # A block (or attention core) being recomputed holds its saved tensors until its backward is done.
    saved = Saved(per_mb, tuple(per_stage), rise, first_rise, max(rebuilt.values(), default=0))
    return attrs.evolve(rank, saved=saved)


def _kept_for_backward(setup: Setup, hu: HeldUnit, rebuilt: dict[str, int]) -> int:
    """Bytes one copy of the unit keeps for backward under the plan's `recompute` (an average over
    its copies when some are recomputed); adds to `rebuilt` what its block rebuilds in backward."""
    plan, tokens, seq, micro, flash = setup.plan, setup.tokens, setup.plan.seq, setup.micro_batch, setup.flash_attention
    saved = unit_activation_bytes(plan, hu, tokens, seq, micro, flash)
    rc = recomputed_copies(plan, hu)  # `blocks` / `ops` [every N]: copies rerun in backward
    if rc:
        # Kept: only each block's input (activations) and under `ops` its matmul and attention
        # outputs; the block's own saved tensors exist again while its backward runs (a
        # transient, one block at a time). Blocks `every N` skips save as usual.
        rebuilt[hu.prefix] = rebuilt.get(hu.prefix, 0) + saved
        kept = kept_bytes(plan, hu, tokens, seq, micro, flash)
        return (rc * kept + (hu.count - rc) * saved) // hu.count
    if recomputes_core(plan, hu):
        core = primitives.of(hu.unit).core_bytes(plan, hu, tokens, seq, micro, flash)
        rebuilt[hu.prefix] = max(rebuilt.get(hu.prefix, 0), core)
        return saved - core
    return saved


def _backward_work(setup: Setup, hu: HeldUnit) -> int:
    """Bytes the unit's backward allocates at once beyond what its forward saved."""
    plan, w = setup.plan, setup.dtype_bytes
    floor = 2 * w * setup.tokens * setup.hidden  # any unit's backward: the gradients of its input and output
    work = max(floor, unit_backward_bytes(plan, hu, setup.tokens))
    if not (setup.accumulates and setup.upcast):  # (there the unit's gradients are all counted)
        # Autograd makes each weight's gradient before adding it into the one the step
        # holds: the unit's largest, e.g. a vocab-parallel head's [vocab / t, hidden].
        work += w * max((local_numel(plan, t, hu.placement(leaf)) for leaf in hu.unit.leaves
                         for t in leaf.params), default=0)
    return work


def states(setup: Setup, rank: Rank) -> Rank:
    """Adds `states`: weights, gradients and optimizer states after ZeRO, from `params`."""
    return attrs.evolve(rank, states=_fsdp_states(setup, rank.params) if setup.fsdp else _zero_states(setup, rank.params))


def _fsdp_states(setup: Setup, params: Params) -> States:
    """FSDP2 (ZeRO 2 / 3, ZeRO 1 with master weights): every state sharded in the master dtype."""
    plan, w, master = setup.plan, setup.dtype_bytes, setup.master_bytes
    dense, expert_local = params.dense, params.experts
    gather = fsdp_gather_bytes(gather_stage(plan), w, dense, params.root, params.largest_block,
                               params.float8, params.largest_block_float8)
    if expert_shards(plan, params) > 1:
        # Each moe layer's experts are an FSDP2 unit over the ZeRO axes that replicate them
        # (runtime/parallel/fsdp.py): sharded there, gathered in the compute dtype like a block.
        experts_b = fsdp_per_device(expert_local, expert_shards(plan, params), master)
        gather += fsdp_gather_bytes(gather_stage(plan), w, expert_local, 0, params.largest_expert_layer)
    else:
        # Split over every ZeRO axis, no rank of them holds another's experts: FSDP2 leaves
        # them out, whole in the master dtype with their gradients and moments, each cast to
        # the compute dtype from its forward to its backward (runtime/moe/dispatch.py).
        experts_b = (master * expert_local, master * expert_local, 2 * master * expert_local)
        gather += w * expert_local if master > w else 0
    weight_b, grad_b, opt_b = (a + b for a, b in zip(fsdp_per_device(dense, plan.zero_size, master), experts_b))
    accum = 0
    if setup.accumulates:
        # torch's PipelineStage (and at ZeRO 1 the runtime's microbatch loop) runs every
        # backward but the step's last without gradient sync or reshard: FSDP2 accumulates
        # each unit's unsharded (tensor-local) gradient between microbatches, upcast to the
        # reduce dtype (`to_accumulated_grad_if_needed`), on top of the sharded gradient it
        # reduce-scatters into at the end of the step. (The experts' accumulate in their own.)
        accum = DTYPES[plan.reduce_dtype or plan.dtype] * dense
    return States(weight_b, grad_b, opt_b, gather, accum)


def _zero_states(setup: Setup, params: Params) -> States:
    """ZeRO 0 and ZeRO 1 without master weights: the ZeRO paper's shares (zero_per_device)."""
    plan, w, master, k = setup.plan, setup.dtype_bytes, setup.master_bytes, setup.optimizer_k
    expert_local = params.experts
    # With `precision` at ZeRO 0 (runtime/train/amp.py: autocast) the parameters and their gradients are the
    # master dtype's, and each weight's cast to the compute dtype lives from its forward to
    # its backward, as FSDP2's gathered copy does.
    state_w = master if plan.master_dtype else w
    weight_b, grad_b, opt_b = zero_per_device(params.dense, plan.zero, plan.zero_size, state_w, state_w, k)
    # ZeRO 1 shards the experts' states over the ranks holding the same experts only.
    opt_b += zero_per_device(expert_local, plan.zero, plan.expert_zero_size, state_w, state_w, k)[2]
    weight_b += state_w * expert_local
    grad_b += state_w * expert_local
    gather = w * params.local if plan.master_dtype and master > w else 0
    return States(weight_b, grad_b, opt_b, gather, 0)


def peak(setup: Setup, rank: Rank) -> Rank:
    """Adds `peak`: the moment of the step the device holds the most, from `saved`, `states` and
    the schedule's order.

    The peak is while a backward runs: at the start of each backward (a full B, or a split
    backward's I) of the rank, in torch's own order (planner/schedule.py), every stage's held
    microbatches (from its F to its W or B: W needs the layer inputs) times that stage's bytes (an
    interleaved rank's chunks hold very different counts; rank.stages are in index order, which
    is the order's chunk order in the V placement too), the units the forward before left
    gathered, and (once a backward ran before it) the gradient accumulators. A backward that
    follows a backward (the drain, pipelined ZeRO 2 / 3) finds every unit still gathered (no
    reshard until the step's last) and the accumulators all there."""
    plan, saved, st = setup.plan, rank.saved, rank.states
    p_size = plan.pipeline_size
    chunks = max(1, len(rank.stages))
    # torch.distributed.pipelining keeps each in-flight forward's output (the residual stream,
    # or the logits on the last stage) until that microbatch's backward.
    stage_kept = [stage_output_bytes(plan, s, setup.tokens) if p_size > 1 else 0 for s in rank.stages]
    stage_act = list(saved.per_stage)
    if p_size <= 1:  # no pipeline: the stages' activations all belong to the one microbatch running
        stage_act, stage_kept = [saved.per_microbatch // chunks], [sum(stage_kept) // chunks]
    best = None
    for moment in rank_moments(plan.schedule, p_size, plan.virtual, plan.microbatches, rank.coord):
        held = sum(moment.held)
        everything = setup.dtype_bytes * rank.params.local - (setup.dtype_bytes - FP8_BYTES) * rank.params.float8
        gathered = everything if st.accum and moment.follows_backward else st.gather
        accumulated = st.accum if moment.backward_before else 0
        act_b = sum(h * a for h, a in zip(moment.held, stage_act))
        # An upper bound: the rerun block frees its tensors as its backward uses them.
        trans = ((saved.rise if accumulated or not st.accum else saved.first_rise) + saved.recomputed
                 + sum(h * k for h, k in zip(moment.held, stage_kept)))
        total = act_b + trans + gathered + accumulated
        if best is None or total > best[0]:
            best = (total, held, act_b, trans, gathered, accumulated)
    assert best is not None
    return attrs.evolve(rank, peak=Peak(*best[1:]))
