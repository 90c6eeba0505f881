"""`meshc compile --slurm`: the sbatch script (golden, `bash -n`, and run against stand-ins for
srun / scontrol / torchrun), written and owned through the package's manifest."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from meshllm_dsl.cli import main
from meshllm_dsl.outputs import MANIFEST

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"


def _compile(tmp: Path, spec: str, *extra: str) -> int:
    cwd = os.getcwd()
    os.chdir(tmp)  # the script names the package by the path given to -o, relative to here
    try:
        return main(["compile", spec, "-o", "out", "--slurm", *extra])
    finally:
        os.chdir(cwd)


def test_sbatch_matches_golden_and_parses(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    assert _compile(tmp_path, str(ROOT / "examples" / "llama2_70b_2x8.mesh")) == 0
    text = (tmp_path / "out" / "train.sbatch").read_text()
    golden = GOLDEN / "llama2_70b_2x8.sbatch.txt"
    if request.config.getoption("--update-goldens"):
        golden.write_text(text)
    assert text == golden.read_text()
    assert subprocess.run(["bash", "-n", str(tmp_path / "out" / "train.sbatch")]).returncode == 0
    # Recorded in the manifest with the package: a later compile replaces it only while it is meshc's.
    assert "train.sbatch" in json.loads((tmp_path / "out" / MANIFEST).read_text())["files"]


def test_sbatch_runs_one_torchrun_per_node_at_the_first_nodes_rendezvous(tmp_path: Path) -> None:
    assert _compile(tmp_path, str(ROOT / "examples" / "llama2_70b_2x8.mesh")) == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        # A long node list: a script that read only its first line through `| head` under
        # pipefail would die of scontrol's SIGPIPE (exit 141), as it did here once.
        "scontrol": 'printf "gpu017\\ngpu018\\n"; seq 100000 | sed "s/^/gpu9/"',
        "srun": 'echo "srun $1" >> "$LOG"; shift; exec "$@"',
        "torchrun": 'echo "torchrun $*" >> "$LOG"',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log),
               SLURM_JOB_NODELIST="gpu[017-018]", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2")
    proc = subprocess.run(["bash", "out/train.sbatch", "--steps", "100"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [
        "srun --kill-on-bad-exit=1",
        "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=gpu017:29500 "
        "--rdzv-id=4242 out/train.py --steps 100",
    ]


def test_a_cpu_mesh_asks_for_no_gpus_and_sets_no_nccl(tmp_path: Path) -> None:
    assert _compile(tmp_path, str(ROOT / "examples" / "tiny_llama.mesh")) == 0
    text = (tmp_path / "out" / "train.sbatch").read_text()
    assert "#SBATCH --nodes=1\n" in text and "--gpus-per-node" not in text and "NCCL" not in text
    assert "--nnodes=1 --nproc-per-node=8" in text


def test_an_edited_sbatch_is_not_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(ROOT / "examples" / "llama2_70b_2x8.mesh")
    assert _compile(tmp_path, spec) == 0
    script = tmp_path / "out" / "train.sbatch"
    script.write_text(script.read_text() + "# my partition\n")
    assert _compile(tmp_path, spec) == 2
    assert "train.sbatch" in capsys.readouterr().err
    assert script.read_text().endswith("# my partition\n")


def test_plan_filter_keeps_its_sbatch(tmp_path: Path) -> None:
    assert _compile(tmp_path, str(ROOT / "examples" / "llama2_70b_2x8.mesh"), "--plan", "train") == 0
    assert (tmp_path / "out" / "train.sbatch").is_file()
