"""Sharded vs unsharded comparison run inside the worker pool, with optional planted faults.

`compare` is the job function: every rank of the plan runs runtime.compare.compare_to_reference
(max |sharded - reference| over the forward logits, the loss of one training step, every gradient
gathered to full shape and every parameter after one AdamW step). Every rank reports (not only rank 0): full tensors are gathered to all ranks,
so a replica that drifted from the others is caught too.

`FAULTS` plants known runtime bugs *inside the worker process* by patching attributes of
`meshllm_dsl.runtime` (generated code looks `rt.reduce_from` etc. up at call time) or of the
classes in runtime/train/program.py. Patches are undone when the job ends, because the workers are
long-lived and run the next plan afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from meshllm_dsl.runtime.jobs.compare import TOLERANCE
from meshllm_dsl.verify.equivalence import load_generated


def write_module(plan: Any, text: str, directory: Path) -> str:
    """Render a checked plan to a module file named after its text (stable, unique per plan)."""
    from meshllm_dsl.codegen.emit import render_plan

    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = directory / f"plan_{digest}.py"
    path.write_text(render_plan(plan, f"generated_{digest}.mesh", text))
    return str(path)


# ---------------------------------------------------------------- planted faults


class _Patches:
    def __init__(self) -> None:
        self.undo: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, attr: str, value: Any) -> None:
        self.undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def restore(self) -> None:
        for obj, attr, value in reversed(self.undo):
            setattr(obj, attr, value)


def _naive_all_reduce(p: _Patches, info: dict[str, Any]) -> None:
    """(i) torch.distributed.nn.functional.all_reduce as the g operator: its backward all-reduces
    the gradient again, so everything upstream of a row layer gets tensor-size times the gradient."""
    import torch.distributed.nn.functional as dnn

    import meshllm_dsl.runtime as rt

    p.set(rt, "reduce_from", lambda x, group: x if group is None else dnn.all_reduce(x, group=group))


def _missing_all_reduce(p: _Patches, info: dict[str, Any]) -> None:
    """(ii) reduce_from forgotten: each rank keeps its partial sum."""
    import meshllm_dsl.runtime as rt

    p.set(rt, "reduce_from", lambda x, group: x)


class _NeighbourMesh:
    """A mesh view whose coordinate 0 along any axis reads as 1: that rank loads its neighbour's chunk."""

    def __init__(self, mesh: Any) -> None:
        self._mesh = mesh

    def index(self, *axes: str) -> int:
        i = self._mesh.index(*axes)
        return 1 if i == 0 and self._mesh.size(*axes) > 1 else i

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mesh, name)


def _off_by_one_slice(p: _Patches, info: dict[str, Any]) -> None:
    """(iii) the shard slice is off by one block on the first rank of each sharded axis."""
    from meshllm_dsl.runtime.parallel import shards
    from meshllm_dsl.runtime.train import program

    real = shards.local_slice
    p.set(program, "local_slice", lambda full, spec, mesh: real(full, spec, _NeighbourMesh(mesh)))


def _rotary_offset(p: _Patches, info: dict[str, Any]) -> None:
    """(iv) a wrong rotary offset on odd tensor ranks: queries rotated one position ahead of keys.

    Shifting q and k by the same offset would change nothing (rotary attention depends on
    relative positions only, the property decoding with a KV cache relies on), so the planted bug
    is the one that matters: the query offset disagrees with the keys' (as with a stale cache offset).
    """
    import meshllm_dsl.runtime as rt

    real = rt.apply_rotary
    odd = info["mesh"].index(info["tensor_axis"]) % 2 == 1

    def shifted(q: Any, k: Any, pos: Any, theta: float) -> Any:
        if not odd:
            return real(q, k, pos, theta)
        q_rot, _ = real(q, k, pos + 1, theta)
        _, k_rot = real(q, k, pos, theta)
        return q_rot, k_rot

    p.set(rt, "apply_rotary", shifted)


