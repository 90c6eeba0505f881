"""``rt.launch.main`` under real torchrun: training, decoding and a failing rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

MODULE = """
import torch.distributed as dist

import meshllm_dsl.runtime as rt
from rt_models import llama_model, split_stages, vocab_loss


def make_loss(mesh):
    loss = vocab_loss(mesh)
    calls = []

    def checked(logits, targets):
        calls.append(1)
        if FAIL and dist.get_rank() == 1 and len(calls) == 3:
            raise RuntimeError("injected failure in the loss")
        return loss(logits, targets)

    return checked


FAIL = {fail}
PROGRAM = rt.Program(
    model=llama_model(2),
    axes=(("pipeline", 2), ("tensor", 1)),
    stages=split_stages("llama", 2, 2),
    loss=make_loss,
    pipeline_axis="pipeline",
    schedule="1f1b",
    microbatches=2,
    batch=4,
    seq=8,
)

if __name__ == "__main__":
    rt.launch.main(PROGRAM)
"""


def _torchrun(tmp_path: Path, *args: str, fail: bool = False) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "plan.py"
    script.write_text(MODULE.format(fail=fail))
    env = dict(os.environ, PYTHONPATH=str(HERE), OMP_NUM_THREADS="1", LOGLEVEL="WARNING")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_train_and_save_then_infer_from_the_checkpoint(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    ckpt = tmp_path / "ckpt"
    proc = _torchrun(tmp_path, "--steps", "3", "--data", str(data), "--save", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert "step 3/3" in proc.stderr
    summary = [line for line in proc.stderr.splitlines() if line.startswith("done: loss")]
    assert (
        len(summary) == 1
        and "tokens/s" in summary[0]
        and "r0=" in summary[0]
        and "r1=" in summary[0]
    )
    assert (ckpt / ".metadata").exists()

    proc = _torchrun(tmp_path, "--infer", "--tokens", "4", "--load", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    generated = [line for line in proc.stderr.splitlines() if line.startswith("generated")]
    assert len(generated) == 1 and len(generated[0].split(",")) == 4


def test_a_failing_rank_stops_the_job_promptly_and_names_the_cause(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _torchrun(tmp_path, "--steps", "5", "--timeout", "600", fail=True)
    assert proc.returncode != 0
    assert "rank 1 failed: RuntimeError: injected failure in the loss" in proc.stderr
    assert time.monotonic() - start < 60
