"""What the data does to a plan's step (`meshc plan --data`, `meshc data-stats --plan`): the attention
work of the packed rows the data ranks train on, measured over a run's first steps, priced against
the plan's attention core.

The plan alone prices the attention core over all `seq` keys of every query (primitives' Work: the
core's products are s x s per sequence), an upper bound under `pack = documents`, where a token
attends only within its document: a row's work is then the sum of its documents' squared lengths,
not seq squared (torchtitan's and Megatron's document masks skip the blocks between documents, so
their kernels do this much work). The lengths come from the data; `DataProfile` holds what the
packer's seeded order put in each data rank's rows, and `data_attention` scales the plan's
attention-core seconds by it:

  even      the core's seconds x the rows' mean share of the upper bound (every rank the average)
  busiest   the core's seconds x the busiest data rank's share, step by step: the step waits for it
  excess    busiest / even - 1 over the steps (`Skew.excess` of runtime/data/packing.py)

The step's other work does not depend on the documents. Without `pack = documents` every row costs
seq squared: the shares of attention are equal and only the tokens' shares (a chat's context turns
are not targets) can differ. Pure Python, as the rest of the planner: the measuring is in
meshllm_dsl/cli/data.py, on the `--data` path only.

With context parallelism (|C| > 1) a device is a data rank x a context rank: it computes, of each of
its data rank's rows, the queries its context rank holds (`context_balance`, runtime/parallel/
context_layout.py), and the step waits for the busiest DEVICE. Head-tail evens a causal row, not a
row of documents: the measuring records, per row, the causal pairs each context rank's queries see
(context_layout.rank_pairs) under each balance. A document's causal pairs are L (L + 1) / 2 and this
module counts L squared = 2 x causal - L (the diagonal once), so a context rank's work of a row, in
the same unit, is 2 x its causal pairs - its s / |C| tokens (every balance hands each rank s / |C|
tokens of every row; over the ranks it sums to the row's squared lengths exactly). Then

  busiest   the core's seconds x the busiest device's share, step by step
  excess    = data part + context part: the data part is the busiest data rank's (its devices at
            their mean), the context part what the split within the rows adds on top (never below 0:
            a data rank's busiest device does at least its mean)

and every balance is measured on the same rows, so the report shows what switching would give.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import W0808, W0809
from meshllm_dsl.diagnostics import Diagnostic
from meshllm_dsl.ir import PlanIR, Repeat
from meshllm_dsl.parallel.costs import HeldUnit
from meshllm_dsl.planner.formatting import fmt_seconds
from meshllm_dsl.planner.rank import rank_drafts, recomputes_core, running_units, setup_of
from meshllm_dsl.planner.recompute import recomputed_copies
from meshllm_dsl.planner.records import PlanReport
from meshllm_dsl.planner.spans import find_word, header_span
from meshllm_dsl.planner.time import unit_forward_time

__all__ = ["DATA_SKEW_WARN", "DataAttention", "DataProfile", "DeviceSplit", "Row", "data_attention", "data_json",
           "data_lines", "data_profile", "data_warnings", "device_pairs", "row_pairs"]

DATA_SKEW_WARN = 0.10  # warn when the busiest data rank's (or device's) attention takes this much longer than the even share


@attrs.frozen
class Row:
    """One packed row as the packer made it: its documents' lengths (tokens of the row, `seq` in
    all) and how many of its targets train (not a chat's context)."""

    lengths: tuple[int, ...]
    trained: int


def row_pairs(row: Row, seq: int, masked: bool) -> int:
    """A row's attention work in query-key pairs over all keys: the sum of its documents' squared
    lengths under a document mask, else seq squared (the causal half is the same share of both)."""
    return sum(n * n for n in row.lengths) if masked else seq * seq


def device_pairs(causal: int, tokens: int) -> int:
    """A context rank's work of a row in this module's unit (a document counts L squared) from the
    causal pairs its ``tokens`` queries see (a document's causal pairs are L (L + 1) / 2)."""
    return 2 * causal - tokens


@attrs.frozen
class DeviceSplit:
    """The devices' attention work under one `context_balance`: ``pairs[r][c]`` is data rank r's rows'
    work on context rank c summed over the steps, ``busiest_pairs`` the sum over the steps of each
    step's busiest device's work (both in this module's unit, see `device_pairs`)."""

    balance: str
    pairs: tuple[tuple[int, ...], ...]
    busiest_pairs: int


@attrs.frozen
class DataProfile:
    """The data ranks' work over the first `steps` global batches of the seeded order: each rank's
    share of the trained tokens and of the attention pairs (shares sum to 1), the pairs of all
    rows (`pairs`) and the sum over the steps of the busiest rank's pairs (`busiest_pairs`); with
    `contexts` > 1, the devices' work under each measured `context_balance` (`splits`)."""

    seq: int
    batch: int
    ranks: int
    steps: int
    masked: bool  # the plan's `pack = documents`
    balanced: bool  # each step's documents repacked for the ranks (`--balance`)
    documents: int  # documents (and pieces of split ones) in the rows
    tokens: tuple[float, ...]
    attention: tuple[float, ...]
    pairs: int
    busiest_pairs: int  # the busiest data rank's, step by step
    contexts: int = 1  # context ranks each row is split over
    context_balance: str = "headtail"  # the plan's
    # Under each measured balance, the plan's first (none with one context rank or no document mask:
    # a causal row's head-tail halves are even, and so is every device of a data rank).
    splits: tuple[DeviceSplit, ...] = ()

    @property
    def devices(self) -> int:
        return self.ranks * self.contexts

    @property
    def busiest_device_pairs(self) -> int:
        """The sum over the steps of the busiest device's work under the plan's balance."""
        if self.splits:
            return self.splits[0].busiest_pairs
        return self.busiest_pairs // self.contexts  # every device of the busiest data rank even

    @property
    def upper_pairs(self) -> int:
        """What the plan alone prices: seq squared per row."""
        return self.steps * self.batch * self.seq * self.seq

    @property
    def even_share(self) -> float:
        """The rows' attention work over the upper bound: every rank at the mean."""
        return self.pairs / self.upper_pairs

    @property
    def busiest_share(self) -> float:
        """The busiest device's attention work, step by step, over its upper bound (its data rank's
        rows' upper bound over the context ranks)."""
        return self.busiest_device_pairs * self.devices / self.upper_pairs

    @property
    def excess(self) -> float:
        """How much longer the attention takes waiting for each step's busiest device than with the work
        even: `data_excess` + `context_excess`."""
        return self._excess(self.busiest_device_pairs * self.devices)

    @property
    def data_excess(self) -> float:
        """The part of `excess` the data ranks make: each step's busiest data rank over the mean."""
        return self._excess(self.busiest_pairs * self.ranks)

    @property
    def context_excess(self) -> float:
        """The part of `excess` the split of the rows over the context ranks adds."""
        return self._part(self.busiest_device_pairs)

    def split_excess(self, split: DeviceSplit) -> float:
        """`excess` were the rows split as ``split`` (one of `splits`)."""
        return self._excess(split.busiest_pairs * self.devices)

    def split_context_excess(self, split: DeviceSplit) -> float:
        """`context_excess` were the rows split as ``split``."""
        return self._part(split.busiest_pairs)

    def _part(self, busiest_device_pairs: int) -> float:
        # From the integers: a data rank's busiest device does at least its mean, so never below 0.
        extra = busiest_device_pairs * self.devices - self.busiest_pairs * self.ranks
        return extra / self.pairs if self.pairs else 0.0

    def split_share(self, split: DeviceSplit) -> float:
        """`busiest_share` were the rows split as ``split``."""
        return split.busiest_pairs * self.devices / self.upper_pairs

    def _excess(self, busiest_times_count: int) -> float:
        return busiest_times_count / self.pairs - 1.0 if self.pairs else 0.0


def _split(balance: str, causal: Sequence[Sequence[Sequence[int]]], *, seq: int, ranks: int,
           contexts: int) -> DeviceSplit:
    """The devices' work from ``causal[step][row][c]``: the causal pairs context rank c's queries see in
    each row of each step (rows in the order the data ranks take them)."""
    per, tokens = len(causal[0]) // ranks, seq // contexts
    pairs = [[0] * contexts for _ in range(ranks)]
    busiest = 0
    for rows in causal:
        if len(rows) != per * ranks or any(len(row) != contexts for row in rows):
            raise ValueError(f"{balance}: expected {per * ranks} rows of {contexts} context ranks' pairs a step")
        work = [[sum(device_pairs(rows[r * per + i][c], tokens) for i in range(per)) for c in range(contexts)]
                for r in range(ranks)]
        for r in range(ranks):
            for c in range(contexts):
                pairs[r][c] += work[r][c]
        busiest += max(max(w) for w in work)
    return DeviceSplit(balance=balance, pairs=tuple(tuple(p) for p in pairs), busiest_pairs=busiest)


def data_profile(steps: Sequence[Sequence[Row]], *, seq: int, ranks: int, masked: bool, balanced: bool,
                 contexts: int = 1, context_balance: str = "headtail",
                 context_pairs: Mapping[str, Sequence[Sequence[Sequence[int]]]] | None = None) -> DataProfile:
    """The profile of `steps` global batches (each its rows in the order the ranks take them: rank r
    the r-th of `ranks` equal consecutive slices, as Built._local_batch slices).  With `contexts` > 1
    and `masked`, ``context_pairs[balance][step][row][c]`` are the causal pairs context rank c's queries
    see in each row (context_layout.rank_pairs) under each measured balance, the plan's
    `context_balance` among them."""
    if not steps:
        raise ValueError("no steps to profile")
    batch = len(steps[0])
    if batch % ranks or any(len(rows) != batch for rows in steps):
        raise ValueError(f"batch {batch} does not split over {ranks} data ranks")
    per = batch // ranks
    tokens, attention = [0] * ranks, [0] * ranks
    busiest = documents = 0
    for rows in steps:
        work = [0] * ranks
        for i, row in enumerate(rows):
            r = i // per
            tokens[r] += row.trained
            work[r] += row_pairs(row, seq, masked)
            documents += len(row.lengths)
        for r in range(ranks):
            attention[r] += work[r]
        busiest += max(work)
    total_t, total_a = sum(tokens), sum(attention)
    splits: tuple[DeviceSplit, ...] = ()
    if contexts > 1 and masked:
        if seq % contexts:
            raise ValueError(f"a row of {seq} tokens does not split over {contexts} context ranks")
        measured = dict(context_pairs or {})
        if context_balance not in measured:
            raise ValueError(f"no context ranks' pairs measured under the plan's `context_balance = {context_balance}`")
        if any(len(c) != len(steps) for c in measured.values()):
            raise ValueError(f"context ranks' pairs of other than the {len(steps)} steps")
        order = [context_balance] + sorted(b for b in measured if b != context_balance)
        splits = tuple(_split(b, measured[b], seq=seq, ranks=ranks, contexts=contexts) for b in order)
        if any(sum(map(sum, s.pairs)) != total_a for s in splits):  # every balance splits the same rows
            raise ValueError("the context ranks' pairs are not those of the rows' documents")
    return DataProfile(seq=seq, batch=batch, ranks=ranks, steps=len(steps), masked=masked, balanced=balanced,
                       documents=documents, tokens=tuple(t / max(total_t, 1) for t in tokens),
                       attention=tuple(a / max(total_a, 1) for a in attention), pairs=total_a, busiest_pairs=busiest,
                       contexts=contexts, context_balance=context_balance, splits=splits)


@attrs.frozen
class DataAttention:
    """A plan's attention under its data: FLOPs per step (the whole batch, forward and backward) as
    the plan alone prices them and under the rows' documents, and the step's time with the attention
    core at the busiest device's share and at the even share."""

    profile: DataProfile
    upper_flops: float  # the attention core over all seq keys, per step
    flops: float  # over each row's documents: upper x even share
    core_s: float  # the slowest rank class's attention-core seconds per step at the upper bound
    step_s: float  # the plan's step at the upper bound
    busiest_step_s: float  # with the core at the busiest device's share
    even_step_s: float  # with the core at the even share (what balancing the devices reaches at best)

    @property
    def excess_s(self) -> float:
        """What waiting for the busiest device costs per step: `data_excess_s` + `context_excess_s`."""
        return self.busiest_step_s - self.even_step_s

    @property
    def data_excess_s(self) -> float:
        """The part of `excess_s` the data ranks make (the core's even seconds x the data part)."""
        return self.core_s * self.profile.even_share * self.profile.data_excess

    @property
    def context_excess_s(self) -> float:
        """The part of `excess_s` the split of the rows over the context ranks adds."""
        return self.excess_s - self.data_excess_s

    def split_step_s(self, split: DeviceSplit) -> float:
        """The step with the rows split over the context ranks as ``split``."""
        return self.step_s - self.core_s * (1.0 - self.profile.split_share(split))


def _core_flops_per_sequence(plan: PlanIR) -> float:
    """The whole model's attention-core flops of one sequence, forward and backward (3 x forward), over all seq keys."""
    total = 0.0
    for item in plan.model.items:
        units, count = (item.body, item.count) if isinstance(item, Repeat) else ((item,), 1)
        for unit in units:
            whole = HeldUnit(unit, "", 1, (), None)  # unsharded: the whole layer's products
            work = primitives.of(unit).work(plan, whole, plan.seq, plan.seq, 1, True)
            total += count * sum(mm.flops for mm in work.matmuls if mm.core)
    return 3 * total


def _core_seconds(rep: PlanReport) -> float:
    """The attention core's seconds per step on the slowest rank class (forward, backward at twice
    it, and what `recompute` reruns of it): the part of the step the documents' lengths scale."""
    setup = setup_of(rep.plan, rep.device, rep.flash_attention)
    plan, m = setup.plan, setup.plan.microbatches
    best = 0.0
    for rank in rank_drafts(setup):
        core = 0.0
        for hu in running_units(rank):
            core_s = unit_forward_time(plan, setup.device, hu, setup.tokens, plan.seq, setup.micro_batch,
                                       setup.flash_attention).core_s
            rc = recomputed_copies(plan, hu)
            reruns = rc if rc else (hu.count if recomputes_core(plan, hu) else 0)
            core += (3 * hu.count + reruns) * core_s
        best = max(best, core * m)
    return best


def data_attention(rep: PlanReport, profile: DataProfile) -> DataAttention:
    """`rep`'s attention priced by the measured rows (see the module's docstring)."""
    upper = _core_flops_per_sequence(rep.plan) * rep.plan.batch
    core_s = _core_seconds(rep)
    step_s = rep.step.total_s
    return DataAttention(profile=profile, upper_flops=upper, flops=upper * profile.even_share, core_s=core_s,
                         step_s=step_s, busiest_step_s=step_s - core_s * (1.0 - profile.busiest_share),
                         even_step_s=step_s - core_s * (1.0 - profile.even_share))


def _flops(x: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} FLOP"


def data_lines(da: DataAttention, source: str) -> list[str]:
    """The report's data section: the rows' documents, each data rank's shares, the attention FLOPs and
    the step; with context ranks, the busiest device's excess in its data and context parts under each
    `context_balance`."""
    p = da.profile
    busiest = "busiest device" if p.contexts > 1 else "busiest data rank"
    lines = [f"data: {source}, first {p.steps} steps of the seeded order ({p.steps * p.batch:,} rows of {p.seq:,}, "
             f"{p.documents / (p.steps * p.batch):.2f} documents a row{', balanced over the data ranks' if p.balanced else ''})"]
    if p.masked:
        lines.append(f"  attention core {_flops(da.flops)} per step over the documents (sum of squared lengths), "
                     f"{p.even_share:.1%} of the {_flops(da.upper_flops)} over all seq keys")
        lines.append(f"  step {fmt_seconds(da.busiest_step_s)} waiting for the {busiest} "
                     f"({fmt_seconds(da.even_step_s)} with the attention even, {fmt_seconds(da.step_s)} over all seq keys)")
    else:
        lines.append(f"  attention over all seq keys (no `pack = documents`): {_flops(da.upper_flops)} per step whatever the documents")
    lines.append("  data rank   tokens   attention")
    for r, (t, a) in enumerate(zip(p.tokens, p.attention)):
        lines.append(f"  {r:>9}   {t:>6.1%}   {a:>9.1%}")
    if p.contexts == 1:
        lines.append(f"  busiest rank's attention excess {p.excess:.1%} ({fmt_seconds(da.excess_s)} a step)")
        return lines
    lines.append(f"  busiest device's attention excess {p.excess:.1%} ({fmt_seconds(da.excess_s)} a step) over "
                 f"{p.ranks} data x {p.contexts} context ranks: data ranks {p.data_excess:.1%} "
                 f"({fmt_seconds(da.data_excess_s)}), context ranks {p.context_excess:.1%} "
                 f"({fmt_seconds(da.context_excess_s)}) under `context_balance = {p.context_balance}`")
    if p.splits:
        lines.append(f"  {'context_balance':<26}  {'excess':>6}   {'context part':>12}   step")
        for split in p.splits:
            mine = " (the plan's)" if split.balance == p.context_balance else ""
            excess = p.split_excess(split)
            lines.append(f"  {split.balance + mine:<26}  {excess:>6.1%}   {p.split_context_excess(split):>12.1%}   "
                         f"{fmt_seconds(da.split_step_s(split))}")
    return lines


def data_json(da: DataAttention, source: str) -> dict[str, object]:
    p = da.profile
    return {"source": source, "steps": p.steps, "rows": p.steps * p.batch, "seq": p.seq, "data_ranks": p.ranks,
            "context_ranks": p.contexts, "context_balance": p.context_balance,
            "document_mask": p.masked, "balanced": p.balanced, "documents": p.documents,
            "token_shares": list(p.tokens), "attention_shares": list(p.attention),
            "attention_pairs": p.pairs, "busiest_attention_pairs": p.busiest_pairs,
            "busiest_device_attention_pairs": p.busiest_device_pairs,
            "attention_share_of_upper_bound": p.even_share, "busiest_share_of_upper_bound": p.busiest_share,
            "attention_excess": p.excess, "attention_excess_data": p.data_excess,
            "attention_excess_context": p.context_excess, "attention_flops_upper_bound": da.upper_flops,
            "attention_flops": da.flops, "attention_core_s": da.core_s, "step_s_upper_bound": da.step_s,
            "step_s": da.busiest_step_s, "step_s_even": da.even_step_s, "excess_s": da.excess_s,
            "excess_s_data": da.data_excess_s, "excess_s_context": da.context_excess_s,
            "context_balances": {s.balance: {
                "attention_excess": p.split_excess(s), "attention_excess_context": p.split_context_excess(s),
                "busiest_device_attention_pairs": s.busiest_pairs, "busiest_share_of_upper_bound": p.split_share(s),
                "step_s": da.split_step_s(s),
                "device_attention_shares": [[w / max(p.pairs, 1) for w in row] for row in s.pairs]}
                for s in p.splits}}


def data_warnings(rep: PlanReport, da: DataAttention) -> list[Diagnostic]:
    """W0808: the busiest data rank's attention work passes DATA_SKEW_WARN over the even share;
    W0809: the split of the rows over the context ranks adds more than DATA_SKEW_WARN on top."""
    p = da.profile
    out = []
    if p.data_excess > DATA_SKEW_WARN:
        where = find_word(rep.plan.span, "pack") or header_span(rep.plan.span)
        out.append(Diagnostic(
            W0808, f"on this data the busiest data rank does {p.data_excess:.0%} more attention work than the average "
            f"over the first {p.steps} steps: {fmt_seconds(da.data_excess_s)} a step waiting for it "
            f"({fmt_seconds(da.even_step_s + da.data_excess_s)} against {fmt_seconds(da.even_step_s)} with the work "
            "even)", where,
            label=f"data ranks' attention uneven by more than {DATA_SKEW_WARN:.0%}",
            help="`meshc run --balance` repacks each step's documents by length so the data ranks' attention work "
            "evens out (the same documents each step); `meshc data-stats --plan FILE --balance` shows the shares it reaches"))
    if p.context_excess > DATA_SKEW_WARN:
        out.append(_context_warning(rep, da))
    return out


def _context_warning(rep: PlanReport, da: DataAttention) -> Diagnostic:
    """W0809 on the `context_balance` setting (else `pack`, else the plan's header), its help naming the
    balance that measured best on the same rows."""
    p = da.profile
    where = (find_word(rep.plan.span, "context_balance") or find_word(rep.plan.span, "pack")
             or header_span(rep.plan.span))
    best = min(p.splits, key=lambda s: (s.busiest_pairs, s.balance != p.context_balance))
    measured = ", ".join(f"{s.balance} {p.split_context_excess(s):.1%}" for s in p.splits)
    if best.balance != p.context_balance:
        advice = (f"`context_balance = {best.balance}` measured best on these rows: the context part "
                  f"{p.split_context_excess(best):.1%} ({fmt_seconds(da.split_step_s(best))} a step); "
                  f"measured: {measured}")
    else:
        advice = (f"`{p.context_balance}` already measured best on these rows ({measured}); fewer context ranks "
                  "(more data ranks) split each row's documents less")
    return Diagnostic(
        W0809, f"on this data `context_balance = {p.context_balance}` splits the rows unevenly over the {p.contexts} "
        f"context ranks: the busiest device does {p.excess:.0%} more attention work than the average over the first "
        f"{p.steps} steps, {p.context_excess:.0%} of it on top of the busiest data rank's {p.data_excess:.0%}: "
        f"{fmt_seconds(da.context_excess_s)} a step waiting for it", where,
        label=f"context ranks' attention uneven by more than {DATA_SKEW_WARN:.0%}", help=advice)
