"""Greedy decoding with the KV cache (sharded over tensor, across pipeline ranks) vs recomputation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rt_models import VOCAB, gpt2_model, llama_model, split_stages, vocab_loss

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool
from meshllm_dsl.runtime.model.reference import build_reference


def _reference_greedy(model: dict[str, Any], prompt: torch.Tensor, n_new: int) -> torch.Tensor:
    ref = build_reference(model, torch.float64, seed=5)
    tokens = prompt
    with torch.no_grad():
        for _ in range(n_new):  # no cache: the whole sequence every step
            tokens = torch.cat([tokens, ref(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def _generate_job(
    ctx: RankContext, kind: str, axes: Any, stages: int, pipeline_axis: str | None
) -> list[list[int]]:
    model = llama_model(4) if kind == "llama" else gpt2_model(4)
    program = rt.Program(
        model=model,
        axes=axes,
        stages=split_stages(kind, 4, stages, tie=kind == "gpt2"),
        loss=vocab_loss,
        pipeline_axis=pipeline_axis,
        dtype=torch.float64,
    )
    built = program.build(ctx.mesh(axes), seed=5)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    out = rt.greedy_generate(built, prompt, 8)
    assert torch.equal(out, _reference_greedy(model, prompt, 8))
    return out.tolist()


CASES = {
    "llama-tensor2": ("llama", (("tensor", 2),), 1, None),
    "gpt2-tensor4": ("gpt2", (("tensor", 4),), 1, None),
    "llama-pipeline2xtensor2": ("llama", (("pipeline", 2), ("tensor", 2)), 2, "pipeline"),
    "gpt2-pipeline2-interleaved": ("gpt2", (("pipeline", 2), ("tensor", 1)), 4, "pipeline"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kv_cache_decoding_matches_full_recomputation(pool: WorkerPool, name: str) -> None:
    kind, axes, stages, pipeline_axis = CASES[name]
    n = 1
    for _, size in axes:
        n *= size
    outs = pool.run(_generate_job, n, kind, axes, stages, pipeline_axis)
    assert all(o == outs[0] for o in outs)
    assert len(outs[0][0]) == 13
