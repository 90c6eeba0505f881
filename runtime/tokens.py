"""Text in and out: a Hugging Face tokenizer (``tokenizers`` library), token corpora and eval windows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "TOKEN_MAGIC",
    "Tokenizer",
    "eval_batches",
    "open_token_file",
    "parse_ids",
    "token_file_vocab",
    "write_token_file",
]

# A token file (`meshc tokenize`): this magic, then little-endian uint32 item size (2 or 4) and
# uint32 vocabulary size, then the ids as flat little-endian uint16 / uint32, documents joined with
# the end-of-text id -- nanoGPT's .bin with a header, so that a rank can memory-map it, read only
# its windows, and refuse ids its model's vocabulary does not have.
TOKEN_MAGIC = b"MESHTOK1"
_HEADER = len(TOKEN_MAGIC) + 8


class Tokenizer:
    """``DIR/tokenizer.json`` with the end-of-text id from the directory's configs (if any)."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        d = Path(directory)
        path = d / "tokenizer.json" if d.is_dir() else d
        if not path.is_file():
            raise ValueError(f"--tokenizer {directory}: no tokenizer.json there")
        self.tok: Any = _Tok.from_file(str(path))
        self.eos: int | None = None
        for name in ("generation_config.json", "config.json"):
            f = path.parent / name
            if self.eos is None and f.is_file():
                eos = json.loads(f.read_text()).get("eos_token_id")
                self.eos = eos[0] if isinstance(eos, list) else eos
        if self.eos is None:
            cfg = path.parent / "tokenizer_config.json"
            token = json.loads(cfg.read_text()).get("eos_token") if cfg.is_file() else None
            token = token.get("content") if isinstance(token, dict) else token
            self.eos = self.tok.token_to_id(token) if token else None

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


def token_file_vocab(path: str | Path) -> int | None:
    """The vocabulary size a token file was written for; None for any other file (bytes)."""
    with open(path, "rb") as f:
        head = f.read(_HEADER)
    if len(head) < _HEADER or not head.startswith(TOKEN_MAGIC):
        return None
    return int.from_bytes(head[len(TOKEN_MAGIC) + 4 :], "little")


def open_token_file(path: str | Path) -> Any:
    """A read-only memory map of a token file's ids (only the windows read are paged in)."""
    import numpy as np

    with open(path, "rb") as f:
        head = f.read(_HEADER)
    itemsize = int.from_bytes(head[len(TOKEN_MAGIC) : len(TOKEN_MAGIC) + 4], "little")
    if itemsize not in (2, 4):
        raise ValueError(f"{path}: a token file with item size {itemsize} (expected 2 or 4)")
    return np.memmap(path, dtype=np.dtype(f"<u{itemsize}"), mode="r", offset=_HEADER)


def parse_ids(text: str, vocab: int) -> Tensor:
    """``"1,2,3"`` -> [[1, 2, 3]], each id checked against the vocabulary."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    bad = [i for i in ids if not 0 <= i < vocab]
    if not ids or bad:
        raise ValueError(f"--prompt-ids {text!r}: ids must be in 0..{vocab - 1}" + (f" (got {bad})" if bad else ""))
    return torch.tensor([ids], dtype=torch.long)


def eval_batches(ids: Tensor, batch: int, seq: int, limit: int) -> list[tuple[Tensor, Tensor]]:
    """Consecutive non-overlapping windows of ``ids`` as (tokens, targets) batches, at most ``limit``."""
    n = (ids.numel() - 1) // seq
    if n < batch:
        raise ValueError(
            f"--eval needs at least {batch * seq + 1} tokens for one batch of {batch} x {seq}, "
            f"got {ids.numel()}"
        )
    out = []
    for b in range(min(limit, n // batch)):
        starts = [(b * batch + r) * seq for r in range(batch)]
        win = torch.stack([ids[s : s + seq + 1] for s in starts])
        out.append((win[:, :-1], win[:, 1:]))
    return out
