"""Bad data (issue 41, "Bad input"): each unusable record is named by file and line (or row) in one
line, or with --skip-bad counted; empty documents are skipped and counted; a Parquet or dataset
column missing or of another type is named with its type; a dataset written by a newer `datasets`
is one line.  Through `meshc` each is an error line and exit 2, never a traceback, and nothing is
left behind."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")

from alice_corpus import ALICE  # noqa: E402

from meshllm_dsl.cli.main import main  # noqa: E402
from meshllm_dsl.runtime.data.prepare import prepare_corpora  # noqa: E402
from meshllm_dsl.runtime.train.tokens import DataError  # noqa: E402

GOOD = json.dumps({"text": ALICE[0]})

# name: (the file's lines as bytes, the error after "FILE:LINE: ")
BAD_LINES = {
    "not JSON": (b'{"text": "unterminated', "not JSON (Unterminated string"),
    "no field": (json.dumps({"body": "x", "id": 3}).encode(), "no field `text` (fields: body, id)"),
    "a number": (json.dumps({"text": 12}).encode(), "field `text` is a number, expected a string"),
    "null": (json.dumps({"text": None}).encode(), "field `text` is null, expected a string"),
    "an array": (b"[1, 2]", "a JSON list, expected an object with a `text` field"),
    "not UTF-8": ('{"text": "caf\u00e9"}'.encode("latin-1"), "not UTF-8 (byte 13 of the line)"),
    "a bad message": (json.dumps({"text": [{"role": "user"}]}).encode(),
                      "field `text` item 0 is an object with fields role, expected a chat message"),
}


def _meshc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _write(path: Path, bad: bytes) -> Path:
    # Line 1 good, line 2 blank (no record), line 3 bad, line 4 an empty document, line 5 good.
    empty = json.dumps({"text": "  "}).encode()
    path.write_bytes(b"\n".join([GOOD.encode(), b"", bad, empty, GOOD.encode()]) + b"\n")
    return path


@pytest.mark.parametrize("name", BAD_LINES)
def test_a_bad_line_is_named_or_skipped_and_counted(name: str, tmp_path: Path, tok_dir: Path) -> None:
    bad, why = BAD_LINES[name]
    src = _write(tmp_path / "d.jsonl", bad)
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as info:
        prepare_corpora(str(src), tok_dir, cache, workers=1, log=lambda _: None)
    assert str(info.value).startswith(f"{src}:3: {why}"), str(info.value)
    assert "--skip-bad" in str(info.value)
    assert not cache.exists() or not list(cache.iterdir())  # nothing half-written is left
    # Through meshc: the line and exit 2, no traceback, no output file.
    out = tmp_path / "d.tokens"
    code, _, err = _meshc("tokenize", str(src), "--tokenizer", str(tok_dir), "-o", str(out), "--workers", "1")
    assert code == 2 and err.startswith(f"meshc: error: {src}:3: {why}") and "Traceback" not in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p != cache) == ["d.jsonl", "tok"]
    # --skip-bad: the two good documents, the bad and the empty one counted.
    lines: list[str] = []
    [(corpus, _)] = prepare_corpora(str(src), tok_dir, cache, skip_bad=True, workers=1, log=lines.append)
    assert corpus.documents == 2
    assert lines[-1].startswith(f"{src}: skipped 1 bad and 1 empty records; first: {src}:3: {why}")
    code, _, err = _meshc("tokenize", str(src), "--tokenizer", str(tok_dir), "-o", str(out), "--skip-bad")
    assert code == 0 and f"skipped 1 bad and 1 empty records (first: {src}:3: {why}" in err
    assert "in 2 documents" in err


def test_a_parquet_column_missing_or_of_another_type(tmp_path: Path, tok_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), path)
    with pytest.raises(DataError, match=r"t\.parquet: no column `text` \(columns: body, n\)"):
        prepare_corpora(str(path), tok_dir, tmp_path / "cache", workers=1)
    code, _, err = _meshc("tokenize", str(path), "--tokenizer", str(tok_dir), "-o", str(tmp_path / "o"),
                          "--text-field", "n")
    assert code == 2 and err == f"meshc: error: --data {path}: column `n` is int64, expected a string (or a " \
        "chat: a list of {role: string, content: string}); --text-field names the column\n"
    pq.write_table(pa.table({"text": ["a", None, "b"]}), path)
    with pytest.raises(DataError, match=r"t\.parquet:row 1: column `text` is null"):
        prepare_corpora(str(path), tok_dir, tmp_path / "cache", workers=1)
    (tmp_path / "not.parquet").write_text("hello")
    with pytest.raises(DataError, match="not a Parquet file"):
        prepare_corpora(str(tmp_path / "not.parquet"), tok_dir, tmp_path / "cache", workers=1)


def test_a_dataset_from_a_newer_datasets_or_without_the_column(tmp_path: Path, tok_dir: Path) -> None:
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ALICE, "n": list(range(len(ALICE)))}).save_to_disk(str(path))
    with pytest.raises(DataError, match=r"ds: no column `body` \(columns: text, n\)"):
        prepare_corpora(str(path), tok_dir, tmp_path / "cache", text_field="body", workers=1)
    with pytest.raises(DataError, match=r"ds: column `n` is int64"):
        prepare_corpora(str(path), tok_dir, tmp_path / "cache", text_field="n", workers=1)
    # A feature type this `datasets` does not know, as a newer one writes (List in 4.0 was one).
    info = json.loads((path / "dataset_info.json").read_text())
    info["features"]["text"]["_type"] = "Utf8View"
    (path / "dataset_info.json").write_text(json.dumps(info))
    code, _, err = _meshc("data-stats", str(path), "--tokenizer", str(tok_dir))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"meshc: error: --data {path}: written by a newer `datasets` than the installed "
                          f"{datasets.__version__} (Feature type 'Utf8View' not found)")
    # A DatasetDict directory: name a split.
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a `datasets` DatasetDict \(splits: train\); name one split's directory, e.g. .*dd/train"):
        prepare_corpora(str(tmp_path / "dd"), tok_dir, tmp_path / "cache", workers=1)
    [(corpus, _)] = prepare_corpora(str(tmp_path / "dd" / "train"), tok_dir, tmp_path / "cache", workers=1,
                                    log=lambda _: None)
    assert corpus.documents == 1


def test_a_chat_without_a_chat_template(tmp_path: Path) -> None:
    from alice_corpus import build_tokenizer

    plain = build_tokenizer(tmp_path / "plain", template=None)
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"c\.jsonl:1: a chat .* no chat_template in its tokenizer_config.json"):
        prepare_corpora(str(src), plain, tmp_path / "cache", text_field="messages", workers=1)


def test_outputs_are_never_inputs(tmp_path: Path, tok_dir: Path) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text(GOOD + "\n")
    before = src.read_bytes()
    code, _, err = _meshc("tokenize", str(src), "--tokenizer", str(tok_dir), "-o", str(src), "--force")
    assert code == 2 and "is one of the inputs" in err and src.read_bytes() == before
    code, _, err = _meshc("tokenize", str(src), "-o", str(tmp_path / "x.tokens"))
    assert code == 2 and "pass --tokenizer DIR" in err


def test_a_text_file_not_utf8_is_named_by_line(tmp_path: Path, tok_dir: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"Down, down, down.\n\ncaf\xe9 au lait\n")
    with pytest.raises(DataError, match=r"t\.txt:3: not UTF-8 text \(byte 3 of the line\)"):
        prepare_corpora(str(path), tok_dir, tmp_path / "cache", workers=1)
