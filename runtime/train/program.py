"""A compiled plan as something that trains: stages placed on the mesh, schedule, optimizer.

``Program`` is what a generated module declares (``PROGRAM = rt.Program(...)``); ``Program.build``
places it on a mesh and returns a ``Built`` that trains, runs forward and gathers full tensors.
Semantics are those of the unsharded model on the whole global batch: the loss is the mean over
every token, gradients are averaged over the batch axes, so any plan matches the reference.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshllm_dsl.runtime.data.corpus import IGNORE
from meshllm_dsl.runtime.model import description
from meshllm_dsl.runtime.model.documents import Packing, packed
from meshllm_dsl.runtime.moe import grouped
from meshllm_dsl.runtime.moe import routing as moe_routing
from meshllm_dsl.runtime.parallel import fsdp
from meshllm_dsl.runtime.parallel.collectives import all_reduce_, all_reduce_sum
from meshllm_dsl.runtime.parallel.context import ContextShard
from meshllm_dsl.runtime.parallel.mesh import Mesh
from meshllm_dsl.runtime.parallel.shards import ShardSpec, full_init, gather_full, local_slice
from meshllm_dsl.runtime.train import amp

__all__ = ["Built", "Optimizers", "Program", "StageClass", "optimizer_parts"]

LossFn = Callable[[Tensor, Tensor], Tensor]


class StageClass(Protocol):
    """A generated stage: ``Stage(mesh)`` builds the local shard, ``Stage.params()`` maps names."""

    def __call__(self, mesh: Mesh) -> nn.Module: ...

    def params(self, prefix: str = "") -> dict[str, ShardSpec]: ...


# Schedule name (lower case, no "_" or "-") -> torch.distributed.pipelining class. The first two run
# one stage per rank, the others a list of them.
_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "loopedbfs": "ScheduleLoopedBFS",
    "interleavedzb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
_SINGLE_STAGE = ("gpipe", "1f1b")
# The schedules whose classes place stages in a V (rank r holds stages r and 2p - 1 - r): they set
# torch's generate_stage_to_rank_mapping(style="v") on their stages, so the runtime places alike.
_V_PLACED = ("zbv", "dualpipev")
_SPLIT_BACKWARD = ("interleavedzb", "zbv", "dualpipev")


# Optimizer settings that are the training loop's, not torch.optim.AdamW's.
LOOP_SETTINGS = ("clip", "warmup", "decay_steps", "min_lr")


def adamw_kwargs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A plan's optimizer settings as torch.optim.AdamW keyword arguments (lr defaults to 1e-3)."""
    kw = {k: v for k, v in settings.items() if k not in LOOP_SETTINGS}
    kw.setdefault("lr", 1e-3)
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    return kw


def lr_at(settings: Mapping[str, Any], step: int) -> float:
    """The learning rate of update ``step`` (0-based): linear warmup over ``warmup`` steps, then a
    cosine decay to ``min_lr`` at ``decay_steps`` (torchtitan's and nanoGPT's shape); constant
    ``lr`` without them. A function of the step only, so a resumed run needs nothing else saved."""
    lr = float(settings.get("lr", 1e-3))
    warmup, decay = int(settings.get("warmup", 0)), int(settings.get("decay_steps", 0))
    if step < warmup:
        return lr * (step + 1) / warmup
    if not decay:
        return lr
    progress = min(1.0, (step - warmup) / max(1, decay - warmup))
    low = float(settings.get("min_lr", 0.0))
    return low + (lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _schedule_name(name: str) -> str:
    key = name.lower().replace("_", "").replace("-", "")
    key = "interleaved1f1b" if key == "interleaved" else key
    if key not in _SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected gpipe, 1f1b, interleaved_1f1b, looped_bfs, "
                         "interleaved_zb, zbv or dualpipev")
    return key


def splits_backward(schedule: str) -> bool:
    """Whether torch's class for ``schedule`` runs each backward as input-gradient then weight-gradient work."""
    return _schedule_name(schedule) in _SPLIT_BACKWARD


def stage_ranks(schedule: str, pipeline: int, stages: int) -> dict[int, int]:
    """Stage index -> pipeline coordinate that runs it under ``schedule``: torch's own mapping (a loop,
    i % p, or a V for ZBV and DualPipeV), the one its schedule classes send and receive by."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    style = "v" if _schedule_name(schedule) in _V_PLACED else "loop"
    return generate_stage_to_rank_mapping(pipeline, stages, style=style)


@dataclass(frozen=True)
class Program:
    """Everything a plan fixes.  ``stages[i]`` runs on pipeline coordinate ``stage_ranks(...)[i]``:
    ``i % p``, or a V under the schedules that place so."""

    model: Mapping[str, Any]
    axes: Sequence[tuple[str, int]]
    stages: Sequence[StageClass]
    loss: Callable[[Mesh], LossFn]
    pipeline_axis: str | None = None
    batch_axes: Sequence[str] = ()
    schedule: str = "gpipe"
    microbatches: int = 1
    batch: int = 8
    seq: int = 32
    zero: int = 0
    # The batch axes ZeRO shards over; the other batch axes hold replicas (HSDP). Empty: all of them.
    zero_axes: Sequence[str] = ()
    optimizer: Mapping[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32  # the parameters' (with `precision`: the master weights')
    # A plan's `precision`: compute in param_dtype and reduce gradients in reduce_dtype (FSDP2's
    # MixedPrecisionPolicy with zero 2 / 3, torch.autocast with zero 0 / 1: runtime/train/amp.py); None: in ``dtype``.
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    hosts: int = 1  # the spec's `hosts`: axes whose groups stay inside one host (ranks node-major)
    # Sequence parallelism: the axes the residual stream is sharded over along the sequence
    # between sublayers (and so between pipeline stages), [b, s / t, hidden].
    seq_axes: Sequence[str] = ()
    # Context parallelism: the axes every sequence is split over through the whole model
    # (runtime/parallel/context.py); the parameters are replicated over them and their gradients averaged.
    context_axes: Sequence[str] = ()
    # `precision { matmul = R }`: layer path patterns (`blocks.*.attn.q`) -> the torchao recipe their
    # matmuls train in (runtime/train/float8.py); float8_gather: FSDP2 gathers those weights in float8.
    float8: Mapping[str, str] = field(default_factory=dict)
    float8_gather: bool = False
    compile: str = "none"  # `compile = blocks`: torch.compile each block (runtime/train/compile.py)
    # `pack = documents`: rows hold several documents and a token attends only to its own document's
    # earlier tokens (runtime/model/documents.py); `positions = restart`: rotary positions restart
    # at each document. The data path reads both to build batches (runtime/data/corpus.py ``Batch``).
    document_mask: bool = False
    restart_positions: bool = False
    # `context_balance`: how packed rows spread over the context ranks (runtime/parallel/context_layout.py).
    context_balance: str = "headtail"

    @property
    def vocab(self) -> int:
        return int(description.token_embedding(self.model)["num"])

    def build(
        self,
        mesh: Mesh | None = None,
        seed: int = 0,
        device: torch.device | None = None,
        weights: str | Path | None = None,
    ) -> Built:
        """Place the program on ``mesh`` (default: the whole world) with weights from ``seed``.

        ``device`` defaults to the current CUDA device when there is one, else the CPU.
        ``weights``: a Hugging Face model directory; each rank reads only its own slices
        (``runtime/hf/weights.py``) instead of drawing the seeded initialisation.
        Collective: every rank of the mesh must call it.
        """
        mesh = Mesh.build(self.axes) if mesh is None else mesh
        if tuple(mesh.axes) != tuple((a, int(s)) for a, s in self.axes):
            raise ValueError(f"program wants mesh {tuple(self.axes)}, got {mesh.axes}")
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        return Built(self, mesh, seed, device, weights)


_BUCKET_ELEMENTS = 1 << 24


def _microbatch(packing: Packing | None, m: int, j: int) -> Packing | None:
    """Microbatch ``j`` of ``m`` of this rank's rows (consecutive rows, as the tokens split)."""
    if packing is None:
        return None

    def part(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.chunk(m)[j]

    return Packing(part(packing.documents), part(packing.keys), part(packing.positions),
                   part(packing.sequence), part(packing.key_sequence))


def _float8_recipe(patterns: Mapping[str, str], path: str) -> str | None:
    """The recipe of the first pattern matching ``path``: segments are names, `*` (any one) or
    `{1,2,3}` (one of these), as ``Float8Plan.patterns`` writes them."""
    parts = path.split(".")
    for pattern, recipe in patterns.items():
        want = pattern.split(".")
        if len(want) == len(parts) and all(
                w in ("*", p) or (w.startswith("{") and p in w[1:-1].split(",")) for w, p in zip(want, parts)):
            return recipe
    return None


def _all_reduce_coalesced(tensors: list[Tensor], group: dist.ProcessGroup | None, divide_by: int = 1,
                          dtype: torch.dtype | None = None) -> None:
    """In-place sum over ``group`` of many tensors (a mean with ``divide_by`` = the group's size),
    coalesced into few flat all-reduces, summed in ``dtype`` (default: each tensor's own).

    One collective per parameter is latency-bound (gloo especially); buckets of up to 16M
    elements of one dtype keep the extra memory bounded.
    """
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        start = 0
        while start < len(same):
            end, count = start, 0
            while end < len(same) and (
                end == start or count + same[end].numel() <= _BUCKET_ELEMENTS
            ):
                count += same[end].numel()
                end += 1
            bucket = same[start:end]
            flat = torch.cat([t.reshape(-1) for t in bucket])
            if dtype is not None and dtype != flat.dtype:
                flat = flat.to(dtype)
            # [sum of bucket numels]: gradients of this rank's shards, summed over the replicas.
            all_reduce_(flat, group)
            if divide_by != 1:
                flat.div_(divide_by)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))
            start = end


