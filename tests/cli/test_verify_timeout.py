"""`meshc verify` of big twins: a pool timeout that grows with the processes, `--timeout`, a
timed-out comparison said in one line (no traceback), and progress while the ranks report."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from meshllm_dsl.cli.main import main
from meshllm_dsl.progress import StatusLine
from meshllm_dsl.verify import equivalence

SPEC = ("mesh m {\n    axes tensor = 2\n    device = cpu\n}\n"
        "model t = llama { vocab = 64, hidden = 16, layers = 1, heads = 2, ffn = 32 }\n"
        "plan p on m for t {\n    batch = 2\n    seq = 8\n"
        "    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }\n}\n")


def test_the_pool_timeout_grows_with_the_processes() -> None:
    assert equivalence.pool_timeout(2) == equivalence.pool_timeout(8) == 300
    assert equivalence.pool_timeout(64) == 120 + 10 * 64
    assert equivalence.pool_timeout(128) > equivalence.pool_timeout(64)


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_bad_timeout_is_a_usage_error(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "two.mesh"
    spec.write_text(SPEC)
    assert main(["verify", str(spec), "--timeout", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--timeout must be positive seconds" in err, err


class _Pool:
    """Stands in for WorkerPool: records its timeouts, reports like the real one, then times out."""

    seen: dict[str, Any] = {}

    def __init__(self, world_size: int, timeout: float, start_timeout: float, preload: Any) -> None:
        _Pool.seen = {"world_size": world_size, "timeout": timeout, "start_timeout": start_timeout}
        self.on_report: Any = None
        self.timings: dict[str, float] = {}

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def prestart(self) -> None:
        pass

    def run(self, fn: Any, n: int, *args: Any) -> list[Any]:
        from meshllm_dsl.runtime.jobs.pool import PoolError

        self.on_report("ready", 1, n)
        self.on_report("job", 0, n)
        self.on_report("job", 1, n)
        raise PoolError(f"job timed out after {_Pool.seen['timeout']:.0f}s; ranks [1] did not finish")


def test_timeout_reaches_the_pool_and_a_timed_out_compare_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    from meshllm_dsl.runtime.jobs import pool

    monkeypatch.setattr(pool, "WorkerPool", _Pool)
    spec = tmp_path / "two.mesh"
    spec.write_text(SPEC)
    assert main(["verify", str(spec), "--timeout", "7"]) == 2
    assert _Pool.seen == {"world_size": 2, "timeout": 7.0, "start_timeout": 7.0}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("meshc: error: verify: the job timed out after 7s; ranks [1] did not finish")
    assert "--timeout" in err
    # Without --timeout: the default for 2 processes.
    assert main(["verify", str(spec)]) == 2
    assert _Pool.seen["timeout"] == equivalence.pool_timeout(2)
    # The status line follows the ranks.
    stream = io.StringIO()
    with pytest.raises(pool.PoolError):
        equivalence.verify(str(spec), None, status=StatusLine("meshc verify", stream, tty=True, tick=0))
    shown = stream.getvalue()
    assert "starting 2 processes: 1 of 2 in the process group" in shown
    assert "comparing the twin sharded on 2 processes with it unsharded (logits, gradients, one step): 0 of 2 ranks done" in shown
    assert ": 1 of 2 ranks done" in shown


PIPELINE_SPEC = ("mesh m {\n    axes pipeline = 2\n    device = cpu\n}\n"
                 "model t = llama { vocab = 64, hidden = 16, layers = 2, heads = 2, ffn = 32 }\n"
                 "plan p on m for t {\n    batch = 8\n    seq = 8\n    microbatches = 8\n"
                 "    stages over pipeline balanced\n    schedule 1f1b\n}\n")


def test_microbatches_makes_a_smaller_twin_and_a_bad_count_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    spec = tmp_path / "pp.mesh"
    spec.write_text(PIPELINE_SPEC)
    assert main(["verify", str(spec), "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "batch 8 -> 2, seq 8 -> 8, microbatches 8 -> 2" in out and "verdict: EQUAL" in out, out
    for value, says in (("1", "--microbatches 1: the tiny twin does not check: `1f1b` needs at least as many "
                              "microbatches as pipeline stages (1 < 2) [E0606]"),
                        ("0", "--microbatches must be at least 1, got 0")):
        assert main(["verify", str(spec), "--microbatches", value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
