"""`meshc compile --slurm`: the sbatch script (golden, `bash -n`, and run against stand-ins for
srun / scontrol / torchrun), written and owned through the package's manifest."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from meshllm_dsl.cli.main import main
from meshllm_dsl.runtime.outputs import MANIFEST

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


# ---------------------------------------------------------------- names from outside the spec

# Each would run `touch` (or end the script's line) if it reached the script as text.
HOSTILE_NAMES = [
    "with space", "$(touch INJECTED)", "`touch INJECTED`", "a; touch INJECTED", "it's", 'say "hi"',
    "'; touch INJECTED; '", '"; touch INJECTED; "', "$HOME", "a\\b", "-q", "--no-python", "*", "~root",
    "a&&touch INJECTED", "a|touch INJECTED", "#x", "!x", "{a,b}", "é中",
]
# What would end a script line: refused (exit 2), nothing written.
UNSHOWABLE = ["a\ntouch INJECTED\n", "a\rtouch INJECTED", "a\ttab", "a\x1b[2Kb", "a\u2028touch INJECTED",
              "a\x85touch INJECTED", "a\u202eb", os.fsdecode(b"a\xffb")]


def _stub_bin(tmp: Path) -> dict[str, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "scontrol": 'printf "gpu017\\ngpu018\\n"',
        "srun": 'shift; exec "$@"',
        # Every argument as it arrived, NUL-separated: an argument split or joined by the shell shows.
        "torchrun": 'printf "%s\\0" "$@" > "$ARGV"',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", ARGV=str(tmp / "argv"),
                SLURM_JOB_NODELIST="gpu[017-018]", SLURM_JOB_ID="4242")


def _run_script(tmp: Path, script: Path) -> list[str]:
    env = _stub_bin(tmp)
    proc = subprocess.run(["bash", str(script), "--steps", "5"], cwd=tmp, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return (tmp / "argv").read_bytes().decode().split("\0")[:-1]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_hostile_package_path_reaches_torchrun_as_one_argument(tmp_path: Path, name: str) -> None:
    spec = tmp_path / "spec.mesh"
    spec.write_text((ROOT / "examples" / "llama2_70b_2x8.mesh").read_text())
    package = tmp_path / "work" / name
    package.parent.mkdir()
    cwd = os.getcwd()
    os.chdir(package.parent)
    try:
        assert main(["compile", str(spec), f"--output={name}", "--slurm"]) == 0  # = : argparse would read -q as a flag
    finally:
        os.chdir(cwd)
    argv = _run_script(package.parent, package / "train.sbatch")
    module = ("./" + name if name.startswith("-") else name) + "/train.py"
    assert argv == ["--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu017:29500",
                    "--rdzv-id=4242", module, "--steps", "5"]
    assert not list(tmp_path.rglob("INJECTED"))
    # Same shape as for a plain name: every value stayed on its own line.
    plain = (GOLDEN / "llama2_70b_2x8.sbatch.txt").read_text().splitlines()
    assert len((package / "train.sbatch").read_text().splitlines()) == len(plain)


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_hostile_spec_file_name_stays_in_its_comment(tmp_path: Path, name: str) -> None:
    spec = tmp_path / f"{name}.mesh"
    spec.write_text((ROOT / "examples" / "llama2_70b_2x8.mesh").read_text())
    assert _compile(tmp_path, str(spec)) == 0
    script = tmp_path / "out" / "train.sbatch"
    lines = script.read_text().splitlines()
    assert lines[1].startswith(f"# Plan `train` of {name}.mesh: ")
    assert lines[2:] == (GOLDEN / "llama2_70b_2x8.sbatch.txt").read_text().splitlines()[2:]
    assert _run_script(tmp_path, script)[-3:] == ["out/train.py", "--steps", "5"]
    assert not list(tmp_path.rglob("INJECTED"))


@pytest.mark.parametrize("name", UNSHOWABLE)
@pytest.mark.parametrize("where", ["package", "spec"])
def test_a_name_that_would_end_a_script_line_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, where: str
) -> None:
    spec = tmp_path / (f"{name}.mesh" if where == "spec" else "spec.mesh")
    spec.write_text((ROOT / "examples" / "llama2_70b_2x8.mesh").read_text())
    package = name if where == "package" else "out"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(["compile", str(spec), f"--output={package}", "--slurm"])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code == 2
    (line,) = err.splitlines()
    assert line.startswith("meshc: error: --slurm: ") and repr(name if where == "package" else f"{name}.mesh") in line
    assert ("package path (-o)" if where == "package" else "spec's file name") in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.name]  # nothing written
