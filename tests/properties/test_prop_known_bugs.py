"""Regression tests for bugs the equivalence property found, as fixed plans (fast, no hypothesis)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from equiv import compare, over_tolerance, write_module

from meshllm_dsl.checker import check_text
from meshllm_dsl.runtime.jobs.pool import WorkerPool

# GPT-2 (head tied to the embedding) without a pipeline: embed and lm_head share one stage.
# Found by test_prop_equivalence. Codegen declared `self.lm_head.weight = nn.Parameter(torch.empty(...))`
# in that stage instead of using `self.embed.weight`; params() did not map it, so Program.build
# failed with "params() and the module disagree; only in the module: ['lm_head.weight']" (without that
# check the head would have multiplied by uninitialised memory). Pipelined GPT-2 plans, where the
# head lives on another stage, were fine.
TIED_ONE_STAGE = {
    "replicated": """
mesh m { axes data = 1 }
model net = gpt2 { vocab = 12, hidden = 8, layers = 1, heads = 2, positions = 4 }
plan p on m for net { batch = 2  seq = 4 }
""",
    "tensor2": """
mesh m { axes tensor = 2 }
model net = gpt2 { vocab = 16, hidden = 8, layers = 2, heads = 2, positions = 4 }
plan p on m for net {
    batch = 2
    seq = 4
    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }
}
""",
}


@pytest.mark.parametrize("name", list(TIED_ONE_STAGE))
def test_gpt2_tied_head_in_the_embedding_stage(name: str, tmp_path: Path, pool: WorkerPool) -> None:
    text = TIED_ONE_STAGE[name]
    result = check_text(text, f"{name}.mesh")
    assert result.ok, [d.message for d in result.errors]
    (plan,) = result.plans.values()
    path = write_module(plan, text, tmp_path)
    assert not over_tolerance(pool.run(compare, plan.mesh.devices, path))
