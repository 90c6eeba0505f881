"""``launch.check_same_plan``: the nodes of a job compare plan digest and flags through the job's
store before building anything (a fake store stands in for torchrun's here)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from meshllm_dsl.runtime import launch


class FakeStore:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = dict(values)

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        missing = [k for k in keys if k not in self.values and not k.startswith("meshllm/same-read/")]
        assert not missing, missing

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def _run(monkeypatch: pytest.MonkeyPatch, other: dict) -> None:
    args = launch.parse_args(["--steps", "3"])
    store = FakeStore({"meshllm/same/1": json.dumps(other)})
    monkeypatch.setattr(launch.dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setenv("GROUP_RANK", "0")
    launch.check_same_plan(args, 0, 2, timedelta(seconds=1))


def _mine(*argv: str, **flags: str) -> dict:
    args = launch.parse_args(["--steps", "3", *argv])
    return {"node": "1", "plan": launch.plan_digest(), "flags": {**launch._flags_text(args), **flags}}


def test_same_plan_and_flags_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    _run(monkeypatch, _mine())


def test_a_node_with_other_code_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(launch.PlanMismatch, match=r"^node 0 and node 1 run different plans \(spec or generated code \w+ vs 0123\): start every node"):
        _run(monkeypatch, {**_mine(), "plan": "0123"})


def test_a_node_with_other_flags_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(launch.PlanMismatch, match=r"^node 0 and node 1 were started with different flags \(--steps 3 vs 5\)"):
        _run(monkeypatch, _mine(steps="5"))


def test_profile_directories_may_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    _run(monkeypatch, _mine("--profile", "/elsewhere"))


AXES = (("data", 2), ("tensor", 2))


def test_check_same_plan_returns_every_ranks_node(monkeypatch: pytest.MonkeyPatch) -> None:
    args = launch.parse_args(["--steps", "3"])
    store = FakeStore({"meshllm/same/1": json.dumps(_mine())})
    monkeypatch.setattr(launch.dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setenv("GROUP_RANK", "0")
    assert launch.check_same_plan(args, 0, 2, timedelta(seconds=1)) == ["0", "1"]


def test_groups_kept_in_a_host_on_one_node_give_no_warning() -> None:
    assert launch.node_warnings(AXES, 2, ["0", "0", "1", "1"]) == []
    assert launch.node_warnings(AXES, 1, ["0", "1", "0", "1"]) == []  # no hosts: nothing promised


def test_a_tensor_group_split_over_nodes_is_named() -> None:
    # Ranks interleaved over two nodes: the tensor groups [0, 1] and [2, 3] each span both; the
    # data groups cross hosts in the spec already, so they are not reported.
    assert launch.node_warnings(AXES, 2, ["0", "1", "0", "1"]) == [
        "warning: the `tensor` group [0, 1] (and 1 more group) spans nodes 0, 1, though the spec (hosts = 2) "
        "keeps it in one host: its collectives cross the network"
    ]
