"""Which context rank holds which tokens of a packed row: the plan setting `context_balance`.

Under context parallelism each of the ``n`` context ranks computes the attention of the queries it
holds against every key (runtime/parallel/context.py), so its attention work is the number of
(query, key) pairs its queries see.  Causal rows are evened by head-tail (rank ``i`` holds chunks
``i`` and ``2 n - 1 - i`` of ``2 n``), which is static.  With a document mask a query sees only its
own document's earlier tokens, and head-tail no longer evens the work: a row of one long document
and many short ones puts the long document's late queries (the costly ones) on one rank.  The
balances here are torch's (torch.distributed.tensor.experimental._context_parallel._load_balancer),
decided per row from its document numbers:

* ``headtail``: the static split above (torch's ``_HeadTailLoadBalancer``), whatever the row holds.
* ``per_document``: head-tail within every document (torch's ``_PerDocumentHeadTailLoadBalancer``):
  a document of ``L`` tokens is cut into ``2 n`` chunks of ``L // (2 n)`` and rank ``i`` takes chunks
  ``i`` and ``2 n - 1 - i``.  torch asserts that every document's length divides by ``2 n``; here the
  ``L mod 2 n`` tokens between the head and tail chunks are dealt round-robin over the ranks along the
  row, so any lengths work and every rank still holds exactly ``s / n`` tokens (the remainders of a row
  sum to a multiple of ``2 n``, since the row's length does).  A row of one document is head-tail.
* ``ptrr``: processing-time round-robin (torch's ``_PTRRLoadBalancer``): the row is cut into blocks,
  the blocks sorted by their work (descending, ties in row order) and dealt to the ranks in a snake
  (0 .. n - 1, then n - 1 .. 0, ...).  torch measures a block's work in flex_attention's 128-token
  key blocks; here in exact pairs, which is what both SDPA's explicit mask and the planner count.
  Blocks are ``gcd(128, s / 2 n)`` tokens (flex's block size where the row allows), so a row has a
  multiple of ``2 n`` blocks; with exactly ``2 n`` blocks of a causal row, PTRR is head-tail.

A layout is a permutation of each row's positions in rank order (rank 0's tokens, then rank 1's,
each rank's in row order): rank ``i`` holds ``order[:, i s / n : (i + 1) s / n]``, and K / V
gathered over the context axes come in that order.  It is computed on the host from the batch's
document numbers (no device sync) and is a pure function of them, so every rank of the row computes
the same one.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["BALANCES", "FLEX_BLOCK", "layout", "owners", "query_pairs", "rank_pairs"]

BALANCES = ("headtail", "per_document", "ptrr")
FLEX_BLOCK = 128  # flex_attention's default block size (torch.nn.attention.flex_attention)


def _check(documents: Tensor, ranks: int) -> tuple[int, int]:
    if documents.dim() != 2:
        raise ValueError(f"document numbers of shape {tuple(documents.shape)}: expected [rows, seq]")
    b, s = documents.shape
    if ranks < 1 or s % (2 * ranks):
        raise ValueError(f"a row of {s} tokens does not split into {2 * ranks} equal chunks over {ranks} context ranks")
    return b, s


def _starts(documents: Tensor) -> Tensor:
    """[b, s] bool: where a document begins (the row's first token, and each change of number)."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def query_pairs(documents: Tensor) -> Tensor:
    """[b, s] int64: the keys each query sees under the document mask (its own document's tokens up to
    itself: 1 for a document's first token, 2 for the next, ...)."""
    s = documents.shape[1]
    idx = torch.arange(s).expand_as(documents)
    # Each token's document start: the running maximum of the start positions so far.
    first = torch.where(_starts(documents), idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first + 1


def _headtail(b: int, s: int, ranks: int) -> Tensor:
    chunk = torch.arange(s) // (s // (2 * ranks))
    return torch.minimum(chunk, 2 * ranks - 1 - chunk).expand(b, s).clone()


def _per_document(documents: Tensor, ranks: int) -> Tensor:
    b, s = documents.shape
    n2 = 2 * ranks
    idx = torch.arange(s).expand(b, s)
    starts = _starts(documents)
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # each token's document start
    # Each token's document length: the next start after it (or the row's end) minus its own start.
    nxt = torch.where(starts, idx, torch.full_like(idx, s))
    nxt = torch.cat([nxt[:, 1:], torch.full((b, 1), s)], dim=1).flip(1).cummin(dim=1).values.flip(1)
    length = nxt - first
    offset = idx - first
    c, rest = length // n2, length % n2
    # Remainder tokens dealt before this document along the row (an exclusive running sum).
    dealt = torch.where(starts, rest, torch.zeros_like(rest)).cumsum(dim=1) - rest
    head_end, tail_start = ranks * c, ranks * c + rest
    safe = c.clamp(min=1)  # c = 0: no head or tail chunks, every token is in the middle
    return torch.where(offset < head_end, offset // safe,
                       torch.where(offset < tail_start, (dealt + offset - head_end) % ranks,
                                   ranks - 1 - (offset - tail_start) // safe))


def _ptrr(documents: Tensor, ranks: int) -> Tensor:
    b, s = documents.shape
    block = math.gcd(FLEX_BLOCK, s // (2 * ranks))
    work = query_pairs(documents).reshape(b, s // block, block).sum(dim=2)  # [b, blocks]
    # Descending by work, ties in row order (a stable sort of the negated work).
    ranked = torch.sort(-work, dim=1, stable=True).indices  # [b, blocks]: block ids, costliest first
    k = torch.arange(ranked.shape[1])
    lap, seat = k // ranks, k % ranks
    rank_of_rank = torch.where(lap % 2 == 0, seat, ranks - 1 - seat)  # the snake over the ranks
    owner_block = torch.empty_like(ranked)
    owner_block.scatter_(1, ranked, rank_of_rank.expand_as(ranked).clone())
    return owner_block.unsqueeze(2).expand(b, s // block, block).reshape(b, s)


def owners(documents: Tensor, ranks: int, balance: str) -> Tensor:
    """[b, s] int64: the context rank that holds each token of rows whose document numbers are
    ``documents`` [b, s] (host tensor), under ``balance`` (one of ``BALANCES``); every rank holds
    ``s / ranks`` tokens of every row."""
    b, s = _check(documents, ranks)
    documents = documents.cpu()
    if balance == "headtail":
        return _headtail(b, s, ranks)
    if balance == "per_document":
        return _per_document(documents, ranks)
    if balance == "ptrr":
        return _ptrr(documents, ranks)
    raise ValueError(f"unknown context balance {balance!r}; expected one of {', '.join(BALANCES)}")


def layout(documents: Tensor, ranks: int, balance: str) -> Tensor:
    """[b, s] int64: each row's positions in context-rank order (rank 0's tokens in row order, then
    rank 1's, ...); rank ``i``'s are ``[:, i s / ranks : (i + 1) s / ranks]``."""
    owner = owners(documents, ranks, balance)
    s = owner.shape[1]
    # Rank-major, row order within a rank: one stable sort of the owners.
    order = torch.sort(owner, dim=1, stable=True).indices
    counts = torch.bincount(owner.flatten() + torch.arange(owner.shape[0]).repeat_interleave(s) * ranks,
                            minlength=owner.shape[0] * ranks)
    if not bool((counts == s // ranks).all()):  # a balance must hand every rank the same share
        raise AssertionError(f"context balance {balance!r} gave uneven shares {counts.tolist()}")
    return order


def rank_pairs(documents: Tensor, ranks: int, balance: str) -> Tensor:
    """[b, ranks] int64: the (query, key) pairs each context rank's queries see under the document
    mask (no window), per row: what its attention core computes."""
    owner = owners(documents, ranks, balance)
    out = torch.zeros(owner.shape[0], ranks, dtype=torch.int64)
    return out.scatter_add_(1, owner, query_pairs(documents.cpu()))
