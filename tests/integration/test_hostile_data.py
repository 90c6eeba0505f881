"""Hostile token files, text, tokenizers and prompts for `meshc run` (issue 21, items 6 and 9).

Each case is refused before any rank starts: exit 2 and one line naming the file or flag and what
was expected, never a traceback.  The cases run `meshc run` in this process (the refusal comes
before the launch, so no process starts); one case runs a generated module the way torchrun would,
so the ranks' own check is covered too.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from hf_models import word_tokenizer  # noqa: E402

from meshllm_dsl.cli.main import main  # noqa: E402
from meshllm_dsl.runtime.train import (
    launch,  # noqa: E402
    tokens,  # noqa: E402
)

# vocab 64, 16 learned positions: small enough that every limit is easy to cross.
SPEC = """
mesh one { axes data = 1 }
model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }
plan train on one for m {
    batch = 2
    seq = 8
}
"""
WORDS = "the cat sat on a mat".split()


def _token_file(path: Path, ids: list[int], itemsize: int = 2, vocab: int = 64, tail: bytes = b"") -> Path:
    dtype = "<u2" if itemsize == 2 else "<u4"
    body = np.asarray(ids, dtype=dtype).tobytes() if itemsize in (2, 4) else bytes(len(ids) * itemsize)
    path.write_bytes(tokens.TOKEN_MAGIC + np.array([itemsize, vocab], dtype="<u4").tobytes() + body + tail)
    return path


def _tokenizer_dir(d: Path, **files: object) -> Path:
    """A working word-level tokenizer in ``d``, with ``files`` (name -> bytes, or JSON) over it."""
    word_tokenizer(d, WORDS)
    for name, content in files.items():
        name = name.replace("__", ".")
        (d / name).write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return d


Case = Callable[[Path], list[str]]


def _data(build: Callable[[Path], Path], *more: str) -> Case:
    return lambda tmp: ["--data", str(build(tmp)), *more]


def _tok(**files: object) -> Case:
    return lambda tmp: ["--tokenizer", str(_tokenizer_dir(tmp / "tok", **files))]


HOSTILE: dict[str, tuple[Case, str]] = {
    # 21.6: ids at or above the vocabulary were trained on modulo the vocabulary; --eval raised IndexError.
    "ids past the vocabulary": (
        _data(lambda t: _token_file(t / "d.tokens", [1, 2, 3, 59_999] * 10)),
        "--data {tmp}/d.tokens: holds token id 59,999, past the model's vocabulary of 64 (ids 0..63)"),
    "ids past the vocabulary, --eval": (
        _data(lambda t: _token_file(t / "d.tokens", [5] * 30 + [64]), "--eval"),
        "holds token id 64, past the model's vocabulary of 64"),
    "ids past the vocabulary, uint32": (
        _data(lambda t: _token_file(t / "d.tokens", [0] * 40 + [70_000], itemsize=4)),
        "holds token id 70,000"),
    "written for a larger vocabulary": (
        _data(lambda t: _token_file(t / "d.tokens", [1] * 40, itemsize=4, vocab=100_000)),
        "tokenized for a vocabulary of 100000, the model has 64"),
    # 21.9: token files that cannot be one.
    "odd byte length": (
        _data(lambda t: _token_file(t / "d.tokens", [1] * 40, tail=b"\x07")),
        "--data {tmp}/d.tokens: 81 bytes after the header are not a whole number of 2-byte ids (truncated?)"),
    "uint32 ids cut short": (
        _data(lambda t: _token_file(t / "d.tokens", [1] * 40, itemsize=4, tail=b"\x01\x02")),
        "not a whole number of 4-byte ids"),
    "header cut short": (
        _data(lambda t: (t / "d.tokens").write_bytes(tokens.TOKEN_MAGIC + b"\x02\x00") and t / "d.tokens"),
        "a token file cut short in its 16-byte header (10 bytes"),
    "item size 3": (
        _data(lambda t: _token_file(t / "d.tokens", [1] * 40, itemsize=3)),
        "a token file with item size 3, expected 2 or 4"),
    "fewer ids than a window": (
        _data(lambda t: _token_file(t / "d.tokens", [1] * 9)),
        "--data {tmp}/d.tokens: 9 token ids, training at seq 8 needs at least 10"),
    "header and no ids": (
        _data(lambda t: _token_file(t / "d.tokens", [])),
        "a token file with no ids"),
    "vocabulary 0": (
        _data(lambda t: _token_file(t / "d.tokens", [0] * 40, vocab=0)),
        "a token file for a vocabulary of 0, expected at least 1"),
    # Text through a tokenizer must be UTF-8 (was a UnicodeDecodeError on every rank).
    "latin-1 text with --tokenizer": (
        lambda t: ["--data", str(_latin1(t)), "--tokenizer", str(_tokenizer_dir(t / "tok"))],
        "--data {tmp}/latin.txt: not UTF-8 text (byte 25)"),
    # Prompts.
    "--prompt bytes that are not UTF-8": (
        lambda t: ["--infer", "--tokenizer", str(_tokenizer_dir(t / "tok")), "--prompt", "the cat\udcffsat"],
        "--prompt: not UTF-8 text (byte 0xff at character 7)"),
    "--prompt-ids 1,,x": (lambda t: ["--infer", "--prompt-ids", "1,,x"],
                          "--prompt-ids '1,,x': item 2 is empty, expected comma-separated token ids, e.g. 1,2,3"),
    "--prompt-ids 1,x": (lambda t: ["--infer", "--prompt-ids", "1,x"], "item 2 is 'x'"),
    "--prompt-ids -1": (lambda t: ["--infer", "--prompt-ids", "-1"], "item 1 is '-1'"),
    "--prompt-ids empty": (lambda t: ["--infer", "--prompt-ids", ""], "item 1 is empty"),
    "--prompt-ids past the vocabulary": (lambda t: ["--infer", "--prompt-ids", "1,2,99"],
                                         "--prompt-ids '1,2,99': ids must be in 0..63 (got [99])"),
    # --tokens past the learned positions (was an IndexError in the position embedding).
    "--tokens past the positions": (
        lambda t: ["--infer", "--tokens", "10"],
        "--tokens 10: after the synthetic prompt of 8 tokens the model's 16 learned positions allow at most 9"),
    "--tokens past the positions after --prompt-ids": (
        lambda t: ["--infer", "--prompt-ids", "1,2,3", "--tokens", "15"],
        "after --prompt-ids of 3 tokens the model's 16 learned positions allow at most 14"),
    "a prompt longer than the positions": (
        lambda t: ["--infer", "--prompt-ids", ",".join(["1"] * 17), "--tokens", "1"],
        "--prompt-ids: 17 tokens, past the model's 16 learned positions"),
    # Flags whose values used to fail on every rank (timedelta(inf), an int64 generator seed).
    "--timeout inf": (lambda t: ["--timeout", "inf"], "--timeout must be positive seconds, at most 1e+07, got inf"),
    "--timeout nan": (lambda t: ["--timeout", "nan"], "got nan"),
    "--seed past int64": (lambda t: ["--seed", str(10**20)], f"--seed must be 0 to {2**32 - 1}, got {10**20}"),
    "--seed negative": (lambda t: ["--seed", "-1"], "got -1"),
    # Tokenizer directories.
    "garbled tokenizer.json": (
        _tok(tokenizer__json=b'{"version": "1.0", "model": '),
        "--tokenizer: {tmp}/tok/tokenizer.json is not a tokenizer the tokenizers library reads ("),
    "tokenizer.json a JSON list": (_tok(tokenizer__json=[1, 2]), "is not a tokenizer the tokenizers library reads"),
    "garbled tokenizer_config.json": (
        _tok(tokenizer_config__json=b'{"eos_token": '),
        "--tokenizer: {tmp}/tok/tokenizer_config.json is not readable JSON ("),
    "tokenizer_config.json a list": (
        _tok(tokenizer_config__json=["<eos>"]),
        "--tokenizer: {tmp}/tok/tokenizer_config.json holds a JSON list, expected an object"),
    "tokenizer_config.json not UTF-8": (
        _tok(tokenizer_config__json=b'{"eos_token": "\xff"}'), "tokenizer_config.json is not readable JSON"),
    "eos_token a number": (_tok(tokenizer_config__json={"eos_token": 5}),
                           "tokenizer_config.json: `eos_token` is 5, expected a token string"),
    "eos_token_id a string": (_tok(generation_config__json={"eos_token_id": "x"}),
                              "generation_config.json: `eos_token_id` is 'x', expected a token id in 0..7"),
    "eos_token_id past the tokenizer": (_tok(config__json={"eos_token_id": [10**6]}),
                                        "config.json: `eos_token_id` is [1000000], expected a token id"),
}


def _latin1(tmp: Path) -> Path:
    path = tmp / "latin.txt"
    path.write_bytes(b"the cat sat on a mat\n\n" + "caf\u00e9 au lait\n".encode("latin-1") * 4)
    return path


def _meshc(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_meshc_run_refuses_hostile_data_before_launching(name: str, tmp_path: Path) -> None:
    case, expected = HOSTILE[name]
    spec = tmp_path / "one.mesh"
    spec.write_text(SPEC)
    code, err = _meshc("run", str(spec), *case(tmp_path))
    assert code == 2, err
    assert "launching" not in err and "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line
    assert expected.format(tmp=tmp_path) in err, err


def test_the_same_files_are_accepted_when_they_are_right(tmp_path: Path) -> None:
    """The checks refuse only what is wrong: the largest id in range, a tokenizer with its configs,
    a prompt at the last position, a UTF-8 character split across the reader's 1 MiB chunks."""
    model = {"layers": [{"kind": "embedding", "num": 64, "dim": 8}, {"kind": "positional", "num": 16, "dim": 8}]}
    ok = _token_file(tmp_path / "ok.tokens", [0, 63] * 20)
    tok = _tokenizer_dir(tmp_path / "tok", generation_config__json={"eos_token_id": [1, 2]})
    assert tokens.Tokenizer(tok).eos == 1
    for argv in (["--data", str(ok)], ["--data", str(ok), "--eval"],
                 ["--infer", "--prompt-ids", "1, 2,3", "--tokens", "14"], ["--infer", "--tokens", "9"],
                 ["--infer", "--tokenizer", str(tok), "--prompt", "the cat", "--tokens", "15"]):
        launch.check_inputs(launch.parse_args(argv), model, 8)
    text = tmp_path / "split.txt"
    text.write_bytes(b"a" * ((1 << 20) - 1) + "\u00e9".encode() + b" the end")
    tokens.check_utf8_file(text)
    text.write_bytes(b"a" * ((1 << 20) - 1) + "\u00e9".encode() + b"\xff")
    with pytest.raises(tokens.DataError, match=f"byte {(1 << 20) + 1:,}\\)"):
        tokens.check_utf8_file(text)


