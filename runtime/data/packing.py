"""Packed training batches from document corpora: a seeded, multi-epoch, weighted order of documents
cut into ``seq + 1``-id rows, and the small cursor that makes the order resumable.

What the references do, and what this packer does the same way:

* **Rows** hold ``seq + 1`` consecutive ids of the document stream and do not overlap (torchtitan's
  ``HuggingFaceTextDataset`` takes ``seq_len + 1`` tokens off its buffer per sample): tokens are
  ``row[:-1]``, targets ``row[1:]``, so every id of a consumed document appears in exactly one row,
  in order.  A document longer than the room left is split and its rest opens the next row
  (torchtitan's buffer and Megatron's ``GPTDataset`` sample index both cut documents at row
  boundaries); no row is padded.
* **Documents** within a row are numbered 0, 1, ...; an end-of-text id belongs to the document it
  ends (torchtitan's ``get_document_mask_mod`` counts a document from the id after each EOS; Megatron's
  ``reset_attention_mask`` hides ``[:i + 1]`` from the ids after an EOD at ``i``).  A split
  document's rest is a new document of its row: the ids before it are in another row, which no
  attention reaches.
* **Positions** restart at 0 at each document start and at each row start, so a continuation
  restarts too: Megatron's ``reset_position_ids`` subtracts from ``arange(seq)``, which every sample
  starts at, and a continuation numbered from its offset in the document would need positions past
  ``seq`` (a learned position table has none) and would not equal the continuation run alone.
* **Targets** are the next ids; ``IGNORE`` where the corpus's loss mask is 0 for the target id (a
  chat's context turns).  A target that is the next document's first id (the input is an EOS) is
  kept: torchtitan never masks it and Megatron masks it only under ``--eod-mask-loss``, off by
  default.

Order: each corpus's documents are shuffled per epoch by a permutation seeded from (seed, corpus,
epoch), so epochs differ and any epoch is reproducible alone.  Several corpora are drawn from as
Megatron's ``BlendedDataset`` blends: the next document comes from the corpus whose share of the
ids drawn so far is furthest below its weight (weights are shares of tokens, not of documents, so a
corpus of long documents does not take more than its weight); each corpus runs through its own
epochs.  Nothing here depends on the data-parallel layout: every rank packs the same global batch
and takes its rows (``Built._local_batch``).

Balance (``balance = dp``): with a document mask a row's attention work is the sum of its documents'
squared lengths, so rows of one long document cost more than rows of many short ones and the data
ranks wait for the busiest.  ``data_skew`` measures each rank's share over a run's first steps;
``balance`` repacks each step: the ``batch`` rows ``next_row`` would give (the cursor moves exactly
as without it, so a resume, the cursor and the identity are the same) are taken apart into their
pieces (a document, or the part of one the packer cut at a row's end) and laid into ``batch`` rows
again by length (``repack``): longest first, whole, to the rank with the least work that has room,
first fit within its rows; a piece no row fits whole is split at a row's end, its rest a new
document as at any row's end.  Pieces the packer cut at row ends are not joined back: a joined
document's squared length is more work than its parts' (measured on the corpus below, joined: the
busiest rank's work 57% and 98% over the average of the rows as packed, reordered rows: 3% and 13%).
Where the greedy layout leaves the busiest rank no less work than the rows as packed in
``balanced_order`` (each rank's rows largest first), the step takes those (``balanced_rows``), so
balance never makes the slowest rank slower.  A step trains on the same ids of the same documents
either way; which ids are targets changes at the pieces' edges (a row's first id is no target, and a
piece cut short that cannot end its row makes the next id none either).  On a corpus of mostly
1-5-id documents with one in ten as long as a row (seq 64, batch 8, 50 steps), the busiest rank's
attention excess goes from 13.7% (as packed) to 2.9% (reordered rows) to 1.5% (repacked) at 2 data
ranks and from 46.4% to 13.1% to 8.7% at 4, at the cost of 70 and 85 of 25,600 targets (0.3%) after
pieces cut mid-row (tests/data/test_packing.py).  On bench/packed_attention.py's corpus (20,000
log-normal documents, median 300) at seq 4,096, batch 16 and 8 ranks: 84.9% to 40.2% to 27.9%, the
pieces a row 7.61 to 8.20 (the splits), 202 of 1,310,720 targets cut.  Every rank repacks the
global batch: 512 rows of 8,193 ids took 0.22 s a step against 0.10 s to pack them (2 shared cores).

Memory: the ids are read through the corpus's memory map, one row at a time; the permutation of the
current epoch is ``documents`` int64s per corpus, as the document index (``Corpus.starts``) already is.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from meshllm_dsl.runtime.data.corpus import IGNORE, Batch, Corpus, open_corpus
from meshllm_dsl.runtime.train.tokens import DataError

__all__ = ["Cursor", "Packer", "Piece", "Skew", "balanced_order", "balanced_rows", "corpus_identity", "corpus_packer",
           "data_skew", "pieces_attention", "repack", "row_attention"]


class Piece(NamedTuple):
    """A run of one document's ids in a row: its corpus and document, the offset of its first id in
    the document, how many ids, and whether it reaches the document's end (its last id the
    end-of-text; else the document goes on in another row or the next step)."""

    corpus: int
    document: int
    offset: int
    length: int
    ends: bool


@dataclass
class Cursor:
    """Where the packer is in the data: small and JSON-serialisable (a checkpoint's ``state``).

    Per corpus: ``epochs`` (which shuffled order it is in), ``index`` (the next position in that
    order) and ``drawn`` (ids drawn so far, what the weights balance).  ``split`` is (corpus,
    document, offset) of a document whose rest opens the next row, else None; ``rows`` counts the
    rows packed so far."""

    epochs: list[int]
    index: list[int]
    drawn: list[int]
    split: list[int] | None = None
    rows: int = 0

    @classmethod
    def start(cls, corpora: int) -> Cursor:
        return cls(epochs=[0] * corpora, index=[0] * corpora, drawn=[0] * corpora)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], corpora: int) -> Cursor:
        try:
            cur = cls(epochs=[int(x) for x in d["epochs"]], index=[int(x) for x in d["index"]],
                      drawn=[int(x) for x in d["drawn"]],
                      split=None if d.get("split") is None else [int(x) for x in d["split"]],
                      rows=int(d["rows"]))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"the checkpoint's data cursor is malformed ({err})") from None
        if not len(cur.epochs) == len(cur.index) == len(cur.drawn) == corpora:
            raise DataError(f"the checkpoint's data cursor is for {len(cur.epochs)} corpora, --data has {corpora}")
        return cur


def corpus_identity(corpus: Corpus) -> dict[str, Any]:
    """What must be the same for a saved cursor to mean the same documents: the file, its size,
    document count and a hash of its document index and first MiB of ids."""
    h = hashlib.sha256(np.ascontiguousarray(corpus.starts).tobytes())
    h.update(np.asarray(corpus.ids[: 1 << 19]).tobytes())
    return {"path": str(corpus.path), "ids": int(len(corpus.ids)), "documents": corpus.documents,
            "sha256": h.hexdigest()[:16]}


@dataclass
class Packer:
    """Packs ``batch`` rows of ``seq + 1`` ids per call of ``next_batch`` from ``sources`` (corpus,
    weight) in the seeded order, from ``start`` (a saved cursor; the beginning by default).  ``cursor``
    is where it is now."""

    sources: list[tuple[Corpus, float]]
    seq: int
    seed: int
    start: Cursor | None = None
    shuffle: bool = True  # False: each corpus's documents in file order (held-out evaluation)
    # Data ranks to even the attention work over (0: rows in packed order): ``next_batch`` repacks
    # each step's documents so that the ranks' slices hold about equal sums of squared lengths.
    balance: int = 0
    cursor: Cursor = field(init=False)
    _orders: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.sources:
            raise DataError("no corpus to pack")
        if self.seq < 1:
            raise DataError(f"seq {self.seq}: rows need at least one token")
        for corpus, weight in self.sources:
            if not weight > 0 or not np.isfinite(weight):
                raise DataError(f"{corpus.path}: weight {weight} (a corpus's weight is a positive number)")
            if corpus.documents < 1:
                raise DataError(f"{corpus.path}: no documents")
        if self.balance < 0:
            raise DataError(f"balance {self.balance}: the number of data ranks to balance over (0: off)")
        total = sum(w for _, w in self.sources)
        self._shares = np.array([w / total for _, w in self.sources], dtype=np.float64)
        n = len(self.sources)
        # A copy: packing moves the cursor, and ``start`` stays what the caller passed.
        self.cursor = Cursor.from_dict(self.start.to_dict(), n) if self.start is not None else Cursor.start(n)

    def identity(self, batch: int) -> dict[str, Any]:
        """What a checkpoint's cursor is valid for: refused on resume when it differs."""
        return {"corpora": [dict(corpus_identity(c), weight=float(w)) for c, w in self.sources],
                "seq": self.seq, "batch": batch, "seed": self.seed, "balance": self.balance}

    def order(self, corpus: int, epoch: int) -> np.ndarray:
        """Corpus ``corpus``'s documents in epoch ``epoch``'s shuffled order."""
        cached = self._orders.get(corpus)
        if cached is None or cached[0] != epoch:
            n = self.sources[corpus][0].documents
            if self.shuffle:
                # One generator per (seed, corpus, epoch): an epoch's order does not depend on the others'.
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, corpus, epoch])))
                cached = (epoch, rng.permutation(n))
            else:
                cached = (epoch, np.arange(n))
            self._orders[corpus] = cached
        return cached[1]

    def _draw(self) -> tuple[int, int]:
        """The next (corpus, document) of the order; advances the cursor past it."""
        cur = self.cursor
        total = sum(cur.drawn)
        # Megatron's BlendedDataset rule in tokens: furthest below its share; ties to the first.
        c = int(np.argmax(self._shares * total - np.array(cur.drawn, dtype=np.float64))) if len(self.sources) > 1 else 0
        doc = int(self.order(c, cur.epochs[c])[cur.index[c]])
        cur.index[c] += 1
        if cur.index[c] == self.sources[c][0].documents:
            cur.epochs[c], cur.index[c] = cur.epochs[c] + 1, 0
        starts = self.sources[c][0].starts
        cur.drawn[c] += int(starts[doc + 1] - starts[doc])
        return c, doc

    def _next_pieces(self) -> list[Piece]:
        """The pieces of the next row of ``seq + 1`` ids in the order: whole documents, the rest of
        one split at the last row first, one split at this row's end last; advances the cursor."""
        n = self.seq + 1
        pieces: list[Piece] = []
        fill, cur = 0, self.cursor
        while fill < n:
            if cur.split is not None:
                c, doc, offset = cur.split
            else:
                (c, doc), offset = self._draw(), 0
            starts = self.sources[c][0].starts
            left = int(starts[doc + 1] - starts[doc]) - offset
            take = min(left, n - fill)
            pieces.append(Piece(c, doc, offset, take, ends=take == left))
            cur.split = None if take == left else [c, doc, offset + take]
            fill += take
        cur.rows += 1
        return pieces

    def _row(self, pieces: Sequence[Piece]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The row of ``pieces`` laid end to end: ids, document numbers (0, 1, ... a piece),
        positions (restarting at each piece) and whether each id is a target (the loss mask)."""
        n = sum(p.length for p in pieces)
        ids = np.empty(n, dtype=np.int64)
        docs = np.empty(n, dtype=np.int64)
        pos = np.empty(n, dtype=np.int64)
        train = np.ones(n, dtype=bool)
        fill = 0
        for number, p in enumerate(pieces):
            corpus = self.sources[p.corpus][0]
            begin = int(corpus.starts[p.document]) + p.offset
            ids[fill : fill + p.length] = corpus.ids[begin : begin + p.length]
            if corpus.loss_mask is not None:
                train[fill : fill + p.length] = np.asarray(corpus.loss_mask[begin : begin + p.length]) != 0
            if number and not pieces[number - 1].ends:
                train[fill] = False  # the previous piece's document goes on elsewhere: not its next id
            docs[fill : fill + p.length] = number
            pos[fill : fill + p.length] = np.arange(p.length)
            fill += p.length
        return ids, docs, pos, train

    def next_row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One row of ``seq + 1``: ids, document numbers, positions, and whether each id is a target."""
        return self._row(self._next_pieces())

    def step_rows(self, batch: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """The next global batch's ``batch`` rows (as ``next_row``) in the order the data ranks take
        them; with ``balance``, the step's documents repacked so the ranks' attention work evens out
        (``repack``).  The cursor moves as without ``balance``: the step's documents are the same."""
        rows = [self._next_pieces() for _ in range(batch)]
        if self.balance > 1:
            rows = balanced_rows(rows, self.balance)
        return [self._row(r) for r in rows]

    def next_batch(self, batch: int) -> Batch:
        """The next global batch: ``batch`` rows, tokens / targets / documents / positions [batch, seq]."""
        rows = self.step_rows(batch)
        ids = torch.from_numpy(np.stack([r[0] for r in rows]))
        targets = ids[:, 1:].clone()
        targets[~torch.from_numpy(np.stack([r[3] for r in rows]))[:, 1:]] = IGNORE
        return Batch(tokens=ids[:, :-1].contiguous(), targets=targets,
                     documents=torch.from_numpy(np.stack([r[1] for r in rows]))[:, :-1].contiguous(),
                     positions=torch.from_numpy(np.stack([r[2] for r in rows]))[:, :-1].contiguous())


def corpus_packer(sources: Path | Sequence[tuple[Path, float]], seq: int, seed: int,
                  start: dict[str, Any] | None = None, *, shuffle: bool = True, balance: int = 0) -> Packer:
    """The packer of the corpus at ``sources`` (a token file and its sidecars), or of several
    weighted ones, from the saved cursor ``start`` (a checkpoint's, as ``Cursor.to_dict`` wrote it),
    else from the beginning."""
    listed = [(Path(sources), 1.0)] if isinstance(sources, (str, Path)) else list(sources)
    corpora = [(open_corpus(path), float(weight)) for path, weight in listed]
    cursor = None if start is None else Cursor.from_dict(start, len(corpora))
    return Packer(corpora, seq=seq, seed=seed, start=cursor, shuffle=shuffle, balance=balance)


def row_attention(documents: np.ndarray) -> int:
    """A row's attention work under a document mask, in units of one query-key pair: the sum of its
    documents' squared lengths (``documents`` numbers each token's document, 0, 1, ...)."""
    return int((np.bincount(np.asarray(documents)) ** 2).sum())


def balanced_order(work: list[int], ranks: int) -> list[int]:
    """An order of rows whose ``ranks`` equal consecutive slices (rank r takes the r-th, as
    ``Built._local_batch`` slices) have about equal total ``work``: largest first, each to the
    rank with the least work so far that has room (ties: the lower rank), each rank's rows in
    their packed order.  Only the order changes, so a step trains on the same rows."""
    if len(work) % ranks:
        raise DataError(f"batch {len(work)} does not split over {ranks} data ranks to balance")
    room = len(work) // ranks
    taken: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        r = min((r for r in range(ranks) if len(taken[r]) < room), key=lambda r: (load[r], r))
        taken[r].append(i)
        load[r] += work[i]
    return [i for rows in taken for i in sorted(rows)]


def repack(rows: Sequence[Sequence[Piece]], ranks: int) -> list[list[Piece]]:
    """The pieces of one step's ``rows`` laid into as many rows of the same width so that ``ranks``
    equal consecutive slices of them (rank r takes the r-th, as ``Built._local_batch`` slices) hold
    about equal attention work, the sum of squared piece lengths (see the module's Balance).

    Pieces go longest first (ties: the earlier in the step), each whole to the rank with the least
    work that has a row it fits in, into that rank's first such row.  A piece no row fits whole is
    split: its head fills the first row with room of the least-loaded rank that has one, to the
    row's end, and its rest goes back into the queue as a piece of its own (a new document of the
    row it lands in, as ``next_row`` opens a row with a split document's rest).  A piece whose
    document goes on elsewhere (a split head, a piece the packer cut at a row's end) ends its row
    where it can: its last id is then a target only, as at any row's end; one that cannot (its row
    ends with another) makes the next piece's first id no target (``Packer._row``).  Within a row,
    the pieces that reach their documents' ends come in the step's order, then those that do not."""
    batch = len(rows)
    if batch % ranks:
        raise DataError(f"batch {batch} does not split over {ranks} data ranks to balance")
    per = batch // ranks
    width = sum(p.length for p in rows[0])
    pieces = [p for row in rows for p in row]
    queue = [(-p.length, i, p.offset, p) for i, p in enumerate(pieces)]
    heapq.heapify(queue)
    room = np.full((ranks, per), width, dtype=np.int64)
    open_end = np.zeros((ranks, per), dtype=bool)  # the row ends with a piece whose document goes on
    work = np.zeros(ranks, dtype=np.int64)
    placed: list[list[tuple[int, Piece]]] = [[] for _ in range(batch)]

    def least_work(candidates: np.ndarray) -> int:
        ks = np.flatnonzero(candidates)
        return int(ks[np.argmin(work[ks])])  # argmin takes the first: ties to the lower rank

    while queue:
        _, i, _, p = heapq.heappop(queue)
        free_end = ~open_end  # rows whose end no piece whose document goes on holds yet
        fits = room >= p.length
        if fits.any():
            # A piece whose document goes on: to a row whose end is free where one fits it.
            fits_at_end = fits & free_end
            fits = fits if p.ends or not fits_at_end.any() else fits_at_end
            k = least_work(fits.any(axis=1))
            j = int(np.argmax(fits[k]))
            head = p
        else:
            # Its head ends a row: one whose end is free where one has room.
            some = room > 0
            some_at_end = some & free_end
            some = some if not some_at_end.any() else some_at_end
            k = least_work(some.any(axis=1))
            j = int(np.argmax(some[k]))
            take = int(room[k, j])
            head = p._replace(length=take, ends=False)
            rest = p._replace(offset=p.offset + take, length=p.length - take)
            heapq.heappush(queue, (-rest.length, i, rest.offset, rest))
        placed[k * per + j].append((i, head))
        room[k, j] -= head.length
        open_end[k, j] |= not head.ends
        work[k] += head.length * head.length
    return [[p for _, p in sorted(row, key=lambda t: (not t[1].ends, t[0], t[1].offset))] for row in placed]


def pieces_attention(row: Sequence[Piece]) -> int:
    """``row_attention`` of the row of ``pieces``: its last id is no token, so its last piece counts one id less."""
    return sum(p.length * p.length for p in row) - 2 * row[-1].length + 1


def balanced_rows(rows: Sequence[Sequence[Piece]], ranks: int) -> list[list[Piece]]:
    """One step's rows for ``ranks`` data ranks with their attention work evened out: ``repack``'s
    layout, or where that leaves the busiest rank no less work (a greedy packing is not always the
    best), the rows as packed in ``balanced_order``, which is one layout of the same pieces."""
    per = len(rows) // ranks
    order = balanced_order([pieces_attention(r) for r in rows], ranks)
    reordered = [list(rows[i]) for i in order]
    packed = repack(rows, ranks)

    def busiest(layout: Sequence[Sequence[Piece]]) -> int:
        return max(sum(pieces_attention(r) for r in layout[k * per : (k + 1) * per]) for k in range(ranks))

    return packed if busiest(packed) < busiest(reordered) else reordered


@dataclass(frozen=True)
class Skew:
    """Each data rank's share of the trained tokens (targets not ``IGNORE``) and of the attention
    work (``row_attention``) over some steps (shares sum to 1), and ``excess``: how much longer
    the steps' attention takes waiting for each step's busiest rank than with the work even
    (``sum of per-step maxima / sum of per-step means - 1``; 0.25: 25% longer)."""

    tokens: list[float]
    attention: list[float]
    excess: float


def data_skew(packer: Packer, batch: int, ranks: int, steps: int) -> Skew:
    """The data ranks' shares over the next ``steps`` global batches of ``packer`` (which it
    advances: pass a fresh one for a run's first steps)."""
    if batch % ranks:
        raise DataError(f"batch {batch} does not split over {ranks} data ranks")
    tokens = np.zeros(ranks, dtype=np.float64)
    attention = np.zeros(ranks, dtype=np.float64)
    busiest = 0.0
    for _ in range(steps):
        b = packer.next_batch(batch)
        work = np.zeros(ranks, dtype=np.float64)
        for r, (targets, documents) in enumerate(zip(b.targets.chunk(ranks), b.documents.chunk(ranks))):
            tokens[r] += int((targets != IGNORE).sum())
            work[r] = sum(row_attention(row.numpy()) for row in documents)
        attention += work
        busiest += work.max()
    total = attention.sum()
    return Skew(tokens=(tokens / max(tokens.sum(), 1)).tolist(), attention=(attention / max(total, 1)).tolist(),
                excess=busiest * ranks / max(total, 1) - 1.0)
