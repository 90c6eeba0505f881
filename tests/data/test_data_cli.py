"""`meshc tokenize` and `meshc data-stats` over every kind of source: the token file and its sidecars
are the corpus prepare_corpora writes, and data-stats counts documents, tokens, skipped records and
document lengths in power-of-two buckets (a token file with its sidecars without a tokenizer)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from alice_corpus import ALICE  # noqa: E402

from meshllm_dsl.cli.main import main  # noqa: E402
from meshllm_dsl.runtime.data.corpus import docs_path, loss_mask_path, open_corpus  # noqa: E402
from meshllm_dsl.runtime.data.prepare import length_histogram  # noqa: E402
from meshllm_dsl.runtime.train.tokens import Tokenizer  # noqa: E402


def _meshc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _histogram_lines(out: str) -> dict[str, int]:
    rows = out.split("documents\n", 1)[1].splitlines()
    return {r.split()[0]: int(r.split()[1].replace(",", "")) for r in rows}


def test_data_stats_counts_and_buckets(tmp_path: Path, tok_dir: Path) -> None:
    docs = ALICE + ["Down.", "  "]
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + "not json\n")
    lengths = [len(Tokenizer(tok_dir).documents([d])) for d in docs[:-1]]
    code, out, err = _meshc("data-stats", str(src), "--tokenizer", str(tok_dir), "--skip-bad", "--workers", "2")
    assert code == 0, err
    assert f"documents  {len(lengths)}\n" in out and f"tokens     {sum(lengths):,}\n" in out
    assert f"skipped    1 bad, 1 empty; first: {src}:{len(docs) + 1}: not JSON" in out
    want = {f"{2 ** k:,}..{2 ** (k + 1) - 1:,}": n for k, n in length_histogram(np.array(lengths)).items()}
    got = _histogram_lines(out)
    assert {k: v for k, v in got.items() if v} == want and sum(got.values()) == len(lengths)
    assert all(2 ** k <= n < 2 ** (k + 1) for k, n in ((int(np.log2(n)), n) for n in lengths))
    # The token file `meshc tokenize` writes reads back the same numbers without a tokenizer.
    out_file = tmp_path / "a.tokens"
    code, _, err = _meshc("tokenize", str(src), "--tokenizer", str(tok_dir), "-o", str(out_file), "--skip-bad")
    assert code == 0 and f"{sum(lengths):,} tokens in {len(lengths)} documents" in err
    assert docs_path(out_file).is_file() and not loss_mask_path(out_file).exists()
    code, out2, _ = _meshc("data-stats", str(out_file))
    assert code == 0 and out2.split("documents  ")[1].split("skipped")[0] == out.split("documents  ")[1].split("skipped")[0]
    assert _histogram_lines(out2) == got


def test_tokenize_writes_a_chat_corpus_and_several_sources(tmp_path: Path, tok_dir: Path) -> None:
    chat = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "The White Rabbit."}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    (tmp_path / "t.txt").write_text("\n\n".join(ALICE[:2]) + "\n")
    out = tmp_path / "mix.tokens"
    code, _, err = _meshc("tokenize", str(tmp_path / "c.jsonl"), str(tmp_path / "t.txt"), "--tokenizer",
                          str(tok_dir), "-o", str(out), "--text-field", "messages")
    assert code == 0, err
    corpus = open_corpus(out)
    assert corpus.documents == 3 and corpus.loss_mask is not None
    chat_len = corpus.lengths()[0]
    assert 0 < int(corpus.loss_mask[:chat_len].sum()) < chat_len  # the user's turn is context only
    assert np.asarray(corpus.loss_mask[chat_len:]).all()  # text documents train on every id
    assert f"loss on {int(np.asarray(corpus.loss_mask).sum()):,}" in err
    # A token file passes through tokenize (with its sidecars), with no tokenizer needed.
    again = tmp_path / "again.tokens"
    code, _, err = _meshc("tokenize", str(out), "-o", str(again))
    assert code == 0, err
    for f in (lambda p: p, docs_path, loss_mask_path):
        assert f(again).read_bytes() == f(out).read_bytes()
    # A token file joins other sources only under the tokenizer of its vocabulary.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    other = tmp_path / "other"
    other.mkdir()
    HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(other / "tokenizer.json"))
    code, _, err = _meshc("tokenize", str(out), str(tmp_path / "t.txt"), "--tokenizer", str(other), "-o",
                          str(tmp_path / "x.tokens"))
    assert code == 2 and f"{out} was tokenized for a vocabulary of {corpus.vocab:,}" in err
    code, stats, _ = _meshc("data-stats", str(out))
    assert code == 0 and f"(loss on {int(np.asarray(corpus.loss_mask).sum()):,})" in stats


def test_workers_is_a_positive_number(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("x\n")
    for bad in ("0", "-1", "two"):
        code, _, err = _meshc("data-stats", str(tmp_path / "t.txt"), "--workers", bad)
        assert code == 2 and "expected a number of processes, 1 or more" in err