def _loss_scaled_twice(p: _Patches, info: dict[str, Any]) -> None:
    """(v) the loss divided by the microbatch count a second time (the runtime already divides once,
    explicitly without a pipeline and through `scale_grads` in the pipeline schedules)."""
    from meshllm_dsl.runtime.train.program import Built

    real = Built.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        loss, m = self.loss_fn, self.program.microbatches
        self.loss_fn = lambda logits, targets: loss(logits, targets) / m

    p.set(Built, "__init__", init)


def _dp_grads_summed(p: _Patches, info: dict[str, Any]) -> None:
    """(vi) data-parallel gradients all-reduced (summed) but not divided by the replica count."""
    import torch.distributed as dist

    from meshllm_dsl.runtime.train.program import Built

    real = Built._sync_grads

    def sync(self: Any) -> None:
        dp, replicas = self.dp, self.replicas
        self.dp = self.replicas = 1  # the real code then syncs tied weights only
        try:
            real(self)
        finally:
            self.dp, self.replicas = dp, replicas
        if dp > 1:
            group = self.mesh.group(*self.batch_axes)
            for q in self.parameters():
                if q.grad is not None:
                    dist.all_reduce(q.grad, group=group)  # summed, never averaged

    p.set(Built, "_sync_grads", sync)


def _recompute_double_grad(p: _Patches, info: dict[str, Any]) -> None:
    """(vii) a recomputation that keeps the first forward's graph too: the checkpointed region's
    output carries the recomputed graph *and* the original one, so backward runs both (and the
    region's tensor-parallel collectives twice) and every gradient upstream of it doubles."""
    import meshllm_dsl.runtime as rt

    real = rt.recompute

    def double(fn: Any, *args: Any) -> Any:
        kept = fn(*args)  # the forward's own graph, never freed
        again = real(fn, *args)
        return kept + (again - again.detach())

    p.set(rt, "recompute", double)


def _clip_norm_counts_copies(p: _Patches, info: dict[str, Any]) -> None:
    """(viii) the classic clipping bug: every rank adds the squares of all its local gradients, so
    replicated parameters count once per tensor rank and data replicas once per replica."""
    import torch

    from meshllm_dsl.runtime.train.program import Built

    def naive(self: Any) -> Any:
        return sum((q.grad.double().pow(2).sum() for q in self.parameters() if q.grad is not None),
                   torch.zeros((), dtype=torch.float64))

    p.set(Built, "grad_norm_sq", naive)


def _sp_norm_grad_not_summed(p: _Patches, info: dict[str, Any]) -> None:
    """(ix) the classic sequence-parallel bug: norm weights are replicated but each rank saw only
    its slice of the sequence, and nobody sums their gradients over the tensor axis (Megatron's
    `allreduce_sequence_parallel_grad` forgotten): forward right, norm gradients partial."""
    from meshllm_dsl.runtime.train.program import Built

    p.set(Built, "_sum_partial_grads", lambda self: None)


def _sp_missing_reduce_scatter(p: _Patches, info: dict[str, Any]) -> None:
    """(x) sequence parallelism whose reduce-scatter after the row layer only splits: each rank
    keeps its slice of its own partial sum."""
    import meshllm_dsl.runtime as rt

    p.set(rt, "reduce_scatter_seq", lambda x, group: rt.split_seq(x, group))


def _zero3_grads_summed(p: _Patches, info: dict[str, Any]) -> None:
    """(xi) ZeRO-3 whose reduce-scatter sums the data replicas' gradients without averaging them
    (FSDP2's divide factor 1): forward and loss right, gradients x data size."""
    from torch.distributed.fsdp import FSDPModule

    from meshllm_dsl.runtime.parallel import fsdp

    real = fsdp.shard_stage

    def summed(module: Any, *args: Any, **kwargs: Any) -> None:
        real(module, *args, **kwargs)
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)

    p.set(fsdp, "shard_stage", summed)


def _zero3_over_tensor(p: _Patches, info: dict[str, Any]) -> None:
    """(xii) ZeRO-3 over the tensor ranks instead of the data ranks: FSDP2 takes the tensor ranks'
    different shards for copies of one tensor, so the all-gather before each forward assembles a
    parameter from pieces of different shards: the forward already differs."""
    from meshllm_dsl.runtime.parallel import fsdp

    real = fsdp.data_mesh
    p.set(fsdp, "data_mesh", lambda mesh, batch_axes, device_type, shard_axes=None: real(mesh, ("tensor",), device_type))


