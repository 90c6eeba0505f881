"""Measuring what a step really holds: live tensor bytes and their peak, saved activations.

Works on any device, CPU included (where torch keeps no allocator statistics): a
``TorchDispatchMode`` sees every tensor an operator creates, and a weak reference to its storage
says when it is freed.  The peak is taken between operators, so it is exact up to the transient
buffers inside one kernel.  Used by ``meshc run --profile`` and by ``bench/activation_memory.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from meshllm_dsl.runtime.moe import routing as moe_routing
from meshllm_dsl.runtime.parallel.fsdp import data_local, is_sharded
from meshllm_dsl.runtime.train.profile_steps import PROFILE_UNTIMED
from meshllm_dsl.runtime.train.program import optimizer_parts

__all__ = ["CollectiveLog", "LiveBytes", "profile_memory", "profile_train", "saved_bytes", "trace_train"]


def _counted(t: Any) -> bool:
    """A tensor with storage of its own to count. A wrapper subclass other than a DTensor (the
    functional collectives' ``AsyncCollectiveTensor`` of expert parallelism's all-to-all) has
    none: the tensor it wraps was counted when the operator that made it ran."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    return not is_traceable_wrapper_subclass(t) or is_sharded(t)


def _storage(t: torch.Tensor) -> Any:
    return data_local(t).untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Bytes of tensors created inside the ``with`` block and still alive; ``peak`` is the maximum.

    Tensors that existed before the block (weights, gradients and optimizer states after a first
    step) are not counted, so after a warm-up step the peak is activations plus temporaries.

    Storages resized in the block count by how much they grew: FSDP2 (ZeRO 2 / 3) allocates
    its all-gathered parameters by ``storage.resize_`` on buffers made in the first step, and frees
    them by resizing to 0, which no operator (so no dispatch mode) sees.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self._grown: dict[int, tuple[StorageWeakRef, int]] = {}  # resized storages: net bytes added
        self.peak_op = ""  # the operator after which the peak was reached
        self.ops = 0  # operators dispatched: the kernels the step launched
        self._outer: Any = None  # the resize hook of a LiveBytes around this one

    def _sweep(self) -> None:
        for refs in (self._refs, self._grown):
            dead = [key for key, (ref, _) in refs.items() if ref.expired()]
            for key in dead:
                self.live -= refs.pop(key)[1]

    def _resize(self, storage: Any, size: int) -> Any:
        before = storage.nbytes()
        out = (self._outer or torch._C.StorageBase.resize_)(storage, size)
        key = storage._cdata
        grown = self._grown[key][1] if key in self._grown else 0
        self._grown[key] = (StorageWeakRef(storage), grown + storage.nbytes() - before)
        self.live += storage.nbytes() - before
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, "storage resize"
        return out

    def __enter__(self) -> LiveBytes:
        self._outer = torch.UntypedStorage.__dict__.get("resize_")  # another LiveBytes around this one
        torch.UntypedStorage.resize_ = lambda storage, size: self._resize(storage, size)  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._outer is None:
            del torch.UntypedStorage.resize_  # torch._C.StorageBase's own again
        else:
            torch.UntypedStorage.resize_ = self._outer  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        # Frees happen between calls: sweep first so the peak never counts a dead buffer.
        self._sweep()
        # An output sharing an input's storage (a view, an in-place op on a gradient that existed
        # before the block) allocated nothing.
        # (A DTensor of ZeRO 2 / 3 reaches the mode as itself: its storage is its local part's.)
        inputs = {_storage(t).data_ptr() for t in tree_leaves((args, kwargs)) if _counted(t)}
        for t in tree_leaves(out):
            if not _counted(t):
                continue
            storage = _storage(t)
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
    skip = {data_local(t).untyped_storage().data_ptr() for t in exclude or ()}
    seen: dict[int, StorageWeakRef] = {}
    result = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:
            return t  # saved while running backward (a recomputation): freed within backward
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            # ZeRO 2 / 3: FSDP2's gathered parameter, or a view of it (a linear layer saves its
            # weight transposed), charged as its gather buffer
            return t
        storage = data_local(t).untyped_storage()
        key = storage.data_ptr()
        old = seen.get(key)
        # An address seen before counts again once its first storage is gone (the allocator
        # reuses addresses across microbatches).
        if key not in skip and (old is None or old.expired()):
            seen[key] = StorageWeakRef(storage)
            result["bytes"] += storage.nbytes()
        return t

    from meshllm_dsl.runtime.train import remat

    remat.HOLDERS.append(pack)  # a checkpoint's inputs: kept for its recomputation
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield result
    finally:
        remat.HOLDERS.remove(pack)


# ---------------------------------------------------------------- meshc run --profile

_SYNC_OPS = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",  # FSDP2's (ZeRO 2 / 3) in torch 2.13
    "reduce_scatter_single",  # FSDP2's, and sequence parallelism's (runtime/parallel/collectives.py)
    "send",
    "recv",
)


