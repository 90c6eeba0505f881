"""The runtime's memory measurement (``LiveBytes``, ``saved_bytes``) and the profile comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from meshllm_dsl.runtime.train.profile import LiveBytes, saved_bytes  # noqa: E402 - after the torch skip

ROOT = Path(__file__).resolve().parents[2]


def test_live_bytes_counts_new_tensors_and_their_peak() -> None:
    x = torch.zeros(1000)  # before the block: not counted
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 4000 more: peak 8000
        del a, b
        c = torch.ones(500)  # 2000 after both were freed
        x.add_(1)  # in place on an old tensor: nothing new
    assert live.peak == 8000
    assert live.live == 2000
    del c


def test_saved_bytes_counts_what_backward_keeps_once() -> None:
    lin = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    with saved_bytes(exclude=list(lin.parameters())) as saved:
        y = torch.relu(lin(x))  # linear keeps x; relu keeps its output
    assert saved["bytes"] == 4 * 8 * 4 + 4 * 16 * 4
    y.sum().backward()


def test_live_bytes_counts_storages_resized_in_the_block() -> None:
    # FSDP2 (ZeRO 2 / 3) all-gathers parameters into buffers made in the first step, grown and
    # freed by storage.resize_, which no operator dispatch shows.
    buf = torch.empty(1000)
    buf.untyped_storage().resize_(0)
    with LiveBytes() as outer:
        with LiveBytes() as live:
            buf.untyped_storage().resize_(4000)
            a = torch.ones(1000)
            buf.untyped_storage().resize_(0)
        del a
        buf.untyped_storage().resize_(2000)
    assert (live.peak, live.live) == (8000, 4000)
    assert (outer.peak, outer.live) == (8000, 6000)
    assert "resize_" not in torch.UntypedStorage.__dict__  # torch's own method again


def test_saved_bytes_skips_views_of_parameters() -> None:
    # A linear layer keeps its weight transposed: a view of a parameter (under ZeRO 2 / 3 of
    # FSDP2's gathered one, whose storage is not the sharded parameter's), charged as weights.
    w = torch.nn.Parameter(torch.randn(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with saved_bytes() as saved:
        y = x @ w.t()
    assert saved["bytes"] == 4 * 8 * 4  # x only
    y.sum().backward()


def test_profile_report_puts_planned_next_to_measured() -> None:
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.views.profile_report import compare, report_text

    (plan,) = check_file(str(ROOT / "examples" / "tiny_gpt2.mesh")).plans.values()
    ranks = [
        {
            "rank": r, "coords": plan.mesh.coords(r), "stages": [plan.mesh.coords(r)["pipeline"]],
            "steps": 3, "step_s": 0.5, "compute_s": 0.2, "collectives_s": 0.2, "pipeline_wait_s": 0.1,
            "collectives": [{"axes": "tensor", "op": "all_reduce", "calls": 10, "bytes": 1024, "seconds": 0.2}],
            "memory": {"weights": 1, "gradients": 1, "optimizer": 1, "activations_per_microbatch": 1,
                       "activations_and_temporaries_peak": 1},
        }
        for r in range(plan.mesh.devices)
    ]
    data = compare(plan, ranks)
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert data["ranks"][0]["collectives"]["tensor"]["measured"]["bytes"] == 1024
    text = report_text(data)
    assert "activations + temporaries peak" in text and "collectives over tensor" in text
