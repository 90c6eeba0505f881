"""Measuring what a step really holds: live tensor bytes and their peak, saved activations.

Works on any device, CPU included (where torch keeps no allocator statistics): a
``TorchDispatchMode`` sees every tensor an operator creates, and a weak reference to its storage
says when it is freed.  The peak is taken between operators, so it is exact up to the transient
buffers inside one kernel.  Used by ``meshc run --profile`` and by ``bench/activation_memory.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "saved_bytes"]


class LiveBytes(TorchDispatchMode):
    """Bytes of tensors created inside the ``with`` block and still alive; ``peak`` is the maximum.

    Tensors that existed before the block (weights, gradients and optimizer states after a first
    step) are not counted, so after a warm-up step the peak is activations plus temporaries.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_op = ""  # the operator after which the peak was reached

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self._refs.items() if ref.expired()]
        for key in dead:
            self.live -= self._refs.pop(key)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Frees happen between calls: sweep first so the peak never counts a dead buffer.
        self._sweep()
        # An output sharing an input's storage (a view, an in-place op on a gradient that existed
        # before the block) allocated nothing.
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self._refs or key in inputs:
                continue  # empty, already counted, or no new allocation
            n = storage.nbytes()
            self._refs[key] = (StorageWeakRef(storage), n)
            self.live += n
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, str(func)
        return out


@contextlib.contextmanager
def saved_bytes(exclude: list[torch.Tensor] | None = None) -> Iterator[dict[str, int]]:
    """Count the distinct storages autograd saves for backward inside the block.

    ``exclude`` (the parameters) is not counted: a linear layer saves its weight, which is memory
    the plan already charges as weights.  Yields a dict whose ``bytes`` fills in as the block runs.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude or ()}
    seen: dict[int, StorageWeakRef] = {}
    result = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:
            return t  # saved while running backward (a recomputation): freed within backward
        storage = t.untyped_storage()
        key = storage.data_ptr()
        old = seen.get(key)
        # An address seen before counts again once its first storage is gone (the allocator
        # reuses addresses across microbatches).
        if key not in skip and (old is None or old.expired()):
            seen[key] = StorageWeakRef(storage)
            result["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
