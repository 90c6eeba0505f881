"""Every layer kind a model can declare (ir.Unit.kind), each one module of this package.

A kind's module holds what the compiler knows about it: the fields of its entry in the generated
`MODEL` description (what the runtime's reference model and Hugging Face adapters read), the lines
codegen prints for it, its activation flow across the mesh axes, and what the planner charges for
it, its arguments and how resolve builds its IR unit. Resolve, layouts, lowering and the planner
look the record up here instead of comparing kind strings, so a kind without a record, or whose
record lacks one of those parts, is an error at import (`_registry`), never a silent fallthrough to
another kind's code. The runtime cannot import the compiler and keeps its own table keyed by kind
(runtime/model/reference.py LAYER_KINDS); tests/checker/test_primitive_registry.py keeps the two in step.

Adding a kind: its module here (a `Primitive` subclass and its record in REGISTRY), its `UnitKind`
name (meshllm_dsl/ir.py), its runtime layer (runtime/model/reference.py, runtime/model/layers.py) and the goldens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, get_args

import attrs

from meshllm_dsl.ir import LeafKind, UnitKind
from meshllm_dsl.parallel.costs import Work
from meshllm_dsl.primitives.args import Arg
from meshllm_dsl.registry import keyed

if TYPE_CHECKING:
    from meshllm_dsl.front.site import UnitSite
    from meshllm_dsl.ir import Collective, Leaf, Placement, PlanIR, Unit, UnitFlow
    from meshllm_dsl.parallel.costs import HeldUnit
    from meshllm_dsl.parallel.flow import FlowSite

# What a kind's build gives: the unit's attributes and its leaves.
Built = tuple[dict[str, Any], list["Leaf"]]



@attrs.frozen
class TopSite:
    """What a top-level unit's forward lines depend on: the plan, the unit, its flow and placement,
    the variable holding its input, and the top-level units this stage holds."""

    plan: PlanIR
    unit: Unit
    flow: UnitFlow | None
    placement: Placement
    cur: str
    held: frozenset[str]


@attrs.frozen
class Primitive:
    """One layer kind. Subclasses (one per module) override what their kind does differently.

    `w` in the codegen methods is codegen/lower.py's _UnitWriter: it makes lines (`w.line`), names
    process groups and sizes mesh axes; the methods only choose what to print."""

    kind: UnitKind
    # A norm: in a block it normalises the input of the sublayer after it; sequence parallelism
    # keeps it on this rank's slice of the sequence.
    norm: bool = False
    # A residual branch of a block: column layers read its input, a row layer closes it.
    sublayer: bool = False
    # Its forward reads the sequence length `s` (attention's views): where a fused gather brings in
    # the whole sequence, codegen binds `s` again from the gathered output.
    reads_sequence: bool = False
    # It keeps keys and values per token when generating (the planner's KV cache).
    caches_kv: bool = False
    # Selective recomputation (`recompute = attention`) reruns its core in backward.
    recomputed_core: bool = False
    # Leaves whose products that recomputed region reruns with the core (mla's kv_b: its region
    # starts from the latents, so backward up-projects them again); the planner prices them as rerun work.
    core_reruns: tuple[str, ...] = ()
    # It routes each token to `top_k` of its experts (a moe layer): the planner's expert all-to-alls,
    # routing gathers under context parallelism, active parameters and routing skew; a plan's `skew`
    # and the `expert` rule apply to it.
    routes_experts: bool = False
    # Its linear leaves are nn.Linear modules in the generated code whose matmuls torchao may train in
    # float8 (`precision { matmul = R }`: runtime/train/float8.py converts them; checker/matmul.py decides which).
    float8_linears: bool = False
    # Sequence parallelism may shard its input and output along the sequence (f / g become an
    # all-gather and a reduce-scatter); False: refused (E0309) until its forward is written for it.
    sequence_parallel: bool = True
    # Leaves that must stay whole on every rank (a moe layer's routers): the checker suggests
    # `replicate` for them where a plan leaves them out.
    whole: tuple[str, ...] = ()
    # The argument giving the width of the residual stream it reads (a model's chain must agree).
    width_arg: str = "dim"
    # Its arguments as a spec writes them, in order (resolve.py binds calls against them).
    args: tuple[Arg, ...] = ()
    # Its leaf is a table whose rows are the vocabulary (the token embedding): `vocab_parallel`
    # splits it, the one split it takes besides `replicate`.
    vocab_rows: bool = False

    # -- building the IR unit (meshllm_dsl/front/resolve.py binds the arguments first)
    def build(self, site: UnitSite) -> Built | None:
        """Its parameters (leaves) and attributes from the bound arguments; None after an error."""
        raise NotImplementedError(self.kind)

    # -- activation flow (meshllm_dsl/parallel/flow.py holds the layout algebra the records use)
    def flow(self, site: FlowSite) -> UnitFlow | None:
        """Layouts in and out and the collectives between, given its leaves' placements; None after
        an error reported to `site.r`."""
        raise NotImplementedError(self.kind)

    def seq_top_flow(self, unit: Unit, flow: UnitFlow, seq: tuple[str, ...], last: bool,
                     then: Unit | None) -> UnitFlow:
        """A top-level unit's flow under sequence parallelism over `seq` (`then`: the next unit).
        Unchanged by default: a top-level linear between blocks, refused by the checker (E0410)."""
        return flow

    def block_variant(self, unit: Unit, index: int) -> tuple[Any, ...]:
        """What differs between blocks of a repeat for this unit (attention's sliding window on some
        blocks only): blocks whose variants differ get generated classes of their own."""
        return ()

    def unit_collectives(self, unit: Unit, placement: Mapping[str, Placement]) -> tuple[Collective, ...]:
        """The collectives it issues from inside its own forward (registered with `issued = "unit"`
        in meshllm_dsl/parallel/collectives.py), given its leaves' placements keyed by leaf path;
        the layout flow's are its flow's. None by default."""
        return ()

    def collective_width(self, unit: Unit, c: Collective) -> int | None:
        """Features per token of what collective `c` of its flow carries, where that is not the
        residual stream's width (None: the planner's activation size)."""
        return None

    def position_limit(self, unit: Unit) -> int | None:
        """Positions its table holds (learned positions): a longer `seq` would index past it; None:
        the kind reads any sequence length."""
        return None

    def cached_positions(self, unit: Unit, index: int, seq: int) -> int:
        """Positions its KV cache holds in block `index` after `seq` tokens (kinds that cache)."""
        return seq

    def core_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> int:
        """What its core keeps for backward and selective recomputation (`recompute = attention`)
        stops keeping, of what `saved_bytes` counts (kinds with `recomputed_core`)."""
        raise NotImplementedError(self.kind)

    def cached_values(self, unit: Unit) -> int:
        """Values its KV cache holds per token of the whole (unsharded) unit (kinds that cache)."""
        raise NotImplementedError(self.kind)

    def local_cached_values(self, plan: PlanIR, hu: HeldUnit) -> int:
        """Values its KV cache holds per token on one device (kinds that cache)."""
        raise NotImplementedError(self.kind)

    def gathered_values(self, plan: PlanIR, hu: HeldUnit) -> int:
        """Values per token its context-parallel all-gather brings in on one device (kinds that cache)."""
        raise NotImplementedError(self.kind)

    def gathered_tensors(self) -> int:
        """How many all-gathers over the context axes carry `gathered_values` per layer and forward
        (each reduce-scattered back in backward): k and v, 2, unless a kind gathers fewer."""
        return 2

    # -- costs, per copy of the unit and microbatch (meshllm_dsl/parallel/costs.py holds the helpers they
    # use; the planner's steps, meshllm_dsl/planner/memory.py and time.py, add them up)
    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        """Bytes it keeps for backward (`local`: the tokens of a sequence-sharded stream)."""
        raise NotImplementedError(self.kind)

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        """Bytes its backward allocates at once (`regather`: what sequence parallelism's gathered
        column layers hold beyond their output gradients, 0 without it)."""
        raise NotImplementedError(self.kind)

    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        """Framework kernels it launches forward and backward, collectives and loss aside
        (`k`: planner.KERNELS; `linears`: what its linear layers and their biases launch)."""
        raise NotImplementedError(self.kind)

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Work:
        """Its forward's matrix products and lookups on one device for one microbatch of `tokens`
        = `micro` sequences of `seq` (costs.linear_matmuls gives a unit's linear layers')."""
        raise NotImplementedError(self.kind)

    def flops_per_token(self, unit: Unit, seq: int) -> int:
        """Forward flops per token of the whole (unsharded) unit, in sequences of `seq`: what
        `stages ... balanced` weighs layers by, before any plan exists. Its linear layers' weights,
        2 per element (a lookup or a norm: none); kinds that do more add it."""
        return 2 * sum(t.numel for leaf in unit.leaves if leaf.kind == "linear" for t in leaf.params if len(t.shape) >= 2)

    # -- codegen
    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        """Its entry of the generated MODEL description, beyond name and kind (`a`: the unit's attrs)."""
        raise NotImplementedError(self.kind)

    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        """__init__ lines building the unit as attribute `attr`; `tied_here`: a tied layer whose
        weight's owner is on this stage."""
        return w.composite_init(attr, unit, placement)

    def core_lines(self, w: Any, attr: str, unit: Unit, a: Mapping[str, Any],
                   placement: Mapping[str, Placement], x: str) -> list[Any]:
        """A sublayer's forward between its column layers and its row layer, ending in `a`."""
        raise AssertionError(f"{self.kind} is not a sublayer")

    def sublayer_lines(self, w: Any, attr: str, unit: Unit, flow: UnitFlow, placement: dict[str, Placement],
                       x: str) -> list[Any]:
        """A sublayer's whole forward on its normed input `x`, result in `out`: column layers,
        `core_lines`, the row layer (a kind that is not that shape, as moe, writes its own)."""
        return w.sublayer(attr, unit, flow, placement, x)

    def top_lines(self, w: Any, site: TopSite) -> tuple[list[Any], str]:
        """A top-level unit's forward lines and the variable holding its output."""
        raise AssertionError(f"top-level {self.kind} is not supported by codegen")


# What every record defines itself, and what only a block sublayer or only a top-level kind does.
_REQUIRED = ("build", "flow", "saved_bytes", "backward_bytes", "kernels", "work", "describe")
_SUBLAYER = ("core_lines",)
_TOP_LEVEL = ("top_lines",)
_CACHING = ("cached_values", "local_cached_values", "gathered_values")  # caches_kv
_RECOMPUTED = ("core_bytes",)  # recomputed_core


def _registry(prims: tuple[Primitive, ...]) -> Mapping[UnitKind, Primitive]:
    """The registry keyed by kind; refuses (at import) a kind of UnitKind without a record, a record
    for a kind UnitKind lacks, or one named twice."""
    registry: dict[UnitKind, Primitive] = keyed(  # type: ignore[assignment]
        prims, lambda p: p.kind, UnitKind, "primitive", "kind")
    lacking = {p.kind: [m for m in _REQUIRED + (_SUBLAYER if p.sublayer else _TOP_LEVEL) + (_CACHING if p.caches_kv else ())
                        + (_RECOMPUTED if p.recomputed_core else ())
                        if getattr(type(p), m) is getattr(Primitive, m)] for p in prims}
    lacking = {k: ms for k, ms in lacking.items() if ms}
    if lacking:
        raise ValueError(f"primitive registry: records without their own {lacking}")
    leaf_kinds = set(get_args(LeafKind))
    if not leaf_kinds <= set(registry):
        raise ValueError(f"primitive registry: leaf kinds {sorted(leaf_kinds - set(registry))} are no layer kind")
    return registry


from meshllm_dsl.primitives import attention, embedding, linear, mla, mlp, moe, norm  # noqa: E402

REGISTRY: Mapping[UnitKind, Primitive] = _registry((
    embedding.EMBEDDING, embedding.POSITIONAL, linear.LINEAR, norm.RMSNORM, norm.LAYERNORM,
    attention.ATTENTION, mla.MLA, mlp.MLP, moe.MOE,
))


def of_leaf(leaf: Leaf) -> Primitive:
    """The record of the layer kind owning `leaf` (ir.Leaf.kind, a LeafKind: every one is a layer kind)."""
    return REGISTRY[leaf.kind]


def of(unit: Unit) -> Primitive:
    """The record of `unit`'s kind; a kind nobody registered is a compiler bug, named as one."""
    found = REGISTRY.get(unit.kind)  # type: ignore[call-overload]
    if found is None:
        raise KeyError(f"layer kind {unit.kind!r} has no record in meshllm_dsl/primitives (known: {', '.join(REGISTRY)})")
    return found

