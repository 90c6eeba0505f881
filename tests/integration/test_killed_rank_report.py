"""A rank killed with SIGKILL is named: by its peers, though for a moment after its connections close
the kernel still shows it alive, and by `meshc run`, though torchrun's table may list a rank it
stopped itself (SIGTERM) first."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

pytest.importorskip("torch")

from meshllm_dsl.cli.job import killed_rank  # noqa: E402
from meshllm_dsl.runtime.train import launch  # noqa: E402


class _Progress:
    store = None

    def read(self, key: str) -> str | None:
        return None


def test_a_peer_lost_waits_for_the_killed_rank_to_show(monkeypatch: pytest.MonkeyPatch, capfd: Any) -> None:
    calls = []

    def gone(progress: Any, world: int) -> list[int]:
        calls.append(1)
        return [1] if len(calls) > 3 else []  # still exiting: not yet a zombie

    monkeypatch.setattr(launch, "_gone_ranks", gone)
    exc = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    launch._report(exc, 0, 2, True, False, _Progress())  # type: ignore[arg-type]
    assert capfd.readouterr().err == "\nrank 0 stopped: rank 1 exited without a word (killed?)\n"


def test_a_peer_lost_without_a_cause_gives_up_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_gone_ranks", lambda progress, world: [])
    start = time.monotonic()
    assert launch._lost_peer(_Progress(), 2, wait=0.3) == (None, [])  # type: ignore[arg-type]
    assert 0.3 <= time.monotonic() - start < 2
    assert launch._lost_peer(None, 2) == (None, [])


def test_the_rank_killed_from_outside_is_named_before_those_torchrun_stopped() -> None:
    term, kill = -int(signal.SIGTERM), -int(signal.SIGKILL)
    assert killed_rank([(0, term), (1, kill)]) == "rank 1 was killed (SIGKILL)"
    assert killed_rank([(0, 1), (1, kill)]) == "rank 1 was killed (SIGKILL)"
    assert killed_rank([(0, term)]) == "rank 0 was killed (SIGTERM)"
    assert killed_rank([(0, 1)]) is None
    assert killed_rank([(3, -200)]) == "rank 3 was killed (signal 200)"
