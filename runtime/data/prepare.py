"""Sources tokenized into corpora (corpus.py), in parallel, once: ``prepare_corpora`` is what
``meshc run --data SPEC`` calls, ``encode_sources`` what ``meshc tokenize`` and ``meshc data-stats``
run.

One process reads the sources in order (sources.py) and cuts their documents into chunks; a pool
of processes, one per core, tokenizes the chunks (encode.py); the results are taken back in the
order the chunks were cut, so the corpus is the same bytes for 1 process and for N.  At most two
chunks per process are in flight: memory holds a few chunks, never the corpus.

A prepared corpus is cached in the cache directory under a name with the SHA-256 of what decides
its bytes: the source's files (names and bytes), the tokenizer's files and the field.  A second
call with the same inputs opens the cached corpus without tokenizing.  Each file is written to a
temporary name in the cache directory and renamed into place, the token file last, so a corpus
under its final name is whole; a cache path that is one of the inputs is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshllm_dsl.runtime.data.corpus import (
    DOCS_MAGIC,
    Corpus,
    docs_path,
    loss_mask_path,
    open_corpus,
)
from meshllm_dsl.runtime.data.encode import Chunk, Encoded, Encoder, EncoderSpec, compile_template
from meshllm_dsl.runtime.data.sources import Source, open_source, parse_data_spec, read_records
from meshllm_dsl.runtime.train.tokens import TOKEN_MAGIC, DataError, Tokenizer

__all__ = ["CACHE_VERSION", "Counts", "TokenFileWriter", "cache_key", "encode_sources", "encoder_spec",
           "length_histogram", "prepare_corpora"]

# Part of every cache key: bump it when what a corpus holds for the same inputs changes.
CACHE_VERSION = "meshllm-corpus-1"

# A chunk closes at this many documents or characters, whichever comes first: big enough that a
# process's round trip is small beside its tokenizing, small enough to keep every core busy.
_CHUNK_DOCS = 512
_CHUNK_CHARS = 1 << 20


@dataclass
class Counts:
    """What encoding sources found: documents and ids kept, records skipped, and document lengths
    (ids, end-of-text included) in power-of-two buckets: ``histogram[k]`` documents of
    ``2**k <= length < 2**(k + 1)``."""

    documents: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    bad: int = 0
    empty: int = 0
    first_bad: str | None = None
    histogram: dict[int, int] = field(default_factory=dict)

    def add_lengths(self, lengths: np.ndarray) -> None:
        if len(lengths):
            for k, n in zip(*np.unique(length_buckets(lengths), return_counts=True)):
                self.histogram[int(k)] = self.histogram.get(int(k), 0) + int(n)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "histogram": {str(k): v for k, v in sorted(self.histogram.items())}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Counts:
        return cls(**{**data, "histogram": {int(k): int(v) for k, v in data["histogram"].items()}})


def length_buckets(lengths: np.ndarray) -> np.ndarray:
    """The power-of-two bucket of each length (>= 1): floor(log2(length))."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)


def length_histogram(lengths: np.ndarray) -> dict[int, int]:
    """Documents per power-of-two length bucket (see ``Counts.histogram``)."""
    counts = Counts()
    counts.add_lengths(np.asarray(lengths))
    return dict(sorted(counts.histogram.items()))


def _config_token(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def encoder_spec(tokenizer: Tokenizer, directory: Path) -> EncoderSpec:
    """The picklable part of a loaded tokenizer, with the chat template of its tokenizer_config.json
    (the one named ``default`` when it holds several); ``DataError`` for a template that does not
    compile."""
    d = directory if directory.is_dir() else directory.parent
    cfg_path = d / "tokenizer_config.json"
    template: str | None = None
    variables: dict[str, str] = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise DataError(f"--tokenizer: {cfg_path} is not readable JSON ({err})") from None
        raw = cfg.get("chat_template") if isinstance(cfg, dict) else None
        if isinstance(raw, list):  # [{name, template}, ...]
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            raw = named.get("default")
        if raw is not None and not isinstance(raw, str):
            raise DataError(f"--tokenizer: {cfg_path}: `chat_template` is not a template string")
        template = raw
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = _config_token(cfg.get(name)) if isinstance(cfg, dict) else None
            if token is not None:
                variables[name] = token
    chat_file = d / "chat_template.jinja"  # transformers >= 4.43 saves the template beside the config
    if template is None and chat_file.is_file():
        template = chat_file.read_text(encoding="utf-8")
    if template is not None:
        try:
            compile_template(template)
        except ValueError as err:
            raise DataError(f"--tokenizer: {cfg_path}: {err}") from None
    path = d / "tokenizer.json" if directory.is_dir() else directory
    return EncoderSpec(tokenizer_json=str(path), eos=tokenizer.eos, chat_template=template,
                       template_vars=variables)


def _tokenizer_files(directory: Path) -> list[Path]:
    d = directory if directory.is_dir() else directory.parent
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
             "generation_config.json")
    return [d / n for n in names if (d / n).is_file()]


