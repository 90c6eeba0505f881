"""What one held unit (or one stage) of a plan holds and saves on a device: its local parameters,
what its forward saves for backward and what its backward adds (Korthikanti et al. 2022), the parameters
expert axes split, the residual stream's width, tied copies' gradient sync, and a stage's label.
The memory steps (planner/memory.py) and communication step (planner/comm.py) add these up.
"""

from __future__ import annotations

import math

from meshllm_dsl import primitives
from meshllm_dsl.ir import DTYPES, Placement, PlanIR, Stage, Tensor, Unit
from meshllm_dsl.parallel.costs import HeldUnit, axes_size, seq_size
from meshllm_dsl.planner.held import held_units

# ---------------------------------------------------------------- what a stage holds


def stage_label(plan: PlanIR, stage: Stage) -> str:
    """`embed, pos, blocks 0-3` — what a stage holds, for tables and pictures."""
    parts = []
    for pc in stage.pieces:
        if pc.start is not None and pc.stop is not None:
            parts.append(f"{pc.item} {pc.start}-{pc.stop - 1}" if pc.stop - pc.start > 1 else f"{pc.item} {pc.start}")
        else:
            parts.append(pc.item)
    return ", ".join(parts)


def local_numel(plan: PlanIR, tensor: Tensor, placement: Placement) -> int:
    return math.prod(plan.local_shape(tensor, placement))


def unit_local_params(plan: PlanIR, hu: HeldUnit) -> tuple[int, int, int]:
    """(global, local, replicated-local) parameters of one copy of the unit on one device."""
    glob = local = repl = 0
    for leaf in hu.unit.leaves:
        p = hu.placement(leaf)
        for t in leaf.params:
            n = local_numel(plan, t, p)
            glob += t.numel
            local += n
            if not p.split_dims(t):
                repl += n
    return glob, local, repl


# ---------------------------------------------------------------- activations (Korthikanti et al. 2022)



def unit_activation_bytes(plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int,
                          flash_attention: bool = True) -> int:
    """Bytes one copy of the unit keeps for backward, for one microbatch of `tokens` = s x b tokens.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section
    4.1) count, per GPT layer in 16-bit, sbh (34 + 5 a s / h): attention 11 sbh + 5 a s^2 b, MLP 19 sbh,
    two LayerNorms 4 sbh; with t-way tensor parallelism sbh (10 + 24 / t + 5 a s / (h t)). We count the
    same saved tensors tensor by tensor, for the layers this model really has, because Llama differs:
      * no dropout (Llama and our runtime train without it): the paper's masks (sbh per sublayer and
        a s^2 b in attention) and the dropout output (2 a s^2 b) disappear;
      * fused attention (torch SDPA / FlashAttention, `flash_attention=True`): no s x s matrix is kept,
        only q, k, v, the output and an fp32 log-sum-exp per head and token. This is the paper's
        "selective recomputation" done by the kernel. With `flash_attention=False` the softmax
        probabilities (a s^2 b elements per layer) are kept, as in the paper;
      * GQA: k and v have kv_heads heads, so they cost 2 kv_heads head_dim instead of 2 h;
      * SwiGLU keeps gate, up, silu(gate) and their product: 4 x ffn (the paper's GeLU keeps its input
        and output: 2 x 4h = 8 sbh + 8 sbh); a plain activation keeps 2 x ffn;
      * RMSNorm keeps its input and an fp32 reciprocal RMS per token (4 sb; the runtime's own
        autograd Function, which does not also keep the normalised tensor); LayerNorm its input and
        an fp32 mean and rstd (8 sb); the paper counts 2 sbh per norm (its input only).
    Tensor-sharded tensors divide by the size of the axes they are split over; without sequence
    parallelism the norm inputs and the inputs of column layers are replicated over the tensor axis,
    the paper's "10 sbh" term. With it (section 4.2.2, `layout { seq -> tensor }`) that term is
    divided by t too: norms see [b, s / t, h], and the column layers keep only their rank's slice of
    the input they all-gather (`rt.gather_seq_linear`); the head's input likewise, when it is
    column-parallel over the same axes. Activation elements are in the plan's dtype.
    """
    sp = plan.sequence_size
    local = tokens // sp  # tokens of the sequence-sharded stream (norms, sublayer inputs)
    return primitives.of(hu.unit).saved_bytes(plan, hu, tokens, local, seq, micro, flash_attention)




def unit_backward_bytes(plan: PlanIR, hu: HeldUnit, tokens: int) -> int:
    """Bytes of gradients one unit's backward allocates at once, for one microbatch (measured with
    `bench/activation_memory.py`): the MLP holds the gradients of its ffn-wide tensors (4 for SwiGLU:
    product, silu, gate, up; 2 for a plain activation); a loss over full (unsharded) logits the fp32
    log-softmax gradient and the gradient of the logits; the vocab-parallel loss works in place."""
    unit = hu.unit
    e = DTYPES[plan.dtype]
    # Sequence parallelism: the backward of the gathered column layers (rt.gather_seq_linear) holds
    # their output gradients, the re-gathered input, its gradient and that gradient's copy laid out
    # for the reduce-scatter: 3 x [tokens, hidden] beyond the output gradients.
    regather = 3 * e * tokens * hidden_width(plan) if plan.roles.sequence else 0
    return primitives.of(unit).backward_bytes(plan, hu, tokens, regather)