class Optimizers:
    """Several optimizers stepped as one (torchtitan's ``OptimizersContainer``): ZeRO 1 with expert
    parallelism, whose dense parameters and experts shard their states over different groups.
    ``parts`` are the optimizers; ``param_groups`` theirs in order, where the learning rate is set."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        self.parts = list(parts)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for part in self.parts:
            part.step()


def optimizer_parts(optimizer: torch.optim.Optimizer | Optimizers) -> list[torch.optim.Optimizer]:
    """The optimizers that hold per-parameter state: each part's own, ZeRO's the local one of its
    partition (its ``optim``)."""
    parts = optimizer.parts if isinstance(optimizer, Optimizers) else [optimizer]
    out = []
    for part in parts:
        local = getattr(part, "optim", None)
        out.append(local if isinstance(local, torch.optim.Optimizer) else part)
    return out


class Built:
    """A program placed on this rank: its stage modules, optimizer and schedule."""

    def __init__(
        self,
        program: Program,
        mesh: Mesh,
        seed: int,
        device: torch.device,
        weights: str | Path | None = None,
    ) -> None:
        self.program, self.mesh, self.device = program, mesh, device
        pp_axis = program.pipeline_axis
        self.pp = mesh.size(pp_axis) if pp_axis else 1
        n = len(program.stages)
        if n % self.pp:
            raise ValueError(f"{n} stages do not divide over {self.pp} pipeline ranks")
        coord = mesh.coord(pp_axis) if pp_axis else 0
        # Stage index -> pipeline coordinate running it.
        self.stage_rank = stage_ranks(program.schedule, self.pp, n) if pp_axis else dict.fromkeys(range(n), 0)
        self.stage_ids = [i for i in range(n) if self.stage_rank[i] == coord]
        self.specs: dict[int, dict[str, ShardSpec]] = {
            i: dict(program.stages[i].params()) for i in range(n)
        }
        self.modules: dict[int, nn.Module] = {}
        hf: Any = None
        if weights is not None:
            from meshllm_dsl.runtime.hf import weights as hf

            # Checked against every stage's parameters before anything is read, on every rank.
            ckpt = hf.HFCheckpoint(weights)
            keys = hf.plan_load(ckpt, program.model, self.specs)
        for i in self.stage_ids:
            if hf is not None:
                module = self._empty_stage(i)
            else:
                module = program.stages[i](mesh).to(device=device, dtype=program.dtype)
            with torch.no_grad():
                for name, spec in self.specs[i].items():
                    if hf is not None:
                        # Only this rank's slice is read: no full tensor, no random init first.
                        local = hf.local_from_hf(ckpt, *keys[name], spec, mesh, program.dtype)
                    else:
                        full = full_init(name, spec.shape, seed, program.dtype)
                        local = local_slice(full, spec, mesh)
                    module.get_parameter(spec.local).copy_(local)
            self.modules[i] = module
        if hf is not None:  # the buffers a checkpoint holds: the sigmoid routers' correction biases
            buffer_keys = hf.plan_buffers(ckpt, program.model)
            with torch.no_grad():
                for name, buf in self.routing_buffers().items():
                    buf.copy_(hf.read_buffer(ckpt, buffer_keys[name], mesh, buf.dtype))
        # Bytes of checkpoint tensors this rank read (its slices only); 0 without --weights.
        self.weights_bytes_read = ckpt.bytes_read if hf is not None else 0
        self._check_coverage()
        self.float8_layers = self._convert_float8()
        if program.compile == "blocks":
            self._compile_blocks()
        self._hidden = int(description.token_embedding(program.model)["dim"])
        self.batch_axes = tuple(program.batch_axes)
        self.dp = mesh.size(*self.batch_axes) if self.batch_axes else 1
        self.context = (ContextShard(mesh, tuple(program.context_axes), program.context_balance)
                        if program.context_axes else None)
        # The axes the parameters are replicated over and their gradients averaged over: the batch
        # axes and the context axes (each context rank's loss is the mean over an equal share of tokens).
        self.grad_axes = tuple(a for a in mesh.names if a in self.batch_axes or a in program.context_axes)
        self.replicas = mesh.size(*self.grad_axes) if self.grad_axes else 1
        self.zero_axes = tuple(a for a in mesh.names if a in (program.zero_axes or self.batch_axes))
        self._tied = self._tied_groups()
        # A moe model's load-balancing / z-loss terms, added to each microbatch's loss (runtime/moe/routing.py).
        self.router_losses = moe_routing.RouterLosses.of(program.model)
        if fsdp.uses_fsdp(program.zero, program.param_dtype):
            self._fully_shard()
        elif amp.uses_autocast(program.zero, program.dtype, program.param_dtype):
            assert program.param_dtype is not None
            for module in self.modules.values():
                amp.autocast_forward(module, self.device.type, program.param_dtype)
        self.loss_fn = program.loss(mesh)
        # With pipeline stages each stage's routing statistics travel to the next with its
        # activations, only while a training schedule runs (forward-only runs pass activations alone).
        self._carry_routing = False
        if self.router_losses is not None and self.pp > 1:
            for i in self.stage_ids:
                module = self.modules[i]
                # An instance attribute, as amp.autocast_forward: FSDP2's module type stays, which
                # the schedules test for.
                module.forward = functools.partial(self._routed_forward, module.forward)  # type: ignore[method-assign]
        self.optimizer = self._make_optimizer()
        # Routers whose correction bias moves toward balance after each step (runtime/moe/routing.py
        # `balance`), with the ranks that route tokens to the same layers: all but the pipeline axis.
        self.balanced_routers = moe_routing.balanced_routers(self.modules[i] for i in self.stage_ids)
        balance_axes = tuple(a for a in mesh.names if a != pp_axis)
        self._balance_group = mesh.group(*balance_axes) if balance_axes else None
        self.steps_done = 0  # optimizer updates so far: the learning-rate schedule's clock
        # The step's number of counted (not IGNORE) targets over the global batch while some are
        # ignored: each microbatch's mean loss is then weighted by its share (``_token_loss``).
        self._counted: int | None = None
        # A pipeline step's rows per microbatch while its schedule runs (``_packed_chunk``).
        self._micro_packings: list[Packing | None] | None = None
        self.grad_norm = float("nan")  # the global gradient norm of the last step (with clip)
        self._schedules: dict[tuple[int, int, bool], Any] = {}

    # ------------------------------------------------------------------ set-up

    @property
    def _routing_dtype(self) -> torch.dtype:
        return moe_routing.compute_dtype(self.compute_dtype)

    def _router_statistics(self, routing: moe_routing.RouterLog, carried: Tensor | None, sequences: int) -> Tensor:
        """RouterLosses.statistics of one forward's routing on this rank, of ``sequences`` sequences
        (under context parallelism each sequence's pair counts summed over the context ranks)."""
        assert self.router_losses is not None
        cp = self.context
        return self.router_losses.statistics(
            routing.logits, carried, self._routing_dtype, self.device, chosen=routing.chosen, sequences=sequences,
            sequence_counts=(lambda x: cp.sequence_sum(x.detach())) if cp is not None else None,
            parts=cp.size if cp is not None else 1)

    def _routed_forward(self, forward: Callable[[Tensor], Tensor], x: Tensor, *carried: Tensor) -> Any:
        """A stage's forward that, under a training schedule with router losses, also returns the
        routing statistics [2 E + 3] of its forward so far (``carried``: the previous stage's).

        Under FSDP2 the stage root casts no input (``_fully_shard``): the activations are cast to
        the compute dtype here, as FSDP2 would, while ``carried`` stays in the routing dtype
        (fp32), so pair counts past 256 and the probability sums cross stages exactly."""
        if x.is_floating_point():
            x = x.to(self.compute_dtype)
        if not self._carry_routing:
            return forward(x)
        assert self.router_losses is not None
        with moe_routing.recording() as routing:
            y = forward(x)
        stats = self._router_statistics(routing, carried[0] if carried else None, x.shape[0])
        if not stats.requires_grad:  # a stage without moe layers: the next stage still sends a gradient back
            stats.requires_grad_(True)
        return y, stats

    def _empty_stage(self, i: int) -> nn.Module:
        """Stage ``i`` with uninitialised local storage, for weights that are read in right after.

        Built on the meta device, so torch's default initialisation (wasted work, every
        parameter is overwritten from the checkpoint and coverage is checked) never runs.
        """
        p = self.program
        with torch.device("meta"):
            module = p.stages[i](self.mesh).to(dtype=p.dtype)
        if any(True for _ in module.buffers()):  # state that no checkpoint fills: build it normally
            return p.stages[i](self.mesh).to(device=self.device, dtype=p.dtype)
        return module.to_empty(device=self.device)

    def _fully_shard(self) -> None:
        """ZeRO-3 (parameters resharded after each forward) or ZeRO-2 and ZeRO-1 with master weights
        (kept until backward) by FSDP2 over the data (and context) ranks; master weights, gradients
        and optimizer states are sharded either way."""
        dmesh = fsdp.data_mesh(self.mesh, self.grad_axes, self.device.type, self.zero_axes)
        # Expert parallelism: experts split over batch or context axes are left out of the dense units. Split
        # over every ZeRO axis, no other rank of them holds them: plain tensors, reduced as without
        # ZeRO. Otherwise each layer's experts are a unit over the ZeRO axes that replicate them
        # (the checker sees that these are all the batch and context axes that do).
        experts: set[str] = set()
        units: dict[int, dict[str, tuple[Any, float]]] = {}
        emeshes: dict[tuple[str, ...], Any] = {}
        for i, specs in self.specs.items():
            for spec in specs.values():
                split = {a for _, axes in spec.dims for a in axes}
                if not split & set(self.grad_axes):  # the experts, split over batch or context axes
                    continue
                experts.add(spec.local)
                rest = tuple(a for a in self.zero_axes if a not in split)
                if rest and self.mesh.size(*rest) > 1:
                    if rest not in emeshes:
                        emeshes[rest] = fsdp.data_mesh(self.mesh, rest, self.device.type)
                    units.setdefault(i, {})[spec.local.rsplit(".", 2)[0]] = (emeshes[rest], float(self.replicas))
        for i in self.stage_ids:
            fsdp.shard_stage(
                self.modules[i],
                dmesh,
                # The schedules that split backward compute the weight gradients after the input
                # gradients, from the parameters the forward used: FSDP2 must keep them gathered from
                # forward to the weight backward (torchtitan, too, keeps them gathered under a pipeline).
                reshard_after_forward=self.program.zero == 3 and not splits_backward(self.program.schedule),
                param_dtype=self.program.param_dtype,
                reduce_dtype=self.program.reduce_dtype,
                experts=experts,
                # The routing statistics beside a stage's activations stay fp32 (_routed_forward).
                cast_stage_inputs=self.router_losses is None or self.pp == 1,
                expert_units=units.get(i),
            )

    def _global_modules(self, i: int) -> dict[str, str]:
        """Stage ``i``'s module paths -> their paths in the whole model (`blocks.1.attn.q` on the second
        stage is `blocks.5.attn.q`), from its parameters' names."""
        out: dict[str, str] = {}
        for name, spec in self.specs[i].items():
            if "." in name and "." in spec.local:
                out[spec.local.rsplit(".", 1)[0]] = name.rsplit(".", 1)[0]
        return out

    def _convert_float8(self) -> list[str]:
        """The plan's float8 layers converted by torchao, before FSDP2 wraps them (torchtitan's order);
        their paths in the model."""
        if not self.program.float8:
            return []
        from meshllm_dsl.runtime.train import float8

        done: list[str] = []
        for i in self.stage_ids:
            paths = self._global_modules(i)
            layers = {local: recipe for local, path in paths.items()
                      if (recipe := _float8_recipe(self.program.float8, path)) is not None}
            converted = float8.convert(self.modules[i], layers, self.program.float8_gather, self.device.type != "cuda")
            done += [paths[p] for p in converted]
        return done

    def _compile_blocks(self) -> None:
        """torch.compile each block of this rank's stages (after float8, before FSDP2: torchtitan's order)."""
        from meshllm_dsl.runtime.train.compile import compile_blocks

        repeat = next(layer["name"] for layer in self.program.model["layers"] if layer["kind"] == "repeat")
        for i in self.stage_ids:
            blocks = getattr(self.modules[i], repeat, None)
            if blocks is None:
                continue
            paths = self._global_modules(i)
            names = {key: next((p.split(".")[1] for loc, p in paths.items() if loc.startswith(f"{repeat}.{key}.")), key)
                     for key in blocks}
            compile_blocks(blocks, {key: f"{repeat}.{n}" for key, n in names.items()})

    def precompute_float8_scales(self) -> None:
        """After each optimizer step under `all_gather = fp8`: the float8 weights' scales for the next
        step's FSDP2 all-gathers, one all-reduce of amaxes per stage (torchao)."""
        if self.program.float8_gather and self.float8_layers and fsdp.uses_fsdp(self.program.zero, self.program.param_dtype):
            from meshllm_dsl.runtime.train import float8

            float8.precompute_scales(self.modules[i] for i in self.stage_ids)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of activations: ``param_dtype`` under mixed precision, else ``dtype``. Under
        autocast (ZeRO 0) the residual stream stays in the master dtype: only products narrow."""
        p = self.program
        return p.dtype if amp.uses_autocast(p.zero, p.dtype, p.param_dtype) else p.param_dtype or p.dtype

    def _check_coverage(self) -> None:
        for i, module in self.modules.items():
            mapped = {spec.local for spec in self.specs[i].values()}
            owned = {name for name, _ in module.named_parameters()}
            if mapped != owned:
                raise ValueError(
                    f"stage {i}: params() and the module disagree; only in params(): "
                    f"{sorted(mapped - owned)}, only in the module: {sorted(owned - mapped)}"
                )

    def _tied_groups(self) -> list[tuple[str, list[int], dist.ProcessGroup | None]]:
        """Full names held by more than one stage, with the group joining their pipeline ranks.

        Like Megatron's embedding group: the copies start equal (same name, same init) and stay
        equal because their gradients are summed before every step.
        """
        holders: dict[str, list[int]] = {}
        for i in sorted(self.specs):
            for name in self.specs[i]:
                holders.setdefault(name, []).append(i)
        tied = {name: ids for name, ids in sorted(holders.items()) if len(ids) > 1}
        wanted: list[tuple[int, ...]] = []
        by_name: dict[str, tuple[int, ...]] = {}
        pp_axis = self.program.pipeline_axis
        for name, ids in tied.items():
            coords = sorted({self.stage_rank[i] for i in ids})
            if len(coords) == 1 or pp_axis is None:
                continue
            others = [a for a in self.mesh.names if a != pp_axis]
            # Every rank lists the groups of every position, so group creation stays in step.
            for point in itertools.product(*(range(self.mesh.size(a)) for a in others)):
                at = dict(zip(others, point))
                members = tuple(sorted(self.mesh.rank_at(**at, **{pp_axis: c}) for c in coords))
                if members not in wanted:
                    wanted.append(members)
            by_name[name] = tuple(sorted(self.mesh.rank_at(**{pp_axis: c}) for c in coords))
        groups = self.mesh.make_groups(wanted)
        return [
            (name, ids, groups.get(by_name[name]) if name in by_name else None)
            for name, ids in tied.items()
        ]

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for i in self.stage_ids:
            for p in self.modules[i].parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _make_optimizer(self) -> torch.optim.Optimizer | Optimizers:
        # torch's fused AdamW: one kernel per parameter tensor where the default for-each loop
        # runs about ten (measured on a 4-block tensor-parallel CPU step: 11.6 ms of ~150 went to
        # the loop); the same update, rounded differently only.
        kw = {**adamw_kwargs(self.program.optimizer), "fused": True}
        params = self.parameters()
        # ZeRO-2 / 3 and ZeRO-1 with master weights: the parameters are FSDP2's DTensors, each rank
        # holding a slice, so plain AdamW keeps (and steps) state for that slice only.
        if self.program.zero == 1 and not fsdp.uses_fsdp(self.program.zero, self.program.param_dtype):
            # ZeRO-1 shards a parameter's states over the ZeRO ranks that hold the same shard of it:
            # all of them for the dense parameters; for experts split over some of them (expert
            # parallelism), the others (Megatron's expert-data-parallel group, torchtitan's dp_mod_ep).
            # One optimizer per such group, stepped together.
            by_axes: dict[tuple[str, ...], list[nn.Parameter]] = {}
            seen: set[int] = set()
            for i in self.stage_ids:
                for spec in self.specs[i].values():
                    q = self.modules[i].get_parameter(spec.local)
                    if id(q) not in seen:
                        seen.add(id(q))
                        split = {a for _, axes in spec.dims for a in axes}
                        by_axes.setdefault(tuple(a for a in self.zero_axes if a not in split), []).append(q)
            parts = [self._zero1(group, axes, kw) for axes, group in by_axes.items()]
            return parts[0] if len(parts) == 1 else Optimizers(parts)
        # Expert parallelism under ZeRO 2 / 3: the experts stay plain tensors beside FSDP2's
        # DTensors; fused and for-each kernels (the step's and zero_grad's) cannot take the two
        # together, so each kind is its own group, stepped tensor by tensor.
        # Keyed by the mesh's value, not its identity: FSDP2 may hand parameters of one data mesh
        # equal DeviceMesh objects that are not the same one (seen in a pool rank that had built
        # another FSDP2 plan before), and those fuse like one (DTensor compares meshes by value).
        kinds: dict[Any, list[nn.Parameter]] = {}
        for q in params:
            kinds.setdefault(q.device_mesh if fsdp.is_sharded(q) else None, []).append(q)  # type: ignore[attr-defined]
        if len(kinds) > 1:
            kw.update(fused=False, foreach=False)
            return torch.optim.AdamW([{"params": group} for group in kinds.values()], **kw)
        return torch.optim.AdamW(params, **kw)

    def _zero1(self, params: list[nn.Parameter], axes: tuple[str, ...], kw: dict[str, Any]) -> torch.optim.Optimizer:
        """ZeRO-1 of ``params`` over the ranks along ``axes`` (plain AdamW where that is one rank)."""
        if not axes or self.mesh.size(*axes) == 1:
            return torch.optim.AdamW(params, **kw)
        # Imported here, not at module level: it pulls in FSDP and DTensor (~2.4 CPU-s per
        # rank), which only ZeRO plans should pay for.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Each rank of the group keeps Adam state for a slice of the parameters, steps it, and
        # broadcasts the updated values to the others. Bucket views make that one broadcast per
        # owner instead of one per parameter (1.45x the step of no ZeRO without them, 0.86x with
        # them, measured on 2 data ranks here).
        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=torch.optim.AdamW,
            # With HSDP each replica group steps the same partition alike: the gradients were
            # already averaged over every batch axis.
            process_group=self.mesh.group(*axes),
            parameters_as_bucket_view=True,
            **kw,
        )

    def _pipeline(self, mb_shape: tuple[int, int], train: bool = True) -> Any:
        """The schedule for microbatches of token shape ``mb_shape``, built on first use.

        Forward-only runs get their own schedule without a loss: the multi-stage schedules compute
        the loss on the last stage even under ``eval()``.
        """
        key = (*mb_shape, train)
        if key in self._schedules:
            return self._schedules[key]
        from torch.distributed import pipelining as pl

        p = self.program
        assert p.pipeline_axis is not None
        # The stages' own device: a CPU plan on a machine with CUDA stays on the CPU.
        device = self.device
        example: dict[int, Any] = self._example_activations(mb_shape, device)
        loss_fn: Callable[..., Tensor] | None = self._token_loss if train else None
        routed = train and self.router_losses is not None
        if routed:
            # [2 E + 3] routing statistics beside every stage boundary's activations (after stage
            # 0 on): a few floats per expert, P's gradient coming back with the activations'.
            for i in range(1, len(p.stages) + 1):
                stats = torch.zeros(self.router_losses.width, dtype=self._routing_dtype, device=device,
                                    requires_grad=True)
                example[i] = (example[i], stats)
            loss_fn = self._loss_with_router_losses
        stages = [
            pl.PipelineStage(
                self.modules[i],
                stage_index=i,
                num_stages=len(p.stages),
                device=device,
                input_args=example[i],
                output_args=example[i + 1],
                group=self.mesh.group(p.pipeline_axis),
            )
            for i in self.stage_ids
        ]
        for stage in stages:
            # Every schedule runs a stage's forward of microbatch j as forward_one_chunk(j, ...): there
            # it gets microbatch j's rows (its recomputed regions keep them for backward: remat.py).
            stage.forward_one_chunk = functools.partial(self._packed_chunk, stage.forward_one_chunk)  # type: ignore[method-assign]
        kind = _schedule_name(p.schedule)
        cls = getattr(pl, _SCHEDULES[kind])
        # Microbatch losses are means, so the schedule divides gradients by the microbatch count.
        if kind in _SINGLE_STAGE:
            (stage,) = stages
            schedule = cls(stage, n_microbatches=p.microbatches, loss_fn=loss_fn, scale_grads=True)
        else:
            schedule = cls(stages, n_microbatches=p.microbatches, loss_fn=loss_fn, scale_grads=True)
        self._schedules[key] = schedule
        return schedule

    def _loss_with_router_losses(self, out: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        """The last stage's loss of one microbatch: the token loss plus the router losses of the
        whole forward, whose statistics came through every stage (as ``_forward_backward`` adds
        them without a pipeline)."""
        logits, stats = out
        assert self.router_losses is not None
        return self._token_loss(logits, target) + self.router_losses.loss(
            stats, self.context.sequence_sum if self.context is not None else None)

    def _packed_chunk(self, forward_one_chunk: Callable[..., Any], fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """A pipeline stage's forward of microbatch ``fwd_chunk_id`` with that microbatch's packed rows."""
        rows = self._micro_packings[fwd_chunk_id] if self._micro_packings is not None else None
        with packed(rows):
            return forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def _token_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """One microbatch's token loss, the mean over its counted targets, weighted so that the
        step's gradients (averaged over replicas and microbatches) are those of the mean over the
        global batch's counted targets: by counted here x replicas x microbatches / counted in all.
        Unweighted (that factor is exactly 1) when no target is ignored."""
        loss = self.loss_fn(logits, target)
        if self._counted is None:
            return loss
        here = (target != IGNORE).sum().to(loss.dtype)
        return loss * (here * (self.replicas * self.program.microbatches) / max(self._counted, 1))

    def _example_activations(
        self, mb_shape: tuple[int, int], device: torch.device
    ) -> dict[int, Tensor]:
        """Inputs of every stage (and the last output) for one microbatch, all shapes static.

        PipelineStage would otherwise infer shapes with object collectives; giving examples
        up front avoids that round trip.  Boundaries are inferred from the model description:
        the residual stream between stages, logits (last dim from the head's sharding) at the end.
        """
        hidden = int(description.token_embedding(self.program.model)["dim"])
        n = len(self.program.stages)
        out: dict[int, Tensor] = {0: torch.zeros(mb_shape, dtype=torch.long, device=device)}
        between = (mb_shape[0], self._seq_local(mb_shape[1]), hidden)
        for i in range(1, n):
            out[i] = torch.zeros(
                *between, dtype=self.compute_dtype, device=device, requires_grad=True
            )
        vocab_local = self.program.vocab // math.prod(
            self.mesh.size(*axes) for _, axes in self._head_dims()
        )
        out[n] = torch.zeros(
            *mb_shape, vocab_local, dtype=self.compute_dtype, device=device, requires_grad=True
        )
        return out

    def _seq_local(self, seq: int) -> int:
        """Sequence length of the residual stream between stages: s / t under sequence parallelism."""
        from meshllm_dsl.runtime.parallel.collectives import sequence_sharded

        if not self.program.seq_axes or not sequence_sharded():
            return seq
        return seq // self.mesh.size(*self.program.seq_axes)

    def _head_dims(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """How the logits are sharded: like the output rows of the last stage's head weight."""
        last = self.specs[len(self.program.stages) - 1]
        for name in ("lm_head.weight", "embed.weight"):
            if name in last:
                return last[name].dims
        candidates = [
            s for s in last.values() if len(s.shape) == 2 and s.shape[0] == self.program.vocab
        ]
        if not candidates:
            raise ValueError("cannot find the head weight of the last stage")
        return candidates[-1].dims

    # ------------------------------------------------------------------ training

    def _rows(self, t: Tensor) -> Tensor:
        """This rank's rows of the global [B, S] ``t``."""
        if t.shape[0] % self.dp:
            raise ValueError(
                f"batch {t.shape[0]} does not split over {self.dp} data-parallel ranks"
            )
        return t.chunk(self.dp, dim=0)[self.mesh.index(*self.batch_axes)] if self.dp > 1 else t

    def _local_batch(self, t: Tensor, order: Tensor | None = None) -> Tensor:
        """This rank's rows of the global [B, S] ``t`` and, with context parallelism, its chunks of
        each sequence (each row's own under a balance by documents: ``order``, ``_context_order``)."""
        t = self._rows(t)
        return self.context.local(t, order=order) if self.context is not None else t

    def _context_order(self, tokens: Tensor, documents: Tensor | None) -> Tensor | None:
        """This rank's rows' positions in context-rank order [B / dp, S] when the plan spreads packed
        rows over the context ranks by their documents (`context_balance`); None: head-tail."""
        if self.context is None or documents is None:
            return None
        if documents.shape != tokens.shape:
            raise ValueError(f"documents of shape {tuple(documents.shape)} for tokens of shape {tuple(tokens.shape)}")
        # Decided from the host's document numbers (no device sync), then copied to the device once.
        order = self.context.row_order(self._rows(documents))
        return None if order is None else order.to(self.device)

    def _packing(self, tokens: Tensor, documents: Tensor | None, positions: Tensor | None,
                 order: Tensor | None = None) -> Packing | None:
        """This rank's part of a packed batch's ``documents`` / ``positions`` [B, S] (None: plain rows)."""
        if documents is None and positions is None:
            return None
        for name, t in (("documents", documents), ("positions", positions)):
            if t is not None and t.shape != tokens.shape:
                raise ValueError(f"{name} of shape {tuple(t.shape)} for tokens of shape {tuple(tokens.shape)}")
        docs = self._rows(documents.to(self.device)) if documents is not None else None
        pos = self._local_batch(positions.to(self.device), order) if positions is not None else None
        if docs is None:
            return Packing(None, None, pos)
        if self.context is None:
            return Packing(docs, docs, pos)
        if order is not None:
            # Each row spread by its documents: this rank's tokens and the gathered keys at their own
            # row positions, which also number the rotary positions when they continue over the row.
            mine = self.context.mine(order)
            return Packing(self.context.local(docs, order=order), self.context.in_rank_order(docs, order=order),
                           mine if pos is None else pos, sequence=mine, key_sequence=order)
        # Keys are gathered over the context ranks in rank order: their document numbers likewise.
        return Packing(self.context.local(docs), self.context.in_rank_order(docs), pos)

    def train_step(self, tokens: Tensor, targets: Tensor, documents: Tensor | None = None,
                   positions: Tensor | None = None) -> float:
        """One optimizer step on the global batch ``tokens``/``targets`` [B, S] (same on every rank).

        ``documents`` / ``positions`` [B, S]: a packed batch's document numbers and rotary positions
        (runtime/data/corpus.py ``Batch``): each token attends only to its own document's earlier
        tokens. Targets ``IGNORE`` take no loss. Returns the mean token loss over the whole global
        batch's counted targets, on every rank.
        """
        self.optimizer.zero_grad(set_to_none=False)
        # Counted where the batch comes from (the host), not after the copy: no device sync.
        counted = int((targets != IGNORE).sum())
        order = self._context_order(tokens, documents)
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        packing = self._packing(tokens, documents, positions, order)
        self._counted = None if counted == targets.numel() else counted
        try:
            local_loss = self._forward_backward(self._local_batch(tokens, order), self._local_batch(targets, order), packing)
        finally:
            self._counted = None
        self._sync_grads()
        self._match_grad_layouts()
        settings = self.program.optimizer
        if "clip" in settings:
            self.grad_norm = self.clip_grads(float(settings["clip"]))
        lr = lr_at(settings, self.steps_done)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.balance_experts()
        self.precompute_float8_scales()
        self.steps_done += 1
        return self._global_loss(local_loss)

    def balance_experts(self) -> None:
        """After an optimizer step: each balanced router's correction bias moves toward balance by
        the expert loads of the step, summed over every rank that routed them (one all-reduce of
        the counts of this rank's moe layers; nothing without `balance_rate`)."""
        moe_routing.balance(self.balanced_routers, self._balance_group)

    def routing_buffers(self) -> dict[str, Tensor]:
        """The sigmoid routers' correction biases of this rank's stages, by full name (replicated:
        every rank of a stage holds the whole bias)."""
        out: dict[str, Tensor] = {}
        for i in self.stage_ids:
            paths = self._global_modules(i)
            for name, buf in self.modules[i].named_buffers():
                module, _, leaf = name.rpartition(".")
                if leaf == moe_routing.CORRECTION:
                    out[f"{paths.get(module, module)}.{leaf}"] = buf
        return out

    def grad_norm_sq(self) -> Tensor:
        """This rank's share of the squared global gradient norm, so that the sum over the mesh
        counts every element of every full gradient exactly once.

        A shard counts on every rank that holds a different slice of it; a copy (replicated over
        tensor or unused axes, averaged over data axes, tied on another stage) counts only on the
        first holder: each pipeline stage's parameters, once; the tied weight, on its first stage.
        """
        first_stage = {name: min(ids) for name, ids, _ in self._tied}
        seen: set[int] = set()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in sorted(self.stage_ids):
            for name, spec in self.specs[i].items():
                param = self.modules[i].get_parameter(spec.local)
                if id(param) in seen or param.grad is None:
                    continue
                seen.add(id(param))
                if first_stage.get(name, i) != i:
                    continue
                split = {a for _, axes in spec.dims for a in axes}
                if fsdp.is_sharded(param.grad):
                    split |= set(self.zero_axes)  # each shard rank holds its own slice of it (HSDP: replicas repeat it)
                copies = [a for a in self.mesh.names if a != self.program.pipeline_axis and a not in split]
                if all(self.mesh.coord(a) == 0 for a in copies):
                    grad = fsdp.data_local(param.grad.detach())
                    total += grad.to(torch.float64).pow(2).sum()
        return total

    def clip_grads(self, max_norm: float) -> float:
        """Scale every gradient by min(1, max_norm / (norm + 1e-6)), with the norm over the whole
        model as torch.nn.utils.clip_grad_norm_ computes it on the unsharded one; the norm."""
        total = self.grad_norm_sq()
        group = self.mesh.group(*self.mesh.names)
        if group is not None:
            # [1]: each rank's share of the squared norm, summed over the whole mesh.
            total = all_reduce_sum(total.reshape(1), group)[0]
        norm = float(total.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for q in self.parameters():
                if q.grad is not None:
                    q.grad.mul_(coef)
        return norm

    def _forward_backward(self, tokens: Tensor, targets: Tensor, packing: Packing | None = None) -> Tensor | None:
        p = self.program
        m = p.microbatches
        if tokens.shape[0] % m:
            raise ValueError(f"local batch {tokens.shape[0]} does not split into {m} microbatches")
        losses: list[Tensor] = []
        if self.pp == 1:
            defer = fsdp.defers_grad_sync(p.zero, p.param_dtype)
            for j, (tok, tgt) in enumerate(zip(tokens.chunk(m), targets.chunk(m))):
                if defer:
                    # ZeRO 1 (Megatron's distributed optimizer): one gather and one reduce-scatter a
                    # step; the microbatches before the last accumulate whole fp32 gradients.
                    for i in self.stage_ids:
                        self.modules[i].set_requires_gradient_sync(j == m - 1)  # type: ignore[operator]
                        self.modules[i].set_reshard_after_backward(j == m - 1)  # type: ignore[operator]
                x = tok
                # This microbatch's rows for every attention layer, through backward too (where
                # recomputed blocks rerun their forward).
                with packed(_microbatch(packing, m, j)):
                    with moe_routing.recording(self.router_losses is not None) as routing:
                        for i in self.stage_ids:
                            x = self.modules[i](x)
                    loss = self._token_loss(x, tgt)
                    if self.router_losses is not None:
                        # Over this microbatch's tokens on this replica, as transformers per forward
                        # (its whole sequences: the statistics summed over the context ranks).
                        stats = self._router_statistics(routing, None, tok.shape[0])
                        loss = loss + self.router_losses.loss(
                            stats, self.context.sequence_sum if self.context is not None else None)
                    del x  # the logits: backward needs only what the loss saved, not them
                    (loss / m).backward()
                losses.append(loss.detach())
            return torch.stack(losses).mean()
        schedule = self._pipeline((tokens.shape[0] // m, tokens.shape[1]))
        n = len(p.stages)
        args = (tokens,) if 0 in self.stage_ids else ()
        target = targets if n - 1 in self.stage_ids else None
        # return_outputs=False: otherwise the last stage keeps every microbatch's logits
        # ([mb, s, vocab / t] each) until the step ends, though training only needs the losses.
        self._carry_routing = self.router_losses is not None
        # torch's split-backward schedules (input gradients first, weight gradients later) give wrong
        # expert weight gradients through torch._grouped_mm (measured: 6e-3 off under DualPipeV), so
        # their experts run the F.linear loop (runtime/moe/grouped.py loop_only).
        loop = grouped.loop_only() if splits_backward(p.schedule) else contextlib.nullcontext()
        # Every rank holds the global batch, so each stage's rank knows every microbatch's rows itself.
        self._micro_packings = None if packing is None else [_microbatch(packing, m, j) for j in range(m)]
        try:
            with loop:
                schedule.step(*args, target=target, losses=losses, return_outputs=False)
        finally:
            self._carry_routing = False
            self._micro_packings = None
        return torch.stack([x.detach() for x in losses]).mean() if losses else None

    def _sum_partial_grads(self) -> None:
        """Sum the gradients that are partial over some axes (``ShardSpec.partial_grad``: norms
        under sequence parallelism) over those axes, coalesced per set of axes.

        Under ZeRO 2 / 3 a gradient is FSDP2's DTensor over the data ranks: the ranks of a tensor
        group sit at one data coordinate and hold the same slice of it, so their local slices are
        summed (sum over tensor and FSDP's mean over data commute)."""
        by_axes: dict[tuple[str, ...], list[Tensor]] = {}
        for i in self.stage_ids:
            for spec in self.specs[i].values():
                param = self.modules[i].get_parameter(spec.local)
                if spec.partial_grad and param.grad is not None:
                    by_axes.setdefault(tuple(spec.partial_grad), []).append(fsdp.data_local(param.grad))
        for axes, grads in by_axes.items():
            group = self.mesh.group(*axes)
            if group is not None:
                _all_reduce_coalesced(grads, group)

    def _match_grad_layouts(self) -> None:
        """Each plain gradient in its parameter's memory layout before the optimizer reads it.

        Autograd's accumulation keeps a parameter's strides, but torch's zero-bubble schedules
        compute weight gradients apart (``stage_backward_weight``) and assign what autograd.grad
        returns, whose strides can differ: a stacked experts' weight [hidden, experts, ffn] of
        strides (128, 32, 1) got a gradient of strides (32, 1024, 1). torch 2.13's fused AdamW then
        pairs the two as flat buffers on CPU (elements of different positions: measured, Mixtral
        under ZBV / DualPipeV moved expert weights by lr the wrong way) and refuses them on CUDA
        ("must have same dtype, device, and layout", pytorch/pytorch#106951). FSDP2's sharded
        gradients are its own and already match."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if type(g) is torch.Tensor and g.stride() != p.stride():
                    p.grad = torch.empty_like(p).copy_(g)  # empty_like keeps p's strides

    def _sync_grads(self) -> None:
        self._sum_partial_grads()
        for name, ids, group in self._tied:
            local = [
                self.modules[i].get_parameter(self.specs[i][name].local)
                for i in ids
                if i in self.modules
            ]
            if not local:
                continue
            grads = [fsdp.data_local(q.grad) for q in local if q.grad is not None]
            total = sum(grads, torch.zeros_like(fsdp.data_local(local[0].detach())))
            # [shard of the tied weight]: sum the copies' grads across the pipeline ranks holding it
            # (with ZeRO 2 / 3, this data rank's slice of it: the copies are sliced alike).
            total = all_reduce_sum(total, group)
            for q in local:
                if fsdp.is_sharded(q):
                    assert q.grad is not None
                    fsdp.data_local(q.grad).copy_(total)
                else:
                    q.grad = total.clone()
        if self.replicas > 1:
            # FSDP2 already averaged its (DTensor) gradients over the data (and context) ranks. A
            # parameter split over batch axes (expert parallelism: each rank holds other experts) is
            # summed only over the batch (and context) axes that replicate it: its gradient already
            # holds every token of the axes that split it (the all-to-all's backward brought them), so
            # it is only divided there.
            by_axes: dict[tuple[str, ...], list[Tensor]] = {}
            seen: set[int] = set()
            for i in self.stage_ids:
                for spec in self.specs[i].values():
                    q = self.modules[i].get_parameter(spec.local)
                    if id(q) in seen or q.grad is None or fsdp.is_sharded(q.grad):
                        continue
                    seen.add(id(q))
                    by_axes.setdefault(self._replica_axes(spec), []).append(q.grad)
            # Under FSDP2 the plain gradients are the experts' it leaves out: summed in the plan's
            # reduce dtype, as FSDP2 reduces the dense ones.
            p = self.program
            reduce = p.reduce_dtype if fsdp.uses_fsdp(p.zero, p.param_dtype) else None
            for over, grads in by_axes.items():
                if over and self.mesh.size(*over) > 1:
                    _all_reduce_coalesced(grads, self.mesh.group(*over), divide_by=self.replicas, dtype=reduce)
                else:
                    torch._foreach_div_(grads, self.replicas)

    def _replica_axes(self, spec: ShardSpec) -> tuple[str, ...]:
        """The batch and context axes (in mesh order) over which ranks hold the same shard of
        ``spec``'s parameter, so its gradient is averaged over them: all of them but those that split it."""
        split = {a for _, axes in spec.dims for a in axes}
        return tuple(a for a in self.grad_axes if a not in split)

    def _global_loss(self, local: Tensor | None) -> float:
        """Mean of the per-replica losses, known to every rank (only last stages computed one)."""
        value = (
            torch.zeros((), dtype=torch.float64)
            if local is None
            else local.detach().to(torch.float64)
        )
        axes = tuple(
            a for a in self.mesh.names if a == self.program.pipeline_axis or a in self.grad_axes
        )  # not tensor: its ranks computed the same vocab-parallel loss
        if axes:
            group = self.mesh.group(*axes)
            # [1]: the last stages' losses, summed over pipeline (others add 0), replicas and
            # context ranks (each the mean over an equal share of the tokens).
            value = all_reduce_sum(value.reshape(1), group)[0]
        return float(value) / self.replicas

    # ------------------------------------------------------------------ inspection

    def run_stages(self, tokens: Tensor) -> Tensor | None:
        """Run this rank's stages in order on one batch, without a schedule (forward, decoding).

        Returns the local logits on ranks holding the last stage, else None.  Activations
        [b, s, hidden] move to the next pipeline rank with point-to-point send / recv.
        """
        n, x = len(self.program.stages), tokens
        for i in self.stage_ids:
            # At the turn of a V the previous stage ran here: its output is already ``x``.
            if i > 0 and self.pp > 1 and self.stage_rank[i - 1] != self.stage_rank[i]:
                b, s = tokens.shape
                x = torch.empty(
                    b, self._seq_local(s), self._hidden, dtype=self.compute_dtype, device=self.device
                )
                # [b, s, hidden] residual stream from the previous stage's rank.
                dist.recv(x, src=self._pipeline_rank(i - 1))
            x = self.modules[i](x)
            if i < n - 1 and self.pp > 1 and self.stage_rank[i + 1] != self.stage_rank[i]:
                # [b, s, hidden] to the next stage's rank.
                dist.send(x.contiguous(), dst=self._pipeline_rank(i + 1))
        return x if n - 1 in self.stage_ids else None

    def gather_logits(self, local: Tensor | None, shape: tuple[int, int]) -> Tensor:
        """Full logits [b, s, vocab] on every rank of a pipeline group from the last stage's shards."""
        # A head whose stage already gathered its output returns the full vocab: nothing to do.
        if local is not None and local.shape[-1] != self.program.vocab:
            for _, axes in reversed(self._head_dims()):
                group = self.mesh.group(*axes)
                if group is not None:
                    parts = [torch.empty_like(local) for _ in range(self.mesh.size(*axes))]
                    # [b, s, vocab / n] -> [b, s, vocab]: logits sharded like the head's rows.
                    dist.all_gather(parts, local.contiguous(), group=group)
                    local = torch.cat(parts, dim=-1)
        if self.pp == 1:
            assert local is not None
            return local
        full = (
            local
            if local is not None
            else torch.empty(
                *shape, self.program.vocab, dtype=self.compute_dtype, device=self.device
            )
        )
        full = full.contiguous()
        # [b, s, vocab] from the rank holding the last stage to the rest of its pipeline group.
        dist.broadcast(
            full,
            src=self._pipeline_rank(len(self.program.stages) - 1),
            group=self.mesh.group(self._pp_axis),
        )
        return full

    @torch.no_grad()
    def forward(self, tokens: Tensor, documents: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """Full logits [B, S, vocab] of the global batch, on every rank (for equivalence checks);
        ``documents`` / ``positions``: a packed batch's, as ``train_step`` takes them."""
        order = self._context_order(tokens, documents)
        tokens = tokens.to(self.device)
        packing = self._packing(tokens, documents, positions, order)  # every pipeline rank's stages read the same rows
        local = self._local_batch(tokens, order)
        with packed(packing):
            logits = self.gather_logits(self.run_stages(local), (local.shape[0], local.shape[1]))
        if self.context is not None:
            # [B / dp, S / cp, vocab] per context rank -> [B / dp, S, vocab] in position order.
            logits = self.context.unshard(logits, order=order)
        if self.dp > 1:
            parts = [torch.empty_like(logits) for _ in range(self.dp)]
            # [B / dp, S, vocab] per replica -> [B, S, vocab].
            dist.all_gather(parts, logits, group=self.mesh.group(*self.batch_axes))
            logits = torch.cat(parts, dim=0)
        return logits

    @property
    def _pp_axis(self) -> str:
        assert self.program.pipeline_axis is not None
        return self.program.pipeline_axis

    def _pipeline_rank(self, stage: int) -> int:
        """Global rank holding ``stage`` at this rank's other coordinates."""
        return self.mesh.rank_at(**{self._pp_axis: self.stage_rank[stage]})

    def _gather(self, grads: bool) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        from_stage: dict[int, list[Tensor]] = {}
        for i in range(len(self.program.stages)):
            for name, spec in sorted(self.specs[i].items()):
                if name in out:
                    continue  # a tied copy: the first holder's tensor stands for all
                if i in self.modules:
                    param = self.modules[i].get_parameter(spec.local)
                    local = param.grad if grads else param
                    local = torch.zeros_like(param) if local is None else local
                    full = gather_full(fsdp.tp_local(local.detach()), spec, self.mesh)
                else:
                    full = torch.empty(spec.shape, dtype=self.program.dtype, device=self.device)
                out[name] = full
                from_stage.setdefault(self.stage_rank[i], []).append(full)
        if self.pp > 1:
            group = self.mesh.group(self._pp_axis)
            for index, tensors in sorted(from_stage.items()):
                # Every full tensor of the stages at pipeline index `index`, from the rank holding
                # them to the rest of the pipeline group: a few coalesced broadcasts, not one per
                # tensor (latency-bound on gloo).
                # (the C++ helper DDP syncs its modules with; src is a group rank, here the index).
                bucket_bytes = _BUCKET_ELEMENTS * tensors[0].element_size()
                dist._broadcast_coalesced(group, tensors, bucket_bytes, index)
        return out

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter at full shape keyed by full name, on every rank (collective)."""
        return self._gather(grads=False)

    def full_grads(self) -> dict[str, Tensor]:
        """Gradients of the last step at full shape (after data-parallel averaging), on every rank."""
        return self._gather(grads=True)

    def load_full_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load this rank's shards from full tensors keyed by full name (same on every rank)."""
        with torch.no_grad():
            for i in self.stage_ids:
                for name, spec in self.specs[i].items():
                    if name not in state:
                        raise KeyError(f"full state dict has no {name!r}")
                    param = self.modules[i].get_parameter(spec.local)
                    fsdp.store_tp_local(param, local_slice(state[name].to(param.dtype), spec, self.mesh))
