"""The data tests' tokenizer, trained offline on alice_corpus.ALICE."""

from __future__ import annotations

from pathlib import Path

import pytest
from alice_corpus import build_tokenizer


@pytest.fixture
def tok_dir(tmp_path: Path) -> Path:
    return build_tokenizer(tmp_path / "tok")