def _nbytes(obj: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(obj) if isinstance(t, torch.Tensor)
    )


class CollectiveLog:
    """Wall time and bytes of every collective this rank issues, by mesh axes and kind.

    Wraps the ``torch.distributed`` functions the runtime and ``torch.distributed.pipelining``
    call (looked up at call time, so the wrappers see them) for the duration of the block.  Point
    to point traffic of the pipeline schedule is timed at its wait: that time is the transfer plus
    the wait for the peer stage, i.e. the bubble as this rank sees it.
    """

    def __init__(self, mesh: Any, pipeline_axis: str | None = None) -> None:
        import torch.distributed as dist

        self.pipeline_label = pipeline_axis or "pipeline"
        self.dist = dist
        self.labels: dict[tuple[int, ...], str] = {}
        names = list(mesh.names)
        for n in range(len(names), 0, -1):
            for subset in itertools.combinations(names, n):
                group = mesh.group(*subset)
                if group is not None:
                    self.labels[tuple(dist.get_process_group_ranks(group))] = " x ".join(subset)
        self.stats: dict[tuple[str, str], list[float]] = {}  # (axes, op) -> [calls, bytes, s, cpu s]
        self._pending: dict[int, tuple[str, str]] = {}  # id(async work) -> its stats key
        self._saved: list[tuple[Any, str, Any]] = []

    def _label(self, group: Any) -> str:
        if group is None:
            return "world"
        ranks = tuple(self.dist.get_process_group_ranks(group))
        return self.labels.get(ranks, "ranks " + ",".join(map(str, ranks)))

    def _add(self, axes: str, op: str, nbytes: int, seconds: float, cpu: float, calls: int = 1) -> None:
        entry = self.stats.setdefault((axes, op), [0, 0, 0.0, 0.0])
        entry[0] += calls
        entry[1] += nbytes
        entry[2] += seconds
        entry[3] += cpu

    def _wrap(self, owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def __enter__(self) -> CollectiveLog:
        import torch.distributed as dist

        from meshllm_dsl.runtime.parallel import collectives

        for op in (op for op in _SYNC_OPS if hasattr(dist, op)):

            def make(original: Any, op: str = op) -> Any:
                def timed(*args: Any, **kwargs: Any) -> Any:
                    key = (self._label(kwargs.get("group")), op)
                    start, cpu = time.perf_counter(), time.process_time()
                    out = original(*args, **kwargs)
                    self._add(*key, _nbytes(args[:1]), time.perf_counter() - start, time.process_time() - cpu)
                    if kwargs.get("async_op") and out is not None:
                        self._pending[id(out)] = key  # its wait, if the runtime's, counts too
                    return out

                return timed

            self._wrap(dist, op, make)

        def make_own_wait(original: Any) -> Any:
            def timed(work: Any, *args: Any) -> Any:
                key = self._pending.pop(id(work), None)
                start, cpu = time.perf_counter(), time.process_time()
                out = original(work, *args)
                if key is not None:
                    self._add(*key, 0, time.perf_counter() - start, time.process_time() - cpu, calls=0)
                return out

            return timed

        # The runtime's own collectives start async and wait in collectives.wait (polling or
        # blocking): a call's time is its launch plus that wait.  Others' async work (FSDP2's)
        # is timed at launch only, as before.
        self._wrap(collectives, "wait", make_own_wait)
        schedules = sys.modules.get("torch.distributed.pipelining.schedules")
        if schedules is not None:
            pending: list[int] = [0]

            def make_batch(original: Any) -> Any:
                def counted(p2p_ops: Any, *args: Any, **kwargs: Any) -> Any:
                    pending[0] += sum(_nbytes(o.tensor) for o in p2p_ops)
                    return original(p2p_ops, *args, **kwargs)

                return counted

            def make_wait(original: Any) -> Any:
                def timed(*args: Any, **kwargs: Any) -> Any:
                    start, cpu = time.perf_counter(), time.process_time()
                    out = original(*args, **kwargs)
                    nbytes, pending[0] = pending[0], 0
                    self._add(
                        self.pipeline_label, "send_recv (wait)", nbytes,
                        time.perf_counter() - start, time.process_time() - cpu,
                    )
                    return out

                return timed

            self._wrap(schedules, "_batch_p2p", make_batch)
            self._wrap(schedules, "_wait_batch_p2p", make_wait)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _state_bytes(optimizer: Any) -> int:
    return sum(
        data_local(v).numel() * v.element_size()
        for inner in optimizer_parts(optimizer)
        for st in inner.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _routing(built: Any, log: moe_routing.RouterLog) -> list[dict[str, Any]]:
    """Per moe layer on this rank: the (token, choice) pairs each expert received in one step (this
    rank's tokens, every microbatch), the pairs dropped for capacity, and max / mean load."""
    routers = [name for i in sorted(built.stage_ids) for name in built.specs[i] if name.endswith(".router.weight")]
    out = []
    for name, (counts, dropped) in zip(routers, log.per_layer()):
        total = sum(counts)
        mean = total / len(counts) if counts else 0.0
        out.append({"layer": name[: -len(".router.weight")], "tokens_per_expert": counts, "dropped": dropped,
                    "max_over_mean": max(counts) / mean if mean else 0.0,
                    "busiest_share": max(counts) / total if total else 0.0})
    return out


def profile_memory(
    built: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``profile_train``'s first two steps: a warm-up on ``batches[0]`` (schedules built, gradients
    and optimizer states allocated; it also counts each moe layer's tokens per expert), then
    ``batches[1]`` measured for memory.  (routing per moe layer, memory by category) of this rank;
    every rank of the job must call it.  Tests of the planner's bytes call it alone: the kernel
    count and timed steps after it measure nothing they read."""
    with moe_routing.recording(keep_logits=False) as routing:
        built.train_step(*batches[0])
    params = built.parameters()
    live = LiveBytes()
    with saved_bytes(exclude=params) as saved, live:
        built.train_step(*batches[1])
    memory = {
        # This rank's own bytes: with ZeRO 2 / 3 its slice of each (DTensor) parameter.
        "weights": sum(data_local(p).numel() * p.element_size() for p in params),
        "gradients": sum(data_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": _state_bytes(built.optimizer),
        "activations_per_microbatch": saved["bytes"] // built.program.microbatches,
        "activations_and_temporaries_peak": live.peak,
    }
    return _routing(built, routing), memory


def profile_train(
    built: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], out_dir: str | Path
) -> dict[str, Any]:
    """Measure training steps on this rank; write ``rank{R}.json``.

    Every rank of the job must call it (the steps are collective).  The first batch is a warm-up
    (schedules built, gradients and optimizer states allocated), the second is measured for memory,
    the third counts the kernels dispatched (the dispatch mode and hooks slow them several-fold, so
    they are not timed), the rest are timed: wall and CPU seconds (all of the process's threads,
    gloo's included).
    """
    if len(batches) < len(PROFILE_UNTIMED) + 1:
        raise ValueError(f"profile_train needs {', '.join(PROFILE_UNTIMED)} and a timed step")
    routing, memory = profile_memory(built, batches[:2])
    # Counted without the saved-tensor hooks, under which autograd dispatches extra operators.
    with LiveBytes() as counted:
        built.train_step(*batches[2])
    log = CollectiveLog(built.mesh, built.program.pipeline_axis)
    steps = []
    cpu = 0.0
    with log:
        for tokens, targets in batches[len(PROFILE_UNTIMED) :]:
            start, cpu_start = time.perf_counter(), time.process_time()
            built.train_step(tokens, targets)
            steps.append(time.perf_counter() - start)
            cpu += time.process_time() - cpu_start
    n = len(steps)
    comm = [
        {"axes": axes, "op": op, "calls": c / n, "bytes": b / n, "seconds": s / n, "cpu_s": cpu / n}
        for (axes, op), (c, b, s, cpu) in sorted(log.stats.items())
    ]
    step_s = sum(steps) / n
    collectives_s = sum(c["seconds"] for c in comm if not c["op"].endswith("(wait)"))
    wait_s = sum(c["seconds"] for c in comm if c["op"].endswith("(wait)"))
    report = {
        "rank": built.mesh.rank,
        "coords": {a: built.mesh.coord(a) for a in built.mesh.names},
        "stages": list(built.stage_ids),
        "steps": n,
        "step_s": step_s,
        "cpu_s": cpu / n,
        "kernels": counted.ops,
        "compute_s": max(0.0, step_s - collectives_s - wait_s),
        "collectives_s": collectives_s,
        "pipeline_wait_s": wait_s,
        "collectives": comm,
        "routing": routing,
        "memory": memory,
    }
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{built.mesh.rank}.json").write_text(json.dumps(report, indent=1))
    return report


def trace_train(
    built: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], out_dir: str | Path
) -> Path:
    """A warm-up step on ``batches[0]``, then ``batches[1]`` under ``torch.profiler``: this rank's
    Chrome trace ``rank{R}.json`` in ``out_dir`` (operators with input shapes, autograd, and
    every collective, e.g. ``gloo:all_reduce``). Every rank of the job must call it.

    The file appears under its final name only once complete (written aside, then renamed).
    """
    from torch.profiler import ProfilerActivity, profile

    built.train_step(*batches[0])  # schedules built, optimizer states allocated: not traced
    activities = [ProfilerActivity.CPU]
    if built.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        built.train_step(*batches[1])
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    final = path / f"rank{built.mesh.rank}.json"
    partial = path / f".rank{built.mesh.rank}.json.partial"
    prof.export_chrome_trace(str(partial))
    os.replace(partial, final)
    return final
