"""Jobs the distributed tests run on the shared pool of gloo ranks (tests/conftest.py `pool`)."""

from __future__ import annotations

from typing import Any


def compare_job(ctx: Any, path: str, steps: int = 3) -> dict[str, dict[str, float]]:
    """On each rank: {dtype: {entry: max |sharded - reference|}} for the generated module at `path`.

    float32 as the plans run; float64 as well, because float32 skips the few elements whose
    gradient is rounding noise (see runtime/compare.py) and float64 checks those too.
    """
    import torch

    from meshllm_dsl.runtime.compare import compare_to_reference
    from meshllm_dsl.verify import load_generated

    program = load_generated(path).PROGRAM
    mesh = ctx.mesh(program.axes)
    return {name: compare_to_reference(program, mesh, dtype=getattr(torch, name), seed=0, steps=steps)
            for name in ("float32", "float64")}
