"""`meshc suggest`: search the plans for a model on N devices and rank them by estimated step time.

The search enumerates data x pipeline x tensor factorizations of the device count (tensor within a
host), context sizes for long sequences, microbatch counts, ZeRO stages (HSDP within a host among
them), fp32 master weights, schedules, activation recomputation (none, attention, ops, blocks
every 2, blocks), the matmul precision (the params dtype, or a float8 recipe the device has tensor
cores for) and `compile = blocks` (precision_choices). Every candidate is written out as .mesh text
(the model's own declarations plus a generated mesh and plan) and checked with `check_text`: the
checker, not this module, decides what is valid. Candidates that check clean are analysed by the
planner; those that fit in device memory (less a headroom) are ranked by estimated step time.

The search is a branch and bound with the full search's answer: candidates in order of a lower bound
on their step time (compute_floor_s x (1 + bubble_scale)), until the fastest that fit are certain,
and a variant whose structure's weights, gradients and optimizer states exceed the device is not
analysed (StateBound), nor one whose variant recomputing less is already slower than the
runner-up (_slower_than_the_runner_up). 530B on 2,520 devices analyses 83 of 8,130 candidates.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.checker import check_text
from meshllm_dsl.checker.matmul import FP8_COMPUTE
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import load
from meshllm_dsl.front.names import divisors
from meshllm_dsl.ir import ModelIR, PlanIR, Repeat, takes_microbatches
from meshllm_dsl.parallel.costs import MFU
from meshllm_dsl.parallel.devices import DeviceProfile
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.float8 import TENSORWISE, best_matmul_tflops
from meshllm_dsl.planner.formatting import fmt_bytes, fmt_seconds
from meshllm_dsl.planner.records import PlanReport
from meshllm_dsl.planner.schedule import schedule_cost
from meshllm_dsl.progress import StatusLine

MESH_NAME, PLAN_NAME = "suggested_mesh", "suggested"
MAX_MICROBATCHES = 64  # beyond this the per-microbatch collectives' latency dominates any memory saving
# Context parallelism is searched from this sequence length on (the Llama 3 paper's long-context
# stage starts past 8K tokens): shorter sequences fit by data parallelism, and every variant costs
# the search an analysis.
LONG_SEQ = 8192
# The share of a device's memory a suggested plan leaves free by default (`--headroom`): what the
# planner does not count, the CUDA context (about 0.5 - 1 GiB a process), NCCL's buffers (a few
# hundred MiB per communicator) and the caching allocator's fragmentation.
DEFAULT_HEADROOM = 0.05
# `recompute = blocks every N` is searched at this N: half the blocks recomputed, half their
# activations kept (a step between none and all; finer steps cost the search more analyses).
RECOMPUTE_EVERY = 2


@attrs.frozen
class Candidate:
    data: int
    pipeline: int
    tensor: int
    microbatches: int
    schedule: str  # "none" when there is no pipeline
    virtual: int
    zero: int
    hosts: int
    recompute: str = "none"
    seq_parallel: bool = False  # `seq -> tensor`: Megatron sequence parallelism over the tensor axis
    # HSDP: ZeRO shards over a `data` axis of this many ranks inside a host, a `replica` axis holds
    # the data / zero_shard copies across hosts (torchtitan's dp_shard x dp_replicate); 0: no HSDP.
    zero_shard: int = 0
    # fp32 master weights at ZeRO 0 / 1 for a 16-bit model (ZeRO 0: autocast over whole fp32
    # parameters, runtime/train/amp.py; ZeRO 1: the distributed optimizer, sharded by FSDP2): searched beside
    # the pure 16-bit plan, which needs less state. ZeRO 2 / 3 always have them (_master_weights).
    master: bool = False
    # Context parallelism: this many of the data ranks split each sequence instead (`seq -> cp`),
    # ZeRO then shards over data x cp as torchtitan's FSDP does; 1: none.
    context: int = 1
    # `precision { matmul = R }`: a float8 recipe for the blocks' linear layers ("": the params dtype),
    # with FSDP2's float8 all-gathers where the recipe is tensorwise and FSDP2 shards the weights.
    matmul: str = ""
    compile: bool = False  # `compile = blocks`

    def key(self) -> str:
        sched = "" if self.schedule == "none" else f" {self.schedule}" + (f" v{self.virtual}" if self.virtual > 1 else "")
        remat = "" if self.recompute == "none" else f", recompute {self.recompute}"
        return (f"data {self.data} x pipeline {self.pipeline} x tensor {self.tensor}, {self.microbatches} microbatches"
                f"{sched}, ZeRO {self.zero}{remat}" + (", sequence parallel" if self.seq_parallel else "")
                + (f", HSDP sharded over {self.zero_shard}" if self.zero_shard else "")
                + (", fp32 master weights" if self.master else "")
                + (f", context {self.context}" if self.context > 1 else "")
                + (f", {self.matmul}" if self.matmul else "") + (", compiled blocks" if self.compile else ""))


@attrs.frozen
class Ranked:
    candidate: Candidate
    text: str  # the mesh and plan blocks, ready to paste
    report: PlanReport
    reason: str = ""


@attrs.frozen
class SuggestResult:
    model: str
    devices: int
    device: DeviceProfile
    batch: int
    seq: int
    per_host: int
    enumerated: int
    checked: int  # .mesh texts run through check_text
    fitting: int  # candidates analysed and estimated to fit in memory (with the headroom)
    ranked: tuple[Ranked, ...]
    rejected: tuple[tuple[str, str], ...]  # (candidate, first checker error) for a few, to show why
    headroom_bytes: int = 0  # what every ranked plan leaves free of the device's memory
    analysed: int = 0  # candidates the planner analysed (the others a lower bound ruled out)
    # (candidate, estimated step seconds, peak bytes) of each analysed candidate, for the chart.
    points: tuple[tuple[str, float, int], ...] = ()

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None


def _prelude_text(path: str, model: str) -> str:
    """The root file's includes, families, devices and the chosen model, verbatim, without its meshes and plans."""
    decls = load(path)
    root = decls.root
    parts = []
    for item in decls.items:
        span = getattr(item, "span", None)
        if span is None or root is None or span.source is not root:
            continue
        if isinstance(item, (ast.Include, ast.FamilyDecl, ast.DeviceDecl)) or (
                isinstance(item, ast.ModelDecl) and item.name.value == model):
            parts.append(span.text)
    return "\n\n".join(parts) + "\n"


