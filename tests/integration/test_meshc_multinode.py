"""`meshc run --nnodes 2` as two nodes on this machine (loopback, torchrun's c10d rendezvous):
the same training as one 4-rank node, bit for bit; and every way the nodes can disagree ends each
of them with one line, within the timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from meshllm_dsl.cli import job as cli_job  # noqa: E402
from meshllm_dsl.cli import main as cli  # noqa: E402

# Tensor inside a node (ranks 0-1 and 2-3), data across the two nodes.
SPEC = """
mesh nodes2 {
    axes data = 2, tensor = 2
    hosts = 2
    device = cpu
}
model m = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }
plan train on nodes2 for m {
    batch = 4
    seq = 8
    layout { batch -> data }
    shard blocks.*.attn.{q,k,v} column(tensor)
    shard blocks.*.attn.o row(tensor)
    shard blocks.*.mlp.{gate,up} column(tensor)
    shard blocks.*.mlp.down row(tensor)
    shard embed vocab_parallel(tensor)
    shard lm_head column(tensor)
    OPTIMIZER
}
"""
TIMEOUT = 15


def _spec(tmp: Path, name: str = "nodes.mesh", lr: str = "0.001") -> Path:
    path = tmp / name
    path.write_text(SPEC.replace("OPTIMIZER", f"optimizer adamw {{ lr = {lr} }}"))
    return path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _meshc(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshllm_dsl", "run", *args]


def _nodes(commands: list[list[str]], budget: float) -> list[tuple[int, str, float]]:
    """Start each command as a node; (exit code, stderr, seconds) of each."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    procs = [subprocess.Popen(c, env=env, stderr=subprocess.PIPE, text=True) for c in commands]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=budget)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, err, time.monotonic() - start))
    return out


def _errors(err: str) -> list[str]:
    return [line for line in err.replace("\r", "\n").splitlines() if line.startswith(("error", "meshc: error"))]


def test_two_nodes_train_exactly_like_one_node(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    steps = ["--steps", "2", "--timeout", "60"]
    port = _port()
    nodes = _nodes(
        [_meshc(str(spec), *steps, "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--save", str(tmp_path / "two")) for r in (0, 1)],
        budget=240,
    )
    for code, err, _ in nodes:
        assert code == 0, err
    (single_code, single_err, _), = _nodes([_meshc(str(spec), *steps, "--save", str(tmp_path / "one"))], budget=240)
    assert single_code == 0, single_err

    def manifest(root: str) -> dict:
        return json.loads((tmp_path / root / "step-000002" / "manifest.json").read_text())

    two, one = manifest("two"), manifest("one")
    assert two["state"]["loss"] == one["state"]["loss"]  # the float, not its printed digits
    # Every rank's weights and optimizer state, byte for byte.
    shards = {k: v["sha256"] for k, v in one["files"].items() if k.endswith(".distcp")}
    assert len(shards) == 4
    assert {k: two["files"][k]["sha256"] for k in shards} == shards
    losses = [line.split("loss ")[1].split()[0] for line in single_err.replace("\r", "\n").splitlines() if "step " in line]
    printed = "\n".join(err for _, err, _ in nodes).replace("\r", "\n")
    assert losses and all(f"loss {x}" in printed for x in losses)


def test_nodes_with_different_specs_each_stop_with_one_line(tmp_path: Path) -> None:
    port = _port()
    specs = [_spec(tmp_path, "a.mesh"), _spec(tmp_path, "b.mesh", lr="0.01")]
    nodes = _nodes(
        [_meshc(str(s), "--steps", "2", "--timeout", str(TIMEOUT), "--nnodes", "2", "--node-rank", str(r),
                "--rdzv-endpoint", f"127.0.0.1:{port}") for r, s in enumerate(specs)],
        budget=120,
    )
    for code, err, _ in nodes:
        assert code == 1, err
        lines = _errors(err)
        assert len(lines) == 1, err
        assert "run different plans" in lines[0] and "same .mesh file" in lines[0], err
        assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--nnodes", "3", "--rdzv-endpoint", "h:1"],
         "--nnodes 3 disagrees with the spec: mesh `nodes2` of plan `train` declares `hosts = 2`; "
         "run on 2 nodes or set `hosts = 3`"),
        (["--nnodes", "2"], "--nnodes needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
         "--node-rank must be 0 to 1 for 2 nodes, got 2"),
        (["--nnodes", "2", "--rdzv-endpoint", "node001"], "--rdzv-endpoint node001: expected HOST:PORT"),
        (["--node-rank", "1"], "--node-rank needs --nnodes N"),
        (["--nnodes", "0", "--rdzv-endpoint", "h:1"], "--nnodes must be at least 1, got 0"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--nproc", "4"], "needs 2 processes per node (4 over 2 nodes), not 4"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--profile"], "--profile reads every rank's measurements"),
    ],
)
def test_bad_node_flags_are_one_line_before_launching(
    flags: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_launch(*args: object, **kwargs: object) -> int:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(cli_job, "run_job", no_launch)
    assert cli.main(["run", str(_spec(tmp_path)), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshc: error: "), err
    assert expected in err, err


def test_nnodes_without_hosts_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "one.mesh"
    spec.write_text(_spec(tmp_path).read_text().replace("    hosts = 2\n", ""))
    assert cli.main(["run", str(spec), "--nnodes", "2", "--rdzv-endpoint", "h:1"]) == 2
    assert "declares no `hosts` (one node); run on 1 node or set `hosts = 2`" in capsys.readouterr().err


def test_a_node_with_a_wrong_nnodes_stops_at_once_and_the_other_at_the_timeout(tmp_path: Path) -> None:
    """The node whose --nnodes disagrees with the spec never reaches the rendezvous, so the good
    node is also the case of a node that never arrives: one torchrun job checks both."""
    spec, port = _spec(tmp_path), _port()
    good, bad = _nodes(
        [_meshc(str(spec), "--timeout", "5", "--nnodes", n, "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}")
         for n in ("2", "3")],
        budget=90,
    )
    assert bad[0] == 2 and _errors(bad[1]) == [
        "meshc: error: --nnodes 3 disagrees with the spec: mesh `nodes2` of plan `train` declares `hosts = 2`; "
        "run on 2 nodes or set `hosts = 3`"
    ], bad[1]
    assert "launching" not in bad[1]  # refused before any rank or rendezvous started
    code, err, seconds = good
    assert code == 1
    assert _errors(err) == [
        f"error: rendezvous at 127.0.0.1:{port} timed out after 5 s: not all 2 "
        "nodes arrived (is `meshc run` started on every node with the same --rdzv-endpoint and --rdzv-id?)"
    ], err
    assert seconds < 5 + 40  # the timeout plus torchrun's start and stop on 2 shared cores
