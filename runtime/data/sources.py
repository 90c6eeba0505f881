"""Where training documents come from, read one at a time (never a whole corpus in memory).

A source is a path: a ``.jsonl`` file or a directory of them, a ``.parquet`` file or a directory of
them, a directory written by ``datasets``' ``save_to_disk``, a text file (documents at blank lines)
or a token file (``meshc tokenize``'s, passed through).  Each record's field (``--text-field``,
``text`` by default) is a document: a string, or a chat (a list of ``{role, content}`` objects).

``read_records`` yields a ``Record`` per record with where it is (``file:line`` for JSONL and text,
``file:row N`` for Parquet and datasets rows, counted from 0): its document, or why it is unusable
(``bad``), or neither (an empty document).  The caller decides whether a bad record stops the run
(``--skip-bad`` counts them instead).

A data spec (``--data a.jsonl:0.7,b.parquet:0.3``) names several sources with weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshllm_dsl.runtime.data.encode import Document
from meshllm_dsl.runtime.train.tokens import DataError, token_file_header

__all__ = ["Record", "Source", "open_source", "parse_data_spec", "read_records"]

Kind = Literal["jsonl", "parquet", "datasets", "text", "tokens"]


@dataclass(frozen=True)
class Source:
    """A source path, its kind, and the files it reads (sorted; what its cache key hashes)."""

    path: Path
    kind: Kind
    files: tuple[Path, ...]

    def describe(self) -> str:
        n = len(self.files)
        return f"{self.path} ({self.kind}, {n} file{'s' if n != 1 else ''})"


@dataclass(frozen=True)
class Record:
    """One record: ``doc`` when usable, else ``bad`` says why (both None: an empty document)."""

    where: str
    doc: Document | None = None
    bad: str | None = None


def parse_data_spec(spec: str) -> list[tuple[Path, float]]:
    """``a.jsonl:0.7,b.parquet:0.3`` -> [(a.jsonl, 0.7), (b.parquet, 0.3)]; a path without ``:W``
    weighs 1.  A weight is a positive finite number; ``DataError`` naming the item otherwise."""
    out: list[tuple[Path, float]] = []
    for n, item in enumerate(spec.split(","), 1):
        item = item.strip()
        if not item:
            raise DataError(f"--data {spec!r}: item {n} is empty; expected PATH or PATH:WEIGHT, "
                            "comma-separated (e.g. a.jsonl:0.7,b.parquet:0.3)")
        path, weight = item, 1.0
        head, sep, tail = item.rpartition(":")
        if sep and head:
            try:
                weight = float(tail)
            except ValueError:
                weight = None  # type: ignore[assignment]
            if weight is None:
                path, weight = item, 1.0  # a ':' that is part of the path
            else:
                path = head
                if not math.isfinite(weight) or weight <= 0:
                    raise DataError(f"--data {spec!r}: {item!r} has weight {tail}; a weight is a "
                                    "positive number (the share of that source in the mix)")
        out.append((Path(path), weight))
    return out


def _is_token_file(path: Path) -> bool:
    return token_file_header(path) is not None


def open_source(path: str | Path) -> Source:
    """The source at ``path`` (its kind from what is there); ``DataError`` when it is none."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = _dataset_splits(path)
            raise DataError(f"--data {path}: a `datasets` DatasetDict (splits: {', '.join(splits)}); "
                            f"name one split's directory, e.g. {path / (splits[0] if splits else 'train')}")
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            files = tuple(sorted(p for p in path.rglob("*") if p.is_file()))
            return Source(path, "datasets", files)
        jsonl = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".jsonl")
        parquet = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".parquet")
        if jsonl and parquet:
            raise DataError(f"--data {path}: a directory of both .jsonl and .parquet files; give each "
                            "kind its own directory (and weight) in the data spec")
        if not jsonl and not parquet:
            raise DataError(f"--data {path}: a directory with no .jsonl or .parquet files and no "
                            "`datasets` save_to_disk files (state.json, dataset_info.json)")
        return Source(path, "jsonl" if jsonl else "parquet", tuple(jsonl or parquet))
    if not path.is_file():
        raise DataError(f"--data {path}: no such file or directory")
    if _is_token_file(path):
        return Source(path, "tokens", (path,))
    if path.suffix == ".jsonl":
        return Source(path, "jsonl", (path,))
    if path.suffix == ".parquet":
        return Source(path, "parquet", (path,))
    return Source(path, "text", (path,))


def _dataset_splits(path: Path) -> list[str]:
    try:
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        return [str(s) for s in splits]
    except (OSError, ValueError, AttributeError):
        return []


def read_records(source: Source, field: str = "text") -> Iterator[Record]:
    """Every record of ``source`` in order, one at a time.  ``DataError`` for a source whose
    structure is wrong as a whole (a Parquet or dataset column missing or of another type)."""
    if source.kind == "tokens":
        yield from _token_file_records(source.path)
    elif source.kind == "text":
        yield from _text_records(source.path)
    elif source.kind == "jsonl":
        for f in source.files:
            yield from _jsonl_records(f, field)
    elif source.kind == "parquet":
        for f in source.files:
            yield from _parquet_records(f, field)
    else:
        yield from _dataset_records(source.path, field)


def _document(value: Any, field: str) -> tuple[Document | None, str | None]:
    """A field's value as a document, or why it is not one; (None, None) for an empty one."""
    if isinstance(value, str):
        return (value if value.strip() else None), None
    if isinstance(value, list):
        messages: list[dict[str, str]] = []
        for n, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return None, (f"field `{field}` item {n} is {_json_type(m)}{_keys(m)}, expected a chat message "
                              "{\"role\": string, \"content\": string}")
            messages.append({"role": m["role"], "content": m["content"]})
        return (messages or None), None
    return None, (f"field `{field}` is {_json_type(value)}, expected a string (or a chat: a list of "
                  "{role, content} messages)")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def _keys(value: Any) -> str:
    return f" with fields {', '.join(map(str, value))}" if isinstance(value, dict) and value else ""


