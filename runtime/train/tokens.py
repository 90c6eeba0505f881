"""Text in and out: a Hugging Face tokenizer (``tokenizers`` library), token corpora and eval windows."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "TOKEN_MAGIC",
    "DataError",
    "Tokenizer",
    "check_prompt_text",
    "check_token_ids",
    "check_utf8_file",
    "eval_batches",
    "load_tokenizer",
    "open_token_file",
    "parse_id_list",
    "parse_ids",
    "token_file_count",
    "token_file_header",
    "token_file_max",
    "token_file_vocab",
    "write_token_file",
]

# A token file (`meshc tokenize`): this magic, then little-endian uint32 item size (2 or 4) and
# uint32 vocabulary size, then the ids as flat little-endian uint16 / uint32, documents joined with
# the end-of-text id -- nanoGPT's .bin with a header, so that a rank can memory-map it, read only
# its windows, and refuse ids its model's vocabulary does not have.
TOKEN_MAGIC = b"MESHTOK1"
_HEADER = len(TOKEN_MAGIC) + 8


class DataError(ValueError):
    """A token file, text file, tokenizer or prompt is unusable: one line naming it and what was
    expected (the launcher reports it as an input error, exit 2)."""


def _reason(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:200] if lines else type(err).__name__


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DataError(f"--tokenizer: {path} is not readable JSON ({_reason(err)})") from None
    if not isinstance(data, dict):
        raise DataError(f"--tokenizer: {path} holds a JSON {type(data).__name__}, expected an object")
    return data


class Tokenizer:
    """``DIR/tokenizer.json`` with the end-of-text id from the directory's configs (if any)."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        d = Path(directory)
        path = d / "tokenizer.json" if d.is_dir() else d
        if not path.is_file():
            raise DataError(f"--tokenizer {directory}: no tokenizer.json there")
        try:
            self.tok: Any = _Tok.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise DataError(f"--tokenizer: {path} is not a tokenizer the tokenizers library reads "
                            f"({_reason(err)})") from None
        self.eos: int | None = None
        for name in ("generation_config.json", "config.json"):
            f = path.parent / name
            if self.eos is None and f.is_file():
                self.eos = self._eos_id(f, _json_object(f).get("eos_token_id"))
        if self.eos is None:
            cfg = path.parent / "tokenizer_config.json"
            token = _json_object(cfg).get("eos_token") if cfg.is_file() else None
            token = token.get("content") if isinstance(token, dict) else token
            if token is not None and not isinstance(token, str):
                raise DataError(f"--tokenizer: {cfg}: `eos_token` is {token!r}, expected a token string "
                                "or an object with a `content` string")
            self.eos = self.tok.token_to_id(token) if token else None

    def _eos_id(self, path: Path, eos: Any) -> int | None:
        """``eos_token_id`` of a config: an id or a list of them (the first ends documents)."""
        if eos is None or eos == []:
            return None
        first = eos[0] if isinstance(eos, list) else eos
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < self.vocab:
            raise DataError(f"--tokenizer: {path}: `eos_token_id` is {eos!r}, expected a token id in "
                            f"0..{self.vocab - 1} (or a list of them)")
        return first

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    @property
    def vocab(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def documents(self, docs: list[str]) -> list[int]:
        """``docs`` tokenized and joined, each followed by the end-of-text id."""
        ids: list[int] = []
        for enc in self.tok.encode_batch(docs, add_special_tokens=False):
            ids += enc.ids
            if self.eos is not None:
                ids.append(self.eos)
        return ids

    def corpus(self, text: str) -> Tensor:
        """Documents (separated by blank lines) tokenized and joined with the end-of-text id."""
        docs = [d for d in (d.strip() for d in text.split("\n\n")) if d]
        return torch.tensor(self.documents(docs), dtype=torch.long)


def _documents(lines: Any) -> Any:
    """Blank-line separated documents of a text stream, one at a time (the file is never whole)."""
    doc: list[str] = []
    for line in lines:
        if line.strip():
            doc.append(line)
        elif doc:
            yield "".join(doc).strip()
            doc = []
    if doc:
        yield "".join(doc).strip()


def write_token_file(text_path: str | Path, tokenizer: Tokenizer, out: str | Path, batch_docs: int = 256) -> int:
    """Tokenize the text file into a token file at ``out`` (atomically); the number of tokens."""
    import os
    import tempfile

    import numpy as np

    vocab = tokenizer.vocab
    dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
    out = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    count = 0
    try:
        with os.fdopen(fd, "wb") as f, open(text_path, encoding="utf-8") as text:
            f.write(TOKEN_MAGIC + np.array([dtype.itemsize, vocab], dtype="<u4").tobytes())
            pending: list[str] = []
            for doc in _documents(text):
                pending.append(doc)
                if len(pending) == batch_docs:
                    count += _write_ids(f, tokenizer.documents(pending), dtype)
                    pending = []
            count += _write_ids(f, tokenizer.documents(pending), dtype)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


def _write_ids(f: Any, ids: list[int], dtype: Any) -> int:
    import numpy as np

    np.asarray(ids, dtype=dtype).tofile(f)
    return len(ids)


def token_file_header(path: str | Path) -> tuple[int, int] | None:
    """(item size, vocabulary size) of a token file; None for a file without the magic (read as
    bytes).  ``DataError`` for a token file whose header or length cannot be one's."""
    with open(path, "rb") as f:
        head = f.read(_HEADER)
    if not head.startswith(TOKEN_MAGIC):
        return None
    if len(head) < _HEADER:
        raise DataError(f"--data {path}: a token file cut short in its {_HEADER}-byte header "
                        f"({len(head)} bytes: {TOKEN_MAGIC.decode()}, item size, vocabulary size)")
    itemsize = int.from_bytes(head[len(TOKEN_MAGIC) : len(TOKEN_MAGIC) + 4], "little")
    vocab = int.from_bytes(head[len(TOKEN_MAGIC) + 4 :], "little")
    if itemsize not in (2, 4):
        raise DataError(f"--data {path}: a token file with item size {itemsize}, expected 2 or 4 (uint16 / uint32 ids)")
    if vocab < 1:
        raise DataError(f"--data {path}: a token file for a vocabulary of 0, expected at least 1")
    body = os.stat(path).st_size - _HEADER
    if body == 0:
        raise DataError(f"--data {path}: a token file with no ids")
    if body % itemsize:
        raise DataError(f"--data {path}: {body:,} bytes after the header are not a whole number of "
                        f"{itemsize}-byte ids (truncated?)")
    return itemsize, vocab


def token_file_vocab(path: str | Path) -> int | None:
    """The vocabulary size a token file was written for; None for any other file (bytes)."""
    header = token_file_header(path)
    return None if header is None else header[1]


def open_token_file(path: str | Path) -> Any:
    """A read-only memory map of a token file's ids (only the windows read are paged in)."""
    import numpy as np

    header = token_file_header(path)
    if header is None:
        raise DataError(f"--data {path}: not a token file (no {TOKEN_MAGIC.decode()} header)")
    return np.memmap(path, dtype=np.dtype(f"<u{header[0]}"), mode="r", offset=_HEADER)


def token_file_count(path: str | Path) -> int | None:
    """How many ids a token file holds (from its length); None for a file read as bytes."""
    header = token_file_header(path)
    return None if header is None else (os.stat(path).st_size - _HEADER) // header[0]


def token_file_max(path: str | Path) -> int:
    """The largest id in a token file: one sequential pass over its memory map."""
    return int(open_token_file(path).max())


def check_token_ids(path: str | Path, vocab: int) -> None:
    """Every id of a token file is a row of the model's embedding (``vocab`` tokens); a no-op for a
    file read as bytes (ids = bytes mod vocab, as documented).  Else ``DataError``."""
    header = token_file_header(path)
    if header is None:
        return
    if header[1] > vocab:
        raise DataError(f"--data {path}: tokenized for a vocabulary of {header[1]}, the model has {vocab}")
    top = token_file_max(path)
    if top >= vocab:
        raise DataError(f"--data {path}: holds token id {top:,}, past the model's vocabulary of {vocab:,} "
                        f"(ids 0..{vocab - 1:,})")


def check_utf8_file(path: str | Path, flag: str = "--data") -> None:
    """``DataError`` naming the first byte of ``path`` that is not UTF-8 (read in chunks, never whole)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a character split across chunks
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                raise DataError(f"{flag} {path}: not UTF-8 text (byte {offset - pending + err.start:,}); with "
                                "--tokenizer it is read as text (or pass a token file from `meshc tokenize`)") from None
            if not chunk:
                return
            offset += len(chunk)


def check_prompt_text(text: str) -> None:
    """A ``--prompt`` from the command line is text: bytes that are not UTF-8 reach Python as lone
    surrogates (``surrogateescape``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        byte = text[err.start].encode("utf-8", "surrogateescape")
        raise DataError(f"--prompt: not UTF-8 text (byte 0x{byte.hex()} at character {err.start})") from None


@functools.lru_cache(maxsize=4)
def load_tokenizer(directory: Path) -> Tokenizer:
    """``Tokenizer(directory)``, loaded once per process: the input checks and the run share it."""
    return Tokenizer(directory)


_ID = re.compile(r"[0-9]+")


def parse_id_list(text: str) -> list[int]:
    """``"1,2,3"`` -> [1, 2, 3] (spaces allowed); ``DataError`` naming the first item that is not an id."""
    items = text.replace(" ", "").split(",")
    for n, item in enumerate(items, 1):
        if not _ID.fullmatch(item):
            what = "empty" if not item else repr(item)
            raise DataError(f"--prompt-ids {text!r}: item {n} is {what}, expected comma-separated "
                            "token ids, e.g. 1,2,3")
    return [int(x) for x in items]


def parse_ids(text: str, vocab: int) -> Tensor:
    """``"1,2,3"`` -> [[1, 2, 3]], each id checked against the vocabulary."""
    ids = parse_id_list(text)
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise DataError(f"--prompt-ids {text!r}: ids must be in 0..{vocab - 1} (got {bad[:5]})")
    return torch.tensor([ids], dtype=torch.long)


def eval_batches(ids: Tensor, batch: int, seq: int, limit: int) -> list[tuple[Tensor, Tensor]]:
    """Consecutive non-overlapping windows of ``ids`` as (tokens, targets) batches, at most ``limit``."""
    n = (ids.numel() - 1) // seq
    if n < batch:
        raise DataError(
            f"--eval needs at least {batch * seq + 1} tokens for one batch of {batch} x {seq}, "
            f"got {ids.numel()}"
        )
    out = []
    for b in range(min(limit, n // batch)):
        starts = [(b * batch + r) * seq for r in range(batch)]
        win = torch.stack([ids[s : s + seq + 1] for s in starts])
        out.append((win[:, :-1], win[:, 1:]))
    return out
