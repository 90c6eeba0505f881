"""ZeRO-1: AdamW state sharded over the data-parallel ranks, updated weights broadcast in buckets.

What ``torch.distributed.optim.ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` does, in
the few lines this runtime needs.  Importing ``torch.distributed.optim`` pulls in FSDP and DTensor
(about 2.4 CPU-s per process, measured): every rank of a ZeRO plan paid that at start-up.

Each rank owns whole parameters (greedy by size, largest first, to the least loaded rank, as torch
does), keeps AdamW state for those only (``self.optim``, the local optimizer), steps them, and then
every rank broadcasts its owned parameters.  The parameters of one owner live in one flat buffer per
dtype (``.data`` is a view into it), so the sync is one broadcast per owner and dtype instead of one
per parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["ZeroAdamW"]


def partition(sizes: list[int], n: int) -> list[int]:
    """Owner rank of each parameter: largest first, each to the rank holding the fewest elements."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW whose state is split over ``group``; ``param_groups`` list every parameter.

    ``optim`` is the local ``torch.optim.AdamW`` over the parameters this rank owns (the same
    attribute ZeroRedundancyOptimizer has, so checkpoint code reads either alike).
    """

    def __init__(
        self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, **adamw: Any
    ) -> None:
        params = list(params)
        super().__init__(params, defaults=adamw)
        self.group = group
        n, me = dist.get_world_size(group), dist.get_rank(group)
        owner = partition([p.numel() for p in params], n)
        self._buckets: list[tuple[int, Tensor]] = []  # (owner group rank, flat buffer)
        for r in range(n):
            mine = [p for p, o in zip(params, owner) if o == r]
            for dtype in sorted({p.dtype for p in mine}, key=str):
                same = [p for p in mine if p.dtype == dtype]
                flat = torch.empty(sum(p.numel() for p in same), dtype=dtype, device=same[0].device)
                offset = 0
                for p in same:
                    view = flat[offset : offset + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
                    offset += p.numel()
                self._buckets.append((r, flat))
        owned = [p for p, o in zip(params, owner) if o == me]
        # An empty partition (fewer parameters than ranks) still needs an optimizer object.
        self.optim = torch.optim.AdamW(owned or [nn.Parameter(torch.zeros(0))], **adamw)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        # Hyperparameters set on the outer groups (an LR scheduler) reach the local optimizer.
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.optim.step()
        for owner, flat in self._buckets:
            # [numel of owner's parameters of one dtype]: the owner's updated weights to every
            # data-parallel replica.
            dist.broadcast(flat, group=self.group, group_src=owner)
        return loss
