"""Nodes and devices: ``launch.check_same_plan`` (nodes compare plan digest and flags through the
job's store before building anything; a fake store stands in for torchrun's), ``node_warnings``
(groups kept in a host that span nodes), ``select_device`` (GPU from LOCAL_RANK; a fake torch.cuda)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from meshllm_dsl.runtime.train import launch


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


class FakeCuda:
    def __init__(self, count: int) -> None:
        self.count = count
        self.selected: list[int] = []

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.selected.append(index)


@pytest.mark.parametrize(
    ("gpus", "local", "env", "expected"),
    [(0, "0", "", False), (2, "1", "", True), (2, "1", "cpu", False)],
)
def test_device_from_local_rank(monkeypatch: pytest.MonkeyPatch, gpus: int, local: str, env: str, expected: bool) -> None:
    cuda = FakeCuda(gpus)
    monkeypatch.setattr(launch.torch, "cuda", cuda)
    monkeypatch.setenv("LOCAL_RANK", local)
    monkeypatch.setenv("MESHLLM_DEVICE", env)
    assert launch.select_device() is expected
    assert cuda.selected == ([int(local)] if expected else [])


def test_more_processes_than_gpus_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.torch, "cuda", FakeCuda(1))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("MESHLLM_DEVICE", raising=False)
    with pytest.raises(launch.InputError, match=r"^local rank 1 has no GPU: this node has 1, so it can run at most 1 processes"):
        launch.select_device()
