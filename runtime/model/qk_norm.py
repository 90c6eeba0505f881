"""RMSNorm of attention's q and k before rotary (``attention(..., qk_norm = head | full)``).

``head``: over each head's head_dim with one scale shared by every head; a rank
holding some heads normalises them on its own (the scale's gradient is summed over the tensor axis,
``ShardSpec.partial_grad``).  ``full``: over the whole projection, heads x head_dim per token,
with a scale per output; split by heads, each rank holds part of every token's row, so the sum of
squares is all-reduced over the projection's axes before the mean.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from meshllm_dsl.runtime.model.layers import _compute_dtype, _rms_norm, _RMSNormFn, offset_rms_norm
from meshllm_dsl.runtime.parallel.collectives import copy_to, reduce_from

__all__ = ["rms_norm", "split_rms_norm"]


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """RMSNorm over the last dim of ``x`` (here [b, s, heads, head_dim] with ``weight`` [head_dim]),
    the runtime's RMSNorm maths (HF Llama's: normalise in fp32, scale in the input dtype; with an
    ``offset``: scale by (offset + weight) in fp32, then cast)."""
    if offset:
        return offset_rms_norm(x, weight, eps, offset)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps)
    return _rms_norm(x, weight, eps)


def split_rms_norm(x: Tensor, weight: Tensor, eps: float, group: ProcessGroup | None, width: int) -> Tensor:
    """RMSNorm over rows of ``width`` values of which this rank holds ``x`` [b, s, width / n] (its
    columns of the projection) and ``weight`` [width / n] the matching scales (in fp32, the scale
    applied before the cast back).  ``group`` None: the whole row."""
    h = x.to(_compute_dtype(x.dtype))
    squares = h.pow(2).sum(-1, keepdim=True)  # [b, s, 1]: this rank's part of each row's sum
    if group is not None:
        # [b, s, 1] summed over the group forward; backward each rank's gradient of the total is
        # only its own columns' part, so it is summed too (copy_to): all-reduce both ways.
        squares = reduce_from(copy_to(squares, group), group)
    rstd = torch.rsqrt(squares / width + eps)
    return (weight * (h * rstd)).to(x.dtype)