def cache_key(source: Source, tokenizer_dir: Path | None, text_field: str) -> str:
    """SHA-256 (hex) of everything that decides a corpus's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()

    def add_file(name: str, path: Path) -> None:
        h.update(f"\0{name}\0{os.stat(path).st_size}\0".encode())
        with open(path, "rb") as f:
            while piece := f.read(1 << 20):
                h.update(piece)

    h.update(f"{CACHE_VERSION}\0{source.kind}\0{text_field}".encode())
    for f in source.files:
        add_file(str(f.relative_to(source.path)) if f != source.path else f.name, f)
    for f in _tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []:
        add_file(f"tokenizer/{f.name}", f)
    return h.hexdigest()


class TokenFileWriter:
    """A corpus written as it is encoded: ids, document index and loss mask each streamed to a
    temporary file beside ``out`` and renamed into place by ``commit`` (the token file last; no loss
    mask when every id is a target, and a stale one of an earlier corpus removed)."""

    def __init__(self, out: Path, vocab: int) -> None:
        self.out = out
        self.dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
        self.count = 0
        self.masked = False
        self._tmps: list[Path] = []
        self.ids = self._open(TOKEN_MAGIC + np.array([self.dtype.itemsize, vocab], dtype="<u4").tobytes())
        self.docs = self._open(DOCS_MAGIC + np.zeros(1, dtype="<u8").tobytes())
        self.mask = self._open(b"")

    def _open(self, head: bytes) -> Any:
        fd, tmp = tempfile.mkstemp(prefix=f".{self.out.name}.", suffix=".tmp", dir=self.out.parent)
        self._tmps.append(Path(tmp))
        f = os.fdopen(fd, "wb")
        f.write(head)
        return f

    def add(self, enc: Encoded) -> None:
        if not len(enc.lengths):
            return
        enc.ids.astype(self.dtype).tofile(self.ids)
        ends = self.count + np.cumsum(enc.lengths)
        ends.astype("<u8").tofile(self.docs)
        self.count = int(ends[-1])
        mask = np.ones(len(enc.ids), np.uint8) if enc.mask is None else enc.mask
        self.masked |= enc.mask is not None and not bool(enc.mask.all())
        mask.tofile(self.mask)

    def commit(self) -> None:
        if self.count == 0:
            self.abort()
            raise DataError(f"no documents to write to {self.out}: every record was empty or skipped")
        ids_tmp, docs_tmp, mask_tmp = self._tmps
        for f in (self.ids, self.docs, self.mask):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        os.replace(docs_tmp, docs_path(self.out))
        if self.masked:
            os.replace(mask_tmp, loss_mask_path(self.out))
        else:
            mask_tmp.unlink()
            loss_mask_path(self.out).unlink(missing_ok=True)
        os.replace(ids_tmp, self.out)
        self._tmps = []

    def abort(self) -> None:
        for f in (self.ids, self.docs, self.mask):
            f.close()
        for tmp in self._tmps:
            tmp.unlink(missing_ok=True)
        self._tmps = []


def _chunks(sources: Sequence[Source], text_field: str, has_template: bool, skip_bad: bool,
            counts: Counts, on_bad: Callable[[str], None]) -> Iterator[tuple[Chunk, list[str]]]:
    """Each source's usable documents in chunks, with where each one is; bad and empty records
    counted (``on_bad`` decides whether a bad one stops the run)."""
    chunk: Chunk = []
    where: list[str] = []
    chars = 0
    for source in sources:
        for rec in read_records(source, text_field):
            if rec.bad is not None:
                on_bad(f"{rec.where}: {rec.bad}")
                continue
            if rec.doc is None:
                counts.empty += 1
                continue
            if isinstance(rec.doc, list) and not has_template:
                raise DataError(f"{rec.where}: a chat (`{text_field}` is a list of messages), and the "
                                "tokenizer has no chat_template in its tokenizer_config.json to render it")
            chunk.append(rec.doc)
            where.append(rec.where)
            chars += len(rec.doc) if isinstance(rec.doc, str) else 64 * len(rec.doc)
            if len(chunk) >= _CHUNK_DOCS or chars >= _CHUNK_CHARS:
                yield chunk, where
                chunk, where, chars = [], [], 0
    if chunk:
        yield chunk, where


def _workers(workers: int | None) -> int:
    if workers is not None:
        if workers < 1:
            raise ValueError(f"workers={workers}: tokenizing takes 1 process or more")
        return workers
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def encode_sources(sources: Sequence[Source], spec: EncoderSpec | None, sink: TokenFileWriter | None, *,
                   text_field: str = "text", skip_bad: bool = False, workers: int | None = None,
                   progress: bool | None = None) -> Counts:
    """Encode ``sources`` in order into ``sink`` (None: only count) over ``workers`` processes (None:
    one per core; 1: in this process).  A bad record raises ``DataError`` naming it unless
    ``skip_bad``; either way the counts say how many were bad and empty."""
    from meshllm_dsl.progress import StatusLine

    counts = Counts()
    pending: deque[tuple[Any, list[str]]] = deque()

    def take(result: Encoded, where: list[str]) -> None:
        for n, why in result.dropped:
            if why is None:
                counts.empty += 1
            else:
                on_bad(f"{where[n]}: {why}")
        if sink is not None:
            sink.add(result)
        counts.documents += len(result.lengths)
        counts.tokens += len(result.ids)
        counts.loss_tokens += len(result.ids) if result.mask is None else int(result.mask.sum())
        counts.add_lengths(result.lengths)

    def on_bad(message: str) -> None:
        counts.bad += 1
        if counts.first_bad is None:
            counts.first_bad = message
        if not skip_bad:
            while pending:  # an earlier chunk's error comes first, as with one process
                future, where = pending.popleft()
                take(future.result(), where)
            raise DataError(f"{message} (--skip-bad skips such records and counts them)")

    if any(s.kind != "tokens" for s in sources) and spec is None:
        raise DataError("--tokenizer: needed to tokenize text, JSONL, Parquet or dataset sources")
    spec = spec or EncoderSpec(tokenizer_json=None, eos=None)
    n_workers = _workers(workers)
    has_template = spec.chat_template is not None
    what = "tokenizing " + ", ".join(str(s.path) for s in sources)
    with StatusLine("meshc", tty=progress) as status:
        chunks = _chunks(sources, text_field, has_template, skip_bad, counts, on_bad)
        if n_workers == 1:
            encoder = Encoder(spec)
            for chunk, where in chunks:
                take(encoder.encode(chunk), where)
                status.update(f"{what}: {counts.documents:,} documents, {counts.tokens:,} tokens")
            return counts
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from meshllm_dsl.runtime.data.encode import encode_chunk, init_worker

        # spawn: a fresh interpreter that imports encode.py only (the parent may hold torch's
        # threads, which a fork would copy in an unknown state).
        with ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=init_worker, initargs=(spec,)) as pool:
            for chunk, where in chunks:
                pending.append((pool.submit(encode_chunk, chunk), where))
                while len(pending) >= 2 * n_workers or (pending and pending[0][0].done()):
                    future, w = pending.popleft()
                    take(future.result(), w)
                    status.update(f"{what}: {counts.documents:,} documents, {counts.tokens:,} tokens")
            while pending:
                future, w = pending.popleft()
                take(future.result(), w)
    return counts


def _cache_name(source: Source, key: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source.path.name) or "data"
    return f"{stem}-{key[:16]}.tokens"


def _refuse_inputs(out: Path, inputs: Sequence[Path]) -> None:
    resolved = out.resolve()
    for p in inputs:
        if p.resolve() == resolved:
            raise DataError(f"the token cache {out} is one of the inputs ({p}); name another cache directory")


def _cached_counts(path: Path) -> Counts | None:
    """The counts of a whole cached corpus at ``path``; None when any of its files is missing (a
    run stopped before its token file was renamed into place, or a sidecar removed since)."""
    meta = Path(f"{path}.json")
    if not (path.is_file() and docs_path(path).is_file() and meta.is_file()):
        return None
    try:
        counts = Counts.from_json(json.loads(meta.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if counts.loss_tokens != counts.tokens and not loss_mask_path(path).is_file():
        return None
    return counts


def prepare_corpora(spec: str | Sequence[tuple[str | Path, float]], tokenizer_dir: str | Path | None,
                    cache_dir: str | Path, *, text_field: str = "text", skip_bad: bool = False,
                    progress: bool | None = None, workers: int | None = None,
                    log: Callable[[str], None] | None = None) -> list[tuple[Corpus, float]]:
    """The corpus of every source of a data spec, with its weight, tokenizing what is not cached.

    ``spec``: ``"a.jsonl:0.7,b.parquet:0.3"`` (parse_data_spec) or ``[(path, weight), ...]``.
    ``tokenizer_dir``: a Hugging Face tokenizer directory (tokenizer.json, and tokenizer_config.json
    for the end-of-text token and the chat template); None when every source is a token file.
    ``cache_dir``: where tokenized corpora are kept (created if missing); nothing else is written.
    ``text_field``: the JSONL / Parquet / dataset field holding each document (a string or a chat).
    ``skip_bad``: skip and count unusable records instead of raising ``DataError`` at the first.
    ``progress``: a status line on stderr (None: when stderr is a terminal).
    ``workers``: tokenizing processes (None: one per core).  ``log``: receives one line per source
    tokenized or found in the cache, and the count of skipped records (None: printed on stderr).

    Token files are opened as they are (their own sidecars, no copy).  Raises ``DataError`` (one
    line, naming the file and record) for anything unusable."""
    say = log if log is not None else (lambda line: print(line, file=sys.stderr))
    items = parse_data_spec(spec) if isinstance(spec, str) else [(Path(p), float(w)) for p, w in spec]
    sources = [(open_source(p), w) for p, w in items]
    cache = Path(cache_dir)
    tok_dir = None if tokenizer_dir is None else Path(tokenizer_dir)
    inputs = [f for s, _ in sources for f in s.files]
    out: list[tuple[Corpus, float]] = []
    loaded: tuple[Tokenizer, EncoderSpec] | None = None
    for source, weight in sources:
        if source.kind == "tokens":
            out.append((open_corpus(source.path), weight))
            continue
        if tok_dir is None:
            raise DataError(f"--data {source.path}: a {source.kind} source needs --tokenizer DIR to tokenize it")
        if loaded is None:
            tokenizer = Tokenizer(tok_dir)
            loaded = tokenizer, encoder_spec(tokenizer, tok_dir)
        key = cache_key(source, tok_dir, text_field)
        cache.mkdir(parents=True, exist_ok=True)
        path = cache / _cache_name(source, key)
        meta = Path(f"{path}.json")
        _refuse_inputs(path, inputs)
        counts = _cached_counts(path)
        if counts is not None:
            say(f"{source.describe()}: cached {path.name} ({counts.documents:,} documents, {counts.tokens:,} tokens)")
        else:
            writer = TokenFileWriter(path, loaded[0].vocab)
            try:
                counts = encode_sources([source], loaded[1], writer, text_field=text_field,
                                        skip_bad=skip_bad, workers=workers, progress=progress)
                meta_tmp = Path(f"{meta}.tmp{os.getpid()}")
                meta_tmp.write_text(json.dumps(counts.to_json()))
                os.replace(meta_tmp, meta)
                writer.commit()
            except BaseException:
                writer.abort()
                raise
            say(f"{source.describe()}: tokenized into {path} ({counts.documents:,} documents, "
                f"{counts.tokens:,} tokens)")
        if counts.bad or counts.empty:
            first = f"; first: {counts.first_bad}" if counts.first_bad else ""
            say(f"{source.path}: skipped {counts.bad:,} bad and {counts.empty:,} empty records{first}")
        out.append((open_corpus(path), weight))
    return out
