"""Every collective operator a plan can issue (ir.Collective.op), each described once.

Layouts decide which operators a unit's flow needs; lowering prints the runtime call each one
becomes, the planner counts its kernels and the bytes it puts on the wire, and `meshc explain` says
what it does forward and backward. All of them read the record here, so an operator cannot be known
to one of them and missing from another (a merge once broke `meshc plan` with a KeyError on
sequence-parallel plans that way). The runtime keeps its own export list (runtime/__init__._WHERE:
it must not import the compiler); tests/planner/test_collective_registry.py checks the two agree.

Megatron's operators (Shoeybi et al. 2019) around a tensor-parallel sublayer: f (`copy_to`) in
front of the column layers, g (`reduce_from`) after the row layer, and `split_to` / `gather_from`
for a row layer fed a replicated input and the converse. Sequence parallelism's (Korthikanti et al.
2022) move the sequence dim instead: f and g become `gather_seq` and `reduce_scatter_seq`.
Expert parallelism's `expert_all_to_all` is issued from inside the moe layer (``issued = "unit"``):
codegen prints its runtime function's name, explain and the planner read its record like the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import attrs

from meshllm_dsl.registry import assert_never, keyed

CollectiveOp = Literal[
    "copy_to",
    "reduce_from",
    "split_to",
    "gather_from",
    "gather_seq",
    "reduce_scatter_seq",
    "split_seq",
    "gather_seq_split",
    "expert_all_to_all",
]
# Who issues an operator: "layout", the layout flow between a unit's layers (ir.Collective; lowering
# prints `x = rt.<runtime>(x, group)` for it); "unit", a primitive's own runtime function from inside
# the unit, whenever its placement asks for it (the moe layer's dispatch and combine, runtime/moe/dispatch.py).
Issuer = Literal["layout", "unit"]
# What a device puts on the wire for one call (the planner's Comm.op); send_recv is the pipeline's.
WirePrimitive = Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all"]


def ring_bytes(primitive: WirePrimitive, size: int, n: int) -> int:
    """Bytes each of `n` ranks sends for one call on a `size`-byte tensor, ring algorithm (NCCL's
    for large sizes): an all-reduce is a reduce-scatter then an all-gather."""
    if n <= 1:
        return 0
    if primitive == "all_reduce":
        return 2 * (n - 1) * size // n
    if primitive in ("all_gather", "reduce_scatter", "all_to_all"):
        # an all-to-all keeps its own 1 / n of `size` (routing spread evenly) and sends the rest
        return (n - 1) * size // n
    if primitive == "send_recv":
        return size
    assert_never(primitive)


@attrs.frozen
class Fused:
    """A runtime call that runs the operator and the column layers after it as one autograd Function.

    The templates are the generated line's comment, formatted with `dim` (the input's hidden
    width), `n` and `axes` (the group), and for the head `out` and `what` (its logits' width and
    layout)."""

    runtime: str
    columns: str  # comment in a sublayer, in front of its column layers
    head: str  # comment at the model's head
    # The call's input is this rank's slice of the sequence and its outputs span all of it, so the
    # attention after it reads the sequence length again.
    gathers_sequence: bool
    # Kernels the fused call saves per microbatch against the operator then the layers one by one,
    # given the number of column layers and of their biases (counted on gloo ranks).
    kernels_saved: Callable[[int, int], int] | None = None


@attrs.frozen
class CollectiveSpec:
    op: CollectiveOp
    runtime: str  # the function of meshllm_dsl.runtime (runtime/parallel/collectives.py) it lowers to
    runtime_args: str  # arguments after (x, group) in the generated call
    # Comment of the generated `x = rt.<runtime>(x, group)` line, formatted with `dim` (the hidden
    # width), `local` (dim // n), `n` and `axes`.
    line: str
    # What it puts on the wire per microbatch, forward then backward, each the full activation.
    wire: tuple[WirePrimitive, ...]
    kernels: int  # framework kernels it launches per microbatch, forward and backward
    forward: str  # what `meshc explain` says it does forward
    backward: str  # and backward
    # The operator sequence parallelism turns it into (Megatron's f / g over the sequence axes).
    under_seq: CollectiveOp | None = None
    # Comment when it sums a row layer's partial output inside a sublayer (`line`'s arguments).
    closes_row: str | None = None
    fused: Fused | None = None
    issued: Issuer = "layout"

    def call(self, x: str, group: str) -> str:
        return f"rt.{self.runtime}({x}, {group}{self.runtime_args})"

    def wire_bytes(self, size: int, n: int) -> int:
        """Bytes each of `n` ranks sends per microbatch for a `size`-byte activation."""
        return sum(ring_bytes(p, size, n) for p in self.wire)


def _copy_to_linear_saved(columns: int, biased: int) -> int:
    # 5 fewer per layer and 1 fewer per bias, less one for the Function itself.
    return 5 * columns - 1 + biased if columns else 0


_SPECS = (
    CollectiveSpec(
        "copy_to", "copy_to", "", "f: [b, s, {dim}] identity; backward all-reduces over {axes}",
        ("all_reduce",), 3, "identity", "all-reduce", under_seq="gather_seq",
        fused=Fused(
            "copy_to_linear",
            "f: [b, s, {dim}] into the column layers; backward all-reduces over {axes} ({n}) during their weight gradients",
            "f: [b, s, {dim}] -> [b, s, {out}] {what}; backward all-reduces over {axes} during the weight gradient",
            gathers_sequence=False, kernels_saved=_copy_to_linear_saved,
        ),
    ),
    CollectiveSpec(
        "reduce_from", "reduce_from", "", "g: all-reduce over {axes} ({n}) -> [b, s, {dim}]",
        ("all_reduce",), 2, "all-reduce", "identity", under_seq="reduce_scatter_seq",
        closes_row="g: all-reduce over {axes} ({n}) -> [b, s, {dim}]",
    ),
    CollectiveSpec(
        "split_to", "split_to", ", dim=-1", "[b, s, {local}]: this rank's slice over {axes}",
        ("all_gather",), 3, "split", "all-gather",
    ),
    CollectiveSpec(
        "gather_from", "gather_from", ", dim=-1", "[b, s, {local}] -> [b, s, {dim}]: all-gather over {axes} ({n}); backward splits",
        ("all_gather",), 3, "all-gather", "split",
    ),
    # Fitted to kernel counts on tiny_gpt2's ranks with and without `seq -> tensor`: gather_seq runs
    # the column layers inside its gather (buffers, views) and gathers its kept slice again in
    # backward; reduce_scatter_seq pads, scatters and re-gathers.
    CollectiveSpec(
        "gather_seq", "gather_seq", "",
        "[b, s/{n}, {dim}] -> [b, s, {dim}]: all-gather over {axes} ({n}); backward reduce-scatters",
        ("all_gather", "all_gather", "reduce_scatter"), 14,
        "all-gather(seq)", "all-gather(seq) again and reduce-scatter(seq)",
        fused=Fused(
            "gather_seq_linear",
            "[b, s/{n}, {dim}] all-gathered over {axes} ({n}) into the column layers; backward gathers again and reduce-scatters",
            "[b, s/{n}, {dim}] all-gathered over {axes} ({n}) -> [b, s, {out}] {what}; backward gathers again and reduce-scatters",
            gathers_sequence=True,
        ),
    ),
    CollectiveSpec(
        "reduce_scatter_seq", "reduce_scatter_seq", "",
        "reduce-scatter over {axes} ({n}) -> [b, s/{n}, {dim}] Shard(seq); backward all-gathers",
        ("reduce_scatter", "all_gather"), 14, "reduce-scatter(seq)", "all-gather(seq)",
        closes_row="reduce-scatter over {axes} ({n}) -> [b, s/{n}, {dim}]; backward all-gathers",
    ),
    CollectiveSpec(
        "split_seq", "split_seq", "",
        "[b, s/{n}, {dim}] this rank's slice of the sequence; backward all-gathers over {axes}",
        ("all_gather",), 3, "split(seq)", "all-gather(seq)",
    ),
    # In front of a head that is not split over the sequence axes: its input gradient is whole on
    # every rank, so backward keeps this rank's slice instead of reduce-scattering.
    CollectiveSpec(
        "gather_seq_split", "gather_seq", ", partial_grad=False",
        "[b, s/{n}, {dim}] -> [b, s, {dim}]: all-gather over {axes} ({n}); backward keeps this rank's slice",
        ("all_gather",), 3, "all-gather(seq)", "split(seq)",
    ),
    # Expert parallelism (`experts -> D`): the moe layer's module (runtime `ExpertsParallel`, whose
    # `experts` method FSDP2 can hook) sends each (token, choice) row to its expert's rank and the
    # results back, `all_to_all_single` with uneven splits;
    # their backwards are the reverse all-to-alls. Sizes are the [b*s*top_k, hidden] rows (planner).
    # Its kernels are the moe primitive's (primitives/moe.py counts the layer whole), and so is its
    # generated call's comment, which names the layer's shapes (`line` says the same in general).
    CollectiveSpec(
        "expert_all_to_all", "ExpertsParallel", "",
        "[b*s*top_k, {dim}] rows to their experts' ranks over {axes} ({n}) and back",
        ("all_to_all", "all_to_all", "all_to_all", "all_to_all"), 0,
        "all-to-all dispatch and combine (uneven splits)", "the reverse all-to-alls", issued="unit",
    ),
)


def _registry(specs: tuple[CollectiveSpec, ...]) -> Mapping[CollectiveOp, CollectiveSpec]:
    """The registry keyed by op; refuses (at import) an op of CollectiveOp without a record, a
    record for an op CollectiveOp lacks, or one named twice."""
    registry: dict[CollectiveOp, CollectiveSpec] = keyed(  # type: ignore[assignment]
        specs, lambda s: s.op, CollectiveOp, "collective", "op")
    bad = [s.op for s in specs if s.under_seq is not None and s.under_seq not in registry]
    if bad:
        raise ValueError(f"collective registry: {bad} turn into unregistered ops under sequence parallelism")
    return registry


COLLECTIVES: Mapping[CollectiveOp, CollectiveSpec] = _registry(_SPECS)


def spec(op: str) -> CollectiveSpec:
    """The record of `op`; an op nobody registered is a compiler bug, named as one."""
    found = COLLECTIVES.get(op)  # type: ignore[call-overload]
    if found is None:
        raise KeyError(f"collective {op!r} has no record in meshllm_dsl/parallel/collectives.py (known: {', '.join(COLLECTIVES)})")
    return found


def layout_collectives() -> tuple[CollectiveSpec, ...]:
    """The operators the layout flow places between layers (lowered as `x = rt.<runtime>(x, group)`)."""
    return tuple(s for s in COLLECTIVES.values() if s.issued == "layout")


def runtime_functions() -> frozenset[str]:
    """Every function of meshllm_dsl.runtime (runtime/parallel/collectives.py) generated code calls for a
    collective the layout flow places; a unit's own (`issued = "unit"`) live with its primitive."""
    layout = layout_collectives()
    return frozenset(s.runtime for s in layout) | frozenset(s.fused.runtime for s in layout if s.fused is not None)
