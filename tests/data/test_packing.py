"""The packer: rows of ``seq + 1`` ids from a seeded order of documents, the documents / positions /
targets a step takes, and a cursor that resumes the order exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm_dsl.runtime.data.corpus import IGNORE, open_corpus, write_sidecars
from meshllm_dsl.runtime.data.packing import (
    Cursor,
    Packer,
    balanced_order,
    data_skew,
    row_attention,
)
from meshllm_dsl.runtime.train.tokens import TOKEN_MAGIC, DataError

EOS = 0
VOCAB = 1000


def write_corpus(path: Path, docs: list[list[int]], masks: list[list[int]] | None = None) -> Path:
    """A token file of ``docs`` (each followed by EOS) with its document index (and loss mask)."""
    ids = [i for d in docs for i in [*d, EOS]]
    with open(path, "wb") as f:
        f.write(TOKEN_MAGIC + np.array([2, VOCAB], dtype="<u4").tobytes())
        np.asarray(ids, dtype="<u2").tofile(f)
    starts = np.cumsum([0] + [len(d) + 1 for d in docs])
    mask = None if masks is None else np.array([m for d, ms in zip(docs, masks) for m in [*ms, 1]])
    write_sidecars(path, starts, mask)
    return path


def _docs(draw_lengths: list[int], base: int = 1) -> list[list[int]]:
    """Documents of the given lengths whose ids say (document, position) apart from each other."""
    out, nxt = [], base
    for n in draw_lengths:
        out.append([(nxt + k) % (VOCAB - 1) + 1 for k in range(n)])
        nxt += n
    return out


class Spy(Packer):
    """A packer that records the (corpus, document) order it draws."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.drawn_order: list[tuple[int, int]] = []

    def _draw(self) -> tuple[int, int]:
        got = super()._draw()
        self.drawn_order.append(got)
        return got


lengths = st.lists(st.integers(0, 12), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths, seq=st.integers(1, 16), batch=st.integers(1, 3), steps=st.integers(1, 5),
       seed=st.integers(0, 2**31))
def test_rows_are_the_drawn_documents_in_order_with_consistent_documents_and_positions(
    tmp_path_factory: pytest.TempPathFactory, lengths: list[int], seq: int, batch: int, steps: int, seed: int
) -> None:
    docs = _docs(lengths)
    corpus = open_corpus(write_corpus(tmp_path_factory.mktemp("c") / "c.tok", docs))
    packer = Spy([(corpus, 1.0)], seq=seq, seed=seed)
    got = [packer.next_batch(batch) for _ in range(steps)]
    for b in got:
        assert b.tokens.shape == b.targets.shape == b.documents.shape == b.positions.shape == (batch, seq)
        assert b.tokens.dtype == b.targets.dtype == torch.int64
    # Every id of the drawn documents once, in order: the rows (tokens plus the last target) are
    # the stream of the drawn documents cut every seq + 1 ids, the last document possibly cut short.
    rows = torch.cat([torch.cat([b.tokens, b.targets[:, -1:]], dim=1) for b in got]).reshape(-1).tolist()
    stream = [i for c, d in packer.drawn_order for i in corpus.document(d).tolist()]
    assert len(stream) - len(corpus.document(packer.drawn_order[-1][1])) < len(rows) <= len(stream)
    assert rows == stream[: len(rows)]
    # Each epoch draws every document once.
    order = [d for _, d in packer.drawn_order]
    n = corpus.documents
    for e in range(len(order) // n):
        assert sorted(order[e * n : (e + 1) * n]) == list(range(n))
    for b in got:
        assert torch.equal(b.targets[:, :-1], b.tokens[:, 1:])  # no loss mask: every target trains
        for r in range(batch):
            docs_r, pos_r, tok_r = b.documents[r].tolist(), b.positions[r].tolist(), b.tokens[r].tolist()
            assert docs_r[0] == 0 and pos_r[0] == 0
            for j in range(1, seq):
                if docs_r[j] == docs_r[j - 1]:
                    assert pos_r[j] == pos_r[j - 1] + 1
                else:  # a new document starts only after the previous one's EOS, at position 0
                    assert docs_r[j] == docs_r[j - 1] + 1 and pos_r[j] == 0 and tok_r[j - 1] == EOS
            # An EOS inside a row ends its document: the next id (if in the row) starts another.
            for j in range(seq - 1):
                if tok_r[j] == EOS:
                    assert docs_r[j + 1] == docs_r[j] + 1


def test_a_split_documents_rest_opens_the_next_row_as_its_document_0_at_position_0(tmp_path: Path) -> None:
    corpus = open_corpus(write_corpus(tmp_path / "c.tok", [list(range(1, 12))]))  # 12 ids with EOS
    packer = Packer([(corpus, 1.0)], seq=4, seed=0)
    b = packer.next_batch(3)
    assert b.tokens.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9], [11, 0, 1, 2]]
    assert b.targets.tolist() == [[2, 3, 4, 5], [7, 8, 9, 10], [0, 1, 2, 3]]
    assert b.documents.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1]]
    assert b.positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 1]]
    assert packer.cursor.epochs == [2] and packer.cursor.split == [0, 0, 3] and packer.cursor.rows == 3