def _ep_combine_unpermuted(p: _Patches, info: dict[str, Any]) -> None:
    """Expert parallelism whose combine sends the experts' outputs back in expert-major order
    without undoing the dispatch's permutation: each token gets another token's expert output."""
    import torch

    from meshllm_dsl.runtime.moe import dispatch as moe_dispatch

    p.set(moe_dispatch, "_inverse", lambda perm: torch.arange(perm.numel(), device=perm.device))


def _ep_expert_grads_averaged(p: _Patches, info: dict[str, Any]) -> None:
    """Expert parallelism whose gradient sync treats the experts like dense parameters: averaged
    over the data ranks, though each rank holds other experts (the sum of different experts'
    gradients): forward right, expert gradients differ."""
    from meshllm_dsl.runtime.train.program import Built

    p.set(Built, "_replica_axes", lambda self, spec: tuple(a for a in self.mesh.names if a in self.batch_axes))


FAULTS: dict[str, Callable[[_Patches, dict[str, Any]], None]] = {
    "ep_combine_unpermuted": _ep_combine_unpermuted,
    "ep_expert_grads_averaged": _ep_expert_grads_averaged,
    "sp_norm_grad_not_summed": _sp_norm_grad_not_summed,
    "sp_missing_reduce_scatter": _sp_missing_reduce_scatter,
    "zero3_grads_summed": _zero3_grads_summed,
    "zero3_over_tensor": _zero3_over_tensor,
    "clip_norm_counts_copies": _clip_norm_counts_copies,
    "recompute_double_grad": _recompute_double_grad,
    "naive_all_reduce": _naive_all_reduce,
    "missing_all_reduce": _missing_all_reduce,
    "off_by_one_slice": _off_by_one_slice,
    "rotary_offset": _rotary_offset,
    "loss_scaled_twice": _loss_scaled_twice,
    "dp_grads_summed": _dp_grads_summed,
}


@contextlib.contextmanager
def planted(fault: str | None, info: dict[str, Any]) -> Iterator[None]:
    patches = _Patches()
    try:
        if fault is not None:
            FAULTS[fault](patches, info)
        yield
    finally:
        patches.restore()


# ---------------------------------------------------------------- the job


def compare(
    ctx: Any,
    path: str,
    dtypes: tuple[str, ...] = ("float64", "float32"),
    seed: int = 0,
    fault: str | None = None,
    tensor_axis: str | None = None,
) -> dict[str, dict[str, float]]:
    """On each rank: {dtype: {"logits" | "loss@0" | "grad NAME" | "param NAME": max abs error}}."""
    import torch

    from meshllm_dsl.runtime.jobs.compare import compare_to_reference

    program = load_generated(path).PROGRAM
    mesh = ctx.mesh(program.axes)
    with planted(fault, {"mesh": mesh, "tensor_axis": tensor_axis}):
        return {
            name: compare_to_reference(program, mesh, dtype=getattr(torch, name), seed=seed)
            for name in dtypes
        }


def worst(per_rank: list[dict[str, dict[str, float]]], dtype: str, prefix: str = "") -> float:
    """Largest error over ranks among entries whose key starts with `prefix` (NaN counts as inf)."""
    vals = [v for r in per_rank for k, v in r[dtype].items() if k.startswith(prefix)]
    return max((math.inf if math.isnan(v) else v for v in vals), default=0.0)


def over_tolerance(per_rank: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """{dtype: {entry: worst error}} for every entry above its dtype's tolerance on some rank."""
    bad: dict[str, dict[str, float]] = {}
    for r in per_rank:
        for dtype, errs in r.items():
            for k, v in errs.items():
                if not v <= TOLERANCE[dtype]:
                    seen = bad.setdefault(dtype, {})
                    seen[k] = max(seen.get(k, 0.0), math.inf if math.isnan(v) else v)
    return bad
