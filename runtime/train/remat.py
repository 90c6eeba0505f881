"""Activation recomputation (`recompute = blocks | attention | ops [every N]` in a plan).

Generated code wraps the recomputed region in ``rt.recompute(fn, *args)``: PyTorch's non-reentrant
``torch.utils.checkpoint`` (``use_reentrant=False``, what torchtitan and Megatron-LM's
``--recompute-granularity`` use in PyTorch today). The region keeps only its inputs for backward; its
backward reruns the forward first, tensor-parallel collectives included. Those collectives are
autograd Functions, so the rerun does not add a second gradient: only the recomputed graph is
differentiated, once. Every rank of a tensor group reruns the same region at the same point of its
backward, so the collectives still match up. The model has no dropout, so no RNG state needs
replaying (``preserve_rng_state`` is left on anyway).

`recompute = ops` is torchtitan's selective op-level checkpointing (`selective` / `op`): the same
region, run under ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with torchtitan's
policy (torchtitan/parallelisms/parallelize_llama.py at 9dec370, the commit of its Llama 3.1
benchmarks: ``_save_list`` and ``_get_custom_policy``). It keeps (MUST_SAVE) the outputs of the
attention kernel and of every *odd* matrix product of the region, counted in forward order (the
1st, 3rd, 5th, ...: in a Llama block q, v, gate and down) and recomputes the even ones (k, o, up)
and everything else (norms, rotary, activations, elementwise products). torchtitan's models have
no biases, so its list names ``aten.mm`` only; a biased linear runs ``aten.addmm`` here and is
counted as the same kind of product. The other kernels its list names (the attention backends,
``abs`` and ``max`` for float8 scales, the functional ``reduce_scatter_tensor``) are kept too, as
are batched products (``bmm``: attention without a fused kernel, stacked experts), which its
models never run. Backward then reruns the cheap ops and every second product; the collectives are
recomputed too (in-place c10d ops cannot be cached), so every rank of a tensor group reruns them
at the same point, as with full recomputation. meshllm_dsl/planner/recompute.py plans the same.

Without gradients (inference, decoding) the region just runs. In a packed step the rerun runs
with the forward's documents and positions (runtime/model/documents.py), captured when it ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from meshllm_dsl.runtime.model import documents

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
    packing = documents.active()
    if packing is not None:
        # The rerun in backward sees the rows of this forward's microbatch, whenever backward runs.
        inner = fn

        def fn(*a: Any, **k: Any) -> Any:
            with documents.packed(packing):
                return inner(*a, **k)

    return _torch_checkpoint(fn, *args, use_reentrant=False, **how, **kwargs)


def recompute(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, recomputed in backward instead of keeping what it saves (keyword
    arguments are settings such as attention's window, or parameters such as its sinks: never
    activations to hold)."""
    return _checkpoint(fn, args, kwargs)


def _ops(*names: str, root: Any = None) -> frozenset[Any]:
    """The default overloads of the named ops that this build of torch has."""
    root = torch.ops.aten if root is None else root
    return frozenset(getattr(root, n).default for n in names if hasattr(root, n))


# A linear layer's product (aten.linear folds a [b, s, in] input into one of these): the ones the
# policy counts, keeping the odd and recomputing the even (torchtitan's `mm_count % 2`).
COUNTED_OPS = _ops("mm", "addmm")
# Kept whenever they run: attention kernels (each backend's), batched products, and the rest of
# torchtitan's list (float8's abs / max, the functional reduce-scatter of async tensor parallelism).
KEPT_OPS = (_ops("bmm", "baddbmm", "abs", "max", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable")
            | _ops("reduce_scatter_tensor", root=torch.ops._c10d_functional))


def _tensors(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _policy() -> Callable[..., CheckpointPolicy]:
    """A fresh policy for one run of a region: its forward and its rerun each count their products
    from 1, so the rerun recomputes exactly the products the forward did not keep."""
    counted = {False: 0, True: 0}  # products seen so far, by ctx.is_recompute

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in COUNTED_OPS:
            counted[ctx.is_recompute] += 1
            keep = counted[ctx.is_recompute] % 2 == 1
        else:
            keep = op in KEPT_OPS
        if not keep:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute:
            # The cache of kept outputs lives outside autograd's saved-tensor hooks: report it.
            for hold in HOLDERS:
                for t in _tensors(ctx.op_output):
                    hold(t)
        return CheckpointPolicy.MUST_SAVE

    return policy


def _contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy())


def recompute_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` keeping only its inputs, its attention outputs and every other matmul
    output for backward, which recomputes the rest (torchtitan's `selective op`)."""
    return _checkpoint(fn, args, kwargs, context_fn=_contexts)
