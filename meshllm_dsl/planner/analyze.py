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
             through memory; lookups and elementwise work as memory traffic
  MFU      = the standard 6 (N - N_embedding) + 12 l h q t flops per token (model_flops_per_token)
             over the step time and the devices' peak

The constants (MFU, collective latencies, activation bytes per element, memory passes) are
module-level names below so a reader can see and change every assumption in one place; the GPU
profiles' fitted figures and their sources are in devices.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import W0801, W0802, W0803, W0804, W0805, W0806
from meshllm_dsl.diagnostics import Diagnostic, Label
from meshllm_dsl.front.names import ranges
from meshllm_dsl.ir import (
    DTYPES,
    Collective,
    MeshIR,
    Placement,
    PlanIR,
    Repeat,
    Stage,
    Tensor,
    Unit,
)
from meshllm_dsl.parallel import layouts
from meshllm_dsl.parallel.collectives import WirePrimitive, ring_bytes, spec
from meshllm_dsl.parallel.costs import (
    FP32,
    MFU,
    HeldUnit,
    Work,
    attention_core_bytes,
    axes_size,
    matmul_seconds,
    seq_size,
)
from meshllm_dsl.parallel.devices import (
    DEFAULT_PROFILE,
    PROFILES,
    DeviceProfile,
    assumed_hosts,
    group_crosses_hosts,
)
from meshllm_dsl.parallel.placements import defers_grad_sync, runs_fsdp
from meshllm_dsl.planner.formatting import GB, GIB, fmt_bytes, fmt_count, fmt_seconds, table_text
from meshllm_dsl.planner.held import held_units
from meshllm_dsl.planner.recompute import (
    BLOCKWISE,
    kept_bytes,
    recomputed_copies,
    recomputed_in,
    recomputed_text,
    rerun_seconds,
)
from meshllm_dsl.planner.records import Comm, PlanReport, RankClass, StepTime
from meshllm_dsl.planner.schedule import rank_moments, rank_order, schedule_cost
from meshllm_dsl.planner.spans import find_word, header_span

# ---------------------------------------------------------------- assumptions


# Of a unit's kernels, the share its forward launches (what `recompute = blocks` runs again):
# 756 of 1782 in a single-rank tiny Llama step, counted with runtime.profile.LiveBytes.
FORWARD_KERNEL_SHARE = 0.42

# Per-collective launch + synchronisation latency of a ring, per step of it (an all-reduce takes
# 2 (n - 1) steps, an all-gather or reduce-scatter n - 1): NCCL-tests' small-message all-reduce is
# ~10 us on 8 NVLink GPUs (14 steps) and ~25 us across an InfiniBand network of as many.
LATENCY_INTRA_S = 10e-6 / 14
LATENCY_INTER_S = 25e-6 / 14

# What is not a matmul (norms, activations, rotary, residual adds, softmax without a fused kernel,
# the casts around them) is bound by memory bandwidth: a unit's forward moves the tensors it
# produces (its saved bytes, unit_activation_bytes) this many times through device memory, and its
# backward twice as many, like its matmuls. Fitted with the devices' matmul efficiencies
# (devices.A100_MATMUL, H100_MATMUL) to ../shared/calibration/published.md; nominally 2 (each
# tensor written once and read once), eager PyTorch moves more (upcasts, copies, masks).
ELEMENTWISE_PASSES = 5.0

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


def fsdp_gather_bytes(zero: int, compute_bytes: int, local: int, top: int, largest_block: int) -> int:
    """The compute-dtype copy FSDP2 all-gathers at the peak: ZeRO-2 (and ZeRO-1 with master weights)
    keeps every unit gathered from its forward to its backward (all ``local`` parameters); ZeRO-3 frees each block after its forward,
    so the stage root (``top``: embedding, final norm, head, kept for backward) and two blocks (the
    one running and the one prefetched) are gathered at once (no more than the stage has)."""
    if zero in (1, 2):
        return compute_bytes * local
    return compute_bytes * min(local, top + 2 * largest_block)


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of a pipelined step: (p - 1) / (m + p - 1), divided by v when interleaved.

    GPipe and 1F1B have the same bubble (1F1B only lowers the activation memory); interleaving v
    virtual stages per rank shrinks it v-fold (Narayanan et al. 2021, section 2.2).
    """
    if stages <= 1:
        return 0.0
    frac = (stages - 1) / (microbatches + stages - 1)
    return frac / virtual if schedule == "interleaved_1f1b" else frac


def kv_cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes: one token of KV cache for the whole model."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def stage_actions(schedule: str, stages: int, index: int, microbatches: int, pipeline: int | None = None) -> str:
    """The order in which pipeline stage `index` of `stages` (on `pipeline` ranks, one stage each
    when not given) runs its microbatches' forwards (F) and backwards (B): torch's own, from
    schedule_order (GPipe: every forward, then every backward; 1F1B: min(m, n - i) forwards, then
    alternating, then the drain; interleaved: whole rounds of one chunk, so a rank's first chunk
    runs FFBB where 1F1B would run FBFB)."""
    p = pipeline or stages
    order = rank_order(schedule, p, stages // p, microbatches, index % p)
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
    last = actions.rindex("B")
    for i, action in enumerate(actions):
        if not gathered:
            gathers += 1
            gathered = True
        if action == "F":
            gathered = zero < 3
        elif i == last:
            gathered = False
    return gathers, 1


# ---------------------------------------------------------------- what a stage holds


def _ranges(blocks: list[int]) -> str:
    return ranges(blocks)


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



def _stage_output_bytes(plan: PlanIR, stage: Stage, tokens: int) -> int:
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


def _leaf_tensors(hu: HeldUnit) -> int:
    return sum(len(leaf.params) for leaf in hu.unit.leaves)


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


def unit_forward_time(plan: PlanIR, device: DeviceProfile, hu: HeldUnit, tokens: int, seq: int, micro: int,
                      flash_attention: bool = True) -> UnitTime:
    """A unit's forward on one device: its matmuls (matmul_seconds), its lookups and the memory
    traffic of what it computes without a matmul, ELEMENTWISE_PASSES over the tensors it produces."""
    record = primitives.of(hu.unit)
    work: Work = record.work(plan, hu, tokens, seq, micro, flash_attention)
    e = DTYPES[plan.dtype]
    times = [matmul_seconds(device, mm, e) for mm in work.matmuls]
    memory = 0.0
    if device.hbm_gbps:
        produced = record.saved_bytes(plan, hu, tokens, tokens // plan.sequence_size, seq, micro, flash_attention)
        memory = (work.lookup_bytes + ELEMENTWISE_PASSES * produced) / (device.hbm_gbps * 1e9)
    core = sum(t for t, mm in zip(times, work.matmuls) if mm.core)
    return UnitTime(sum(times) + memory, core)


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


def forward_collectives(hu: HeldUnit) -> list[tuple[tuple[str, ...], WirePrimitive]]:
    """What of unit_collectives runs in the forward (listed first in its spec's wire, when its
    forward moves data): what recomputing the unit's forward issues again."""
    if hu.flow is None:
        return []
    return [(c.axes, spec(c.op).wire[0]) for c in hu.flow.collectives
            if spec(c.op).wire and spec(c.op).forward not in ("identity", "split", "split(seq)")]


# ---------------------------------------------------------------- communication


