"""A tokenized corpus on disk and the batch a training step takes: the one contract between the
data sources (which write corpora), the packer (which reads them into batches) and the model (which
trains on batches).

On disk a corpus is a token file (tokens.py: ``MESHTOK1`` header, ids with each document followed by
the end-of-text id) plus two sidecars next to it:

* ``NAME.docs``: ``MESHDOC1``, then little-endian uint64 offsets into the ids: the start of every
  document and, last, the number of ids (``documents + 1`` entries).  Document ``i`` is
  ``ids[starts[i]:starts[i + 1]]``, its end-of-text id included.
* ``NAME.lossmask`` (optional): one byte per id, 1 where the id is a training target (a chat's
  assistant turns), 0 where it is context only.  Absent: every id is a target.

A token file without ``NAME.docs`` (written before documents were recorded) reads as one document.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from meshllm_dsl.runtime.train.tokens import DataError, open_token_file, token_file_header

__all__ = ["DOCS_MAGIC", "IGNORE", "Batch", "Corpus", "docs_path", "loss_mask_path", "open_corpus",
           "write_sidecars"]

DOCS_MAGIC = b"MESHDOC1"

# A target the loss skips (torch's cross_entropy default ignore_index): context-only ids (a chat's
# user turns) and the padding of a row no document filled.
IGNORE = -100


def docs_path(path: str | Path) -> Path:
    return Path(f"{path}.docs")


def loss_mask_path(path: str | Path) -> Path:
    return Path(f"{path}.lossmask")


@dataclass(frozen=True)
class Corpus:
    """A token file's ids (memory-mapped, read-only), where its documents start, and which ids are
    targets.  ``starts`` has ``documents + 1`` entries, the last the number of ids."""

    path: Path
    ids: Any  # np.memmap of uint16 / uint32
    starts: np.ndarray  # int64 [documents + 1]
    loss_mask: Any | None  # np.memmap of uint8 [ids], or None: every id trains
    vocab: int

    @property
    def documents(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        """Each document's length in ids (its end-of-text id included)."""
        return np.diff(self.starts)

    def document(self, i: int) -> np.ndarray:
        return np.asarray(self.ids[self.starts[i] : self.starts[i + 1]], dtype=np.int64)


@dataclass(frozen=True)
class Batch:
    """One step's rows, identical on every rank (each rank takes its slice).

    ``tokens`` / ``targets`` are [batch, seq] int64; ``targets`` is ``IGNORE`` where no loss is
    taken.  ``documents`` numbers the documents within each row (0, 1, ...; a token attends only to
    earlier tokens of the same number) and ``positions`` restarts at each document; both None for
    rows attended causally across documents."""

    tokens: Tensor
    targets: Tensor
    documents: Tensor | None = None
    positions: Tensor | None = None


def _read_starts(path: Path, count: int) -> np.ndarray:
    side = docs_path(path)
    if not side.is_file():
        return np.array([0, count], dtype=np.int64)
    with open(side, "rb") as f:
        if f.read(len(DOCS_MAGIC)) != DOCS_MAGIC:
            raise DataError(f"{side}: not a document index (no {DOCS_MAGIC.decode()} header)")
        starts = np.frombuffer(f.read(), dtype="<u8").astype(np.int64)
    if len(starts) < 2 or starts[0] != 0 or starts[-1] != count or np.any(np.diff(starts) <= 0):
        raise DataError(f"{side}: a document index that does not cover {path}'s {count:,} ids "
                        "in increasing offsets (written for another token file?)")
    return starts


def open_corpus(path: str | Path) -> Corpus:
    """The corpus of a token file and its sidecars; ``DataError`` for a file that is not one."""
    path = Path(path)
    header = token_file_header(path)
    if header is None:
        raise DataError(f"--data {path}: not a token file")
    ids = open_token_file(path)
    starts = _read_starts(path, len(ids))
    mask_file = loss_mask_path(path)
    mask = None
    if mask_file.is_file():
        if os.stat(mask_file).st_size != len(ids):
            raise DataError(f"{mask_file}: {os.stat(mask_file).st_size:,} bytes for {len(ids):,} ids")
        mask = np.memmap(mask_file, dtype=np.uint8, mode="r")
    return Corpus(path=path, ids=ids, starts=starts, loss_mask=mask, vocab=header[1])


def _atomic_write(path: Path, chunks: list[bytes]) -> None:
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_sidecars(path: str | Path, starts: np.ndarray, loss_mask: np.ndarray | None = None) -> None:
    """Write a token file's document index (and loss mask), each atomically."""
    path = Path(path)
    _atomic_write(docs_path(path), [DOCS_MAGIC, np.asarray(starts, dtype="<u8").tobytes()])
    if loss_mask is not None:
        _atomic_write(loss_mask_path(path), [np.asarray(loss_mask, dtype=np.uint8).tobytes()])
