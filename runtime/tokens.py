"""Text in and out: a Hugging Face tokenizer (``tokenizers`` library), token corpora and eval windows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["Tokenizer", "eval_batches", "parse_ids"]


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

    def corpus(self, text: str) -> Tensor:
        """Documents (separated by blank lines) tokenized and joined with the end-of-text id."""
        ids: list[int] = []
        for doc in (d.strip() for d in text.split("\n\n")):
            if not doc:
                continue
            ids += self.encode(doc)
            if self.eos is not None:
                ids.append(self.eos)
        return torch.tensor(ids, dtype=torch.long)


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
