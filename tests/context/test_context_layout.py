"""Which context rank holds which tokens of a packed row (runtime/parallel/context_layout.py),
against torch's own load balancers where they apply, and what each balance does to the ranks'
attention work on rows of log-normal document lengths."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from torch.distributed.tensor.experimental._context_parallel import _load_balancer as torch_lb  # noqa: E402

from meshllm_dsl.ir import CONTEXT_BALANCES  # noqa: E402
from meshllm_dsl.runtime.parallel import context_layout  # noqa: E402


def _row(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def test_the_checker_and_the_runtime_name_the_same_balances() -> None:
    assert CONTEXT_BALANCES == context_layout.BALANCES


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.data())
def test_every_rank_holds_an_equal_share_and_the_layout_is_a_permutation(ranks: int, chunk: int, data: st.DataObject) -> None:
    s = 2 * ranks * chunk * data.draw(st.integers(1, 3))
    rows = []
    for _ in range(2):
        cuts = sorted(data.draw(st.sets(st.integers(1, s - 1), max_size=s - 1)))
        rows.append(_row([b - a for a, b in zip([0, *cuts], [*cuts, s])]))
    docs = torch.stack(rows)
    for balance in context_layout.BALANCES:
        owner = context_layout.owners(docs, ranks, balance)
        for r in range(ranks):
            assert ((owner == r).sum(dim=1) == s // ranks).all(), balance
        order = context_layout.layout(docs, ranks, balance)
        assert (order.sort(dim=1).values == torch.arange(s)).all()
        # Rank i's part is the tokens it owns, in row order.
        part = s // ranks
        for r in range(ranks):
            mine = order[:, r * part : (r + 1) * part]
            assert (owner.gather(1, mine) == r).all() and (mine.diff(dim=1) > 0).all()
        pairs = context_layout.rank_pairs(docs, ranks, balance)
        assert (pairs.sum(dim=1) == context_layout.query_pairs(docs).sum(dim=1)).all()


def test_query_pairs_count_each_documents_earlier_tokens() -> None:
    assert context_layout.query_pairs(_row([3, 1, 2])[None]).tolist() == [[1, 2, 3, 1, 1, 2]]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_headtail_is_torchs(ranks: int) -> None:
    s = 8 * ranks
    ours = context_layout.layout(torch.zeros(1, s, dtype=torch.long), ranks, "headtail")
    theirs = torch_lb._HeadTailLoadBalancer(s, ranks, "cpu")._generate_indices()
    assert _same_parts(ours, theirs, ranks)


def _same_parts(ours: torch.Tensor, theirs: torch.Tensor, ranks: int) -> bool:
    """The same tokens on each rank (torch lists a rank's head chunk, then its tail chunk; we list
    them in row order, which they already are)."""
    part = ours.shape[1] // ranks
    return all(set(ours[0, r * part:(r + 1) * part].tolist()) == set(theirs[0, r * part:(r + 1) * part].tolist())
               for r in range(ranks))


@pytest.mark.parametrize("ranks", [2, 4])
def test_per_document_is_torchs_where_every_length_divides(ranks: int) -> None:
    lengths = [[2 * ranks * k for k in (3, 1, 4)], [2 * ranks * k for k in (1, 1, 6)]]
    docs = torch.stack([_row(ls) for ls in lengths])
    ours = context_layout.layout(docs, ranks, "per_document")
    theirs = torch_lb._PerDocumentHeadTailLoadBalancer(lengths, ranks, "cpu")._generate_indices()
    for b in range(2):
        # torch lists rank 0's chunks of document 0, rank 1's of document 0, ...: regroup by rank.
        chunk = [n // (2 * ranks) for n in lengths[b]]
        owner = torch.empty(docs.shape[1], dtype=torch.long)
        at = 0
        for c in chunk:
            for r in range(ranks):
                for _ in range(2):
                    owner[theirs[b, at:at + c]] = r
                    at += c
        want = torch.sort(owner, stable=True).indices
        assert ours[b].tolist() == want.tolist()


def test_per_document_deals_the_remainders_evenly_over_any_lengths() -> None:
    docs = _row([5, 3, 7, 1])[None]  # 16 tokens over 2 ranks: remainders 1 + 3 + 3 + 1 = 8
    owner = context_layout.owners(docs, 2, "per_document")
    assert ((owner == 0).sum(), (owner == 1).sum()) == (8, 8)
    assert owner[0, :5].tolist() == [0, 1, 0, 1, 0]  # c = 1: head chunk 0 -> rank 0, 1 -> rank 1; a middle token; tails


@pytest.mark.parametrize("ranks", [2, 4])
def test_ptrr_deals_blocks_as_torchs_schedule(ranks: int) -> None:
    gen = random.Random(ranks)
    docs = torch.stack([_row(_lognormal(gen, 64 * ranks)) for _ in range(3)])
    s = docs.shape[1]
    block = context_layout.FLEX_BLOCK if s // (2 * ranks) % context_layout.FLEX_BLOCK == 0 else s // (2 * ranks)
    work = context_layout.query_pairs(docs).reshape(3, -1, block).sum(dim=2)
    owner = context_layout.owners(docs, ranks, "ptrr")[:, ::block]
    for b in range(3):
        groups = torch_lb._PTRRLoadBalancer.ptrr_scheduling(work[b], ranks)
        for r in range(ranks):
            assert sorted(torch.nonzero(owner[b] == r).flatten().tolist()) == groups[r].tolist()


def test_without_documents_every_balance_is_headtail() -> None:
    docs = torch.zeros(2, 32, dtype=torch.long)
    for ranks in (1, 2, 4, 8):
        want = context_layout.owners(docs, ranks, "headtail")
        for balance in ("per_document", "ptrr"):
            if balance == "ptrr" and 32 // (2 * ranks) != context_layout.FLEX_BLOCK and ranks != 8:
                continue  # finer blocks than 2 n per row deal a causal row otherwise (as evenly)
            assert (context_layout.owners(docs, ranks, balance) == want).all(), (balance, ranks)


def _lognormal(gen: random.Random, s: int) -> list[int]:
    out: list[int] = []
    while sum(out) < s:
        out.append(min(int(gen.lognormvariate(4.0, 1.4)) + 1, s - sum(out)))
    return out


def test_balancing_by_documents_evens_the_work_head_tail_does_not() -> None:
    """4 ranks, 32 rows of 4096 tokens, log-normal document lengths: the busiest rank's pairs over
    the mean (measured: head-tail 1.61, per-document 1.001, ptrr 1.06 on this seed)."""
    gen = random.Random(0)
    docs = torch.stack([_row(_lognormal(gen, 4096)) for _ in range(32)])
    excess = {}
    for balance in context_layout.BALANCES:
        pairs = context_layout.rank_pairs(docs, 4, balance).double()
        excess[balance] = float((pairs.max(dim=1).values / pairs.mean(dim=1)).mean())
    assert excess["per_document"] < 1.01 and excess["ptrr"] < 1.1 < 1.4 < excess["headtail"], excess
