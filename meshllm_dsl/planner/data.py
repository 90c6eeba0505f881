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
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import W0808
from meshllm_dsl.diagnostics import Diagnostic
from meshllm_dsl.ir import PlanIR, Repeat
from meshllm_dsl.parallel.costs import HeldUnit
from meshllm_dsl.planner.formatting import fmt_seconds
from meshllm_dsl.planner.rank import rank_drafts, recomputes_core, running_units, setup_of
from meshllm_dsl.planner.recompute import recomputed_copies
from meshllm_dsl.planner.records import PlanReport
from meshllm_dsl.planner.spans import find_word, header_span
from meshllm_dsl.planner.time import unit_forward_time

__all__ = ["DATA_SKEW_WARN", "DataAttention", "DataProfile", "Row", "data_attention", "data_json", "data_lines",
           "data_profile", "data_warnings", "row_pairs"]

DATA_SKEW_WARN = 0.10  # warn when the busiest data rank's attention takes this much longer than the even share


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


@attrs.frozen
class DataProfile:
    """The data ranks' work over the first `steps` global batches of the seeded order: each rank's
    share of the trained tokens and of the attention pairs (shares sum to 1), the pairs of all
    rows (`pairs`) and the sum over the steps of the busiest rank's pairs (`busiest_pairs`)."""

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
    busiest_pairs: int

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
        """The busiest rank's attention work, step by step, over its rows' upper bound."""
        return self.busiest_pairs * self.ranks / self.upper_pairs

    @property
    def excess(self) -> float:
        """How much longer the attention takes waiting for each step's busiest rank than with the work even."""
        return self.busiest_pairs * self.ranks / self.pairs - 1.0 if self.pairs else 0.0


def data_profile(steps: Sequence[Sequence[Row]], *, seq: int, ranks: int, masked: bool, balanced: bool) -> DataProfile:
    """The profile of `steps` global batches (each its rows in the order the ranks take them: rank r
    the r-th of `ranks` equal consecutive slices, as Built._local_batch slices)."""
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
    return DataProfile(seq=seq, batch=batch, ranks=ranks, steps=len(steps), masked=masked, balanced=balanced,
                       documents=documents, tokens=tuple(t / max(total_t, 1) for t in tokens),
                       attention=tuple(a / max(total_a, 1) for a in attention), pairs=total_a, busiest_pairs=busiest)


@attrs.frozen
class DataAttention:
    """A plan's attention under its data: FLOPs per step (the whole batch, forward and backward) as
    the plan alone prices them and under the rows' documents, and the step's time with the attention
    core at the busiest rank's share and at the even share."""

    profile: DataProfile
    upper_flops: float  # the attention core over all seq keys, per step
    flops: float  # over each row's documents: upper x even share
    core_s: float  # the slowest rank class's attention-core seconds per step at the upper bound
    step_s: float  # the plan's step at the upper bound
    busiest_step_s: float  # with the core at the busiest rank's share
    even_step_s: float  # with the core at the even share (what balancing the ranks reaches at best)

    @property
    def excess_s(self) -> float:
        """What waiting for the busiest data rank costs per step."""
        return self.busiest_step_s - self.even_step_s


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
    """The report's data section: the rows' documents, each data rank's shares, the attention FLOPs and the step."""
    p = da.profile
    lines = [f"data: {source}, first {p.steps} steps of the seeded order ({p.steps * p.batch:,} rows of {p.seq:,}, "
             f"{p.documents / (p.steps * p.batch):.2f} documents a row{', balanced over the data ranks' if p.balanced else ''})"]
    if p.masked:
        lines.append(f"  attention core {_flops(da.flops)} per step over the documents (sum of squared lengths), "
                     f"{p.even_share:.1%} of the {_flops(da.upper_flops)} over all seq keys")
        lines.append(f"  step {fmt_seconds(da.busiest_step_s)} waiting for the busiest data rank "
                     f"({fmt_seconds(da.even_step_s)} with the attention even, {fmt_seconds(da.step_s)} over all seq keys)")
    else:
        lines.append(f"  attention over all seq keys (no `pack = documents`): {_flops(da.upper_flops)} per step whatever the documents")
    lines.append("  data rank   tokens   attention")
    for r, (t, a) in enumerate(zip(p.tokens, p.attention)):
        lines.append(f"  {r:>9}   {t:>6.1%}   {a:>9.1%}")
    lines.append(f"  busiest rank's attention excess {p.excess:.1%} ({fmt_seconds(da.excess_s)} a step)")
    return lines


def data_json(da: DataAttention, source: str) -> dict[str, object]:
    p = da.profile
    return {"source": source, "steps": p.steps, "rows": p.steps * p.batch, "seq": p.seq, "data_ranks": p.ranks,
            "document_mask": p.masked, "balanced": p.balanced, "documents": p.documents,
            "token_shares": list(p.tokens), "attention_shares": list(p.attention),
            "attention_pairs": p.pairs, "busiest_attention_pairs": p.busiest_pairs,
            "attention_share_of_upper_bound": p.even_share, "busiest_share_of_upper_bound": p.busiest_share,
            "attention_excess": p.excess, "attention_flops_upper_bound": da.upper_flops,
            "attention_flops": da.flops, "attention_core_s": da.core_s, "step_s_upper_bound": da.step_s,
            "step_s": da.busiest_step_s, "step_s_even": da.even_step_s, "excess_s": da.excess_s}


def data_warnings(rep: PlanReport, da: DataAttention) -> list[Diagnostic]:
    """W0808: the busiest data rank's attention work passes DATA_SKEW_WARN over the even share."""
    p = da.profile
    if p.excess <= DATA_SKEW_WARN:
        return []
    where = find_word(rep.plan.span, "pack") or header_span(rep.plan.span)
    return [Diagnostic(
        W0808, f"on this data the busiest data rank does {p.excess:.0%} more attention work than the average over the "
        f"first {p.steps} steps: {fmt_seconds(da.excess_s)} a step waiting for it "
        f"({fmt_seconds(da.busiest_step_s)} against {fmt_seconds(da.even_step_s)} with the work even)", where,
        label=f"data ranks' attention uneven by more than {DATA_SKEW_WARN:.0%}",
        help="`meshc run --balance` repacks each step's documents by length so the data ranks' attention work "
        "evens out (the same documents each step); `meshc data-stats --plan FILE --balance` shows the shares it reaches")]