@functools.lru_cache(maxsize=4096)
def _crosses(mesh: MeshIR, axes: tuple[str, ...]) -> bool:
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
    crosses = _crosses(plan.mesh, axes)
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
    return [_comm(plan, device, replicas, "data", "all_reduce", calls, size // plan.zero_size)]


def _comm(plan: PlanIR, device: DeviceProfile, axes: tuple[str, ...], kind: str, op: WirePrimitive, calls: int,
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
    return axes, DTYPES[plan.dtype] * tokens * int(hu.unit.attr("top_k")) * int(hu.unit.attr("hidden"))  # type: ignore[arg-type]


def expert_split_params(plan: PlanIR, hu: HeldUnit) -> int:
    """Parameters of one copy of the unit on one device that expert axes split (its local experts)."""
    return sum(local_numel(plan, t, hu.placement(leaf)) for leaf in hu.unit.leaves for t in leaf.params
               if hu.placement(leaf).expert_dim(t) is not None)


def expert_layer_comm(rep: PlanReport) -> dict[str, Any] | None:
    """Per moe layer and microbatch on one device: the all-to-all's input bytes, what it sends, and
    its time, for one call and for the four of a training step (dispatch + combine, forward +
    backward); None without expert parallelism."""
    plan = rep.plan
    if not plan.roles.expert:
        return None
    for stage in plan.stages:
        for hu in held_units(plan, stage):
            a2a = expert_all_to_all(plan, hu, plan.batch // plan.data_size // plan.microbatches * plan.seq)
            if a2a is None:
                continue
            axes, size = a2a
            (op, *_), calls = EXPERT_WIRE, len(EXPERT_WIRE)
            one = _comm(plan, rep.device, axes, "expert", op, 1, size)
            return {"axes": list(axes), "ranks": plan.mesh.size(*axes), "payload_bytes": size,
                    "wire_bytes": one.wire_bytes, "seconds": one.seconds, "calls_per_step": calls,
                    "step_wire_bytes": calls * one.wire_bytes, "step_seconds": calls * one.seconds}
    return None


def _expert_note(rep: PlanReport) -> str:
    per = expert_layer_comm(rep)
    if per is None:
        return ""
    return (f"per moe layer and microbatch: {per['calls_per_step']} all-to-alls over {' x '.join(per['axes'])} (dispatch + combine, "
            f"forward + backward) of {fmt_bytes(per['payload_bytes'])}, each sending {fmt_bytes(per['wire_bytes'])} "
            f"in {fmt_seconds(per['seconds'])}")


def unit_collectives(hu: HeldUnit) -> list[tuple[tuple[str, ...], WirePrimitive]]:
    """(axes, op) per microbatch, forward and backward, for one copy of the unit.

    Megatron's operators (ir.Collective): copy_to is identity forward / all-reduce backward,
    reduce_from all-reduce forward / identity backward, split_to split forward / all-gather backward,
    gather_from all-gather forward / split backward. Sequence parallelism's: gather_seq all-gathers
    forward, and in backward all-gathers the kept slice again and reduce-scatters the input gradient;
    reduce_scatter_seq reduce-scatters forward, all-gathers backward; split_seq and gather_seq_split
    move data in one direction only (collectives.CollectiveSpec.wire). Sizes are the full
    activation (act_bytes).
    """
    out: list[tuple[tuple[str, ...], WirePrimitive]] = []
    if hu.flow is None:
        return out
    for c in hu.flow.collectives:
        out += [(c.axes, op) for op in spec(c.op).wire]
    return out


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


def _running(rank: Rank) -> Iterator[HeldUnit]:
    """The units the rank runs, in forward order: a tied copy is a copy of weights, with no
    activations or collectives of its own."""
    return (hu for units in rank.units for hu in units if not hu.tied_copy)


def _recomputes_core(plan: PlanIR, hu: HeldUnit) -> bool:
    """`recompute = attention`: backward reruns the core of this block unit (none at the top level)."""
    return bool(hu.prefix) and plan.recompute == "attention" and primitives.of(hu.unit).recomputed_core


def _local_kv_heads(plan: PlanIR, hu: HeldUnit) -> int:
    """The key / value heads of an attention unit on one device."""
    kv_leaf = next(lf for lf in hu.unit.leaves if lf.name in ("k", "qkv"))
    return int(hu.unit.attr("kv_heads")) // axes_size(plan, hu.placement(kv_leaf))  # type: ignore[arg-type]


def parameters(setup: Setup, rank: Rank) -> Rank:
    """Adds `params`: what each device at the coordinate holds, per stage and in all."""
    plan = setup.plan
    total = local = replicated = root = tensors = experts = largest_expert_layer = 0
    block_params: dict[str, int] = {}  # per block class: the parameters of one block
    parts = []
    for stage, units in zip(rank.stages, rank.units):
        stage_root = stage_sharded = expert_layers = 0
        for hu in units:
            g, lo, re = unit_local_params(plan, hu)
            split = expert_split_params(plan, hu)
            total += g * hu.count
            local += lo * hu.count
            stage_sharded += (lo - split) * hu.count  # what FSDP2 shards: not the experts
            stage_root += 0 if hu.prefix else lo
            replicated += re * hu.count
            if hu.prefix:
                block_params[hu.prefix] = block_params.get(hu.prefix, 0) + lo
            else:
                root += lo * hu.count
            tensors += _leaf_tensors(hu) * hu.count
            if hu.tied_copy:
                continue
            experts += hu.count * split
            if split:
                largest_expert_layer = max(largest_expert_layer, split)
                expert_layers += hu.count
        blocks = sum((pc.stop or 0) - (pc.start or 0) for pc in stage.pieces
                     if isinstance(plan.model.item(pc.item), Repeat))
        parts.append(StagePart(stage, blocks, stage_sharded, stage_root, expert_layers))
    params = Params(total, local, replicated, root, max(block_params.values(), default=0), tensors, experts,
                    largest_expert_layer, tuple(parts))
    return attrs.evolve(rank, params=params)


def kv_cache(setup: Setup, rank: Rank) -> Rank:
    """Adds `kv_cache`: every attention unit's k / v heads on a device, at the plan's batch and seq."""
    plan = setup.plan
    batch = plan.batch // plan.data_size
    total = 0
    for hu in _running(rank):
        record = primitives.of(hu.unit)
        if record.caches_kv:
            # a sliding-window layer caches at most its window (primitives' cached_positions)
            positions = sum(record.cached_positions(hu.unit, i, plan.seq) for i in hu.indices or (0,))
            total += ((positions if hu.indices else hu.count * positions) * 2 * _local_kv_heads(plan, hu)
                      * int(hu.unit.attr("head_dim")) * batch * setup.dtype_bytes)  # type: ignore[arg-type]
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
    if _recomputes_core(plan, hu):
        core = attention_core_bytes(plan, hu, tokens, seq, micro, flash)
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


def _expert_shards(plan: PlanIR, params: Params) -> int:
    """ZeRO ranks holding the same experts (the ZeRO axes that do not split them)."""
    return plan.expert_zero_size if params.experts else 1


def states(setup: Setup, rank: Rank) -> Rank:
    """Adds `states`: weights, gradients and optimizer states after ZeRO, from `params`."""
    return attrs.evolve(rank, states=_fsdp_states(setup, rank.params) if setup.fsdp else _zero_states(setup, rank.params))


def _fsdp_states(setup: Setup, params: Params) -> States:
    """FSDP2 (ZeRO 2 / 3, ZeRO 1 with master weights): every state sharded in the master dtype."""
    plan, w, master = setup.plan, setup.dtype_bytes, setup.master_bytes
    dense, expert_local = params.dense, params.experts
    gather = fsdp_gather_bytes(plan.zero, w, dense, params.root, params.largest_block)
    if _expert_shards(plan, params) > 1:
        # Each moe layer's experts are an FSDP2 unit over the ZeRO axes that replicate them
        # (runtime/parallel/fsdp.py): sharded there, gathered in the compute dtype like a block.
        experts_b = fsdp_per_device(expert_local, _expert_shards(plan, params), master)
        gather += fsdp_gather_bytes(plan.zero, w, expert_local, 0, params.largest_expert_layer)
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

    The peak is while a backward runs: at the start of each backward of the rank, in torch's
    own order (schedule_order), every stage's held microbatches times that stage's bytes (an
    interleaved rank's chunks hold very different counts), the units the forward before left
    gathered, and (once a backward ran before it) the gradient accumulators. A backward that
    follows a backward (the drain, pipelined ZeRO 2 / 3) finds every unit still gathered (no
    reshard until the step's last) and the accumulators all there."""
    plan, saved, st = setup.plan, rank.saved, rank.states
    p_size = plan.pipeline_size
    chunks = max(1, len(rank.stages))
    # torch.distributed.pipelining keeps each in-flight forward's output (the residual stream,
    # or the logits on the last stage) until that microbatch's backward.
    stage_kept = [_stage_output_bytes(plan, s, setup.tokens) if p_size > 1 else 0 for s in rank.stages]
    stage_act = list(saved.per_stage)
    if p_size <= 1:  # no pipeline: the stages' activations all belong to the one microbatch running
        stage_act, stage_kept = [saved.per_microbatch // chunks], [sum(stage_kept) // chunks]
    best = None
    for moment in rank_moments(plan.schedule, p_size, plan.virtual, plan.microbatches, rank.coord):
        held = sum(moment.held)
        gathered = setup.dtype_bytes * rank.params.local if st.accum and moment.follows_backward else st.gather
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


@attrs.define
class _Calls:
    """What the units a rank runs issue per microbatch, counted for the communication step."""

    tensor: dict[tuple[tuple[str, ...], WirePrimitive], int] = attrs.Factory(dict)
    recompute: dict[tuple[tuple[str, ...], WirePrimitive], int] = attrs.Factory(dict)  # rerun forwards'
    expert: dict[tuple[tuple[str, ...], int], int] = attrs.Factory(dict)  # (expert axes, bytes per call): calls
    kv_gathers: int = 0  # context parallelism: bytes of k and v one microbatch's forward all-gathers
    route_gathers: dict[int, int] = attrs.Factory(dict)  # context parallelism: capacity ids gathered, bytes -> calls
    router_sums: int = 0  # context parallelism: the load-balancing loss's [experts] sums (bytes)
    seq_grads: int = 0  # sequence parallelism: gradient elements summed over the tensor axes once a step
    holds_head: bool = False


def _unit_calls(setup: Setup, rank: Rank) -> _Calls:
    """The collectives the rank's units issue, unit by unit (a recomputed copy's forward ones again)."""
    plan, cp, micro, w = setup.plan, setup.plan.context_size, setup.micro_batch, setup.dtype_bytes
    calls = _Calls()
    for hu in _running(rank):
        rc = recomputed_copies(plan, hu)
        for axes, op in unit_collectives(hu):
            calls.tensor[(axes, op)] = calls.tensor.get((axes, op), 0) + hu.count
        for axes, op in forward_collectives(hu) if rc else ():
            calls.recompute[(axes, op)] = calls.recompute.get((axes, op), 0) + rc
        if primitives.of(hu.unit).caches_kv:
            # Context parallelism: k and v, [mb, s, kv / t, d] each once gathered, every copy.
            calls.kv_gathers += hu.count * 2 * micro * plan.seq * _local_kv_heads(plan, hu) * int(hu.unit.attr("head_dim")) * w  # type: ignore[arg-type]
        if cp > 1 and primitives.of(hu.unit).routes_experts:
            a = dict(hu.unit.attrs)
            if a.get("capacity"):
                # Each router's ids [mb, s / cp, k] int64 gathered to the whole sequences' order
                # before counting capacity (runtime/parallel/context.py), again when backward recomputes.
                size = 8 * micro * plan.seq * int(a["top_k"])  # type: ignore[arg-type]
                calls.route_gathers[size] = calls.route_gathers.get(size, 0) + hu.count + rc
            if a.get("aux_loss_coef"):
                calls.router_sums = FP32 * int(a["experts"])  # type: ignore[arg-type]
        a2a = expert_all_to_all(plan, hu, setup.tokens)
        if a2a is not None:
            # dispatch and combine, each again in backward; the forward's rerun with the block's
            n = len(EXPERT_WIRE) * hu.count + len(EXPERT_WIRE) // 2 * rc
            calls.expert[a2a] = calls.expert.get(a2a, 0) + n
        calls.seq_grads += hu.count * sum(t.numel for lf in hu.unit.leaves for t in lf.params
                                          if layouts.seq_partial_grad(plan, hu.unit, lf, t))
        calls.holds_head |= hu.last
    return calls


def communication(setup: Setup, rank: Rank) -> Rank:
    """Adds `traffic`: every collective a device runs in the step, from its units' calls and
    `params` (what the gradient reduction moves)."""
    calls = _unit_calls(setup, rank)
    comms = _layer_comms(setup, calls) + _context_comms(setup, rank, calls) + _stream_comms(setup, calls)
    comms += _pipeline_comms(setup, rank)
    data, fsdp_events = _data_comms(setup, rank.params)
    return attrs.evolve(rank, traffic=Traffic(tuple(comms + data), fsdp_events))


def _layer_comms(setup: Setup, calls: _Calls) -> list[Comm]:
    """The tensor-parallel collectives inside the layers, and expert parallelism's all-to-alls."""
    plan, device, m = setup.plan, setup.device, setup.plan.microbatches
    comms = []
    act_size = setup.dtype_bytes * setup.tokens * setup.hidden
    for (axes, op), n in sorted(calls.tensor.items()):
        # A recomputed block's forward runs its forward collectives again (Megatron's full recomputation).
        n += calls.recompute.get((axes, op), 0)
        comms.append(_comm(plan, device, axes, "tensor", op, n * m, act_size))
    for (axes, size), n in sorted(calls.expert.items()):
        comms.append(_comm(plan, device, axes, "expert", EXPERT_WIRE[0], n * m, size))
    return comms


def _context_comms(setup: Setup, rank: Rank, calls: _Calls) -> list[Comm]:
    """Context parallelism's K / V gathers and the moe layers' routing over whole sequences."""
    plan, device, m, axes = setup.plan, setup.device, setup.plan.microbatches, setup.plan.roles.context
    comms = []
    if plan.context_size > 1 and calls.kv_gathers:
        # K and V all-gathered over the context axes in each attention's forward (again when
        # backward recomputes the block), dK and dV reduce-scattered in its backward: per layer
        # and microbatch 2 calls each way of [mb, s, kv / t, d] (runtime/parallel/context.py).
        caching = [hu for hu in _running(rank) if primitives.of(hu.unit).caches_kv]
        layers_here = sum(hu.count for hu in caching)
        reruns = sum(recomputed_copies(plan, hu) for hu in caching)
        per_call = calls.kv_gathers // max(1, 2 * layers_here)
        comms.append(_comm(plan, device, axes, "context", "all_gather", 2 * (layers_here + reruns) * m, per_call))
        comms.append(_comm(plan, device, axes, "context", "reduce_scatter", 2 * layers_here * m, per_call))
    for size, n in sorted(calls.route_gathers.items()):
        comms.append(_comm(plan, device, axes, "context", "all_gather", n * m, size))
    if calls.router_sums:
        # The load-balancing loss over whole sequences: per microbatch its [experts] assignment
        # counts and probability sums summed over the context axes, and the sums' gradient in
        # backward (the row count, one scalar, is not counted).
        comms.append(_comm(plan, device, axes, "context", "all_reduce", 3 * m, calls.router_sums))
    return comms


def _stream_comms(setup: Setup, calls: _Calls) -> list[Comm]:
    """Sequence parallelism's partial gradients, and the vocab-parallel loss's statistics."""
    plan, device, w = setup.plan, setup.device, setup.dtype_bytes
    comms = []
    if calls.seq_grads:
        # The norms' (and row biases') partial gradients, coalesced into one all-reduce per step.
        comms.append(_comm(plan, device, plan.roles.sequence, "tensor", "all_reduce", 1, w * calls.seq_grads))
    if calls.holds_head and plan.roles.loss_parallel:
        # Vocab-parallel cross entropy: one all-gather per microbatch of each shard's log-sum-exp
        # and target logit, 2 fp32 per token from each of the loss group's ranks.
        n_loss = plan.mesh.size(*plan.roles.loss)
        comms.append(_comm(plan, device, plan.roles.loss, "loss", "all_gather", plan.microbatches,
                           n_loss * 2 * FP32 * setup.tokens))
    return comms


def _pipeline_comms(setup: Setup, rank: Rank) -> list[Comm]:
    """The pipeline's sends between stages, and the sync of weights tied across them."""
    plan, device, w = setup.plan, setup.device, setup.dtype_bytes
    if not (plan.roles.pipeline and plan.pipeline_size > 1):
        return []
    from meshllm_dsl.planner import moe as planner_moe

    act_size = w * setup.tokens * setup.hidden
    sends = sum((s.index < len(plan.stages) - 1) + (s.index > 0) for s in rank.stages)
    comms = [_comm(plan, device, (plan.roles.pipeline,), "pipeline", "send_recv", sends * plan.microbatches,
                   act_size // seq_size(plan) + planner_moe.router_statistics_bytes(plan), group=2)]
    tied = _tied_sync_numel(plan, list(rank.stages))
    if tied:
        comms.append(_comm(plan, device, (plan.roles.pipeline,), "tied", "all_reduce", 1, w * tied, group=2))
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
    comms = [_comm(plan, setup.device, data_axes, "data", "all_reduce", 1, reduce_w * params.dense)]
    rest = tuple(a for a in data_axes if a not in plan.roles.expert)
    if params.experts and rest:
        # the experts' gradients, reduced only over the batch axes that replicate them
        comms.append(_comm(plan, setup.device, rest, "data", "all_reduce", 1, reduce_w * params.experts))
    return comms, 0


def _fsdp_comms(setup: Setup, params: Params, data_axes: tuple[str, ...], reduce_w: int) -> tuple[list[Comm], int]:
    """FSDP2, unit by unit: parameters gathered in the compute dtype, gradients reduce-scattered in
    the reduce dtype, as often as fsdp_unit_collectives says; the moe layers' experts a unit of
    their own over the ZeRO axes replicating them, or left out and all-reduced."""
    plan, device, w, m, p_size = setup.plan, setup.device, setup.dtype_bytes, setup.plan.microbatches, setup.plan.pipeline_size
    gathers = gathered_b = scatters = scattered_b = e_gathers = e_scatters = 0
    for part in params.stages:
        units = part.blocks + (part.root > 0)  # runtime/parallel/fsdp.py: each block, then the stage root if it holds parameters
        actions = stage_actions(plan.schedule, len(plan.stages), part.stage.index, m, p_size) if p_size > 1 else None
        g, r = fsdp_unit_collectives(plan.zero, actions, m, defers_grad_sync(plan))
        gathers, gathered_b = gathers + g * units, gathered_b + g * w * part.sharded
        scatters, scattered_b = scatters + r * units, scattered_b + r * reduce_w * part.sharded
        e_gathers, e_scatters = e_gathers + g * part.expert_layers, e_scatters + r * part.expert_layers
    comms = [_comm(plan, device, data_axes, "data", "all_gather", gathers, gathered_b // max(1, gathers)),
             _comm(plan, device, data_axes, "data", "reduce_scatter", scatters, scattered_b // max(1, scatters))]
    comms += hsdp_replica_comm(plan, device, scatters, scattered_b // max(1, scatters))
    events = gathers + scatters
    rest = tuple(a for a in plan.roles.replicas if a not in plan.roles.expert)
    if params.experts and _expert_shards(plan, params) > 1:
        # each moe layer's experts, a unit of their own over the ZeRO axes replicating them
        shard = tuple(a for a in data_axes if a not in plan.roles.expert)
        per_unit = params.experts // max(1, sum(part.expert_layers for part in params.stages))
        comms.append(_comm(plan, device, shard, "data", "all_gather", e_gathers, w * per_unit))
        comms.append(_comm(plan, device, shard, "data", "reduce_scatter", e_scatters, reduce_w * per_unit))
        events += e_gathers + e_scatters
    elif params.experts and rest:
        # the experts FSDP2 leaves out: all-reduced over the batch axes that replicate them
        comms.append(_comm(plan, device, rest, "data", "all_reduce", 1, reduce_w * params.experts))
    return comms, events


def _zero_comms(setup: Setup, params: Params, data_axes: tuple[str, ...], reduce_w: int) -> list[Comm]:
    """ZeRO 1 without master weights: gradients reduce-scattered to their owners, updated weights
    all-gathered back."""
    plan, device, dense = setup.plan, setup.device, params.dense
    comms = [_comm(plan, device, data_axes, "data", "reduce_scatter", 1, reduce_w * dense)]
    comms += hsdp_replica_comm(plan, device, 1, reduce_w * dense)
    comms.append(_comm(plan, device, data_axes, "data", "all_gather", 1, reduce_w * dense))
    rest = tuple(a for a in plan.roles.replicas if a not in plan.roles.expert)
    if params.experts and rest:
        # the experts' gradients, reduced only over the batch axes that replicate them;
        # their ZeRO shards' updates gathered back within the ranks holding the same experts
        comms.append(_comm(plan, device, rest, "data", "all_reduce", 1, reduce_w * params.experts))
        shard = tuple(a for a in data_axes if a not in plan.roles.expert)
        if shard:
            comms.append(_comm(plan, device, shard, "data", "all_gather", 1, reduce_w * params.experts))
    return comms


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
    forward_s, rerun_s, kernels_mb, rerun_kernels = _forward_time(setup, rank)
    st, tensors, events = rank.states, rank.params.tensors, rank.traffic.fsdp_events
    compute_s = (3 * forward_s + rerun_s) * m
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


def _forward_time(setup: Setup, rank: Rank) -> tuple[float, float, int, int]:
    """One microbatch's forward on the rank (matmuls, lookups, memory traffic) and its kernels, with
    what backward runs of them again under `recompute`: (forward s, rerun s, kernels, rerun kernels)."""
    plan, device, tokens, seq, micro, flash = (setup.plan, setup.device, setup.tokens, setup.plan.seq,
                                               setup.micro_batch, setup.flash_attention)
    forward_s = rerun_s = 0.0
    kernels = rerun_kernels = 0
    for hu in _running(rank):
        unit_kernels_n = unit_kernels(plan, hu)
        kernels += unit_kernels_n * hu.count
        unit_time = unit_forward_time(plan, device, hu, tokens, seq, micro, flash)
        forward_s += hu.count * unit_time.forward_s
        rc = recomputed_copies(plan, hu)  # `blocks` / `ops` [every N]: copies rerun in backward
        if rc:
            rerun_s += rc * rerun_seconds(plan, device, hu, unit_time.forward_s, tokens, seq, micro, flash)
            rerun_kernels += round(FORWARD_KERNEL_SHARE * unit_kernels_n) * rc
        elif _recomputes_core(plan, hu):
            rerun_s += hu.count * unit_time.core_s
            rerun_kernels += KERNELS["attention_core"] // 2 * hu.count  # the core's forward again
    return forward_s, rerun_s, kernels, rerun_kernels


# Per rank class, in order (each reads what those before it added to the Rank):
#   parameters     what each device holds before ZeRO, per stage and in all
#   kv_cache       inference's KV cache at the plan's batch and seq
#   activations    what a microbatch saves for backward, and a backward's rise above it
#   states         weights, gradients and optimizer states after ZeRO (reads parameters)
#   peak           the step's peak in the schedule's order (reads activations, states)
#   communication  every collective of the step (reads parameters)
#   compute        compute, kernels and host time (reads parameters, states, communication)
STEPS: tuple[Callable[[Setup, Rank], Rank], ...] = (parameters, kv_cache, activations, states, peak, communication, compute)


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


def _busy_s(rc: RankClass) -> float:
    """A rank's work per step that the pipeline bubble stretches: compute, and the collectives inside it and its sends."""
    return rc.compute_s + rc.comm_seconds(("tensor", "expert", "loss", "pipeline", "tied"))


def step_time(setup: Setup, classes: list[RankClass]) -> tuple[float, StepTime]:
    """The pipeline bubble and the step's time, from every rank class.

    The bubble of torch's own action order, simulated with unit-cost forwards and backwards of
    twice that; bubble_fraction's closed form is printed beside it as the reference. They agree for
    GPipe and 1F1B; for interleaved the closed form divides the fraction, not the idle time, by v.
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
                      kv_bytes_per_token(setup.plan), setup.optimizer_k, hosts_assumed)


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


def _overlap_note(rep: PlanReport) -> str:
    if not fsdp_overlaps_compute(rep.plan, rep.device):
        return ""
    total = max(rc.comm_seconds(("data",)) for rc in rep.ranks)
    return f"   exposed of FSDP2's {fmt_seconds(total)}, which overlap the compute unit by unit" if total else ""


def _training_state_line(plan: PlanIR, k: int, numel: int) -> str:
    w = DTYPES[plan.dtype]
    if not runs_fsdp(plan):
        # At ZeRO 0 with `precision` the parameters are the master weights (runtime/train/amp.py).
        held = DTYPES[plan.master_dtype or plan.dtype]
        cast = f", + {w} per parameter of {plan.dtype} casts while a stage runs" if held > w else ""
        return (f"  training state  {k + 2 * held} bytes per parameter ({held} weight + {held} gradient + {k} optimizer{cast})"
                f" = {fmt_bytes(numel * (k + 2 * held))} unsharded")
    m = DTYPES[plan.master_dtype or plan.dtype]
    total = w + 2 * m + k
    return (f"  training state  {total} bytes per parameter ({w} {plan.dtype} compute copy + {m} master weight + {m} gradient"
            f" + {k} optimizer) = {fmt_bytes(numel * total)} before ZeRO-{plan.zero} shards all but the compute copy")


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


def hidden_width(plan: PlanIR) -> int:
    h = plan.model.value("hidden")
    if isinstance(h, int):
        return h
    emb = next((u for u in plan.model.items if isinstance(u, Unit) and primitives.of(u) is primitives.embedding.EMBEDDING), None)
    return int(emb.attr("dim")) if emb is not None else 0  # type: ignore[arg-type]


def _tied_sync_numel(plan: PlanIR, stages: list[Stage]) -> int:
    """Local parameters of tied weights held on two stages: their gradients are summed once per step."""
    total = 0
    for s in stages:
        for hu in held_units(plan, s):
            if hu.tied_copy or (primitives.of(hu.unit) is primitives.embedding.EMBEDDING and _is_tied_elsewhere(plan, hu.unit.name, s)):
                total += unit_local_params(plan, hu)[1]
    return total


def _is_tied_elsewhere(plan: PlanIR, name: str, stage: Stage) -> bool:
    for item in plan.model.items:
        if isinstance(item, Unit) and any(lf.tie == name for lf in item.leaves):
            return all(pc.item != item.name for pc in stage.pieces)
    return False


def kv_bytes_per_token(plan: PlanIR) -> int:
    """KV cache bytes per token for the whole model in the plan's dtype (every attention unit)."""
    total = 0
    for item in plan.model.items:
        units = item.body if isinstance(item, Repeat) else (item,)
        count = item.count if isinstance(item, Repeat) else 1
        for u in units:
            if primitives.of(u).caches_kv:
                total += count * kv_cache_bytes_per_token(1, int(u.attr("kv_heads")), int(u.attr("head_dim")),  # type: ignore[arg-type]
                                                          DTYPES[plan.dtype])
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
                total += kv_cache_bytes_per_token(1, int(u.attr("kv_heads")), int(u.attr("head_dim")),  # type: ignore[arg-type]
                                                  DTYPES[plan.dtype]) * positions
    return total


# ---------------------------------------------------------------- warnings (the seed's pitfalls, with numbers)

# Thresholds, each the point where the pitfall costs more than a typical plan tolerates.
BUBBLE_WARN = 0.2  # more than a fifth of the step idle in the pipeline
IMBALANCE_WARN = 1.25  # as the checker's W0701 for parameters: the busiest stage sets the pace


def _comm_help(step: StepTime) -> str:
    """W0803's help: what raises the compute per byte moved, for the collectives the step has,
    the largest first (a plan without a tensor axis is never told to shrink one)."""
    remedies = {
        "tensor": "fewer tensor-parallel devices or larger microbatches",
        "pipeline": "larger microbatches (fewer, bigger pipeline transfers) or fewer pipeline stages",
        "data": "more sequences per data replica (a larger batch or fewer replicas)",
        "expert": "fewer expert-parallel ranks (the all-to-all moves top_k rows per token whatever the batch)",
        "context": "fewer context-parallel ranks (each gathers every rank's keys and values per layer)",
    }
    parts = sorted(((step.tensor_s, "tensor"), (step.expert_s, "expert"), (step.pipeline_s, "pipeline"),
                    (step.data_s, "data"), (step.context_s, "context")), reverse=True)
    named = [remedies[kind] for seconds, kind in parts if seconds > 0]
    return f"{'; or '.join(named) or 'larger microbatches'} raise the compute per byte moved"


def _fullest(report: PlanReport) -> RankClass:
    """The rank class needing the most memory in training."""
    return max(report.ranks, key=lambda r: r.training_bytes)


def _memory_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0801: the plan does not fit, with what takes the most of the fullest rank's memory."""
    if report.fits:
        return []
    plan, dev, worst = report.plan, report.device, _fullest(report)
    mesh_dev = find_word(plan.mesh.span, "device")
    dev_label = (Label(mesh_dev, f"{dev.name}: {dev.memory_gib:g} GiB, {dev.tflops:g} TFLOP/s"),) if mesh_dev else ()
    parts = {"weights": worst.weight_bytes, "gradients": worst.grad_bytes, "optimizer states": worst.optimizer_bytes,
             "activations": worst.activation_bytes, "ZeRO-3 gather buffer": worst.gather_buffer_bytes,
             "gradient accumulators": worst.grad_accum_bytes}
    biggest = max(parts, key=lambda k: parts[k])
    return [Diagnostic(
        W0801, f"plan `{plan.name}` needs {fmt_bytes(worst.training_bytes)} on pipeline rank {worst.coord}, "
        f"more than the {fmt_bytes(dev.memory_bytes)} of a {dev.name}", header_span(plan.span),
        label="does not fit in device memory", secondary=dev_label,
        note="per device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items() if v),
        help=_fit_help(report, biggest))]


def _over_sharding_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0802: the last doubling of a sharding axis costs more communication than it saves."""
    plan, dev, out = report.plan, report.device, []
    for axis, comm_s in _tensor_comm_by_axis(report).items():
        size = plan.mesh.size(axis)
        slow = max(report.ranks, key=lambda r: r.compute_s)
        sharded = slow.params_local - slow.params_replicated
        saved = 6 * sharded * (plan.batch // plan.data_size) * plan.seq / (dev.tflops * 1e12 * (dev.mfu or MFU))
        half = size // 2
        kept = comm_s * ((half - 1) / half) / ((size - 1) / size) if half > 1 else 0.0
        if size > 1 and comm_s - kept > saved:
            ax = plan.mesh.axis(axis)
            out.append(Diagnostic(
                W0802, f"`{axis}` = {size} over-shards: {fmt_count(slow.params_local)} parameters per device cost "
                f"{fmt_seconds(comm_s)} of collectives per step", ax.span if ax else header_span(plan.span),
                label=f"halving it would save {fmt_seconds(comm_s - kept)} of communication for {fmt_seconds(saved)} more compute",
                help=f"use `{axis}` = {half} and give the devices to data parallelism, if it still fits in memory "
                "(`meshc suggest` searches the alternatives)",
                note="each tensor-parallel layer all-reduces its activations; below a few thousand columns per "
                "device the matmul is too small to hide it"))
    return out


def _communication_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0803: the step spends more time communicating than computing."""
    step = report.step
    if step.comm_s <= step.compute_s:
        return []
    return [Diagnostic(
        W0803, f"communication ({fmt_seconds(step.comm_s)}) exceeds compute ({fmt_seconds(step.compute_s)}) per step",
        header_span(report.plan.span), label="communication-dominated",
        note=f"tensor {fmt_seconds(step.tensor_s)}, "
        + (f"expert {fmt_seconds(step.expert_s)}, " if step.expert_s else "")
        + f"pipeline {fmt_seconds(step.pipeline_s)}, data {fmt_seconds(step.data_s)}",
        help=_comm_help(step))]


def _network_tensor_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0804: a tensor axis runs over the inter-host link, with its cost."""
    plan, dev, out = report.plan, report.device, []
    for axis, comm_s in _tensor_comm_by_axis(report).items():
        if _crosses(plan.mesh, (axis,)):
            intra = comm_s * dev.inter_gbps / dev.intra_gbps
            ax = plan.mesh.axis(axis)
            out.append(Diagnostic(
                W0804, f"tensor-parallel axis `{axis}` runs its collectives over the network: "
                f"{fmt_seconds(comm_s)} per step", ax.span if ax else header_span(plan.span),
                label=f"about {fmt_seconds(intra)} within a host ({dev.inter_gbps:g} vs {dev.intra_gbps:g} GB/s)",
                help=f"put `{axis}` last in `axes` and keep it at most {plan.mesh.devices_per_host} (devices per host)"))
    return out


def _bubble_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0805: a large pipeline bubble, with the microbatches that would shrink it."""
    if report.bubble <= BUBBLE_WARN:
        return []
    plan = report.plan
    p, m = plan.pipeline_size, plan.microbatches
    need = math.ceil(9 * (p - 1) / plan.virtual)  # (p - 1) / (v (m + p - 1)) <= 10%, roughly
    where = find_word(plan.span, "microbatches") or header_span(plan.span)
    return [Diagnostic(
        W0805, f"the pipeline bubble is {report.bubble:.0%} of the step ({fmt_seconds(report.step.bubble_s)})", where,
        label=f"{m} microbatches over {p} stages",
        help=f"raise microbatches to about {need} or more (batch permitting) for a bubble near 10%"
        + ("" if plan.schedule == "interleaved_1f1b" else ", or interleave: `stages over ... virtual 2` with `schedule interleaved_1f1b`"),
        note=f"bubble = {report.bubble:.3f}" + _bubble_formula(plan, report.bubble))]


def _imbalance_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0806: one pipeline rank needs far more memory than another."""
    if len(report.ranks) <= 1:
        return []
    plan, worst = report.plan, _fullest(report)
    light = min(report.ranks, key=lambda r: r.training_bytes)
    if not (light.training_bytes and worst.training_bytes > IMBALANCE_WARN * light.training_bytes):
        return []
    where = find_word(plan.span, "stages") or header_span(plan.span)
    return [Diagnostic(
        W0806, f"pipeline rank {worst.coord} needs {worst.training_bytes / light.training_bytes:.2f}x the memory "
        f"of rank {light.coord} ({fmt_bytes(worst.training_bytes)} vs {fmt_bytes(light.training_bytes)})", where,
        label="stage memory imbalance",
        note="per pipeline rank: " + ", ".join(f"{r.coord}: {fmt_bytes(r.training_bytes)}" for r in report.ranks),
        help=f"move blocks off stage {worst.stages[0]}"
        + (" (1F1B keeps p - r microbatches of activations on rank r, so early stages should hold fewer blocks)"
           if plan.schedule != "gpipe" and worst.coord < light.coord else ""))]


def _skew_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0807: under the plan's routing skew the other expert-parallel ranks wait long."""
    from meshllm_dsl.planner import moe as planner_moe

    return planner_moe.skew_warnings(report)


# The plan's warnings (the seed's pitfalls, with numbers), in the order `meshc plan` prints them.
WARNINGS: tuple[Callable[[PlanReport], list[Diagnostic]], ...] = (
    _memory_warnings, _over_sharding_warnings, _communication_warnings, _network_tensor_warnings, _bubble_warnings,
    _imbalance_warnings, _skew_warnings,
)


def plan_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0801 - W0807 for one analysed plan: WARNINGS in order."""
    return [d for warnings in WARNINGS for d in warnings(report)]


def _tensor_comm_by_axis(report: PlanReport) -> dict[str, float]:
    """Seconds per step of tensor-parallel collectives on the slowest rank, per sharding axis."""
    slow = max(report.ranks, key=lambda r: r.compute_s + r.comm_seconds(("tensor", "loss")))
    out: dict[str, float] = {}
    for c in slow.comms:
        if c.kind in ("tensor", "loss"):
            for a in c.axis.split(" x "):
                out[a] = out.get(a, 0.0) + c.seconds
    return out


def _fit_help(report: PlanReport, biggest: str) -> str:
    plan = report.plan
    if biggest == "optimizer states" and plan.data_size > 1 and plan.zero < 1:
        return (f"shard the optimizer states over the data axes: `optimizer adamw {{ zero 1 over "
                f"{' * '.join(plan.roles.batch)} }}` divides them by {plan.data_size}")
    if biggest == "activations" and plan.batch // (plan.data_size * plan.microbatches) > 1:
        return (f"more microbatches make each smaller: activations scale with the microbatch size "
                f"({report.micro_batch} sequences now)")
    path = plan.span.file if plan.span is not None else "FILE"
    return (f"shard over more devices (tensor or pipeline), or run `meshc suggest {path} --devices "
            f"{plan.mesh.devices} --device {report.device.name}` to search the plans that fit")


# ---------------------------------------------------------------- rendering


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return _ranges(list(ranks)) if ranks else "-"


def _heading_lines(rep: PlanReport) -> list[str]:
    """The plan, its mesh and device, and the shape of its step."""
    plan, dev, mesh = rep.plan, rep.device, rep.plan.mesh
    axes = " x ".join(f"{a.name} {a.size}" for a in mesh.axes)
    hosts = f", {mesh.hosts} hosts{' assumed' if rep.hosts_assumed else ''}" if mesh.hosts > 1 else ""
    return [
        f"plan {plan.name}: {plan.model.name} on {mesh.name} ({mesh.devices} x {dev.name}{' (assumed)' if rep.device_assumed else ''}: {axes}{hosts})",
        (f"  batch {plan.batch} x seq {plan.seq}; {plan.data_size} data replica{'s' if plan.data_size != 1 else ''} x "
        f"{plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''} of {rep.micro_batch} sequence{'s' if rep.micro_batch != 1 else ''}; "
        f"{f'schedule {plan.schedule}' if plan.pipeline_size > 1 else 'no pipeline'}{f' (virtual {plan.virtual})' if plan.virtual > 1 else ''}; "
        f"{plan.optimizer}, ZeRO {plan.zero}{' over ' + ' x '.join(plan.roles.batch_shard) if plan.zero else ''}"
        + (f"; context {plan.context_size} over {' x '.join(plan.roles.context)} ({plan.seq // plan.context_size:,} tokens "
           "of each sequence per rank)" if plan.roles.context else "")),
    ]


def _model_lines(rep: PlanReport) -> list[str]:
    """The whole model: parameters, weights, training state and KV cache, before any sharding."""
    plan, model = rep.plan, rep.plan.model
    w = DTYPES[plan.dtype]
    return [
        "",
        "model",
        f"  parameters      {model.numel:,} ({fmt_count(model.numel)})",
        *_active_lines(plan),
        f"  weights         {model.numel * w / GB:.2f} GB = {model.numel * w / GIB:.2f} GiB in {plan.dtype}",
        _training_state_line(plan, rep.optimizer_k, model.numel),
        (f"  KV cache        {rep.kv_bytes_per_token:,} bytes per token in {plan.dtype}; "
        f"{fmt_bytes(kv_cache_bytes(plan, plan.seq) * plan.batch)} at batch {plan.batch} x seq {plan.seq}"
        + (" (sliding-window layers hold their window only)" if kv_cache_bytes(plan, plan.seq) < rep.kv_bytes_per_token * plan.seq else "")
        + (f"; decoding keeps it gathered: each of the {plan.context_size} context ranks holds all of it"
           if plan.roles.context else "")),
    ]


def _memory_lines(rep: PlanReport) -> list[str]:
    """Memory per device: a row per pipeline rank, then what the fullest one holds by dtype."""
    dev = rep.device
    rows = []
    for rc in rep.ranks:
        rows.append([str(rc.coord), _ranks_text(rc.ranks), rc.label, fmt_count(rc.params_global), fmt_count(rc.params_local),
                     fmt_bytes(rc.weight_bytes), fmt_bytes(rc.grad_bytes), fmt_bytes(rc.optimizer_bytes),
                     f"{fmt_bytes(rc.activation_bytes)} ({rc.in_flight} mb)", fmt_bytes(rc.training_bytes),
                     "yes" if rc.training_bytes <= dev.memory_bytes else "NO"])
    return [
        "",
        "memory per device (a row per pipeline rank; the tensor and data ranks at it hold the same)",
        *("  " + x for x in table_text(
            ["pp", "ranks", "layers", "params", "on device", "weights", "grads", "optimizer", "activations", "total", "fits"],
            rows, right={3, 4, 5, 6, 7, 8, 9})),
        *_fullest_rank_lines(rep),
        "  activations per microbatch: " + ", ".join(f"pp {rc.coord} {fmt_bytes(rc.activation_bytes_per_microbatch)}" for rc in rep.ranks),
        f"  inference (weights + KV cache at batch {rep.plan.batch} x seq {rep.plan.seq}): "
        + ", ".join(f"pp {rc.coord} {fmt_bytes(rc.inference_bytes)}" for rc in rep.ranks)
        + f" -> {'fits' if rep.fits_inference else 'does NOT fit'}",
    ]


def _fullest_rank_lines(rep: PlanReport) -> list[str]:
    """The rank needing the most memory: its bytes by dtype, and the FSDP2 buffers it holds."""
    plan = rep.plan
    worst = max(rep.ranks, key=lambda r: r.training_bytes)
    # Weights, gradients and moments are the stored parameters' dtype: the master one with `precision`
    # (FSDP2's sharded parameters, or autocast's fp32 ones at ZeRO 0), else the plan's.
    by_dtype = {plan.dtype: worst.activation_bytes + worst.gather_buffer_bytes}
    held = plan.master_dtype or plan.dtype
    by_dtype[held] = by_dtype.get(held, 0) + worst.weight_bytes + worst.grad_bytes + worst.optimizer_bytes
    if worst.grad_accum_bytes:
        accum_dtype = plan.reduce_dtype or plan.dtype
        by_dtype[accum_dtype] = by_dtype.get(accum_dtype, 0) + worst.grad_accum_bytes
    lines = [
        f"  by dtype on pipeline rank {worst.coord}: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in by_dtype.items())
        + (f"; {fmt_count(worst.params_replicated)} parameters are whole copies on every device (norms, biases, unsharded layers)"
           if not runs_fsdp(plan) or not plan.roles.batch_shard else
           f"; {fmt_count(worst.params_replicated)} parameters are not split by the layout (norms, biases, unsharded layers), "
           f"ZeRO-{plan.zero} shards them over {' x '.join(plan.roles.batch_shard)} like the rest"),
    ]
    if worst.gather_buffer_bytes:
        what = ("every unit, kept from its forward to its backward" if plan.zero in (1, 2)
                else "every unit: the pipeline schedule keeps them gathered between backwards"
                if plan.roles.pipeline and worst.gather_buffer_bytes == worst.params_local * worst.dtype_bytes
                else "the stage root and two blocks, gathered for their forward and backward")
        lines.append(f"  ZeRO-{plan.zero} gather buffer ({what}): {fmt_bytes(worst.gather_buffer_bytes)}")
    if worst.grad_accum_bytes:
        by = "the pipeline schedule" if plan.roles.pipeline else "ZeRO-1 until its one reduce-scatter a step"
        lines.append(f"  gradient accumulators (FSDP2's unsharded gradients in {plan.reduce_dtype or plan.dtype}, kept between"
                     f" microbatches by {by}): {fmt_bytes(worst.grad_accum_bytes)}")
    return lines


def _communication_lines(rep: PlanReport) -> list[str]:
    """Communication per step: a row per axis, kind and op, on the busiest pipeline rank."""
    lines = ["", "communication per step (busiest pipeline rank per row; ring algorithm)"]
    comm_rows = [[c["axis"], c["kind"], c["op"], f"{c['calls']:,}", fmt_bytes(c["payload_bytes"]), fmt_bytes(c["wire_bytes"]),
                  fmt_seconds(c["seconds"]), "network" if c["crosses_hosts"] else "in host"] for c in rep.comm_by_axis()]
    if comm_rows:
        lines += ["  " + x for x in table_text(["axis", "kind", "op", "calls", "payload", "sent", "time", "link"], comm_rows,
                                           right={3, 4, 5, 6})]
    else:
        lines.append("  none (a single device)")
    return lines


def _bubble_lines(rep: PlanReport) -> list[str]:
    """The pipeline bubble, with the formula it comes from."""
    plan = rep.plan
    return ["", f"pipeline bubble: {rep.bubble:.1%}" + (_bubble_formula(plan, rep.bubble) if plan.pipeline_size > 1 else " (no pipeline)")]


def _step_time_lines(rep: PlanReport) -> list[str]:
    """The step's time by part on the slowest pipeline rank, and its throughput and MFU."""
    plan, dev, st = rep.plan, rep.device, rep.step
    slow = next((rc for rc in rep.ranks if rc.compute_s == st.compute_s), rep.ranks[0])
    return [
        "",
        f"step time (estimate; {dev.name} {dev.tflops:g} TFLOP/s, large matmuls at {(dev.mfu or MFU):.0%} of it"
        + (f", memory {dev.hbm_gbps:g} GB/s" if dev.hbm_gbps else "") + f", links {dev.intra_gbps:g} / {dev.inter_gbps:g} GB/s)",
        f"  compute          {fmt_seconds(st.compute_s)}   matmuls" + (" (roofline) and memory traffic" if dev.hbm_gbps else "")
        + " on the slowest pipeline rank"
        + (f" + {slow.kernels:,} kernels x {dev.kernel_us:g} us" if dev.kernel_us else "")
        + (f", of which {fmt_seconds(slow.recompute_s)} recomputes {recomputed_text(plan)} in backward"
           if plan.recompute != "none" else ""),
        f"  tensor comm      {fmt_seconds(st.tensor_s)}",
        *([f"  expert comm      {fmt_seconds(st.expert_s)}   " + _expert_note(rep)] if plan.roles.expert else []),
        f"  pipeline comm    {fmt_seconds(st.pipeline_s)}",
        f"  bubble           {fmt_seconds(st.bubble_s)}",
        f"  data-parallel    {fmt_seconds(st.data_s)}" + _overlap_note(rep),
        *([f"  context comm     {fmt_seconds(st.context_s)}   {_context_text(rep)}"] if plan.context_size > 1 else []),
        *_shared_cores_lines(rep),
        f"  total            {fmt_seconds(st.total_s)}   {st.tokens / st.total_s:,.0f} tokens/s, model flops utilisation {rep.mfu:.0%}"
        f" ({st.model_flops / st.tokens / 1e9:,.3g} GFLOP per token: 6 (N - N_embedding) + 12 l h q t)",
    ]


def _shared_cores_lines(rep: PlanReport) -> list[str]:
    """Ranks time-sharing a host's cores: the step their host time sets (none when each has a device)."""
    dev, st = rep.device, rep.step
    if not st.shared_s:
        return []
    framework = ", ".join(f"{v:g} us per {what}" for v, what in (
        (dev.collective_cpu_us, "collective call"), (dev.stage_cpu_us, "pipeline action"),
        (dev.fsdp_cpu_us, "FSDP2 collective")) if v)
    return [f"  shared cores     {fmt_seconds(st.shared_s)}   {rep.plan.mesh.devices_per_host} ranks per host on {dev.cores:g} cores: their host time "
            f"(compute{', ' + framework if framework else ''}) / cores"
            + (", then the pipeline's fill and drain" if rep.bubble else "")
            + f"; a device per rank would take {fmt_seconds(st.critical_s)}"]


def _peak_lines(rep: PlanReport) -> list[str]:
    """The step's peak against the device's memory."""
    return ["", f"peak memory {fmt_bytes(rep.peak_training_bytes)} of {fmt_bytes(rep.device.memory_bytes)} per device"
            " (tensors allocated, as torch.cuda.max_memory_allocated counts them): "
            + ("fits" if rep.fits else "does NOT fit")]


def _skew_lines(rep: PlanReport) -> list[str]:
    """What the plan's routing skew does to each expert-parallel rank (nothing without `skew`)."""
    from meshllm_dsl.planner import moe as planner_moe

    return planner_moe.skew_lines(rep)


# `meshc plan`'s report, section by section in the order printed; each but the first opens with the
# blank line that separates it, and a section with nothing to say (the skew without `skew`) prints nothing.
REPORT_SECTIONS: tuple[Callable[[PlanReport], list[str]], ...] = (
    _heading_lines, _model_lines, _memory_lines, _communication_lines, _bubble_lines, _step_time_lines, _peak_lines,
    _skew_lines,
)


def report_text(rep: PlanReport) -> str:
    """`meshc plan`'s report of one plan: REPORT_SECTIONS in order."""
    return "\n".join(line for section in REPORT_SECTIONS for line in section(rep)) + "\n"


def _active_lines(plan: PlanIR) -> list[str]:
    """A moe model's parameters one token uses (planner_moe.active_parameters)."""
    from meshllm_dsl.planner import moe as planner_moe

    if not any(planner_moe.moe_units(plan)):
        return []
    active = planner_moe.active_parameters(plan)
    return [f"  active          {active:,} ({fmt_count(active)}) per token: top_k of the experts, router and shared experts"]


def kv_gather_bytes_per_layer(plan: PlanIR) -> int:
    """Context parallelism: bytes one attention layer's K / V all-gather hands over per microbatch,
    k and v of the whole sequence, [mb, s, kv_heads / t, head_dim] each (each rank sends its s / c)."""
    rep = plan.model.repeat
    if rep is None or plan.context_size == 1:
        return 0
    micro = plan.batch // (plan.data_size * plan.microbatches)
    for u in rep.body:
        if primitives.of(u).caches_kv:
            kv_leaf = next(lf for lf in u.leaves if lf.name in ("k", "qkv"))
            kv_local = int(u.attr("kv_heads")) // axes_size(plan, plan.block_class(0).placement(f"{u.name}.{kv_leaf.name}"))  # type: ignore[arg-type]
            return 2 * micro * plan.seq * kv_local * int(u.attr("head_dim")) * DTYPES[plan.dtype]  # type: ignore[arg-type]
    return 0


def _context_text(rep: PlanReport) -> str:
    plan = rep.plan
    n = plan.context_size
    per_layer = kv_gather_bytes_per_layer(plan)
    return (f"K / V all-gathered over {' x '.join(plan.roles.context)} ({n}): {fmt_bytes(per_layer)} per layer and "
            f"microbatch ({fmt_bytes(per_layer * (n - 1) // n)} sent per rank), dK / dV reduce-scattered back; not "
            "overlapped with the compute (each attention waits for its gather)")


def report_json(rep: PlanReport) -> dict[str, Any]:
    plan, model = rep.plan, rep.plan.model
    w = DTYPES[plan.dtype]
    st = rep.step
    return {
        "plan": plan.name,
        "model": model.name,
        "mesh": {"name": plan.mesh.name, "axes": {a.name: a.size for a in plan.mesh.axes}, "hosts": plan.mesh.hosts,
                 "hosts_assumed": rep.hosts_assumed, "devices": plan.mesh.devices},
        "device": {**attrs.asdict(rep.device), "assumed": rep.device_assumed},
        "dtype": plan.dtype,
        "batch": plan.batch, "seq": plan.seq, "microbatches": plan.microbatches, "micro_batch": rep.micro_batch, "recompute": plan.recompute,
        "schedule": plan.schedule, "virtual": plan.virtual, "optimizer": plan.optimizer, "zero": plan.zero,
        "zero_axes": list(plan.roles.batch_shard),
        "context_axes": list(plan.roles.context),
        "kv_gather_bytes_per_layer": kv_gather_bytes_per_layer(plan),
        "parameters": model.numel,
        "weight_bytes": model.numel * w,
        "optimizer_bytes_per_param": rep.optimizer_k,
        "kv_cache_bytes_per_token": rep.kv_bytes_per_token,
        "kv_cache_bytes": kv_cache_bytes(plan, plan.seq) * plan.batch,
        "bubble": rep.bubble,
        "ranks": [
            {"pipeline_coord": rc.coord, "stages": list(rc.stages), "layers": rc.label, "ranks": list(rc.ranks),
             "params": rc.params_global, "params_per_device": rc.params_local, "params_replicated": rc.params_replicated,
             "weight_bytes": rc.weight_bytes, "grad_bytes": rc.grad_bytes, "optimizer_bytes": rc.optimizer_bytes,
             "gather_buffer_bytes": rc.gather_buffer_bytes,
             "activation_bytes_per_microbatch": rc.activation_bytes_per_microbatch, "in_flight": rc.in_flight,
             "activation_bytes": rc.activation_bytes, "transient_bytes": rc.transient_bytes, "kv_cache_bytes": rc.kv_cache_bytes,
             "grad_accum_bytes": rc.grad_accum_bytes,
             "training_bytes": rc.training_bytes, "inference_bytes": rc.inference_bytes, "compute_s": rc.compute_s,
             "recompute_s": rc.recompute_s, "kernels": rc.kernels, "kernel_s": rc.kernel_s, "host_s": rc.host_s,
             "comms": [attrs.asdict(c) for c in rc.comms]}
            for rc in rep.ranks
        ],
        "communication": rep.comm_by_axis(),
        "expert_all_to_all": expert_layer_comm(rep),
        "step": {"compute_s": st.compute_s, "tensor_s": st.tensor_s, "expert_s": st.expert_s, "pipeline_s": st.pipeline_s, "bubble_s": st.bubble_s,
                 "data_s": st.data_s, "context_s": st.context_s, "shared_s": st.shared_s, "critical_s": st.critical_s, "total_s": st.total_s, "model_flops": st.model_flops, "tokens": st.tokens,
                 "tokens_per_s": st.tokens / st.total_s if st.total_s else None, "mfu": rep.mfu, "assumed_matmul_mfu": rep.device.mfu or MFU},
        "peak_training_bytes": rep.peak_training_bytes,
        "peak_inference_bytes": rep.peak_inference_bytes,
        "fits": rep.fits,
        "fits_inference": rep.fits_inference,
        **_moe_json(rep),
    }


def _moe_json(rep: PlanReport) -> dict[str, Any]:
    """A moe model's active parameters and, with `skew`, its per expert-parallel rank figures."""
    from meshllm_dsl.planner import moe as planner_moe

    if not any(planner_moe.moe_units(rep.plan)):
        return {}
    sk = planner_moe.skew_report(rep)
    return {"active_parameters": planner_moe.active_parameters(rep.plan),
            "skew": None if sk is None else {**attrs.asdict(sk, recurse=True), "wait_share": sk.wait_share}}


def _bubble_formula(plan: PlanIR, bubble: float) -> str:
    """How `plan report` explains the bubble: the closed form, and where torch's order (which the
    number comes from) differs from it, the closed form's value as the reference."""
    p, m, v = plan.pipeline_size, plan.microbatches, plan.virtual
    closed = bubble_fraction(plan.schedule, p, m, v)
    formula = f"(p - 1) / (m + p - 1){' / v' if v > 1 else ''} with p = {p}, m = {m}" + (f", v = {v}" if v > 1 else "")
    if abs(closed - bubble) < 5e-4:
        return f" = {formula}"
    return f" in torch's {plan.schedule} order (the closed form {formula} gives {closed:.1%})"