def backward_rise(walk: list[tuple[str, int, int, int, int]], first: bool = False, upcast: bool = False) -> int:
    """How far memory rises above one microbatch's saved activations while its backward runs.

    ``walk`` lists a stage's units in forward order as (block prefix, copies, bytes saved, bytes its
    backward allocates, bytes of its parameters' gradients that backward allocates); a block
    class's units come together and stand for `copies` blocks. Backward visits the units in
    reverse, and each frees what it saved once done: while a unit runs, the units before it still
    hold theirs. So the peak is the largest backward working set plus what precedes it, e.g. a bf16
    norm's fp32 backward in the last block once the head (and its fp32 softmax) has freed its
    tensors, not that working set on top of the whole microbatch.

    The last field is for pipelined ZeRO 2 / 3, whose FSDP2 units keep unsharded gradients between
    microbatches (``accum_bytes``). With a wider reduce dtype (``upcast``), each backward's
    compute-dtype gradients live until their unit's post-backward folds them into the accumulators:
    a block's until the block is done, the stage root's (head, final norm, embedding) until the
    stage's backward is. In the step's ``first`` backward the accumulators are made as it goes
    (upcast at each post-backward, or the gradients themselves), and stay.
    """
    order: list[tuple[int, int, int, int]] = []  # (block number or -1 for the root, saved, work, grads)
    blocks = 0
    i = 0
    while i < len(walk):
        j = i + 1
        while j < len(walk) and walk[i][0] and walk[j][0] == walk[i][0]:
            j += 1
        for _ in range(walk[i][1] if walk[i][0] else 1):
            block = blocks if walk[i][0] else -1
            blocks += bool(walk[i][0])
            order += [(block, saved, work, grads) for _, _, saved, work, grads in walk[i:j]]
        i = j
    total = held = sum(saved for _, saved, _, _ in order)
    rise = root_grads = block_grads = made = 0  # made: accumulators of the blocks done so far
    current = -2
    for block, saved, work, grads in reversed(order):
        if block != current and block >= 0:
            made += block_grads * (2 if upcast else 1) if first else 0  # the previous block's
            block_grads, current = 0, block
        if not upcast and not first:
            grads = 0  # accumulated in place into the existing (unsharded) gradient
        if block < 0:
            root_grads += grads
        else:
            block_grads += grads
        rise = max(rise, held + work + root_grads + (block_grads if block >= 0 else 0) + made - total)
        held -= saved
    return rise



def stage_output_bytes(plan: PlanIR, stage: Stage, tokens: int) -> int:
    """One microbatch of a stage's output: the residual stream, or the last stage's logits."""
    e = DTYPES[plan.dtype]
    if stage.index < len(plan.stages) - 1:
        return e * (tokens // seq_size(plan)) * hidden_width(plan)  # [mb, s / t, h] under sequence parallelism
    for hu in held_units(plan, stage):
        if hu.last and primitives.of(hu.unit) is primitives.linear.LINEAR:
            p = hu.placement(hu.unit.leaves[0])
            n_out = int(hu.unit.attr("out"))  # type: ignore[arg-type]
            return e * tokens * (n_out // axes_size(plan, p) if p.rule == "column" and p.sharded else n_out)
    return e * tokens * hidden_width(plan)


def leaf_tensors(hu: HeldUnit) -> int:
    return sum(len(leaf.params) for leaf in hu.unit.leaves)


def expert_split_params(plan: PlanIR, hu: HeldUnit) -> int:
    """Parameters of one copy of the unit on one device that expert axes split (its local experts)."""
    return sum(local_numel(plan, t, hu.placement(leaf)) for leaf in hu.unit.leaves for t in leaf.params
               if hu.placement(leaf).expert_dim(t) is not None)


def hidden_width(plan: PlanIR) -> int:
    h = plan.model.value("hidden")
    if isinstance(h, int):
        return h
    emb = next((u for u in plan.model.items if isinstance(u, Unit) and primitives.of(u) is primitives.embedding.EMBEDDING), None)
    return int(emb.attr("dim")) if emb is not None else 0  # type: ignore[arg-type]


def tied_sync_numel(plan: PlanIR, stages: list[Stage]) -> int:
    """Local parameters of tied weights held on two stages of different ranks (`stages`: one rank's):
    their gradients are summed over the pipeline once per step. Two copies on one rank (a V puts the
    first and the last stage on rank 0) are summed in place, with no collective."""
    total = 0
    for s in stages:
        for hu in held_units(plan, s):
            # A tied copy (planner/held.py) is the embedding's table held beside the head: its
            # partner is the embedding itself, wherever that stage is.
            if hu.tied_copy and not _on_rank(plan, hu.unit.name, stages) or (
                    primitives.of(hu.unit) is primitives.embedding.EMBEDDING
                    and _is_tied_elsewhere(plan, hu.unit.name, s)
                    and not _on_rank(plan, _tied_user(plan, hu.unit.name), stages)):
                total += unit_local_params(plan, hu)[1]
    return total


def _tied_user(plan: PlanIR, name: str) -> str | None:
    """The layer that uses `name`'s weight (a tied head of an embedding)."""
    return next((item.name for item in plan.model.items
                 if isinstance(item, Unit) and any(lf.tie == name for lf in item.leaves)), None)


def _on_rank(plan: PlanIR, item: str | None, stages: list[Stage]) -> bool:
    return item is not None and any(pc.item == item for s in stages for pc in s.pieces)


def _is_tied_elsewhere(plan: PlanIR, name: str, stage: Stage) -> bool:
    for item in plan.model.items:
        if isinstance(item, Unit) and any(lf.tie == name for lf in item.leaves):
            return all(pc.item != item.name for pc in stage.pieces)
    return False
