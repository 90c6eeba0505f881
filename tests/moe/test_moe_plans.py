"""The `moe` layer in compiled plans: sharded runs against the unsharded reference model (outputs,
gradients and parameters after AdamW steps) on the shared pool of gloo ranks, and its generated code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from moe_specs import MODELS, TP, compile_spec, layout_lines, plan_spec  # noqa: E402
from reference_jobs import compare_job  # noqa: E402

from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402

PLANS = {  # mesh axes, layout, other lines
    "single": ("one = 1", "", ""),
    "tensor2": ("tensor = 2", TP, ""),
    "pipeline2_tensor2": ("pipeline = 2, tensor = 2", TP, "    microbatches = 2\n    stages over pipeline balanced\n"),
    "data2_tensor2": ("data = 2, tensor = 2", TP + ", batch -> data", ""),
    # FSDP2 shards the stacked experts' dim 0 (ffn) over data inside the tensor split
    "data2_tensor2_zero3_recompute": ("data = 2, tensor = 2", TP + ", batch -> data",
                                      "    recompute = blocks\n    optimizer adamw { zero 3 }\n"),
}


def moe_spec(model: str, plan: str) -> str:
    axes, layout, rest = PLANS[plan]
    if layout:
        rest = layout_lines(model, layout, replicate_routers=True) + rest
    return plan_spec(axes, MODELS[model], rest, batch=4)


def compiled(model: str, plan: str, tmp_path: Path) -> tuple[str, int, str]:
    return compile_spec(moe_spec(model, plan), f"{model}_{plan}", tmp_path)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("model", MODELS)
def test_sharded_moe_equals_the_reference(model: str, plan: str, pool: Any, tmp_path: Path) -> None:
    path, n, _ = compiled(model, plan, tmp_path)
    for rank_errs in pool.run(compare_job, n, path, 2):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (dtype, worst, errs[worst])


def test_tensor_parallel_moe_code_routes_once_and_sums_once(tmp_path: Path) -> None:
    _, _, code = compiled("qwen2_moe", "tensor2", tmp_path)
    assert code.count("rt.moe_route(") == 1  # per block class: replicated routing
    assert "self.mlp.gate = rt.StackedLinear(6, 32, 12)" in code  # 12 of 24 ffn on each rank
    assert "weights = rt.copy_to(weights, self.g_tensor)" in code  # the weights' gradient is summed
    assert "scale = rt.copy_to(torch.sigmoid(self.mlp.shared_router(t)), self.g_tensor)" in code
    # one all-reduce closes the experts and the shared expert together
    assert code.count("out = rt.reduce_from(out, self.g_tensor)") == 2  # attention's and the moe's
