"""The planner against torchtitan's compiled and compiled + Float8 Llama 3.1 8B runs
(../shared/calibration/published.md), the figures devices.COMPILED_MATMUL and FLOAT8_MATMUL are fitted
to: compile first (eager -> compiled, the eager constants as tests/planner/test_published_runs.py
keeps them), then Float8 (compiled -> compiled + Float8). Every row within 15 %; the specs are the eager
ones with `compile = blocks` and `precision { ..., matmul = fp8_tensorwise, all_gather = fp8 }`.
"""

from __future__ import annotations

import pytest
from test_published_runs import _report

# (spec, GPUs, published tokens/s per GPU)
ROWS = [
    ("torchtitan_llama3_8b_fsdp8.mesh", 8, 5762),
    ("torchtitan_llama3_8b_fsdp8_compile.mesh", 8, 6667),
    ("torchtitan_llama3_8b_fsdp8_float8.mesh", 8, 8532),
    ("torchtitan_llama3_8b_fsdp128.mesh", 128, 5605),
    ("torchtitan_llama3_8b_fsdp128_compile.mesh", 128, 6514),
    ("torchtitan_llama3_8b_fsdp128_float8.mesh", 128, 8380),
]


def tokens_per_gpu(name: str, gpus: int) -> float:
    rep = _report(name)
    return rep.step.tokens / rep.step.total_s / gpus


def test_compiled_and_float8_runs_within_fifteen_percent(capsys: pytest.CaptureFixture[str]) -> None:
    table = [(name, published, tokens_per_gpu(name, gpus)) for name, gpus, published in ROWS]
    with capsys.disabled():
        print(f"\n{'run':42} {'published':>10} {'planned':>10} {'error':>7}")
        for name, published, planned in table:
            print(f"{name.removesuffix('.mesh'):42} {published:10,.0f} {planned:10,.0f} {planned / published - 1:+7.1%}")
    off = [(n, round(planned / published, 3)) for n, published, planned in table if abs(planned / published - 1) > 0.15]
    assert not off, off


def test_each_step_speeds_up_as_published() -> None:
    # The fit's two ratios, each within 5 % of torchtitan's: compiled / eager, Float8 / compiled.
    planned = {name: tokens_per_gpu(name, gpus) for name, gpus, _ in ROWS}
    published = {name: tokens for name, _, tokens in ROWS}
    for i in (0, 3):
        (eager, _, _), (comp, _, _), (f8, _, _) = ROWS[i:i + 3]
        assert planned[comp] / planned[eager] == pytest.approx(published[comp] / published[eager], rel=0.05)
        assert planned[f8] / planned[comp] == pytest.approx(published[f8] / published[comp], rel=0.05)
