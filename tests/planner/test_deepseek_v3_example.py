"""examples/deepseek_v3_671b.mesh (issue 38, item 8): DeepSeek-V3 written with the layer kinds it needs
(mla, moe with sigmoid routing and groups, dense first blocks as a repeat of their own) in its
published training layout. The planner's counts against transformers' own model on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm_dsl.checker import check_file
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.formulas import kv_cache_bytes
from meshllm_dsl.planner.moe import active_parameters

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3_671b.mesh"


def _plan():  # type: ignore[no-untyped-def]
    result = check_file(EXAMPLE)
    assert result.ok, result.diagnostics
    (plan,) = result.plans.values()
    return plan


def test_parameters_equal_transformers_deepseek_v3_on_the_meta_device() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config()  # transformers' defaults are DeepSeek-V3's (671B)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config)
    assert _plan().model.numel == sum(p.numel() for p in model.parameters()) == 671_026_404_352


def test_active_parameters_and_the_latent_kv_cache() -> None:
    plan = _plan()
    # 58 moe blocks each leave 248 of their 256 routed experts (3 x 7168 x 2048 each) unused per token
    idle = 58 * 248 * 3 * 7168 * 2048
    assert active_parameters(plan) == plan.model.numel - idle == 37_552_282_624
    assert kv_cache_bytes(plan, 1) == 61 * (512 + 64) * 2 == 70_272


def test_the_published_layout_fits_an_h800_and_balances_both_kinds_of_block() -> None:
    plan = _plan()
    assert [r.count for r in plan.model.repeats] == [3, 58]
    first = [(pc.item, pc.start, pc.stop) for pc in plan.stages[0].pieces]
    assert first == [("embed", None, None), ("dense", 0, 3), ("blocks", 0, 1)]
    assert sum(pc.stop - pc.start for s in plan.stages for pc in s.pieces if pc.item == "blocks") == 58
    report = analyze(plan, PROFILES["h800"])
    assert report.fits and report.peak_training_bytes < 60 * 2**30