def _sharded_dims(model: ModelIR) -> list[str]:
    """Logical dims a column / vocab-parallel rule splits: the input projections' outputs and the vocabulary."""
    dims: list[str] = []
    last = model.items[-1]
    for item, unit, leaf in model.leaves():
        record = primitives.of(unit)
        # A dense sublayer (attention, an MLP): its column layers, all but the row layer closing it;
        # a moe layer's experts split over expert axes instead, and its router stays whole.
        if record.sublayer and not record.routes_experts:
            if leaf is unit.leaves[-1]:
                continue
        elif not (record is primitives.embedding.EMBEDDING
                  or (record is primitives.linear.LINEAR and unit is last and not isinstance(item, Repeat))):
            continue
        for name, _ in leaf.out_units[:1]:
            if name not in dims:
                dims.append(name)
    return dims


def _dim_sizes(model: ModelIR) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, _, leaf in model.leaves():
        for name, count in (*leaf.out_units, *leaf.in_units):
            out.setdefault(name, count)
    return out


def plan_text(c: Candidate, model: ModelIR, device: str, batch: int, seq: int) -> str:
    data = [("replica", c.data // c.zero_shard), ("data", c.zero_shard)] if c.zero_shard else [("data", c.data)]
    axes = [(n, s) for n, s in (*data, ("pipeline", c.pipeline), ("cp", c.context), ("tensor", c.tensor)) if s > 1] or [("data", 1)]
    mesh = [f"mesh {MESH_NAME} {{", "    axes " + ", ".join(f"{n} = {s}" for n, s in axes)]
    if c.hosts > 1:
        mesh.append(f"    hosts = {c.hosts}")
    mesh += [f"    device = {device}", "}"]
    plan = [f"plan {PLAN_NAME} on {MESH_NAME} for {model.name} {{", f"    batch = {batch}", f"    seq = {seq}",
            f"    microbatches = {c.microbatches}"]
    if c.recompute != "none":
        plan.append(f"    recompute = {c.recompute}")
    if c.compile:
        plan.append("    compile = blocks")
    layout = (["batch -> replica * data" if c.zero_shard else "batch -> data"] if c.data > 1 else []) + ([f"{d} -> tensor" for d in _sharded_dims(model)] if c.tensor > 1 else [])
    # One `seq` entry: over tensor Megatron sequence parallelism, over cp context parallelism, both
    # at once sequence parallelism inside context parallelism.
    seq_axes = (["tensor"] if c.seq_parallel else []) + (["cp"] if c.context > 1 else [])
    layout += [f"seq -> {' * '.join(seq_axes)}"] if seq_axes else []
    if layout:
        plan.append("    layout { " + ", ".join(layout) + " }")
    if c.pipeline > 1:
        virtual = f" virtual {c.virtual}" if c.virtual > 1 else ""
        reps = model.repeats
        # Blocks of several kinds: `balanced` weighs each block's own work.
        if len(reps) > 1 or reps and reps[0].count % (c.pipeline * c.virtual) == 0:
            plan.append(f"    stages over pipeline{virtual} balanced")
        else:
            plan += _explicit_stages(model, c.pipeline)
        plan.append(f"    schedule {c.schedule}")
    if c.zero:
        over = " * ".join((["data"] if c.data > 1 else []) + (["cp"] if c.context > 1 else [])) or "data"
        plan += ["    optimizer adamw {", f"        zero {c.zero} over {over}", "    }"]
    precision = ([f"params = {model.dtype}", "master = fp32", "reduce = fp32"] if _master_weights(c, model) else [])
    precision += [f"matmul = {c.matmul}"] if c.matmul else []
    precision += ["all_gather = fp8"] if _gathers_float8(c, model) else []
    if precision:
        plan.append(f"    precision {{ {', '.join(precision)} }}")
    plan.append("}")
    return "\n".join(mesh) + "\n\n" + "\n".join(plan) + "\n"


def _master_weights(c: Candidate, model: ModelIR) -> bool:
    """16-bit models train with fp32 master weights and reductions (Megatron's and torchtitan's
    default): always under FSDP2's MixedPrecisionPolicy (ZeRO 2 / 3); at ZeRO 0 (autocast over
    fp32 parameters, runtime/train/amp.py) and ZeRO 1 (Megatron's distributed optimizer, FSDP2) where the
    candidate asks, as the pure 16-bit plan is also searched. In 16 bits AdamW's small updates round away (bench/master_weights.py)."""
    return model.dtype in ("bf16", "fp16") and (c.zero >= 2 or c.master)


def _gathers_float8(c: Candidate, model: ModelIR) -> bool:
    """FSDP2 all-gathers the tensorwise layers' weights in float8 (`all_gather = fp8`): where FSDP2
    shards the weights (ZeRO 2 / 3, ZeRO 1 with master weights), which is what the checker allows."""
    return c.matmul == TENSORWISE and (c.zero >= 2 or (c.zero == 1 and _master_weights(c, model)))


def precision_choices(model: ModelIR, device: DeviceProfile) -> list[tuple[str, bool]]:
    """(matmul recipe or "", compiled) pairs searched: the params dtype, and the fastest float8 recipe
    the device has tensor cores for (fp8_tensorwise with `fp8_tflops`, mxfp8 with `mx_tflops`) where
    the model computes in bf16 / fp16 (what torchao casts from); compiled (`compile = blocks`) in a
    model with blocks. Host-bound ranks (CPU) get neither: the planner prices emulated float8 and
    compiled blocks there no differently."""
    if device.kernel_us is not None:
        return [("", False)]
    # Only choices that can win: the planner prices a compiled block never slower than an eager one on
    # a GPU, and fp8_rowwise as fp8_tensorwise without the float8 all-gathers, so the eager variants
    # and rowwise would only fill the ranking with slower copies of the same layouts (and multiply
    # the search). The float8 recipe searched is the device's fastest: mxfp8 with MX tensor cores.
    recipes = [""]
    if model.dtype in FP8_COMPUTE and device.mx_tflops is not None:
        recipes.append("mxfp8")
    elif model.dtype in FP8_COMPUTE and device.fp8_tflops is not None:
        recipes.append("fp8_tensorwise")
    compiled = bool(model.repeats)
    return [(r, compiled) for r in recipes]


def _explicit_stages(model: ModelIR, p: int) -> list[str]:
    """Blocks split as evenly as possible, the first stage one block lighter (it holds the embedding)."""
    rep, = model.repeats
    order = [i.name for i in model.items]
    ri = order.index(rep.name)
    sizes = [rep.count // p + (1 if k >= p - rep.count % p else 0) for k in range(p)]
    out, start = ["    stages over pipeline {"], 0
    for k, n in enumerate(sizes):
        items = (order[:ri] if k == 0 else []) + [f"{rep.name}[{start}:{start + n}]"] + (order[ri + 1:] if k == p - 1 else [])
        out.append(f"        {k}: " + ", ".join(items))
        start += n
    out.append("    }")
    return out


def candidates(model: ModelIR, devices: int, batch: int, per_host: int, seq: int = 0) -> Iterator[Candidate]:
    dims = _dim_sizes(model)
    sharded = [dims[d] for d in _sharded_dims(model) if d in dims]
    layers = model.blocks or 1
    # Recomputation trades a forward pass of the blocks (or of the attention core) for their
    # activations; between none and all of a block: torchtitan's selective `ops`, and every other
    # block (Megatron's --recompute-num-layers, torchtitan's ac_freq).
    remats = ["none"]
    if model.repeats:
        body = [u for r in model.repeats for u in r.body]
        remats += (["attention"] if any(primitives.of(u).recomputed_core for u in body) else []) + ["ops"]
        remats += [f"blocks every {RECOMPUTE_EVERY}"] if max(r.count for r in model.repeats) >= RECOMPUTE_EVERY else []
        remats += ["blocks"]
    hosts = 1
    if devices > per_host:
        hosts = next(h for h in divisors(devices) if h >= devices / per_host)
    for t in divisors(devices):
        if t > per_host or t > devices // hosts:
            continue  # the tensor axis stays inside a host: it all-reduces in every layer
        if any(n % t for n in sharded):
            continue
        for p in divisors(devices // t):
            if p > layers:
                continue
            rest = devices // (t * p)
            # From LONG_SEQ tokens on, some of the ranks left may split each sequence (context
            # parallelism, cut into 2 x cp balanced chunks) rather than the batch.
            for cp in (divisors(rest) if seq >= LONG_SEQ else (1,)):
                d = rest // cp
                if batch % d or seq % (2 * cp) and cp > 1:
                    continue
                yield from _layouts(model, batch, d, p, t, cp, hosts, per_host, layers, remats)


def _layouts(model: ModelIR, batch: int, d: int, p: int, t: int, cp: int, hosts: int, per_host: int, layers: int,
             remats: list[str]) -> Iterator[Candidate]:
    """The schedules, microbatches, ZeRO stages and recomputation of one mesh shape: d data x cp context x p
    pipeline x t tensor ranks."""
    per_replica = batch // d
    # The zero-bubble schedules too: interleaved zero bubble (ZB1P) on one stage per rank, ZBV and
    # DualPipeV on a V of two. Looped BFS is left out: breadth first with full backwards, it never
    # idles less than GPipe on the same stages.
    scheds = [("none", 1)] if p == 1 else [("1f1b", 1), ("gpipe", 1), ("interleaved_zb", 1)] + (
        [("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)] if layers % (2 * p) == 0 else [])
    for sched, v in scheds:
        for m in divisors(per_replica):
            if m > MAX_MICROBATCHES:
                break
            if p > 1 and sched != "gpipe" and m < p:
                continue
            if sched == "interleaved_1f1b" and m % p:
                continue
            if not takes_microbatches(sched, p, p * v, m):  # what torch's class refuses (E0606)
                continue
            # ZeRO 2 / 3 are FSDP2 in the runtime (16-bit models with fp32 master weights at every stage: _master_weights).
            for z in (0, 1, 2, 3) if d * cp > 1 else (0,):
                for r in remats:
                    yield Candidate(d, p, t, m, sched, v, z, hosts, r, context=cp)
                    if z < 2 and model.dtype in ("bf16", "fp16"):
                        yield Candidate(d, p, t, m, sched, v, z, hosts, r, master=True, context=cp)
            # HSDP: sharded within a host, replicated across hosts (FSDP2's 2-D mesh at ZeRO 2 / 3; at
            # ZeRO 1 the optimizer states over the shard group, with fp32 master weights Megatron's
            # distributed optimizer per host).
            shard = max((s for s in divisors(d) if 1 < s < d and s * p * t <= per_host), default=0) if cp == 1 else 0
            for z in (1, 2, 3) if shard else ():
                for r in remats:
                    yield Candidate(d, p, t, m, sched, v, z, hosts, r, zero_shard=shard)
                    if z < 2 and model.dtype in ("bf16", "fp16"):
                        yield Candidate(d, p, t, m, sched, v, z, hosts, r, zero_shard=shard, master=True)


def suggest(path: str, model_name: str, *, devices: int, device: DeviceProfile, batch: int, seq: int,
            per_host: int | None = None, top: int = 3, status: StatusLine | None = None,
            headroom_bytes: int | None = None, prune: bool = True) -> SuggestResult:
    """Enumerate, estimate, then re-check the winners exactly.

    Parsing dominates the cost (about 10 ms a candidate for Llama 2 70B), and candidates that differ
    only in microbatches, ZeRO stage or recomputation share everything the checker derives except
    those plain fields. So each structure (data, pipeline, tensor, schedule) is checked once as text,
    its variants are estimated from that checked PlanIR with those fields replaced, and then every
    variant that fits is written out and checked with `check_text` in order of estimated step time
    until `top` of them pass: nothing is suggested that the checker has not passed as written.
    A plan fits when its peak leaves ``headroom_bytes`` of the device free (default
    DEFAULT_HEADROOM of its memory).
    ``prune``: skip the analysis of candidates a lower bound already rules out (``StateBound``); the
    answer is the same either way (tests/planner/test_suggest_scale.py compares them).
    ``status``: where to say how far it is (default: a line on stderr while it is a terminal).
    """
    if headroom_bytes is None:
        headroom_bytes = int(DEFAULT_HEADROOM * device.memory_bytes)
    with status or StatusLine("meshc suggest") as line:
        return _suggest(path, model_name, devices, device, batch, seq, per_host, top, line,
                        device.memory_bytes - headroom_bytes, prune)


class StateBound:
    """Weights, gradients and optimizer states per device are a lower bound on a plan's peak (the
    peak adds activations, buffers and transients, none negative), and they depend on the
    structure and the ZeRO stage (with the master dtype it implies), not on the microbatches or
    recomputation. So once one variant of a (structure, ZeRO stage) is analysed, its states say
    for every other variant whether it can fit; the planner's own numbers decide, none restated
    here."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.states: dict[tuple[int, bool], int] = {}  # (ZeRO stage, master weights) -> the largest rank's

    def record(self, c: Candidate, report: PlanReport) -> None:
        self.states.setdefault((c.zero, c.master), max(r.weight_bytes + r.grad_bytes + r.optimizer_bytes for r in report.ranks))

    def rules_out(self, c: Candidate) -> bool:
        known = self.states.get((c.zero, c.master))
        return known is not None and known > self.limit


def bubble_scale(c: Candidate) -> float:
    """The pipeline bubble over the busy time (what analyze stretches the slowest rank's work by):
    (p - 1) / m for GPipe and 1F1B, whose torch orders take exactly m + p - 1 slots; the others
    from torch's own order (planner/schedule.py)."""
    if c.pipeline <= 1:
        return 0.0
    if c.schedule in ("gpipe", "1f1b"):
        return (c.pipeline - 1) / c.microbatches
    return schedule_cost(c.schedule, c.pipeline, c.virtual, c.microbatches).bubble_over_busy


def compute_floor_s(report: PlanReport) -> float:
    """No plan of this model, batch and devices computes faster than its matmul flops spread
    evenly over every device at the device's best matmul rate: the slowest rank computes at least
    the average share, and no product runs above peak x MFU (the planner's roofline only slows one
    down), the peak being the fastest any candidate's products reach (a compiled block's float8). The same for every candidate; times (1 + bubble_scale), a lower bound on its step."""
    rate = best_matmul_tflops(report.device) * 1e12 * (report.device.mfu or MFU)
    return report.step.model_flops / (report.plan.mesh.devices * rate)


def variant(structure: PlanIR, c: Candidate, model: ModelIR) -> PlanIR:
    """The checked plan of `c`'s structure (its first candidate's) with `c`'s own microbatches,
    ZeRO stage, recomputation and master weights: what checking `c`'s text would give, without
    parsing it again (tests/planner/test_data_parallel_layouts_plan.py compares the two)."""
    master = _master_weights(c, model)
    region, _, every = c.recompute.partition(" every ")
    shard = (("data",) if c.zero_shard else structure.roles.replicas) if c.zero else ()
    # The structure's checked Float8Plan (its recipe is the structure's): only the float8 all-gathers
    # depend on the variant's ZeRO stage.
    float8 = attrs.evolve(structure.float8, gather=_gathers_float8(c, model)) if structure.float8 else None
    return attrs.evolve(structure, microbatches=c.microbatches, zero=c.zero,
                        roles=attrs.evolve(structure.roles, batch_shard=shard), recompute=region,
                        recompute_every=int(every or 1), master_dtype="fp32" if master else None,
                        reduce_dtype="fp32" if master else None, float8=float8,
                        compile="blocks" if c.compile else "none")


def _recomputes_less(c: Candidate) -> tuple[str, ...]:
    """The recomputation settings that rerun a part of what `c`'s does, so no slower a step in the
    planner (the same plan otherwise): none below every setting; `blocks` reruns each block's whole
    forward, of which attention, ops and every other block rerun a part."""
    if c.recompute == "none":
        return ()
    if c.recompute == "blocks":
        return ("none", "attention", "ops", f"blocks every {RECOMPUTE_EVERY}")
    return ("none",)


def _slower_than_the_runner_up(c: Candidate, steps: dict[Candidate, float],
                               fitting: list[tuple[Candidate, PlanReport]], top: int) -> bool:
    """A variant that recomputes less, analysed before (remats are enumerated in that order),
    bounds `c`'s step from below: past the (top + 1)-th fitting plan's, `c` can be neither
    suggested nor the runner-up the reasons compare with."""
    if len(fitting) <= top:
        return False
    floor = max((steps.get(attrs.evolve(c, recompute=r), 0.0) for r in _recomputes_less(c)), default=0.0)
    return floor > fitting[top][1].step.total_s


# A structure: (data, pipeline, tensor, schedule, virtual, sequence parallel, HSDP shard group, context,
# matmul recipe: the checker decides which layers it converts, from the layout).
Structure = tuple[int, int, int, str, int, bool, int, int, str]


def _by_structure(model: ModelIR, devices: int, batch: int, per_host: int, seq: int,
                  device: DeviceProfile | None = None) -> dict[Structure, list[Candidate]]:
    """Every candidate, grouped by the structure its text shares with the others of its group; with a
    `device`, each in every matmul recipe and compile setting it offers (precision_choices)."""
    groups: dict[Structure, list[Candidate]] = {}
    choices = precision_choices(model, device) if device is not None else [("", False)]
    for c in candidates(model, devices, batch, per_host, seq):
        # Each tensor-parallel candidate also with sequence parallelism, where seq splits over it.
        for v in (c, attrs.evolve(c, seq_parallel=True)) if c.tensor > 1 and seq % c.tensor == 0 else (c,):
            for matmul, comp in choices:
                w = attrs.evolve(v, matmul=matmul, compile=comp)
                groups.setdefault((w.data, w.pipeline, w.tensor, w.schedule, w.virtual, w.seq_parallel, w.zero_shard,
                                   w.context, w.matmul), []).append(w)
    return groups


def _suggest(path: str, model_name: str, devices: int, device: DeviceProfile, batch: int, seq: int,
             per_host: int | None, top: int, line: StatusLine, limit: int, prune: bool) -> SuggestResult:
    prelude = _prelude_text(path, model_name)
    model = check_text(prelude, str(Path(path))).models[model_name]
    host = per_host or min(devices, device.per_host)
    groups = _by_structure(model, devices, batch, host, seq, device)
    everything = [(key, c) for key, group in groups.items() for c in group]
    index = {c: i for i, (_, c) in enumerate(everything)}
    # Branch and bound: candidates in order of their lower bound on step time (the bubble's share:
    # compute_floor_s is common to all), analysed until the fastest that fit are known for certain.
    scales = {c: bubble_scale(c) for _, c in everything} if prune else {}
    if prune:
        everything.sort(key=lambda kc: scales[kc[1]])
    search = _Search(path, prelude, model, device, batch, seq, top, limit, prune, index, _Progress(line, len(everything)))
    for key, c in everything:
        # (less a rounding margin: the bound and the step are sums taken in different orders)
        if prune and search.floor is not None and search.recheck_below(search.floor * (1 + scales[c]) * (1 - 1e-9)):
            break
        search.consider(key, c, groups[key][0])
    search.recheck_below(float("inf"))
    return search.result(model_name, devices, host, len(everything))


class _Search:
    """The state of one `_suggest`: the structures checked, the candidates analysed and those that
    fit (by step time, then memory, then enumeration order), and the fastest re-checked as written."""

    def __init__(self, path: str, prelude: str, model: ModelIR, device: DeviceProfile, batch: int, seq: int,
                 top: int, limit: int, prune: bool, index: dict[Candidate, int], progress: _Progress) -> None:
        self.path, self.prelude, self.model, self.device, self.batch, self.seq = path, prelude, model, device, batch, seq
        self.top, self.limit, self.prune, self.index, self.progress = top, limit, prune, index, progress
        self.rejected: list[tuple[str, str]] = []
        self.structures: dict[Structure, PlanIR | None] = {}
        self.bounds: dict[Structure, StateBound] = {}
        self.fitting: list[tuple[Candidate, PlanReport]] = []
        self.points: list[tuple[str, float, int]] = []
        self.steps: dict[Candidate, float] = {}  # each analysed variant's step (bounds on those recomputing more)
        self.ranked: list[Ranked] = []
        self.analysed = self.checked = self.rechecked = 0
        self.floor: float | None = None

    def check(self, c: Candidate) -> tuple[str, PlanIR | None]:
        """`c` written out and checked: its mesh and plan text, and the plan when it checks clean."""
        block = plan_text(c, self.model, self.device.name, self.batch, self.seq)
        # The path makes includes in the prelude resolve next to the original file.
        result = check_text(self.prelude + "\n" + block, str(Path(self.path)))
        plan = result.plans.get(PLAN_NAME)
        if plan is None or not result.ok:
            err = next(iter(result.errors), None)
            if len(self.rejected) < 5:
                self.rejected.append((c.key(), f"{err.code}: {err.message}" if err else "no plan"))
            return block, None
        return block, plan

    def consider(self, key: Structure, c: Candidate, first: Candidate) -> None:
        """Analyse `c` (from its structure's checked plan, `first`'s) unless a bound rules it out,
        and keep it if it fits."""
        self.progress.tried()
        if key not in self.structures:
            self.structures[key] = self.check(first)[1]
            self.checked += 1
            self.bounds[key] = StateBound(self.limit)
        structure, bound = self.structures[key], self.bounds[key]
        if structure is not None:
            if self.prune and (bound.rules_out(c) or _slower_than_the_runner_up(c, self.steps, self.fitting, self.top)):
                return
            plan = variant(structure, c, self.model)
        else:
            checked = self.check(c)[1]  # the structure failed: judge each variant on its own
            self.checked += 1
            if checked is None:
                return
            plan = checked
        report = analyze(plan, self.device)
        self.analysed += 1
        self.points.append((c.key(), report.step.total_s, report.peak_training_bytes))
        self.floor = compute_floor_s(report) if self.floor is None else self.floor
        if structure is not None:
            bound.record(c, report)
            self.steps[c] = report.step.total_s
        if report.peak_training_bytes <= self.limit:
            # Ties in time and memory go to the earlier candidate in enumeration order, as the full search's do.
            bisect.insort(self.fitting, (c, report),
                          key=lambda cr: (cr[1].step.total_s, cr[1].peak_training_bytes, self.index[cr[0]]))
            self.progress.fits(c, report)

    def recheck_below(self, bound_s: float) -> bool:
        """Re-check, fastest first, the fitting plans no unanalysed candidate can beat (step under
        ``bound_s``); True once `top` pass and the runner-up after them is known too."""
        certain = bisect.bisect_left(self.fitting, bound_s, key=lambda cr: cr[1].step.total_s)
        while len(self.ranked) < self.top and self.rechecked < certain:
            c = self.fitting[self.rechecked][0]
            self.rechecked += 1
            self.progress.line.update(f"re-checking the fastest fitting plans as written ({len(self.ranked)} of {self.top} passed)")
            block, checked_plan = self.check(c)
            self.checked += 1
            if checked_plan is not None:
                rep = analyze(checked_plan, self.device)
                if rep.peak_training_bytes <= self.limit:
                    self.ranked.append(Ranked(c, block, rep))
        return len(self.ranked) >= self.top and certain >= self.top + 1

    def result(self, model_name: str, devices: int, host: int, enumerated: int) -> SuggestResult:
        """The re-checked plans, fastest first, each with why it ranks where it does."""
        ranked = sorted(self.ranked, key=lambda r: (r.report.step.total_s, r.report.peak_training_bytes))
        runner = [Ranked(c, "", r) for c, r in self.fitting[: self.top + 1]]
        best = [attrs.evolve(r, reason=_reason(i, r, ranked if len(ranked) > 1 else runner)) for i, r in enumerate(ranked)]
        return SuggestResult(model_name, devices, self.device, self.batch, self.seq, host, enumerated, self.checked,
                             len(self.fitting), tuple(best), tuple(self.rejected), self.device.memory_bytes - self.limit,
                             self.analysed, tuple(self.points))


class _Progress:
    """The status line while the search runs: candidates tried of all and the fastest fitting plan
    so far. Redrawn at most every tenth of a second (there are thousands of candidates)."""

    def __init__(self, line: StatusLine, total: int) -> None:
        self.line, self.total = line, total
        self.done = 0
        self.best: tuple[float, str] | None = None
        self.shown: float | None = None

    def tried(self) -> None:
        self.done += 1
        if not self.line.tty:
            return
        now = self.line.clock()
        if self.shown is not None and now - self.shown < 0.1:
            return
        self.shown = now
        best = f"; best so far {fmt_seconds(self.best[0])} per step: {self.best[1]}" if self.best else ""
        self.line.update(f"searching: candidate {self.done} of {self.total}{best}")

    def fits(self, c: Candidate, report: PlanReport) -> None:
        if self.best is None or report.step.total_s < self.best[0]:
            self.best = (report.step.total_s, c.key())


_PARTS = (("compute_s", "compute (recomputation included)"), ("tensor_s", "tensor-parallel communication"), ("pipeline_s", "pipeline sends"),
          ("bubble_s", "pipeline bubble"), ("data_s", "data-parallel gradient reduction"))


def _reason(i: int, r: Ranked, ranked: list[Ranked]) -> str:
    st = r.report.step
    head = (f"{fmt_seconds(st.total_s)} per step, {st.tokens / st.total_s:,.0f} tokens/s, peak "
            f"{fmt_bytes(r.report.peak_training_bytes)} of {fmt_bytes(r.report.device.memory_bytes)}")
    if i == 0:
        if len(ranked) < 2:
            return f"the only plan that checks clean and fits: {head}"
        other = ranked[1].report.step
        deltas = {name: getattr(other, key) - getattr(st, key) for key, name in _PARTS}
        win = max(deltas, key=lambda k: deltas[k])
        if deltas[win] <= 0:
            return f"fastest: {head}; ties the runner-up in time and needs less memory"
        return f"fastest: {head}; vs the runner-up it saves {fmt_seconds(deltas[win])} of {win}" + _cost(deltas, win)
    best = ranked[0].report.step
    deltas = {name: getattr(best, key) - getattr(st, key) for key, name in _PARTS}  # negative: this one pays more
    lose = min(deltas, key=lambda k: deltas[k])
    mem = r.report.peak_training_bytes - ranked[0].report.peak_training_bytes
    tail = f"; it needs {fmt_bytes(-mem)} less memory per device than #1" if mem < 0 else ""
    return (f"{head}; {fmt_seconds(st.total_s - best.total_s)} slower than #1: +{fmt_seconds(-deltas[lose])} of {lose}"
            + _gain(deltas, lose) + tail)


def _cost(deltas: dict[str, float], win: str) -> str:
    """What the winner pays back elsewhere, if anything."""
    worst = min(deltas, key=lambda k: deltas[k])
    return f" for {fmt_seconds(-deltas[worst])} more {worst}" if worst != win and deltas[worst] < 0 else ""


def _gain(deltas: dict[str, float], lose: str) -> str:
    best = max(deltas, key=lambda k: deltas[k])
    return f", -{fmt_seconds(deltas[best])} of {best}" if best != lose and deltas[best] > 0 else ""


def suggestion_text(res: SuggestResult) -> str:
    lines = [
        f"suggest: {res.model} on {res.devices} x {res.device.name} ({res.per_host} per host), batch {res.batch} x seq {res.seq}",
        (f"  {res.enumerated} candidates (data x pipeline x tensor, microbatches, schedule, ZeRO, recompute, "
         f"sequence parallelism{', context parallelism' if res.seq >= LONG_SEQ else ''}"
         f"{', matmul precision, compile' if res.device.kernel_us is None else ''}); "
         + (f"{res.analysed} analysed (a lower bound on step time or memory rules out the others), "
            if res.analysed < res.enumerated else "every one analysed, ")
         + f"{res.fitting} of them estimated to fit in {fmt_bytes(res.device.memory_bytes)} with "
         f"{fmt_bytes(res.headroom_bytes)} free; {res.checked} written out and run "
        "through the checker; every plan below checks clean as printed"),
        "",
    ]
    if not res.ranked:
        lines.append(f"no candidate checks clean and fits in memory with {fmt_bytes(res.headroom_bytes)} free: more "
                     "devices, a smaller batch or seq, a larger device or a smaller --headroom")
        for key, why in res.rejected:
            lines.append(f"  rejected {key}: {why}")
        return "\n".join(lines) + "\n"
    for i, r in enumerate(res.ranked):
        lines += [f"#{i + 1}  {r.candidate.key()}", f"    {r.reason}", ""]
        lines += ["    " + x if x else "" for x in r.text.rstrip("\n").split("\n")]
        lines.append("")
    return "\n".join(lines)


def suggestion_json(res: SuggestResult) -> dict[str, Any]:
    return {
        "model": res.model, "devices": res.devices, "device": res.device.name, "batch": res.batch, "seq": res.seq,
        "per_host": res.per_host, "enumerated": res.enumerated, "analysed": res.analysed, "checked": res.checked,
        "fitting": res.fitting, "headroom_bytes": res.headroom_bytes,
        "suggestions": [
            {"rank": i + 1, **attrs.asdict(r.candidate), "text": r.text, "reason": r.reason,
             "step_s": r.report.step.total_s, "peak_training_bytes": r.report.peak_training_bytes,
             "tokens_per_s": r.report.step.tokens / r.report.step.total_s}
            for i, r in enumerate(res.ranked)
        ],
        "rejected": [{"candidate": k, "error": e} for k, e in res.rejected],
    }
