"""`meshc run --data CORPUS` end to end on gloo: training takes packed batches of the corpus's seeded
document order, a run stopped by SIGTERM at step k and resumed sees exactly the batches of the uninterrupted run
(every loss bit for bit), one data-parallel layout trains on the same global batches as
another, and a resume on another corpus is refused with one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from processes import StderrReader, run_module  # noqa: E402
from test_packing import write_corpus  # noqa: E402

from meshllm_dsl.runtime.train import checkpoint  # noqa: E402

SPEC = """
mesh m {{ axes data = {dp} }}
model tiny = llama {{ vocab = 1000, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64 }}
plan train on m for tiny {{
    batch = 4
    seq = 16
    layout {{ batch -> data }}
    optimizer adamw {{ lr = 0.003 }}
}}
"""


def _corpus(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    # Documents from 1 to 40 ids (seq is 16): many rows hold several, some documents are split.
    docs = [rng.integers(1, 1000, size=int(rng.integers(1, 40))).tolist() for _ in range(30)]
    return write_corpus(path, docs)


def _run(tmp: Path, dp: int, *args: str) -> tuple[int, str]:
    spec = tmp / f"dp{dp}.mesh"
    spec.write_text(SPEC.format(dp=dp))
    proc = run_module("meshllm_dsl", "run", str(spec), "--timeout", "120", *args, timeout=300, cwd=tmp)
    return proc.returncode, proc.stderr


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_packed_training_resumes_exactly_and_is_the_same_for_any_data_parallel_layout(tmp_path: Path) -> None:
    data = _corpus(tmp_path / "corpus.tok", seed=0)
    common = ("--data", str(data), "--seed", "3")

    # Stopped by SIGTERM at whatever step it has reached (it saves after that step, with the data
    # cursor), then resumed for 3 steps more.
    spec = tmp_path / "dp2.mesh"
    spec.write_text(SPEC.format(dp=2))
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshllm_dsl", "run", str(spec), *common, "--steps", "1000000", "--timeout", "120",
         "--save", str(tmp_path / "cut"), "--metrics", str(tmp_path / "first.jsonl")],
        env=dict(os.environ, OMP_NUM_THREADS="1", MESHLLM_LOG_EVERY="1"), stderr=subprocess.PIPE, cwd=tmp_path,
    )
    reader = StderrReader(proc)
    try:
        reader.wait_for(b"step 3/")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = reader.text()
    match = re.search(r"stopped by SIGTERM after step (\d+); saved (\S+)", err)
    assert match, err[-3000:]
    k = int(match.group(1))
    manifest = checkpoint.verify(tmp_path / "cut")
    assert manifest["step"] == k >= 3
    cursor = manifest["state"]["packer"]
    assert cursor["rows"] == k * 4 and set(cursor) == {"epochs", "index", "drawn", "split", "rows"}
    first = _losses(tmp_path / "first.jsonl")
    assert len(first) == k
    code, err = _run(tmp_path, 2, *common, "--steps", str(k + 3), "--resume", "latest", "--save", str(tmp_path / "cut"),
                     "--metrics", str(tmp_path / "second.jsonl"))
    assert code == 0, err[-3000:]
    assert f"resumed from {tmp_path / 'cut' / f'step-{k:06d}'} at step {k}" in err

    # The uninterrupted run: the same losses, bit for bit (the floats as JSON wrote them).
    code, err = _run(tmp_path, 2, *common, "--steps", str(k + 3), "--metrics", str(tmp_path / "straight.jsonl"))
    assert code == 0, err[-3000:]
    straight = _losses(tmp_path / "straight.jsonl")
    assert first + _losses(tmp_path / "second.jsonl") == straight

    # One data rank trains on the same global batches: the same loss up to the order of float32
    # sums at step 1 (same weights), within Adam's drift of those differences after.
    code, err = _run(tmp_path, 1, *common, "--steps", str(k + 3), "--metrics", str(tmp_path / "dp1.jsonl"))
    assert code == 0, err[-3000:]
    dp1 = _losses(tmp_path / "dp1.jsonl")
    assert abs(dp1[0] - straight[0]) < 1e-6 and np.allclose(dp1, straight, rtol=1e-4, atol=0), (dp1, straight)
    # ... and another seed trains on other batches: step 1's loss differs far beyond that.
    code, err = _run(tmp_path, 1, "--data", str(data), "--seed", "4", "--steps", "1",
                     "--metrics", str(tmp_path / "seed4.jsonl"))
    assert code == 0, err[-3000:]
    assert abs(_losses(tmp_path / "seed4.jsonl")[0] - straight[0]) > 1e-4

    # A resume on another corpus: refused with one line, before any step.
    other = _corpus(tmp_path / "other.tok", seed=1)
    code, err = _run(tmp_path, 2, "--data", str(other), "--steps", str(k + 9), "--resume", str(tmp_path / "cut"
                                                                                            / f"step-{k:06d}"))
    assert code != 0
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"was trained on {data}" in errors[0] and f"not on {other}" in errors[0], err
    assert "Traceback" not in err and f"step {k + 1}/" not in err


def test_balanced_training_trains_on_the_repacked_steps_and_resumes_exactly(tmp_path: Path) -> None:
    """`meshc run --balance` on 2 data ranks: step 1 trains on the step's documents repacked for
    the ranks (another batch than as packed, so another gradient), and a run stopped after step 2
    and resumed has the uninterrupted balanced run's losses bit for bit."""
    from meshllm_dsl.runtime.data.corpus import open_corpus
    from meshllm_dsl.runtime.data.packing import Packer

    data = _corpus(tmp_path / "corpus.tok", seed=0)
    common = ("--data", str(data), "--seed", "3")
    corpus = open_corpus(data)
    plain, balanced = (Packer([(corpus, 1.0)], seq=16, seed=3, balance=b).step_rows(4) for b in (0, 2))
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(plain, balanced))  # step 1 is repacked

    code, err = _run(tmp_path, 2, *common, "--steps", "1", "--metrics", str(tmp_path / "plain.jsonl"))
    assert code == 0, err[-3000:]
    code, err = _run(tmp_path, 2, *common, "--balance", "--steps", "3", "--metrics", str(tmp_path / "straight.jsonl"))
    assert code == 0, err[-3000:]
    straight = _losses(tmp_path / "straight.jsonl")
    # At the first step's weights the loss hardly depends on how the ids are arranged (4.8e-7
    # apart, measured); the gradient does (3.5e-5 of 1.09), far above float32's order of sums (1e-7).
    norms = [json.loads((tmp_path / f).read_text().splitlines()[0])["grad_norm"] for f in ("plain.jsonl", "straight.jsonl")]
    assert abs(norms[0] - norms[1]) > 1e-5, norms
    code, err = _run(tmp_path, 2, *common, "--balance", "--steps", "2", "--save", str(tmp_path / "cut"),
                     "--metrics", str(tmp_path / "first.jsonl"))
    assert code == 0, err[-3000:]
    code, err = _run(tmp_path, 2, *common, "--balance", "--steps", "3", "--resume", "latest", "--save",
                     str(tmp_path / "cut"), "--metrics", str(tmp_path / "second.jsonl"))
    assert code == 0, err[-3000:]
    assert "resumed from" in err and "at step 2" in err
    assert _losses(tmp_path / "first.jsonl") + _losses(tmp_path / "second.jsonl") == straight


def test_eval_on_a_corpus_reports_the_mean_loss_of_its_packed_rows(tmp_path: Path) -> None:
    data = _corpus(tmp_path / "corpus.tok", seed=0)
    code, err = _run(tmp_path, 1, "--data", str(data), "--eval", "--steps", "2")
    assert code == 0, err[-3000:]
    # 2 batches of 4 rows of 16 targets, none ignored (no loss mask).
    assert "eval loss" in err and "(128 tokens)" in err, err


def test_balance_needs_a_corpus_to_train_on(tmp_path: Path) -> None:
    from meshllm_dsl.runtime.train import launch

    text = tmp_path / "t.txt"
    text.write_text("some text " * 10)
    for argv in (["--balance"], ["--balance", "--data", str(text)],
                 ["--balance", "--eval", "--data", str(_corpus(tmp_path / "c.tok", seed=0))]):
        with pytest.raises(launch.InputError, match="--balance repacks the documents of a token-file --data"):
            launch.check_inputs(launch.parse_args(argv))
    launch.check_inputs(launch.parse_args(["--balance", "--data", str(tmp_path / "c.tok")]))