def test_loss_mask_makes_its_targets_ignored_and_nothing_else(tmp_path: Path) -> None:
    docs = [[5, 6, 7], [8, 9]]
    masks = [[0, 0, 1], [1, 0]]  # per id; each EOS trains
    corpus = open_corpus(write_corpus(tmp_path / "c.tok", docs, masks))
    packer = Spy([(corpus, 1.0)], seq=15, seed=3)
    b = packer.next_batch(1)
    stream = [i for _, d in packer.drawn_order for i in corpus.document(d).tolist()]
    train = [m for _, d in packer.drawn_order
             for m in np.asarray(corpus.loss_mask[corpus.starts[d] : corpus.starts[d + 1]]).tolist()]
    want = [t if m else IGNORE for t, m in zip(stream[1:16], train[1:16])]
    assert b.targets[0].tolist() == want
    assert IGNORE in want and b.tokens[0].tolist() == stream[:15]


def test_the_same_seed_packs_the_same_batches_and_another_seed_others(tmp_path: Path) -> None:
    corpus = open_corpus(write_corpus(tmp_path / "c.tok", _docs([3, 9, 1, 14, 6, 2, 8, 5])))

    def batches(seed: int) -> list[torch.Tensor]:
        p = Packer([(corpus, 1.0)], seq=8, seed=seed)
        return [p.next_batch(2).tokens for _ in range(6)]

    assert all(torch.equal(a, b) for a, b in zip(batches(1), batches(1)))
    assert not all(torch.equal(a, b) for a, b in zip(batches(1), batches(2)))


def test_epochs_are_shuffled_differently(tmp_path: Path) -> None:
    corpus = open_corpus(write_corpus(tmp_path / "c.tok", _docs([2] * 12)))
    packer = Packer([(corpus, 1.0)], seq=8, seed=0)
    assert sorted(packer.order(0, 0).tolist()) == sorted(packer.order(0, 1).tolist()) == list(range(12))
    assert packer.order(0, 0).tolist() != packer.order(0, 1).tolist()


@settings(max_examples=25, deadline=None)
@given(stop=st.integers(0, 6), more=st.integers(1, 4), seq=st.integers(2, 12), seed=st.integers(0, 99),
       weights=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=3), balance=st.sampled_from([0, 2]))
def test_a_cursor_through_json_resumes_the_exact_batches(
    tmp_path_factory: pytest.TempPathFactory, stop: int, more: int, seq: int, seed: int, weights: list[float],
    balance: int
) -> None:
    tmp = tmp_path_factory.mktemp("c")
    sources = [(open_corpus(write_corpus(tmp / f"c{i}.tok", _docs([1 + (7 * k + i) % 11 for k in range(5 + i)], 100 * i))), w)
               for i, w in enumerate(weights)]
    straight = Packer(sources, seq=seq, seed=seed, balance=balance)
    want = [straight.next_batch(2) for _ in range(stop + more)]
    first = Packer(sources, seq=seq, seed=seed, balance=balance)
    for _ in range(stop):
        first.next_batch(2)
    saved = json.loads(json.dumps(first.cursor.to_dict()))
    resumed = Packer(sources, seq=seq, seed=seed, start=Cursor.from_dict(saved, len(sources)), balance=balance)
    for w in want[stop:]:
        got = resumed.next_batch(2)
        for name in ("tokens", "targets", "documents", "positions"):
            assert torch.equal(getattr(got, name), getattr(w, name)), name


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_data_rank_packs_the_same_global_batch_and_takes_its_rows(tmp_path: Path, dp: int) -> None:
    """No rank-dependent state: packers built on dp ranks agree, and their rows (as
    ``Built._local_batch`` slices them) make up the single-rank global batch of every step."""
    corpus = open_corpus(write_corpus(tmp_path / "c.tok", _docs([3, 17, 5, 2, 9, 30, 4, 1, 6, 11])))
    single = Packer([(corpus, 1.0)], seq=8, seed=4)
    ranks = [Packer([(corpus, 1.0)], seq=8, seed=4) for _ in range(dp)]
    for _ in range(5):
        want = single.next_batch(4)
        parts = [p.next_batch(4).tokens.chunk(dp, dim=0)[r] for r, p in enumerate(ranks)]
        assert torch.equal(torch.cat(parts), want.tokens)


