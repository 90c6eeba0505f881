"""The corpus contract: a token file with its document index and loss mask reads back as written."""

import numpy as np
import pytest

from meshllm_dsl.runtime.data.corpus import DOCS_MAGIC, docs_path, open_corpus, write_sidecars
from meshllm_dsl.runtime.train.tokens import TOKEN_MAGIC, DataError


def _token_file(path, ids, vocab=100):
    with open(path, "wb") as f:
        f.write(TOKEN_MAGIC + np.array([2, vocab], dtype="<u4").tobytes())
        np.asarray(ids, dtype="<u2").tofile(f)


def test_documents_and_mask_read_back(tmp_path):
    path = tmp_path / "c.tok"
    _token_file(path, [5, 6, 0, 7, 0, 8, 9, 10, 0])
    write_sidecars(path, np.array([0, 3, 5, 9]), np.array([1, 1, 1, 0, 1, 0, 0, 1, 1]))
    c = open_corpus(path)
    assert c.documents == 3 and c.vocab == 100
    assert c.lengths().tolist() == [3, 2, 4]
    assert c.document(2).tolist() == [8, 9, 10, 0]
    assert c.loss_mask is not None and c.loss_mask.tolist() == [1, 1, 1, 0, 1, 0, 0, 1, 1]


def test_without_index_one_document(tmp_path):
    path = tmp_path / "c.tok"
    _token_file(path, [1, 2, 3])
    c = open_corpus(path)
    assert c.starts.tolist() == [0, 3] and c.loss_mask is None


def test_index_of_another_file_refused(tmp_path):
    path = tmp_path / "c.tok"
    _token_file(path, [1, 2, 3])
    docs_path(path).write_bytes(DOCS_MAGIC + np.array([0, 2, 7], dtype="<u8").tobytes())
    with pytest.raises(DataError, match="does not cover"):
        open_corpus(path)
