"""Megatron-style tensor-parallel collectives as autograd Functions over plain ``torch.distributed``.

``torch.distributed.nn.functional.all_reduce`` cannot be used for these: its backward all-reduces
again, so a row-parallel layer gets weight gradients tensor-size times too large (see
tests/runtime/test_collectives.py), and its all_gather fails on sub-groups that lack global rank 0.
Every operator treats ``group=None`` (an axis of size 1) as the identity, so generated code can
call them unconditionally.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from meshllm_dsl.runtime.model import decode

__all__ = [
    "all_gather_cat",
    "all_reduce_sum",
    "all_reduce_",
    "polls",
    "wait",
    "copy_to",
    "copy_to_linear",
    "uses_module_forward",
    "gather_from",
    "gather_seq",
    "gather_seq_linear",
    "reduce_from",
    "reduce_scatter_seq",
    "sequence_sharded",
    "split_seq",
    "split_to",
]

# The sequence dim of the [b, s, hidden] activations sequence parallelism shards.
SEQ_DIM = 1


# CPUs this process may run on (its affinity, not the machine's count).
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def polls(x: Tensor) -> bool:
    """Whether to wait for a collective on ``x`` by polling it rather than blocking.

    Only gloo (CPU tensors) and only while this host runs no more of the job's ranks than this
    process may use cores (``_ranks_on_this_host``).  A
    blocked rank sleeps, its core idles, and waking it when gloo's threads finish costs far more
    than the transfer on a virtual machine: a 512 KiB all-reduce right after compute took 1-9 ms
    blocked against ~0.5-0.8 ms polled, and the tensor-parallel step of bench/vs_dtensor.py went
    from 131-136 ms to 109-118 ms.  With more ranks than cores a polling rank takes CPU from a
    rank with work: tiny_llama on 8 ranks over 2 cores ran 6-7x slower polled, so it blocks.
    ``MESHLLM_GLOO_WAIT`` = ``poll`` or ``block`` overrides the rule (``auto``, the default).
    """
    if x.device.type != "cpu":
        return False  # NCCL's wait only orders streams; polling would block the host on the GPU
    # The rule sees only this job's ranks: with other jobs on the same cores, MESHLLM_GLOO_WAIT=block.
    choice = os.environ.get("MESHLLM_GLOO_WAIT", "auto")
    if choice not in ("auto", "poll", "block"):
        raise ValueError(f"MESHLLM_GLOO_WAIT must be auto, poll or block, not {choice!r}")
    if choice != "auto":
        return choice == "poll"
    return _ranks_on_this_host() <= _CORES


def _ranks_on_this_host() -> int:
    env = os.environ
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    master = env.get("MASTER_ADDR", "")
    if world.isdigit() and (master in ("localhost", "::1") or master.startswith("127.")):
        # A rendezvous at a loopback address: every node that joined it is this machine (as when
        # `meshc run --nnodes 2` is tried on one host), so all the job's ranks share its cores.
        return int(world)
    return int(local) if local.isdigit() else dist.get_world_size()


# Past this, a wait blocks after all: a peer that lags this long costs more than one wake-up, and
# a Work that never reports completion (gloo's reduce_scatter_single does not, hence it is never
# polled) cannot spin forever.
_POLL_SECONDS = 0.05


def wait(work: Any, x: Tensor) -> None:
    """Wait for ``work``, an all-reduce or all-gather of ``x`` started with ``async_op=True``
    (their gloo Work reports ``is_completed``); raises what it raised (a peer that died, the
    group's timeout)."""
    # Under torch.compile (`compile = blocks`) the wait is the collective's own: a host-side spin is
    # nothing Dynamo can trace.
    if not torch.compiler.is_compiling() and polls(x):
        deadline = time.perf_counter() + _POLL_SECONDS
        # sched_yield: gloo's own threads, which do the transfer, get this core at once.
        while not work.is_completed() and time.perf_counter() < deadline:
            os.sched_yield()
    work.wait()


def all_reduce_(x: Tensor, group: ProcessGroup, op: Any = dist.ReduceOp.SUM) -> Tensor:
    """In-place all-reduce of ``x`` over ``group`` (waited for as ``wait`` says); returns x."""
    wait(dist.all_reduce(x, op=op, group=group, async_op=True), x)
    return x


def all_reduce_sum(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Out-of-place sum over ``group`` without autograd."""
    if group is None:
        return x
    # [any shape] -> same shape, summed over the group.
    return all_reduce_(x.contiguous().clone(), group)


def all_gather_cat(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in group-rank order, without autograd."""
    parts = [
        torch.empty_like(x, memory_format=torch.contiguous_format)
        for _ in range(dist.get_world_size(group))
    ]
    # [.., n_local, ..] per rank -> [.., n_local * world, ..] along dim, in group-rank order.
    wait(dist.all_gather(parts, x.contiguous(), group=group, async_op=True), x)
    return torch.cat(parts, dim=dim)


def _own_chunk(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {n} ranks")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {n} ranks")
    # reduce_scatter_single splits dim 0: bring `dim` to the front (Megatron keeps [s, b, h] for this).
    full = x.movedim(dim, 0).contiguous()
    out = torch.empty((full.shape[0] // n, *full.shape[1:]), dtype=x.dtype, device=x.device)
    # [.., s, ..] per rank -> [.., s / n, ..]: the sum over the group of this rank's chunk along dim.
    dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group)  # blocks: see wait
    # Contiguous again: the result is the residual stream, which pipeline stages send as is.
    return out.movedim(0, dim).contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _own_chunk(grad, ctx.group, ctx.dim), None, None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_gather_cat(grad, ctx.group, ctx.dim), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return all_gather_cat(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _reduce_scatter(grad, ctx.group, SEQ_DIM), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _reduce_scatter(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_gather_cat(grad, ctx.group, SEQ_DIM), None


def copy_to(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """f: identity forward; all-reduce (sum) of the gradient over ``group`` backward.

    Placed where a replicated activation enters column-parallel layers, whose per-rank input
    gradients are partial sums.
    """
    return x if group is None else _CopyTo.apply(x, group)


def reduce_from(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """g: all-reduce (sum) forward; identity backward.  Partial(group) -> Replicate."""
    return x if group is None else _ReduceFrom.apply(x, group)


def gather_from(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """All-gather and concatenate along ``dim`` forward; keep own chunk backward.

    Shard(dim) -> Replicate; chunks are ordered by group rank.
    """
    return x if group is None else _GatherFrom.apply(x, group, dim)


def split_to(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """Keep own chunk along ``dim`` forward; all-gather backward.  Replicate -> Shard(dim)."""
    return x if group is None else _SplitTo.apply(x, group, dim)


# ---------------------------------------------------------------- sequence parallelism
# Megatron-LM's sequence-parallel mappings (Korthikanti et al. 2022) over [b, s, hidden]: between
# tensor-parallel sublayers the activations are Shard(seq), [b, s / t, hidden].  While a
# DecodeSession is active (incremental decoding feeds one token at a time, which does not split)
# the sequence stays whole and each operator acts as its tensor-parallel counterpart instead.


def sequence_sharded() -> bool:
    """Whether activations between sublayers are sharded along the sequence now (not decoding)."""
    return decode.active() is None


def gather_seq(x: Tensor, group: ProcessGroup | None, partial_grad: bool = True) -> Tensor:
    """Shard(seq) -> Replicate: all-gather along the sequence forward.

    Backward: reduce-scatter when the consumer is tensor-parallel (each rank's gradient is a
    partial sum: Megatron's ``gather_from_sequence_parallel_region``), else keep own chunk
    (``partial_grad=False``: a replicated consumer's gradient is already whole on every rank).
    """
    if group is None:
        return x
    if not sequence_sharded():
        return copy_to(x, group) if partial_grad else x
    if not partial_grad:
        return _GatherFrom.apply(x, group, SEQ_DIM)
    return _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Partial -> Shard(seq): reduce-scatter along the sequence forward, all-gather backward
    (Megatron's ``reduce_scatter_to_sequence_parallel_region``)."""
    if group is None:
        return x
    if not sequence_sharded():
        return reduce_from(x, group)
    return _ReduceScatterSeq.apply(x, group)


def split_seq(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Replicate -> Shard(seq): keep own chunk of the sequence forward, all-gather backward
    (Megatron's ``scatter_to_sequence_parallel_region``)."""
    if group is None or not sequence_sharded():
        return x
    return _SplitTo.apply(x, group, SEQ_DIM)


def _column_forward(ctx: Any, x: Tensor, inp: Tensor, group: ProcessGroup, params: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
    """Column layers (weight, bias pairs in ``params``) applied to ``inp``; ``x`` and the weights
    saved for backward, one [b, s, out_local] output per layer."""
    weights, biases = params[0::2], params[1::2]
    ctx.group, ctx.has_bias = group, tuple(b is not None for b in biases)
    ctx.save_for_backward(x, *weights)
    return tuple(F.linear(inp, w, b) for w, b in zip(weights, biases))


def _column_input_grad(g2s: list[Tensor | None], weights: list[Tensor]) -> Tensor | None:
    """This rank's partial sum of the shared input's gradient, [tokens, h], accumulated in place
    (no temporary per layer); None when no output has a gradient."""
    gx: Tensor | None = None
    for g2, w in zip(g2s, weights):
        if g2 is not None:
            gx = g2 @ w if gx is None else gx.addmm_(g2, w)
    return gx


def _column_param_grads(ctx: Any, g2s: list[Tensor | None], flat: Tensor) -> list[Tensor | None]:
    """Each layer's weight gradient [out_local, h] (from the input ``flat`` [tokens, h]) and bias
    gradient, where autograd wants them."""
    out: list[Tensor | None] = []
    for i, (g2, has_bias) in enumerate(zip(g2s, ctx.has_bias)):
        wants_weight, wants_bias = ctx.needs_input_grad[2 + 2 * i : 4 + 2 * i]
        out.append(g2.t() @ flat if g2 is not None and wants_weight else None)
        out.append(g2.sum(0) if g2 is not None and has_bias and wants_bias else None)
    return out


class _GatherSeqLinear(torch.autograd.Function):
    """All-gather x along the sequence, then column layers on the whole sequence; for backward keep
    only this rank's slice of x and gather it again there (Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication`` with sequence parallelism), so the layers'
    shared input costs [b, s / t, h] of activation memory, not [b, s, h]."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, *params: Tensor | None) -> tuple[Tensor, ...]:
        return _column_forward(ctx, x, all_gather_cat(x, group, SEQ_DIM), group, params)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        # [b, s / t, h] -> [b, s, h] again: the weight gradients need the whole sequence.
        full = all_gather_cat(x, ctx.group, SEQ_DIM)
        flat = full.reshape(-1, full.shape[-1])
        g2s = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grads]
        gx = _column_input_grad(g2s, weights)
        gx = torch.zeros_like(flat) if gx is None else gx
        out = _column_param_grads(ctx, g2s, flat)
        # Each rank's input gradient is a partial sum over the tensor group: reduce-scatter it.
        return (_reduce_scatter(gx.view_as(full), ctx.group, SEQ_DIM), None, *out)


class _CopyToLinear(torch.autograd.Function):
    """f, then the column layers that share its output, as one Function: backward launches the
    all-reduce of the input gradient and computes the weight gradients while it is in flight
    (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``).  As ``copy_to`` followed by
    the layers, autograd computes every weight gradient first and only then all-reduces, so each
    rank waits out the collective (and the other rank's lag) doing nothing."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, *params: Tensor | None) -> tuple[Tensor, ...]:
        return _column_forward(ctx, x, x, group, params)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])  # [b*s, h]
        # [b*s, out_local] per layer (autograd passes zeros, not None, for an unused output).
        g2s = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grads]
        gx, work = None, None
        if ctx.needs_input_grad[0]:
            gx = _column_input_grad(g2s, weights)
            if gx is None:
                gx = torch.zeros_like(flat)
            # [b*s, h] all-reduce over tensor, in flight while the weight gradients are computed.
            work = dist.all_reduce(gx, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True)
        out = _column_param_grads(ctx, g2s, flat)
        if work is not None:
            wait(work, gx)
        return (None if gx is None else gx.view_as(x), None, *out)


def _layer_params(layers: tuple[nn.Module, ...]) -> list[Tensor | None]:
    """weight, bias (None without one) of each layer, flat: the fused Functions' parameter inputs."""
    return [t for m in layers for t in (m.weight, getattr(m, "bias", None))]


def uses_module_forward(layer: nn.Module) -> bool:
    """Whether a layer's matmul must go through the layer (its forward, or F.linear on its weight)
    rather than products written with its weight: torchao's Float8Linear casts in its forward, and
    an MXFP8 weight is a tensor subclass that takes any product with it for the linear's."""
    return isinstance(layer, nn.Linear) and (type(layer) is not nn.Linear
                                             or type(layer.weight) not in (nn.Parameter, Tensor))


def copy_to_linear(x: Tensor, group: ProcessGroup | None, *layers: nn.Module) -> tuple[Tensor, ...]:
    """``copy_to`` followed by each column layer applied to x: [b, s, h] Replicate -> one
    [b, s, out_local] per layer; backward all-reduces x's gradient while the layers' weight
    gradients are computed (``_CopyToLinear``).  Layers are anything with ``weight`` (and
    optionally ``bias``).  Float8 layers (``uses_module_forward``) compute their own backward, so
    they run after a plain ``copy_to``: their weight gradients no longer hide the all-reduce."""
    if any(uses_module_forward(m) for m in layers):
        y = copy_to(x, group) if group is not None else x
        return tuple(m(y) for m in layers)
    if group is None:
        return tuple(F.linear(x, m.weight, getattr(m, "bias", None)) for m in layers)
    return _CopyToLinear.apply(x, group, *_layer_params(layers))


def gather_seq_linear(x: Tensor, group: ProcessGroup | None, *layers: nn.Module) -> tuple[Tensor, ...]:
    """Shard(seq) x [b, s / t, h] -> each column layer applied to the whole sequence [b, s, h]:
    ``gather_seq`` followed by the layers, keeping only x's slice for backward (``_GatherSeqLinear``).
    Layers are anything with ``weight`` (and optionally ``bias``)."""
    if group is None or not sequence_sharded():
        return copy_to_linear(x, group, *layers)
    if any(uses_module_forward(m) for m in layers):
        y = gather_seq(x, group)  # the whole [b, s, h] kept for backward, as the layers' own Functions keep it
        return tuple(m(y) for m in layers)
    return _GatherSeqLinear.apply(x, group, *_layer_params(layers))
