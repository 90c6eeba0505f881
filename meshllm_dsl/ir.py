"""The checked program: what the checker hands to codegen, the planner and the CLI.

Everything later stages need is resolved here once (dims to integers, every layer's parameters with
their global shapes, each layer's placement on the mesh, the stage map, the activation layouts and the
collectives they imply), so no later stage re-derives anything from the AST.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import attrs

from meshllm_dsl.front.source import Span
from meshllm_dsl.parallel.dtensor import Layout
from meshllm_dsl.parallel.roles import ParallelRoles

Value = int | float | str | bool

# The layer kinds a model may declare (Unit.kind), each with its record in meshllm_dsl/primitives.
UnitKind = Literal["embedding", "positional", "linear", "rmsnorm", "layernorm", "attention", "mla", "mlp", "moe"]
# The layers that own parameters (Leaf.kind): a unit's leaves are of these kinds.
LeafKind = Literal["linear", "embedding", "positional", "rmsnorm", "layernorm"]

# Rule names a `shard` statement may use.
RULES = ("column", "row", "vocab_parallel", "replicate", "expert")  # expert: a moe layer's experts (checker/placements.py)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
# What each schedule runs per pipeline rank and how its stages sit on the ranks: torch 2.13's
# torch.distributed.pipelining classes (runtime/train/program.py maps the names to them).
#  - stages per rank ("virtual"): exactly 1 (single-stage classes), at least 2, exactly 2, or any;
#  - placement: "loop" (stage i on rank i % p) or "v" (rank r holds stages r and 2p - 1 - r:
#    torch's generate_stage_to_rank_mapping(style="v"), which ZBV and DualPipeV set on their stages);
#  - split backward: the backward runs as input-gradient (I) then weight-gradient (W) actions.
SCHEDULE_VIRTUAL = {"gpipe": "one", "1f1b": "one", "interleaved_1f1b": "many", "looped_bfs": "any",
                    "interleaved_zb": "any", "zbv": "two", "dualpipev": "two"}
V_SCHEDULES = ("zbv", "dualpipev")
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")
PLACEMENTS = ("loop", "v")


def zero_bubble_rounds(ranks: int, microbatches: int) -> int:
    """Microbatches per round of torch's interleaved classes: max(1, m // p) rounds of m // rounds."""
    return max(1, microbatches // ranks) if ranks else 1


def takes_microbatches(schedule: str, ranks: int, stages: int, microbatches: int) -> bool:
    """Whether torch's class for `schedule` takes `microbatches` beyond the rules every pipeline
    shares: DualPipeV fills both arms of its V (at least as many as stages), interleaved zero bubble
    runs whole rounds (ScheduleInterleavedZeroBubble raises otherwise)."""
    if schedule == "dualpipev":
        return microbatches >= stages
    if schedule == "interleaved_zb":
        return microbatches % zero_bubble_rounds(ranks, microbatches) == 0
    return True


def placement_of(schedule: str) -> str:
    """How `schedule` places its stages on the pipeline ranks: "v" or "loop"."""
    return "v" if schedule in V_SCHEDULES else "loop"


def stage_coord(index: int, pipeline: int, placement: str = "loop") -> int:
    """The pipeline coordinate that runs stage `index` of a pipeline of `pipeline` ranks.

    "loop": rank i % p. "v": down the ranks, then back up (stages 0..p-1 on ranks 0..p-1, stages
    p..2p-1 on ranks p-1..0, and so on), as torch's generate_stage_to_rank_mapping(style="v")."""
    if placement == "v":
        lap, offset = divmod(index, pipeline)
        return offset if lap % 2 == 0 else pipeline - 1 - offset
    return index % pipeline
# Activation recomputation (`recompute = ...`): nothing, every block of the repeat (full, per block),
# or only the attention core of each block (selective, Korthikanti et al. 2022).
RECOMPUTE = ("none", "blocks", "attention", "ops")
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
# `precision { matmul = ... }`: the low-precision recipes torchao trains linear layers' matmuls in
# (runtime/train/float8.py); a linear not in one computes in the params dtype.
#  - fp8_tensorwise: one scale per tensor (torchao's "tensorwise"; FSDP2 may all-gather in float8)
#  - fp8_rowwise: one scale per row of each operand (torchao's "rowwise")
#  - mxfp8: one power-of-two scale per 32 elements (OCP MX; Blackwell's tensor cores)
MATMULS = ("fp8_tensorwise", "fp8_rowwise", "mxfp8")
FP8_BYTES = 1
# torchao pads nothing: both dims of a converted layer's local weight must be multiples of this
# (its cuBLAS / torch._scaled_mm kernels want 16-byte-aligned float8 operands; MXFP8 scales blocks
# of 32 elements along each operand's reduction dim).
FP8_DIM_MULTIPLE = 16
MX_BLOCK = 32


def fp8_dim_multiple(recipe: str) -> int:
    return MX_BLOCK if recipe == "mxfp8" else FP8_DIM_MULTIPLE
# `compile = ...`: what torch.compile wraps (runtime/train/compile.py): each block of the repeat on its
# own, as torchtitan compiles per transformer block, or nothing.
COMPILES = ("none", "blocks")
# `pack = ...`: `documents` masks attention at the document boundaries within a row (block-causal,
# runtime/model/documents.py); `none` attends across them. `positions = ...`: `restart` numbers each
# document's tokens from 0; `continue` numbers the row's. The first of each is the default.
PACKS = ("none", "documents")
POSITIONS = ("continue", "restart")
# `context_balance`: how packed rows spread over the context ranks (runtime/parallel/context_layout.py).
CONTEXT_BALANCES = ("headtail", "per_document", "ptrr")


@attrs.frozen
class Float8Plan:
    """Which linear layers run their matmuls in a low-precision recipe (`precision { matmul }` and
    `precision PATH matmul = ...`), and which stay in the params dtype and why."""

    recipe: str  # the plan's recipe, one of MATMULS
    layers: tuple[tuple[str, str], ...]  # full leaf path (`blocks.3.attn.q`) -> recipe, in model order
    skipped: tuple[tuple[str, str], ...] = ()  # full leaf path -> why it stays in the params dtype
    # FSDP2 all-gathers the tensorwise layers' weights in float8 (torchao's enable_fsdp_float8_all_gather).
    gather: bool = False
    # layers as a dict, built once: the planner asks per product and block, thousands of times a plan
    by_path: dict[str, str] = attrs.field(init=False, eq=False, hash=False, repr=False)
    # the planner's answers about this plan's layers (planner/float8.py), kept with it
    memo: dict[Any, Any] = attrs.field(init=False, eq=False, hash=False, repr=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "by_path", dict(self.layers))

    def recipe_of(self, path: str) -> str | None:
        """The recipe leaf `path` runs in, or None for the params dtype."""
        return self.by_path.get(path)

    def patterns(self, model: ModelIR) -> dict[str, str]:
        """The layers as path patterns -> recipe, folded over the blocks: `blocks.*.attn.q` where every
        block's layer runs the same recipe, `blocks.{1,2,3}.attn.q` where some do (`precision blocks.0
        ...`); what the generated module hands the runtime (`Program.float8`) and `meshc explain` prints."""
        reps = {r.name: r for r in model.repeats}
        # (repeat, path in the block, recipe) -> block indices
        blocks: dict[tuple[str, str, str], list[str]] = {}
        out: dict[str, str] = {}
        for path, recipe in self.layers:
            parts = path.split(".")
            if parts[0] in reps and parts[1].isdigit():
                blocks.setdefault((parts[0], ".".join(parts[2:]), recipe), []).append(parts[1])
            else:
                out[path] = recipe
        for (name, rest, recipe), indices in blocks.items():
            which = ("*" if len(indices) == reps[name].count else indices[0] if len(indices) == 1
                     else "{" + ",".join(indices) + "}")
            out[f"{name}.{which}.{rest}"] = recipe
        return out


@attrs.frozen
class Symbol:
    """A bare name used as a value (`swiglu`, `bf16`, `embed`) rather than a dim."""

    name: str

    def __str__(self) -> str:
        return self.name


# ---------------------------------------------------------------- meshes


@attrs.frozen
class Axis:
    name: str
    size: int
    span: Span | None = attrs.field(eq=False, default=None)


@attrs.frozen
class MeshIR:
    name: str
    axes: tuple[Axis, ...]
    hosts: int = 1
    device: str | None = None
    span: Span | None = attrs.field(eq=False, default=None)

    @property
    def devices(self) -> int:
        return math.prod(a.size for a in self.axes)

    @property
    def devices_per_host(self) -> int:
        return self.devices // self.hosts

    def axis(self, name: str) -> Axis | None:
        return next((a for a in self.axes if a.name == name), None)

    def size(self, *names: str) -> int:
        return math.prod(self.axis(n).size for n in names)  # type: ignore[union-attr]

    def stride(self, name: str) -> int:
        """Rank distance between neighbours along an axis (last axis varies fastest)."""
        stride = 1
        for a in reversed(self.axes):
            if a.name == name:
                return stride
            stride *= a.size
        raise KeyError(name)

    def coords(self, rank: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in reversed(self.axes):
            out[a.name] = rank % a.size
            rank //= a.size
        return {a.name: out[a.name] for a in self.axes}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for a in self.axes:
            rank = rank * a.size + coords.get(a.name, 0)
        return rank

    def groups(self, *names: str) -> list[list[int]]:
        """The process groups over `names`: ranks that differ only in those axes."""
        others = [a for a in self.axes if a.name not in names]
        groups = []
        for fixed in _product([a.size for a in others]):
            base = dict(zip((a.name for a in others), fixed))
            members = []
            for varying in _product([self.axis(n).size for n in names]):  # type: ignore[union-attr]
                members.append(self.rank_of({**base, **dict(zip(names, varying))}))
            groups.append(members)
        return groups

    def crosses_hosts(self, *names: str) -> bool:
        per_host = self.devices_per_host
        return any(len({r // per_host for r in g}) > 1 for g in self.groups(*names))


def _product(sizes: list[int]) -> Iterator[tuple[int, ...]]:
    if not sizes:
        yield ()
        return
    for head in range(sizes[0]):
        for rest in _product(sizes[1:]):
            yield (head, *rest)


# ---------------------------------------------------------------- models

# A shard unit: a tensor dim may be split only into whole units, e.g. ("heads", 64) for the rows of
# a q projection (heads x head_dim rows). A fused tensor lists one unit per segment.
ShardUnit = tuple[str, int]


@attrs.frozen
class Tensor:
    """One parameter of a layer, e.g. `weight` of shape (out, in) as torch stores it."""

    name: str
    shape: tuple[int, ...]
    units: tuple[tuple[ShardUnit, ...], ...]  # per tensor dim: the units it is made of
    segments: tuple[int, ...] = ()  # sizes of fused segments along dim 0 (qkv), else ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@attrs.frozen
class Leaf:
    """A layer that owns parameters and can be given a placement (a rule)."""

    name: str  # path inside its unit: "q", or the unit name itself for a single-layer unit
    path: tuple[str, ...]  # path template inside its repeat (or top level), e.g. ("attn", "q")
    kind: LeafKind
    params: tuple[Tensor, ...]
    in_units: tuple[ShardUnit, ...] = ()  # what a row rule splits
    out_units: tuple[ShardUnit, ...] = ()  # what a column / vocab_parallel rule splits
    tie: str | None = None  # path of the layer whose weight this layer uses
    span: Span | None = attrs.field(eq=False, default=None)
    # The repeat whose blocks hold it (None at top level): two repeats' same-named layers are two leaves.
    repeat: str | None = None

    @property
    def shardable(self) -> bool:
        return self.kind in ("linear", "embedding")

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.params)


@attrs.frozen
class Unit:
    """A primitive as declared: embedding, positional, linear, a norm, attention or mlp."""

    name: str
    kind: UnitKind  # its record: meshllm_dsl.primitives.REGISTRY[kind]
    attrs: tuple[tuple[str, Value | None], ...]
    leaves: tuple[Leaf, ...]
    span: Span | None = attrs.field(eq=False, default=None)

    def attr(self, key: str) -> Value | None:
        return dict(self.attrs)[key]

    @property
    def numel(self) -> int:
        return sum(leaf.numel for leaf in self.leaves)


@attrs.frozen
class Repeat:
    name: str
    count: int
    body: tuple[Unit, ...]
    span: Span | None = attrs.field(eq=False, default=None)

    @property
    def numel_per_block(self) -> int:
        return sum(u.numel for u in self.body)


Item = Unit | Repeat


@attrs.frozen
class ModelIR:
    name: str
    values: tuple[tuple[str, Value], ...]  # every dim and setting, resolved
    items: tuple[Item, ...]
    dtype: str
    span: Span | None = attrs.field(eq=False, default=None)
    family: str | None = None  # the family it was declared from (`model m = llama {...}`); None: primitives

    def value(self, name: str) -> Value | None:
        return dict(self.values).get(name)

    @property
    def numel(self) -> int:
        total = 0
        for item in self.items:
            total += item.numel if isinstance(item, Unit) else item.count * item.numel_per_block
        return total

    def item(self, name: str) -> Item | None:
        return next((i for i in self.items if i.name == name), None)

    @property
    def repeats(self) -> tuple[Repeat, ...]:
        """The model's block stacks in order: one for most models, several where blocks differ in kind
        (DeepSeek-V3's dense first blocks, then its moe blocks); they follow one another."""
        return tuple(i for i in self.items if isinstance(i, Repeat))

    @property
    def blocks(self) -> int:
        """Blocks over every repeat."""
        return sum(r.count for r in self.repeats)

    def block_offset(self, repeat: str) -> int:
        """The model-wide number of block 0 of `repeat` (HF's `layers.{i}` counts over every repeat)."""
        offset = 0
        for r in self.repeats:
            if r.name == repeat:
                return offset
            offset += r.count
        raise KeyError(repeat)

    def leaves(self) -> Iterator[tuple[Item, Unit, Leaf]]:
        """Every leaf template with its item and unit (a repeat's leaves once, not per block)."""
        for item in self.items:
            units = item.body if isinstance(item, Repeat) else (item,)
            for unit in units:
                for leaf in unit.leaves:
                    yield item, unit, leaf


# ---------------------------------------------------------------- plans


@attrs.frozen
class Placement:
    """How one layer's parameters lie on the mesh."""

    rule: str  # column | row | vocab_parallel | replicate
    axes: tuple[str, ...] = ()
    span: Span | None = attrs.field(eq=False, default=None)  # the rule (or layout entry) that chose it
    # Expert parallelism (`layout { experts -> D }`): the batch axes a moe layer's stacked experts
    # ([out, experts, in]) are split over along their experts dim, beside the rule's own split.
    experts: tuple[str, ...] = ()

    @property
    def sharded(self) -> bool:
        return self.rule != "replicate" and bool(self.axes)

    def tensor_dim(self, tensor: Tensor) -> int | None:
        """Which dim of `tensor` this placement splits (torch layout: weight is (out, in))."""
        if not self.sharded:
            return None
        if self.rule in ("column", "vocab_parallel"):
            # A dim made of no shard unit repeats per unit (a per-head norm scale): never split.
            return 0 if tensor.units[0] else None
        if self.rule == "row":
            # the last dim: a weight's `in` ([out, in], or [out, experts, in] stacked); a bias stays whole
            # (stacked experts' down bias [out, experts]: its last dim is made of no `in` unit)
            return len(tensor.shape) - 1 if len(tensor.shape) >= 2 and tensor.units[-1] else None
        return None

    def expert_dim(self, tensor: Tensor) -> int | None:
        """Which dim of `tensor` the expert axes split: a stacked experts weight's middle dim, or an
        experts' bias [out, experts] last dim (dim 1 both)."""
        if not self.experts or len(tensor.units) not in (2, 3) or not any(u[0] == "experts" for u in tensor.units[1]):
            return None
        return 1

    def split_dims(self, tensor: Tensor) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """(tensor dim, mesh axes) for every split of `tensor`: the rule's, then the experts'."""
        rule, experts = self.tensor_dim(tensor), self.expert_dim(tensor)
        return ((((rule, self.axes),) if rule is not None else ())
                + (((experts, self.experts),) if experts is not None else ()))

    def layout(self, tensor: Tensor, fsdp: tuple[str, ...] = ()) -> Layout:
        """`tensor`'s placement per mesh axis: Shard of the dim this rule splits over its axes (a
        column or vocab-parallel weight's dim 0, a row weight's `in` dim, a row bias whole), Shard(experts)
        over the expert axes, then FSDP2's Shard(dim 0) over `fsdp` (the ZeRO 2 / 3 axes,
        placements.fsdp_axes), inside that split. FSDP2 shards only over the ZeRO axes that do not
        split the tensor already: experts split over D are sharded by their own FSDP2 units over the
        ZeRO axes that replicate them, and left whole where D covers every ZeRO axis."""
        dims = param_dims(tensor)
        own, used = Layout(), set()
        for dim, axes in self.split_dims(tensor):
            own = own.then(Layout.shard(dims[dim], axes))
            used.update(axes)
        return own.then(Layout.shard(dims[0], tuple(a for a in fsdp if a not in used)))


def param_dims(tensor: Tensor) -> tuple[str, ...]:
    """The logical name of each of `tensor`'s dims, from its shard units (a fused qkv's rows:
    `heads+kv_heads`), unique per tensor."""
    names = ["+".join(dict.fromkeys(name for name, _ in units)) or f"dim {i}" for i, units in enumerate(tensor.units)]
    # A square weight's dims may share a name (hidden, hidden): a Shard must still say which one.
    return tuple(n if names.count(n) == 1 else f"{n} (dim {i})" for i, n in enumerate(names))


REPLICATE = Placement("replicate")


@attrs.frozen
class Collective:
    """A collective the generated forward issues (Megatron's f / g and friends)."""

    # copy_to | reduce_from | split_to | gather_from, and sequence parallelism's gather_seq |
    # reduce_scatter_seq | split_seq | gather_seq_split (collectives.py says what each does);
    # expert_all_to_all only in explain's list: the moe layer issues it itself
    op: str
    axes: tuple[str, ...]
    where: str  # "input" of the unit, or "output" (at the residual add)


@attrs.frozen
class UnitFlow:
    """A unit's activation layouts and the collectives codegen must emit around it."""

    input: Layout
    output: Layout
    collectives: tuple[Collective, ...]
    # Inside a sublayer: the layout after each of its leaves (q -> Shard(heads), o -> Partial(sum)),
    # before the collective at its output; () where the unit has no boundary inside.
    inside: tuple[tuple[str, Layout], ...] = ()


@attrs.frozen
class BlockClass:
    """Blocks of a repeat that share every placement (so one generated class serves them)."""

    repeat: str  # the repeat whose blocks these are
    indices: tuple[int, ...]
    placements: tuple[tuple[str, Placement], ...]  # leaf path "attn.q" -> placement
    flows: tuple[tuple[str, UnitFlow], ...]  # unit name -> flow

    def placement(self, leaf_path: str) -> Placement:
        return dict(self.placements).get(leaf_path, REPLICATE)

    def flow(self, unit: str) -> UnitFlow:
        return dict(self.flows)[unit]


@attrs.frozen
class StagePiece:
    item: str
    start: int | None = None  # block range for a repeat
    stop: int | None = None


@attrs.frozen
class Stage:
    index: int  # position in the pipeline, 0 .. stages-1
    coord: int  # coordinate on the pipeline axis that runs it (stage_coord: index % pipeline size, or a V)
    pieces: tuple[StagePiece, ...]
    numel: int  # parameters held (tied copies counted where they live)


@attrs.frozen
class PlanIR:
    name: str
    mesh: MeshIR
    model: ModelIR
    batch: int
    seq: int
    microbatches: int
    schedule: str
    virtual: int
    roles: ParallelRoles  # which mesh axes are pipeline, batch, tensor, sequence and loss axes
    stages: tuple[Stage, ...]
    top_placements: tuple[tuple[str, Placement], ...]  # top-level leaf path -> placement
    top_flows: tuple[tuple[str, UnitFlow], ...]
    block_classes: tuple[BlockClass, ...]
    optimizer: str
    optimizer_settings: tuple[tuple[str, Value], ...]
    zero: int  # ZeRO stage; the axes it shards over are `roles.batch_shard`
    dtype: str
    recompute: str = "none"  # one of RECOMPUTE
    recompute_every: int = 1  # `recompute = blocks every N`: only blocks N - 1, 2 N - 1, ... (blocks, ops)
    # `precision`: `dtype` is the compute dtype; master weights and optimizer states are kept in
    # master_dtype and gradients reduced in reduce_dtype (None: no `precision`, all in `dtype`).
    master_dtype: str | None = None
    reduce_dtype: str | None = None
    # `skew = F`: the share of a moe layer's routed tokens its busiest expert receives, for the
    # planner (meshllm_dsl/planner/moe.py); None: balanced routing.
    skew: float | None = None
    float8: Float8Plan | None = None  # low-precision matmuls; None: every matmul in the params dtype
    compile: str = "none"  # one of COMPILES
    document_mask: bool = False  # `pack = documents`
    restart_positions: bool = False  # `positions = restart`
    context_balance: str = "headtail"  # one of CONTEXT_BALANCES
    span: Span | None = attrs.field(eq=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.roles.validate(self.mesh)
        if (self.zero > 0) != self.roles.zero_enabled:
            raise ValueError(f"ZeRO stage {self.zero} with batch_shard axes {self.roles.batch_shard}: "
                             "ZeRO >= 1 shards over batch axes, ZeRO 0 over none")

    # Sizes of the roles' axis groups (1 for a role no axis plays).
    @property
    def pipeline_size(self) -> int:
        return self.mesh.size(self.roles.pipeline) if self.roles.pipeline else 1

    @property
    def data_size(self) -> int:
        """Data-parallel replicas of the model: ranks the batch is split over."""
        return self.mesh.size(*self.roles.batch)

    @property
    def zero_size(self) -> int:
        """Ranks ZeRO shards each optimizer state over (1 without ZeRO)."""
        return self.mesh.size(*self.roles.batch_shard)

    @property
    def expert_zero_size(self) -> int:
        """Ranks ZeRO shards the experts' optimizer states over: the ZeRO axes that do not split
        them, whose ranks hold the same experts (Megatron's expert-data-parallel group, torchtitan's
        dp_mod_ep); ``zero_size`` without expert parallelism."""
        return self.mesh.size(*(a for a in self.roles.batch_shard if a not in self.roles.expert))

    @property
    def sequence_size(self) -> int:
        """Ranks the sequence is split over between sublayers (1 without sequence parallelism)."""
        return self.mesh.size(*self.roles.sequence)

    @property
    def context_size(self) -> int:
        """Ranks every sequence is split over through the whole model (1 without context parallelism)."""
        return self.mesh.size(*self.roles.context)

    def block_class(self, repeat: str, index: int) -> BlockClass:
        """The class of block `index` of `repeat`."""
        for cls in self.block_classes:
            if cls.repeat == repeat and index in cls.indices:
                return cls
        raise KeyError((repeat, index))

    def classes_of(self, repeat: str) -> tuple[BlockClass, ...]:
        return tuple(c for c in self.block_classes if c.repeat == repeat)

    def placement(self, path: str) -> Placement:
        """Placement of a full leaf path such as `blocks.3.attn.q` or `lm_head`."""
        top = dict(self.top_placements)
        if path in top:
            return top[path]
        name, _, tail = path.partition(".")
        if tail and any(r.name == name for r in self.model.repeats):
            index, rest = tail.split(".", 1)
            return self.block_class(name, int(index)).placement(rest)
        raise KeyError(path)

    def local_shape(self, tensor: Tensor, placement: Placement) -> tuple[int, ...]:
        shape = list(tensor.shape)
        for dim, axes in placement.split_dims(tensor):
            shape[dim] //= self.mesh.size(*axes)
        return tuple(shape)