def test_weights_are_shares_of_tokens(tmp_path: Path) -> None:
    short = open_corpus(write_corpus(tmp_path / "a.tok", _docs([3] * 50)))  # 4 ids a document
    long = open_corpus(write_corpus(tmp_path / "b.tok", _docs([39] * 10, 500)))  # 40 ids a document
    packer = Spy([(short, 3.0), (long, 1.0)], seq=63, seed=0)
    for _ in range(40):
        packer.next_batch(4)
    drawn = packer.cursor.drawn
    assert abs(drawn[0] / sum(drawn) - 0.75) < 40 / sum(drawn)  # within one long document
    assert packer.cursor.epochs[0] > packer.cursor.epochs[1] > 0  # each corpus its own epochs


def test_bad_sources_are_refused(tmp_path: Path) -> None:
    corpus = open_corpus(write_corpus(tmp_path / "c.tok", _docs([3])))
    with pytest.raises(DataError, match="weight 0.0"):
        Packer([(corpus, 0.0)], seq=4, seed=0)
    with pytest.raises(DataError, match="for 1 corpora, --data has 2"):
        Cursor.from_dict(Cursor.start(1).to_dict(), 2)
    with pytest.raises(DataError, match="malformed"):
        Cursor.from_dict({"epochs": [0]}, 1)


def _skewed(tmp_path: Path) -> Path:
    """A corpus whose documents are mostly short with a few as long as a row: rows of very
    different attention work."""
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in np.where(rng.random(200) < 0.1, 63, rng.integers(1, 6, size=200))]
    return write_corpus(tmp_path / "skewed.tok", _docs(lengths))


def test_data_skew_reports_each_ranks_share_of_tokens_and_of_attention(tmp_path: Path) -> None:
    corpus = open_corpus(_skewed(tmp_path))
    skew = data_skew(Packer([(corpus, 1.0)], seq=64, seed=0), batch=8, ranks=4, steps=10)
    assert len(skew.tokens) == len(skew.attention) == 4
    assert sum(skew.tokens) == pytest.approx(1) and sum(skew.attention) == pytest.approx(1)
    assert skew.tokens == [0.25] * 4  # no loss mask: every rank trains seq tokens a row
    # Measured by hand from the same batches: rank r's rows are r * 2, r * 2 + 1 of each step.
    packer = Packer([(corpus, 1.0)], seq=64, seed=0)
    work = np.zeros((10, 4))
    for step in range(10):
        docs = packer.next_batch(8).documents
        for i in range(8):
            work[step, i // 2] += (torch.bincount(docs[i]) ** 2).sum().item()
    assert skew.attention == pytest.approx((work.sum(0) / work.sum()).tolist())
    assert skew.excess == pytest.approx(work.max(1).sum() / work.mean(1).sum() - 1)
    assert skew.excess > 0.2  # rows of one long document against rows of many short ones


def _busiest(rows: list[tuple[np.ndarray, ...]], ranks: int) -> int:
    """The busiest of ``ranks`` equal consecutive slices of ``rows`` (as Built._local_batch slices):
    its attention work over the rows' tokens (all ids but each row's last)."""
    per = len(rows) // ranks
    return max(sum(row_attention(r[1][:-1]) for r in rows[k * per : (k + 1) * per]) for k in range(ranks))


def _reordered_busiest(rows: list[tuple[np.ndarray, ...]], ranks: int) -> int:
    """The busiest rank's work with the rows as packed only reordered among the ranks."""
    return _busiest([rows[i] for i in balanced_order([row_attention(r[1][:-1]) for r in rows], ranks)], ranks)


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=14), seq=st.integers(1, 24),
       ranks=st.integers(2, 4), per=st.integers(1, 3), steps=st.integers(1, 4), seed=st.integers(0, 2**31),
       masked=st.booleans())