def _jsonl_records(path: Path, field: str) -> Iterator[Record]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Record(where, bad=f"not UTF-8 (byte {err.start} of the line)")
                continue
            if not line.strip():
                continue  # a blank line holds no record (a trailing newline, a separator)
            try:
                obj = json.loads(line.rstrip("\r\n"))
            except (ValueError, RecursionError) as err:
                yield Record(where, bad=f"not JSON ({str(err).splitlines()[0][:120]})")
                continue
            if not isinstance(obj, dict):
                yield Record(where, bad=f"a JSON {_json_type(obj).split(' ')[-1]}, expected an object with a "
                                        f"`{field}` field")
                continue
            if field not in obj:
                fields = ", ".join(list(obj)[:8]) or "none"
                yield Record(where, bad=f"no field `{field}` (fields: {fields}); --text-field names the "
                                        "field that holds the document")
                continue
            doc, bad = _document(obj[field], field)
            yield Record(where, doc=doc, bad=bad)


def _text_records(path: Path) -> Iterator[Record]:
    """Documents at blank lines (as `meshc tokenize` always split them), each stripped; a line that
    is not UTF-8 is a bad record (the document around it goes on without it)."""
    doc: list[str] = []
    start = 1
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Record(f"{path}:{line_no}", bad=f"not UTF-8 text (byte {err.start} of the line)")
                continue
            if line.strip():
                if not doc:
                    start = line_no
                doc.append(line)
            elif doc:
                yield Record(f"{path}:{start}", doc="".join(doc).strip())
                doc = []
    if doc:
        yield Record(f"{path}:{start}", doc="".join(doc).strip())


def _token_file_records(path: Path) -> Iterator[Record]:
    from meshllm_dsl.runtime.data.corpus import open_corpus

    corpus = open_corpus(path)
    for i in range(corpus.documents):
        lo, hi = int(corpus.starts[i]), int(corpus.starts[i + 1])
        mask = None if corpus.loss_mask is None else corpus.loss_mask[lo:hi]
        yield Record(f"{path}:document {i}", doc=(corpus.ids[lo:hi], mask))


def _column_kind(arrow_type: Any) -> str | None:
    """'text' for a string column, 'chat' for a list of {role: string, content: string} structs."""
    import pyarrow as pa

    def is_string(t: Any) -> bool:
        return bool(pa.types.is_string(t) or pa.types.is_large_string(t)
                    or getattr(pa.types, "is_string_view", lambda _: False)(t))

    if is_string(arrow_type):
        return "text"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        item = arrow_type.value_type
        if pa.types.is_struct(item):
            names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
            if "role" in names and "content" in names and is_string(names["role"]) and is_string(names["content"]):
                return "chat"
    return None


def _check_column(where: Path, schema: Any, field: str) -> None:
    """The Arrow ``schema`` (a Parquet file's, a saved dataset's) has ``field`` as text or a chat."""
    if field not in schema.names:
        raise DataError(f"--data {where}: no column `{field}` (columns: {', '.join(schema.names)}); "
                        "--text-field names the column that holds the documents")
    arrow_type = schema.field(field).type
    if _column_kind(arrow_type) is None:
        raise DataError(f"--data {where}: column `{field}` is {arrow_type}, expected a string (or a chat: a "
                        "list of {role: string, content: string}); --text-field names the column")


def _column_records(where: Path, columns: Iterator[Any], field: str) -> Iterator[Record]:
    """One record per row of ``columns`` (Arrow arrays of ``field``, batch by batch), named by row."""
    row = 0
    for column in columns:
        for value in column.to_pylist():
            yield _row_record(f"{where}:row {row}", value, field)
            row += 1


def _parquet_records(path: Path, field: str) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"--data {path}: not a Parquet file pyarrow reads ({str(err).splitlines()[0][:160]})") from None
    _check_column(path, pf.schema_arrow, field)
    yield from _column_records(path, (b.column(0) for b in pf.iter_batches(batch_size=1024, columns=[field])), field)


def _row_record(where: str, value: Any, field: str) -> Record:
    if value is None:
        return Record(where, bad=f"column `{field}` is null")
    doc, bad = _document(value, field)
    return Record(where, doc=doc, bad=bad)


def _dataset_records(path: Path, field: str) -> Iterator[Record]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data {path}: a `datasets` save_to_disk directory needs the datasets "
                        "package: pip install 'meshllm[data]'") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except ValueError as err:
        reason = str(err).splitlines()[0]
        if "not found" in reason and "type" in reason.lower():
            raise DataError(f"--data {path}: written by a newer `datasets` than the installed "
                            f"{datasets.__version__} ({reason.split('. ')[0]}); upgrade it: "
                            "pip install -U datasets") from None
        raise DataError(f"--data {path}: `datasets` cannot load it ({reason[:200]})") from None
    except (OSError, KeyError, TypeError) as err:
        raise DataError(f"--data {path}: `datasets` cannot load it ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:200] if str(err) else ''})") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"--data {path}: a `datasets` {type(ds).__name__}; name one split's directory")
    _check_column(path, ds.data.schema, field)
    tables = ds.select_columns([field]).with_format("arrow").iter(batch_size=1024)
    yield from _column_records(path, (t.column(0) for t in tables), field)
