"""Activation recomputation (`recompute = blocks | attention` in a plan).

Generated code wraps the recomputed region in ``rt.recompute(fn, *args)``: PyTorch's non-reentrant
``torch.utils.checkpoint`` (``use_reentrant=False``, what torchtitan and Megatron-LM's
``--recompute-granularity`` use in PyTorch today). The region keeps only its inputs for backward; its
backward reruns the forward first, tensor-parallel collectives included. Those collectives are
autograd Functions, so the rerun does not add a second gradient: only the recomputed graph is
differentiated, once. Every rank of a tensor group reruns the same region at the same point of its
backward, so the collectives still match up. The model has no dropout, so no RNG state needs
replaying (``preserve_rng_state`` is left on anyway).

Without gradients (inference, decoding) the region just runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

__all__ = ["recompute"]

# Counters of `profile.saved_bytes` that are active: a checkpoint keeps its inputs for the
# recomputation outside autograd's saved-tensor hooks, so it reports them here itself.
HOLDERS: list[Callable[[torch.Tensor], Any]] = []


def recompute(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, recomputed in backward instead of keeping what it saves."""
    if not torch.is_grad_enabled():
        return fn(*args)
    for hold in HOLDERS:
        for a in args:
            if isinstance(a, torch.Tensor):
                hold(a)
    return _torch_checkpoint(fn, *args, use_reentrant=False)
