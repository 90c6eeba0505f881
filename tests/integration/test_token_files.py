"""Token files: `meshc tokenize` writes them, every rank memory-maps them and reads only its windows.

The ids in the file are exactly the tokenizer's (documents joined with the end-of-text id), a
training batch is a window of them (no byte-mod-vocab wrapping), and a file written for a larger
vocabulary than the model's is refused before any step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from hf_models import word_tokenizer  # noqa: E402
from processes import run_module  # noqa: E402

from meshllm_dsl.cli.main import main  # noqa: E402
from meshllm_dsl.runtime.train import launch  # noqa: E402
from meshllm_dsl.runtime.train.tokens import (  # noqa: E402
    DataError,
    Tokenizer,
    check_token_ids,
    open_token_file,
    token_file_vocab,
)

WORDS = "the cat sat on a mat and then it ran far away from home to see big red dog".split()

SPEC = """
mesh one { axes data = 1 }
model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }
plan train on one for m {
    batch = 2
    seq = 8
}
"""


def _tokenizer(directory: Path) -> Tokenizer:
    word_tokenizer(directory, WORDS)
    return Tokenizer(directory)


def _text(n_docs: int = 40) -> str:
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 30)))) for _ in range(n_docs)]
    # Lines wrapped inside documents, and more than one blank line between some of them.
    return "\n\n\n".join(d[:20] + "\n" + d[20:] for d in docs) + "\n"


def _meshc(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


def test_tokenize_writes_the_tokenizers_ids_and_ranks_read_windows_of_them(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path / "tok")
    text = _text()
    (tmp_path / "corpus.txt").write_text(text)
    out = tmp_path / "corpus.tokens"
    code, err = _meshc("tokenize", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tok"), "-o", str(out))
    assert code == 0, err
    want = tok.corpus(text).tolist()
    assert f"{len(want):,} tokens" in err
    assert token_file_vocab(out) == tok.vocab
    ids = open_token_file(out)
    assert ids.dtype == np.dtype("<u2") and ids.tolist() == want
    assert want.count(tok.eos) == 40  # one end-of-text per document
    # open_data memory-maps it; a batch is windows of the ids themselves.
    data = launch.open_data(out)
    assert isinstance(data, np.memmap)
    tokens, targets = launch.text_batch(data, 64, 3, 8, seed=5, step=2)
    flat = np.asarray(data).tolist()
    for row, nxt in zip(tokens.tolist(), targets.tolist()):
        starts = [i for i in range(len(flat) - 8) if flat[i : i + 8] == row]
        assert starts and any(flat[s + 1 : s + 9] == nxt for s in starts)


def test_tokenize_refuses_what_it_should(tmp_path: Path) -> None:
    _tokenizer(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text(_text(3))
    out = tmp_path / "mine.tokens"
    out.write_bytes(b"keep")
    code, err = _meshc("tokenize", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tok"), "-o", str(out))
    assert code == 2 and "exists" in err and out.read_bytes() == b"keep"
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    code, err = _meshc("tokenize", str(tmp_path / "latin1.txt"), "--tokenizer", str(tmp_path / "tok"),
                       "-o", str(tmp_path / "x.tokens"))
    assert code == 2 and "not UTF-8" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "latin1.txt", "mine.tokens", "tok"]


def test_a_token_file_for_a_larger_vocabulary_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.tokens"
    big.write_bytes(b"MESHTOK1" + np.array([4, 100_000], dtype="<u4").tobytes() + np.zeros(64, "<u4").tobytes())
    with pytest.raises(DataError, match="vocabulary of 100000, the model has 64"):
        check_token_ids(big, 64)
    check_token_ids(big, 100_000)
    model = {"layers": [{"kind": "embedding", "num": 64, "dim": 8}]}
    with pytest.raises(launch.InputError, match="vocabulary of 100000, the model has 64"):
        launch.check_inputs(launch.parse_args(["--data", str(big)]), model)


def test_meshc_run_trains_on_a_token_file(tmp_path: Path) -> None:
    _tokenizer(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text(_text())
    out = tmp_path / "corpus.tokens"
    assert _meshc("tokenize", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tok"), "-o", str(out))[0] == 0
    spec = tmp_path / "one.mesh"
    spec.write_text(SPEC)
    proc = run_module("meshllm_dsl", "run", str(spec), "--data", str(out), "--steps", "3", timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 3/3" in proc.stderr and "done: loss" in proc.stderr