def test_balance_repacks_each_steps_documents_without_changing_them(
    tmp_path_factory: pytest.TempPathFactory, lengths: list[int], seq: int, ranks: int, per: int, steps: int,
    seed: int, masked: bool
) -> None:
    """With and without ``balance`` a step takes the same ids of the same documents (the ids name
    (document, position): ``_docs``), the cursor moves alike, and the busiest rank's attention work
    is no more than with the rows as packed only reordered among the ranks.  Each row is pieces of
    documents, numbered 0, 1, ..., positions restarting at each; each id keeps its loss mask, and
    the id after a piece whose document goes on elsewhere (no end-of-text: cut short) is no target."""
    docs = _docs(lengths)
    masks = [[(7 * k + len(d)) % 3 != 0 for k in range(len(d))] for d in docs] if masked else None
    corpus = open_corpus(write_corpus(tmp_path_factory.mktemp("c") / "c.tok", docs, masks))
    mask_of = {i: m for d, ms in zip(docs, masks or [[1] * len(d) for d in docs]) for i, m in zip([*d, EOS], [*ms, 1])}
    batch = ranks * per
    plain = Packer([(corpus, 1.0)], seq=seq, seed=seed)
    balanced = Packer([(corpus, 1.0)], seq=seq, seed=seed, balance=ranks)
    for _ in range(steps):
        a, b = plain.step_rows(batch), balanced.step_rows(batch)
        assert plain.cursor == balanced.cursor
        assert sorted(np.concatenate([r[0] for r in a]).tolist()) == sorted(np.concatenate([r[0] for r in b]).tolist())
        assert _busiest(b, ranks) <= _reordered_busiest(a, ranks)
        for ids, documents, positions, train in b:
            assert len(ids) == seq + 1 and documents[0] == 0 and positions[0] == 0
            for j in range(1, seq + 1):
                if documents[j] == documents[j - 1]:  # one document's next id, the position after
                    assert positions[j] == positions[j - 1] + 1 and ids[j - 1] != EOS
                    assert ids[j] in (ids[j - 1] % (VOCAB - 1) + 1, EOS)
                else:  # the next piece: numbered next, at position 0
                    assert documents[j] == documents[j - 1] + 1 and positions[j] == 0
                cut = documents[j] != documents[j - 1] and ids[j - 1] != EOS
                assert train[j] == (bool(mask_of[int(ids[j])]) and not cut)


@pytest.mark.parametrize(("ranks", "reordered", "repacked"), [(2, 0.029, 0.015), (4, 0.131, 0.087)])
def test_balance_evens_the_skewed_corpus_more_than_reordering_its_rows(
    tmp_path: Path, ranks: int, reordered: float, repacked: float
) -> None:
    """The figures of the module's Balance paragraph: mostly 1 - 5-id documents, one in ten as long
    as a row, seq 64, batch 8, the first 50 steps."""
    corpus = open_corpus(_skewed(tmp_path))
    plain = data_skew(Packer([(corpus, 1.0)], seq=64, seed=0), batch=8, ranks=ranks, steps=50)
    after = data_skew(Packer([(corpus, 1.0)], seq=64, seed=0, balance=ranks), batch=8, ranks=ranks, steps=50)
    packer, busiest, mean = Packer([(corpus, 1.0)], seq=64, seed=0), 0, 0.0
    trained = 0
    balanced = Packer([(corpus, 1.0)], seq=64, seed=0, balance=ranks)
    for _ in range(50):
        rows = packer.step_rows(8)
        busiest += _reordered_busiest(rows, ranks)
        mean += sum(row_attention(r[1][:-1]) for r in rows) / ranks
        trained += sum(int(r[3][1:].sum()) for r in balanced.step_rows(8))
    assert plain.excess > 0.13
    assert busiest / mean - 1 == pytest.approx(reordered, abs=5e-4)
    assert after.excess == pytest.approx(repacked, abs=5e-4)
    # No loss mask: every target trains but the first id after a piece cut short mid-row.
    assert 0.995 * 50 * 8 * 64 < trained < 50 * 8 * 64


def test_balanced_order_gives_each_rank_its_rows_largest_first() -> None:
    assert balanced_order([9, 1, 1, 9], 2) == [0, 1, 2, 3]  # 9 + 1 each: already even
    assert balanced_order([9, 9, 1, 1], 2) == [0, 2, 1, 3]
    assert balanced_order([5, 4, 3, 3, 2, 1], 3) == [0, 5, 1, 4, 2, 3]
    with pytest.raises(DataError, match="does not split over 4"):
        balanced_order([1, 2, 3], 4)
