"""Data sources tokenized into corpora (issue 41 item 1): every kind of source round-trips, the
corpus is the same bytes for 1 and N tokenizing processes, a second call reads the cache, a chat's
loss mask covers only the assistant's tokens, and the data spec's weights parse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")

from alice_corpus import ALICE, decode  # noqa: E402

from meshllm_dsl.runtime.data import prepare  # noqa: E402
from meshllm_dsl.runtime.data.corpus import docs_path, loss_mask_path, open_corpus  # noqa: E402
from meshllm_dsl.runtime.data.prepare import prepare_corpora  # noqa: E402
from meshllm_dsl.runtime.data.sources import open_source, parse_data_spec  # noqa: E402
from meshllm_dsl.runtime.train.tokens import DataError, Tokenizer  # noqa: E402

EOS = "<|endoftext|>"

CHATS = [
    [{"role": "user", "content": "Who ran close by Alice?"},
     {"role": "assistant", "content": "A White Rabbit with pink eyes."}],
    [{"role": "system", "content": "Answer from the book."},
     {"role": "user", "content": "What did the Rabbit say?"},
     {"role": "assistant", "content": "Oh dear! Oh dear! I shall be late!"},
     {"role": "user", "content": "And then?"},
     {"role": "assistant", "content": "Down went Alice after it."}],
]


def _documents(corpus_path: Path, tok_dir: Path) -> list[str]:
    """Each document of a corpus decoded, its end-of-text id checked and dropped."""
    c = open_corpus(corpus_path)
    out = []
    for i in range(c.documents):
        text = decode(tok_dir, c.document(i))
        assert text.endswith(EOS)
        out.append(text[: -len(EOS)])
    return out


def _jsonl(path: Path, docs: list[object], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": n}) + "\n" for n, d in enumerate(docs)))
    return path


def _parquet(path: Path, column: object) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": column, "n": list(range(len(column)))}), path)  # type: ignore[arg-type]
    return path


def _dataset(path: Path, column: list[object], name: str = "text") -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({name: column}).save_to_disk(str(path))
    return path


def _prepare(spec: object, tok_dir: Path | None, cache: Path, **kw: object) -> list[tuple[object, float]]:
    lines: list[str] = []
    out = prepare_corpora(spec, tok_dir, cache, workers=1, log=lines.append, **kw)  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


def test_weights_parse() -> None:
    assert parse_data_spec("a.jsonl:0.7,b.parquet:0.3") == [(Path("a.jsonl"), 0.7), (Path("b.parquet"), 0.3)]
    assert parse_data_spec("corpus.txt") == [(Path("corpus.txt"), 1.0)]
    assert parse_data_spec("x.jsonl, y.jsonl:2") == [(Path("x.jsonl"), 1.0), (Path("y.jsonl"), 2.0)]
    assert parse_data_spec("dir/a:b.txt") == [(Path("dir/a:b.txt"), 1.0)]  # a ':' that is no weight
    for bad, what in (("a.jsonl:0", "weight 0"), ("a.jsonl:-1", "weight -1"), ("a.jsonl:nan", "weight nan"),
                      ("a.jsonl,,b.jsonl", "item 2 is empty")):
        with pytest.raises(DataError, match=what):
            parse_data_spec(bad)


def test_every_kind_of_source_round_trips(tmp_path: Path, tok_dir: Path) -> None:
    """JSONL (a file and a directory), Parquet, a saved dataset and a text file decode back to their
    documents; a token file passes through as it is."""
    (tmp_path / "shards").mkdir()
    _jsonl(tmp_path / "shards" / "00.jsonl", ALICE[:4])
    _jsonl(tmp_path / "shards" / "01.jsonl", ALICE[4:])
    (tmp_path / "alice.txt").write_text("\n\n".join(ALICE) + "\n")
    sources = {
        "jsonl": _jsonl(tmp_path / "alice.jsonl", ALICE),
        "jsonl directory": tmp_path / "shards",
        "parquet": _parquet(tmp_path / "alice.parquet", ALICE),
        "datasets": _dataset(tmp_path / "alice_ds", ALICE),
        "text": tmp_path / "alice.txt",
    }
    cache = tmp_path / "cache"
    for name, path in sources.items():
        [(corpus, weight)] = _prepare(str(path), tok_dir, cache)
        assert weight == 1.0
        assert _documents(corpus.path, tok_dir) == ALICE, name
        assert corpus.loss_mask is None and corpus.path.parent == cache, name
        # The ids are exactly the tokenizer's, each document followed by the end-of-text id.
        tok = Tokenizer(tok_dir)
        assert np.asarray(corpus.ids).tolist() == tok.documents(ALICE), name
    token_file = corpus.path
    [(passed, _)] = _prepare(str(token_file), None, tmp_path / "unused")
    assert passed.path == token_file and not (tmp_path / "unused").exists()


def test_the_corpus_is_the_same_bytes_for_one_and_many_processes(tmp_path: Path, tok_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    docs: list[object] = [" ".join(rng.choice(ALICE, size=int(rng.integers(1, 4)))) for _ in range(120)]
    docs[7::11] = CHATS * (len(docs[7::11]) // 2) + CHATS[: len(docs[7::11]) % 2]
    src = _jsonl(tmp_path / "mixed.jsonl", docs)
    monkeypatch.setattr(prepare, "_CHUNK_DOCS", 7)  # many chunks, so processes interleave
    files = {}
    for workers in (1, 3):
        cache = tmp_path / f"cache{workers}"
        [(corpus, _)] = prepare_corpora(str(src), tok_dir, cache, workers=workers, log=lambda _: None)
        files[workers] = [p.read_bytes() for p in (corpus.path, docs_path(corpus.path), loss_mask_path(corpus.path))]
        assert corpus.documents == len(docs)
    assert files[1] == files[3]


def test_a_second_call_reads_the_cache(tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _jsonl(tmp_path / "alice.jsonl", ALICE)
    cache = tmp_path / "cache"
    calls: list[int] = []
    real = prepare.encode_sources
    monkeypatch.setattr(prepare, "encode_sources", lambda *a, **k: calls.append(1) or real(*a, **k))
    lines: list[str] = []
    [(first, _)] = prepare_corpora(f"{src}:0.5", tok_dir, cache, workers=1, log=lines.append)
    mtime = first.path.stat().st_mtime_ns
    [(second, weight)] = prepare_corpora(f"{src}:0.5", tok_dir, cache, workers=1, log=lines.append)
    assert calls == [1] and weight == 0.5 and second.path == first.path
    assert second.path.stat().st_mtime_ns == mtime and "cached" in lines[-1]
    # Another field, another tokenizer or other bytes: another key, tokenized again.
    src.write_text(src.read_text() + json.dumps({"text": "Down, down, down."}) + "\n")
    [(third, _)] = prepare_corpora(str(src), tok_dir, cache, workers=1, log=lines.append)
    assert calls == [1, 1] and third.path != first.path and third.documents == len(ALICE) + 1
    # Only the cache directory was written; no temporary file is left in it.
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alice.jsonl", "cache", "tok"]


def test_a_chat_trains_on_the_assistant_tokens_only(tmp_path: Path, tok_dir: Path) -> None:
    src = _jsonl(tmp_path / "chats.jsonl", CHATS, field="messages")
    [(corpus, _)] = _prepare(str(src), tok_dir, tmp_path / "cache", text_field="messages")
    assert corpus.documents == 2 and corpus.loss_mask is not None
    for i, chat in enumerate(CHATS):
        lo, hi = corpus.starts[i], corpus.starts[i + 1]
        ids, mask = corpus.document(i), np.asarray(corpus.loss_mask[lo:hi])
        assert decode(tok_dir, ids[mask == 1]) == "".join(m["content"] for m in chat if m["role"] == "assistant")
        context = decode(tok_dir, ids[mask == 0])
        for m in chat:
            assert (m["content"] in context) == (m["role"] != "assistant")
        assert decode(tok_dir, ids).startswith(f"<|{chat[0]['role']}|>{chat[0]['content']}<|end|>")
    # Through Parquet and a saved dataset the same chats give the same corpus.
    import pyarrow as pa

    table_path = tmp_path / "chats.parquet"
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": CHATS}), table_path)
    [(from_parquet, _)] = _prepare(str(table_path), tok_dir, tmp_path / "cache", text_field="messages")
    ds = _dataset(tmp_path / "chats_ds", CHATS, name="messages")
    [(from_dataset, _)] = _prepare(str(ds), tok_dir, tmp_path / "cache", text_field="messages")
    for other in (from_parquet, from_dataset):
        assert np.array_equal(other.ids, corpus.ids) and np.array_equal(other.loss_mask, corpus.loss_mask)


def test_the_chat_template_runs_sandboxed(tmp_path: Path, tok_dir: Path) -> None:
    from alice_corpus import build_tokenizer

    from meshllm_dsl.runtime.data.encode import TemplateError, chat_spans, compile_template

    # Neither Python attributes nor files are reachable from a template.
    escape = compile_template("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError, match="unsafe"):
        chat_spans(escape, CHATS[0], {})
    with pytest.raises(TemplateError, match="does not compile"):
        compile_template("{% include '/etc/passwd' %")
    reads = compile_template("{% include '/etc/passwd' %}")
    with pytest.raises(TemplateError, match="failed"):
        chat_spans(reads, CHATS[0], {})
    # A template that rewrites the content is refused, not guessed at.
    upper = build_tokenizer(tmp_path / "upper", "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    src = _jsonl(tmp_path / "c.jsonl", CHATS, field="messages")
    with pytest.raises(DataError, match=r"c\.jsonl:1: the chat template does not print message 0"):
        _prepare(str(src), upper, tmp_path / "cache", text_field="messages")
    # A role the template refuses is the template's error, at that record.
    odd = _jsonl(tmp_path / "odd.jsonl", [[{"role": "tool", "content": "x"}]], field="messages")
    with pytest.raises(DataError, match=r"odd\.jsonl:1: the chat template raised: unknown role tool"):
        _prepare(str(odd), tok_dir, tmp_path / "cache", text_field="messages")


def test_several_sources_with_weights(tmp_path: Path, tok_dir: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", ALICE[:3])
    b = _parquet(tmp_path / "b.parquet", ALICE[3:])
    out = _prepare(f"{a}:0.7,{b}:0.3", tok_dir, tmp_path / "cache")
    assert [w for _, w in out] == [0.7, 0.3]
    assert [_documents(c.path, tok_dir) for c, _ in out] == [ALICE[:3], ALICE[3:]]  # type: ignore[attr-defined]


def test_source_kinds_are_told_apart(tmp_path: Path, tok_dir: Path) -> None:
    (tmp_path / "t.txt").write_text("hello")
    _jsonl(tmp_path / "a.jsonl", ["x"])
    assert open_source(tmp_path / "t.txt").kind == "text"
    assert open_source(tmp_path / "a.jsonl").kind == "jsonl"
    (tmp_path / "mixed").mkdir()
    _jsonl(tmp_path / "mixed" / "a.jsonl", ["x"])
    _parquet(tmp_path / "mixed" / "b.parquet", ["y"])
    with pytest.raises(DataError, match="both .jsonl and .parquet"):
        open_source(tmp_path / "mixed")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .jsonl or .parquet files"):
        open_source(tmp_path / "empty")
    with pytest.raises(DataError, match="no such file"):
        open_source(tmp_path / "nope.jsonl")


def test_a_cached_corpus_missing_a_file_is_tokenized_again(tmp_path: Path, tok_dir: Path) -> None:
    src = _jsonl(tmp_path / "chats.jsonl", CHATS, field="messages")
    cache = tmp_path / "cache"
    [(first, _)] = _prepare(str(src), tok_dir, cache, text_field="messages")
    mask = loss_mask_path(first.path).read_bytes()
    for remove in (loss_mask_path, docs_path, lambda p: Path(f"{p}.json"), lambda p: p):
        remove(first.path).unlink()
        [(again, _)] = _prepare(str(src), tok_dir, cache, text_field="messages")
        assert again.path == first.path and loss_mask_path(again.path).read_bytes() == mask
        assert again.loss_mask is not None and Path(f"{again.path}.json").is_file()


def test_a_status_line_on_a_terminal_only(tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _jsonl(tmp_path / "alice.jsonl", ALICE)
    prepare_corpora(str(src), tok_dir, tmp_path / "quiet", workers=1, progress=False, log=lambda _: None)
    assert capsys.readouterr().err == ""
    prepare_corpora(str(src), tok_dir, tmp_path / "shown", workers=1, progress=True, log=lambda _: None)
    err = capsys.readouterr().err
    assert f"meshc: tokenizing {src}: {len(ALICE)} documents" in err and err.endswith("\r\x1b[K")


def test_datasets_is_imported_only_for_a_saved_dataset(tmp_path: Path, tok_dir: Path) -> None:
    import subprocess
    import sys

    src = _jsonl(tmp_path / "alice.jsonl", ALICE)
    _parquet(tmp_path / "alice.parquet", ALICE)
    code = ("import sys\n"
            "from meshllm_dsl.runtime.data.prepare import prepare_corpora\n"
            f"prepare_corpora({str(src)!r} + ',' + {str(tmp_path / 'alice.parquet')!r}, {str(tok_dir)!r}, "
            f"{str(tmp_path / 'cache')!r}, workers=1, log=print)\n"
            "print('datasets imported:', 'datasets' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("tokenized into") == 2 and "datasets imported: False" in proc.stdout