def test_the_largest_id_is_one_pass_over_the_memory_map(tmp_path: Path) -> None:
    ids = np.zeros(1 << 20, dtype="<u2")
    ids[777_777] = 63
    path = _token_file(tmp_path / "big.tokens", ids.tolist())
    assert tokens.token_file_max(path) == 63
    ids[123] = 64
    path = _token_file(tmp_path / "big.tokens", ids.tolist())
    with pytest.raises(tokens.DataError, match="holds token id 64"):
        tokens.check_token_ids(path, 64)


def test_a_generated_module_started_without_meshc_refuses_ids_past_the_vocabulary(tmp_path: Path) -> None:
    """The ranks check again (a module may be started by torchrun directly), before joining any group."""
    spec = tmp_path / "one.mesh"
    spec.write_text(SPEC)
    assert _meshc("compile", str(spec), "-o", str(tmp_path / "pkg"))[0] == 0
    data = _token_file(tmp_path / "d.tokens", [1, 2, 3, 59_999] * 10)
    proc = subprocess.run([sys.executable, str(tmp_path / "pkg" / "train.py"), "--data", str(data)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"error: --data {data}: holds token id 59,999, past the model's vocabulary of 64 (ids 0..63)\n"


def test_eval_reads_a_text_file_as_bytes_mod_vocab_as_training_does(tmp_path: Path) -> None:
    """With vocab 64, bytes 64..255 have no embedding row: --eval used to index past it."""
    from types import SimpleNamespace

    model = {"layers": [{"kind": "embedding", "num": 64, "dim": 8}]}
    built = SimpleNamespace(program=SimpleNamespace(model=model))
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)))
    assert launch._corpus(built, text).tolist() == [b % 64 for b in range(256)]
