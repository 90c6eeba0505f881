"""`recompute = ops` (selective op) and `recompute = blocks | ops every N`: the planner's activation
bytes per microbatch vs what autograd and the checkpoints really keep on gloo ranks (measured as
tests/planner/test_recompute_memory.py does, the selective cache's kept outputs included)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_recompute_memory import LLAMA, SHAPES, _job  # noqa: E402 - the same plans and measurement

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.planner import analyze  # noqa: E402
from meshllm_dsl.runtime.pool import WorkerPool  # noqa: E402

MODES = ("none", "ops", "blocks every 2", "ops every 2", "blocks")


def _measure(pool: WorkerPool, tmp: Path, shape: str, mode: str) -> tuple[list[int], list[int]]:
    axes, m, rules = SHAPES[shape]
    text = LLAMA.format(axes=axes, m=m, recompute=mode, rules=rules)
    result = check_text(text, f"{shape}.mesh")
    assert result.ok, [d.message for d in result.errors]
    (plan,) = result.plans.values()
    path = tmp / f"{shape}_{mode.replace(' ', '_')}.py"
    path.write_text(render_plan(plan, path.name, text))
    got = pool.run(_job, plan.mesh.devices, str(path), m)
    by_coord = {rc.coord: rc for rc in analyze(plan).ranks}
    coords = [plan.mesh.coords(r)[plan.roles.pipeline] if plan.roles.pipeline else 0 for r in range(len(got))]
    return got, [by_coord[c].activation_bytes_per_microbatch for c in coords]


@pytest.mark.parametrize("shape", ["single", "tensor2", "pipeline2_tensor2_1f1b", "tensor2_sp"])
def test_planner_activations_match_runtime_for_selective_and_every_n(shape: str, pool: WorkerPool, tmp_path: Path) -> None:
    measured, planned = {}, {}
    for mode in MODES:
        measured[mode], planned[mode] = _measure(pool, tmp_path, shape, mode)
    for rank in range(len(measured["none"])):
        residual = measured["none"][rank] - planned["none"][rank]  # the loss's scalars, outside the blocks
        for mode in MODES[1:]:
            assert measured[mode][rank] - planned[mode][rank] == residual, (mode, rank, measured, planned)
        got = [measured[mode][rank] for mode in MODES]
        # Keeping matmul outputs costs more than full recomputation and less than none; recomputing
        # every 2nd block lies between all and none of them.
        assert got[4] < got[1] < got[0] and got[4] < got[2] < got[0] and got[1] < got[3] < got[0], got
