"""Mixed precision with fp32 master weights at ZeRO 0 (`precision { params = bf16, master = fp32 }`
without FSDP2), as torchtitan does when data parallelism is not FSDP, and Megatron without
``--use-distributed-optimizer``: ``torch.autocast``.

The parameters stay in the master dtype, so they are the master weights, whole on every rank:
AdamW steps them and its moments in fp32, gradients arrive in fp32 (autocast's cast is
differentiated back to the parameter's dtype) and the data-parallel all-reduce sums them in fp32,
the `reduce` dtype. Each stage's forward runs under
autocast, so the matrix products (linear layers, attention) compute in the `params` dtype while
norms, softmax and the loss keep fp32 as the layers already ask. Checkpoints, verification and
export see plain fp32 parameters.
The bf16 casts of a stage's weights live while its forward and backward run.

ZeRO 1 with `precision` is Megatron's distributed optimizer instead (fp32 master weights sharded
with the moments over the data ranks): FSDP2, ``runtime/parallel/fsdp.py``'s ``uses_fsdp``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["autocast_forward", "uses_autocast"]


def uses_autocast(zero: int, dtype: torch.dtype, param_dtype: torch.dtype | None) -> bool:
    """Whether a plan computes in a narrower dtype than its master weights without FSDP2 (ZeRO 0).
    With every dtype equal (verification runs the plan in fp32 / fp64) there is nothing to cast."""
    return zero == 0 and param_dtype is not None and param_dtype != dtype


def _run(forward: Callable[..., Any], device_type: str, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(device_type, dtype=dtype):
        return forward(*args, **kwargs)


def autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``module``'s forward under autocast to ``dtype`` from now on, in place (an instance
    attribute, so parameter names and the module's type stay as they are)."""
    module.forward = functools.partial(_run, module.forward, device_type, dtype)  # type: ignore[method-assign]
