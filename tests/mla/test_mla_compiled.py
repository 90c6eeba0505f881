"""`compile = blocks` with mla's recomputed region from the latents (a closure over the block, under
torch.utils.checkpoint inside the compiled block): the same losses and parameters as the eager blocks,
which tests/mla/test_mla_plans.py proves EQUAL to the reference. Inductor on the CPU: not quick."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from reference_jobs import compiled_job  # noqa: E402
from test_mla_plans import spec  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402


def test_compiled_recomputed_mla_trains_as_eager(pool: Any, tmp_path: Path) -> None:
    """Context 2 with `recompute = attention`: the region's rerun over the gathered latents compiles."""
    text = spec("latent_q", "context2_recompute").replace("    seq = 8\n", "    seq = 8\n    compile = blocks\n")
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    p = result.plans["p"]
    path = tmp_path / "compiled.py"
    path.write_text(render_plan(p, "t.mesh", text))
    eager = pool.run(compiled_job, p.mesh.devices, str(path), 3, "none")[0]
    compiled = pool.run(compiled_job, p.mesh.devices, str(path), 3, "blocks")[0]
    # Inductor fuses and reorders float32 sums: equal to rounding, not bit for bit
    for a, b in zip(compiled["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled["losses"], eager["losses"])
    for name, q in eager["params"].items():
        assert (compiled["params"][name] - q).abs().max() <= 2 * 1e-3 * 3, name
