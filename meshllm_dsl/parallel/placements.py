"""Where a plan's tensors live on its mesh, as the runtime builds them: the SPMD mesh a stage's
DTensors use, whether FSDP2 holds the parameters and over which axes, an activation's whole layout.

The placement algebra these read (Replicate, Shard, Partial, Layout and the reprs torch prints) is
dtensor.py's, below the IR that uses it; its names are imported back here for callers that know
them from this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm_dsl.ir import SPLIT_BACKWARD
from meshllm_dsl.parallel.dtensor import Layout as Layout
from meshllm_dsl.parallel.dtensor import Partial as Partial
from meshllm_dsl.parallel.dtensor import Replicate as Replicate
from meshllm_dsl.parallel.dtensor import Shard as Shard
from meshllm_dsl.parallel.dtensor import activation_dims as activation_dims
from meshllm_dsl.parallel.dtensor import dtensor_placements as dtensor_placements
from meshllm_dsl.parallel.dtensor import dtensor_text as dtensor_text

if TYPE_CHECKING:
    from meshllm_dsl.ir import PlanIR


def spmd_mesh(plan: PlanIR) -> tuple[tuple[str, int], ...]:
    """The mesh a stage's DTensors live on: the plan's axes but the pipeline one, in mesh order (the
    pipeline axis runs stages, each holding its own tensors, as torchtitan keeps it out of the SPMD
    mesh)."""
    return tuple((a.name, a.size) for a in plan.mesh.axes if a.name != plan.roles.pipeline)


def runs_fsdp(plan: PlanIR) -> bool:
    """Whether the runtime holds the plan's parameters as FSDP2's (runtime/parallel/fsdp.py's ``uses_fsdp``):
    ZeRO 2 / 3, and ZeRO 1 with `precision` (Megatron's distributed optimizer, the fp32 master
    weights sharded with the moments)."""
    return plan.zero >= 2 or (plan.zero == 1 and plan.master_dtype is not None)


def gather_stage(plan: PlanIR) -> int:
    """The ZeRO stage FSDP2's gathering behaves as: the plan's, except ZeRO 3 under a schedule that
    splits backward, where the runtime keeps each unit gathered from its forward to its weight
    gradient (no reshard after forward, runtime/train/program.py): ZeRO 2's gathers."""
    return 2 if plan.zero >= 3 and plan.schedule in SPLIT_BACKWARD and plan.roles.pipeline else plan.zero


def defers_grad_sync(plan: PlanIR) -> bool:
    """ZeRO 1 with master weights reduce-scatters once a step, after the last microbatch, with
    whole gradients accumulated in the reduce dtype before it (runtime/parallel/fsdp.py's ``defers_grad_sync``)."""
    return plan.zero == 1 and plan.master_dtype is not None


def fsdp_axes(plan: PlanIR) -> tuple[str, ...]:
    """The axes FSDP2 shards parameters over along dim 0 (ZeRO 2 and 3, and ZeRO 1 with master
    weights: runtime/parallel/fsdp.py); plain ZeRO 1 shards only optimizer states, so its parameters stay
    Replicate there."""
    return plan.roles.batch_shard if runs_fsdp(plan) else ()


def activation_layout(plan: PlanIR, layout: Layout) -> Layout:
    """A flow's layout (what tensor and sequence parallelism make of it) with the batch split over
    the plan's batch axes and, under context parallelism, the sequence over the context axes
    through the whole model: the whole picture of an activation on the mesh."""
    return Layout.shard("batch", plan.roles.batch).then(Layout.shard("seq", plan.roles.context)).then(layout)
