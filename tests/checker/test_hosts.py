"""Devices per host against the device profile's `per_host` (issue 26, item 1): the checker's E0312 and
W0708, the hosts the planner and `compile --slurm` then assume, and the planner's host-crossing test."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from helpers import ERRORS, meshc

from meshllm_dsl.checker import check_text
from meshllm_dsl.ir import Axis, MeshIR
from meshllm_dsl.parallel.devices import group_crosses_hosts, hosts_needed
from meshllm_dsl.planner.analyze import analyze

HOSTS_OMITTED = ERRORS / "W0708_hosts_omitted.mesh"
TOO_MANY_PER_HOST = ERRORS / "E0312_more_devices_per_host_than_profile.mesh"


def _spec(mesh_settings: str, device_decl: str = "") -> str:
    # 32 devices: data 4 x tensor 8
    return HOSTS_OMITTED.read_text().replace("    device = h100\n", mesh_settings) + device_decl


def test_more_devices_per_host_than_the_profile_holds_is_an_error() -> None:
    result = check_text(_spec("    hosts = 2\n    device = h100\n"), "m.mesh")
    (d,) = result.errors
    assert d.code == "E0312" and "16 devices per host" in d.message and "holds 8" in d.message
    assert d.span is not None and d.span.text == "2"  # the value of `hosts`
    assert "`hosts = 4`" in (d.help or "")
    assert not result.plans  # nothing downstream (plan, compile --slurm) sees the mesh


def test_a_declared_profile_that_holds_more_per_host_is_accepted() -> None:
    text = _spec("    hosts = 2\n    device = big\n", "device big { like = h100, per_host = 16 }\n")
    assert check_text(text, "m.mesh").diagnostics == ()
    # and one that holds fewer than the built-in profile is checked against its own per_host
    text = _spec("    hosts = 8\n    device = small\n", "device small { like = h100, per_host = 2 }\n")
    (d,) = check_text(text, "m.mesh").errors
    assert d.code == "E0312" and "4 devices per host" in d.message


def test_omitted_hosts_warn_and_the_planner_prices_the_assumed_hosts() -> None:
    result = check_text(HOSTS_OMITTED.read_text(), "m.mesh")
    (w,) = result.diagnostics
    assert w.code == "W0708" and "4 hosts of 8" in w.label and "`hosts = 4`" in (w.help or "")
    rep = analyze(result.plans["train"])
    assert rep.hosts_assumed and rep.plan.mesh.hosts == 4
    links = {c.axis: c.crosses_hosts for rc in rep.ranks for c in rc.comms}
    # data-parallel ranks are 8 apart: over the network; the tensor group of 8 stays within a host
    assert links["data"] is True and links["tensor"] is False
    declared = analyze(check_text(_spec("    hosts = 4\n    device = h100\n"), "m.mesh").plans["train"])
    assert not declared.hosts_assumed
    assert declared.step.data_s == pytest.approx(rep.step.data_s)  # priced as if `hosts = 4` were written


def test_plan_says_the_hosts_are_assumed() -> None:
    code, out, _ = meshc("plan", str(HOSTS_OMITTED.relative_to(ERRORS.parent.parent)))
    assert code == 0
    assert "4 hosts assumed" in out.splitlines()[0]
    assert any(line.split()[:2] == ["data", "data"] and line.endswith("network") for line in out.splitlines())
    code, out, _ = meshc("plan", "--format", "json", str(HOSTS_OMITTED.relative_to(ERRORS.parent.parent)))
    (plan,) = json.loads(out)["plans"]
    assert plan["mesh"]["hosts"] == 4 and plan["mesh"]["hosts_assumed"] is True


def test_slurm_never_asks_a_node_for_more_gpus_than_a_host_holds(tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    code, _, _ = meshc("compile", "--slurm", str(HOSTS_OMITTED), "-o", str(out))
    assert code == 0
    script = (out / "train.sbatch").read_text()
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--nnodes=4 --nproc-per-node=8" in script
    code, _, err = meshc("compile", "--slurm", str(TOO_MANY_PER_HOST), "-o", str(tmp_path / "bad"))
    assert code == 1 and "error[E0312]" in err and not (tmp_path / "bad").exists()


def test_one_host_meshes_are_left_alone() -> None:
    # 8 h100 fit one host: no warning, no assumed hosts
    text = _spec("    device = h100\n").replace("data = 4, tensor = 8", "data = 1, tensor = 8")
    result = check_text(text.replace("batch = 16", "batch = 4"), "m.mesh")
    assert result.diagnostics == ()
    assert not analyze(result.plans["train"]).hosts_assumed


@pytest.mark.parametrize(("devices", "per_host", "hosts"), [(32, 8, 4), (12, 8, 2), (13, 8, 13), (8, 8, 1), (24, 16, 2)])
def test_hosts_needed(devices: int, per_host: int, hosts: int) -> None:
    assert hosts_needed(devices, per_host) == hosts


def test_group_crosses_hosts_agrees_with_listing_every_group() -> None:
    for sizes in itertools.product((1, 2, 3, 4), repeat=3):
        axes = tuple(Axis(f"a{i}", s) for i, s in enumerate(sizes))
        total = sizes[0] * sizes[1] * sizes[2]
        for hosts in (h for h in range(1, total + 1) if total % h == 0):
            mesh = MeshIR("m", axes, hosts)
            for r in range(4):
                for names in itertools.combinations(("a0", "a1", "a2"), r):
                    assert group_crosses_hosts(mesh, names) == (hosts > 1 and mesh.crosses_hosts(*names)), (sizes, hosts, names)
