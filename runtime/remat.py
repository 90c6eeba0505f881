"""Activation recomputation (`recompute = blocks | attention | ops [every N]` in a plan).

Generated code wraps the recomputed region in ``rt.recompute(fn, *args)``: PyTorch's non-reentrant
``torch.utils.checkpoint`` (``use_reentrant=False``, what torchtitan and Megatron-LM's
``--recompute-granularity`` use in PyTorch today). The region keeps only its inputs for backward; its
backward reruns the forward first, tensor-parallel collectives included. Those collectives are
autograd Functions, so the rerun does not add a second gradient: only the recomputed graph is
differentiated, once. Every rank of a tensor group reruns the same region at the same point of its
backward, so the collectives still match up. The model has no dropout, so no RNG state needs
replaying (``preserve_rng_state`` is left on anyway).

`recompute = ops` is torchtitan's selective op-level checkpointing: the same region, run under
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with a policy that keeps (MUST_SAVE)
the outputs of the matrix products and of the attention kernel and recomputes everything else
(norms, rotary, activations, elementwise products). Backward then reruns only the cheap ops; the
collectives are recomputed too (in-place c10d ops cannot be cached), so every rank of a tensor
group reruns them at the same point, as with full recomputation. torchtitan also recomputes every
second matmul to save more; here all are kept, as the plan's setting says.

Without gradients (inference, decoding) the region just runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

__all__ = ["recompute", "recompute_ops"]

# Counters of `profile.saved_bytes` that are active: a checkpoint keeps its inputs for the
# recomputation outside autograd's saved-tensor hooks, so it reports them here itself.
HOLDERS: list[Callable[[torch.Tensor], Any]] = []


def _checkpoint(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **how: Any) -> Any:
    """torch's non-reentrant checkpoint of ``fn``, reporting the inputs it keeps to the active
    counters (``how``: torch's own options, e.g. a selective ``context_fn``)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    for hold in HOLDERS:
        for a in args:
            if isinstance(a, torch.Tensor):
                hold(a)
    return _torch_checkpoint(fn, *args, use_reentrant=False, **how, **kwargs)


def recompute(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, recomputed in backward instead of keeping what it saves (keyword
    arguments are settings such as attention's window, never tensors to hold)."""
    return _checkpoint(fn, args, kwargs)


def _kept_ops() -> frozenset[Any]:
    """The ops whose outputs `recompute = ops` keeps: matrix products and attention kernels (each
    backend's; the names torch has in this build)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


KEPT_OPS = _kept_ops()


def _tensors(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in KEPT_OPS:
        if not ctx.is_recompute:
            # The cache of kept outputs lives outside autograd's saved-tensor hooks: report it.
            for hold in HOLDERS:
                for t in _tensors(ctx.op_output):
                    hold(t)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` keeping only its inputs and its matmul and attention outputs for
    backward, which recomputes the rest (torchtitan's `selective op`)."""
    return _checkpoint(fn, args, kwargs, context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))
