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
from meshllm_dsl.planner.analyze import analyze  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402

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


def test_selective_op_keeps_the_odd_products_as_torchtitan_does() -> None:
    # torchtitan's `selective` `op` policy (`_get_custom_policy`, `mm_count % 2`): the 1st, 3rd,
    # 5th product of a checkpointed region are kept, the 2nd and 4th recomputed. Each product has
    # its own output width, so the kept outputs name themselves; one is biased (aten.addmm) and
    # counts as a product like aten.mm. Gradients equal the plain function's.
    import torch.nn.functional as F

    from meshllm_dsl.runtime.train import remat

    gen = torch.Generator().manual_seed(0)
    widths = (3, 5, 7, 11, 13)
    ws = [torch.randn(n, k, generator=gen, requires_grad=True) for k, n in zip((2, *widths), widths)]
    bias = torch.randn(widths[2], generator=gen, requires_grad=True)
    x = torch.randn(4, 2, generator=gen, requires_grad=True)

    def chain(x: torch.Tensor, bias: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        for i, w in enumerate(ws):
            x = torch.tanh(F.linear(x, w, bias if i == 2 else None))
        return x

    kept: list[torch.Tensor] = []
    remat.HOLDERS.append(kept.append)
    try:
        out = remat.recompute_ops(chain, x, bias, *ws)
    finally:
        remat.HOLDERS.remove(kept.append)
    inputs = 2 + len(ws)  # the checkpoint reports its inputs first
    assert [tuple(t.shape) for t in kept[inputs:]] == [(4, 3), (4, 7), (4, 13)]
    out.square().sum().backward()
    got = [t.grad.clone() for t in (x, bias, *ws)]
    for t in (x, bias, *ws):
        t.grad = None
    chain(x, bias, *ws).square().sum().backward()
    for g, t in zip(got, (x, bias, *ws)):
        torch.testing.assert_close(g, t.grad, rtol=0, atol=0)
