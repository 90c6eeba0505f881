"""The training loop's optimizer settings: global-norm gradient clipping and warmup + cosine decay.

`clip` must clip by the norm of the *unsharded* model's gradient (every element once, whatever the
layout), and the learning rate must follow the same schedule as the reference, step by step:
compared with torch's own `clip_grad_norm_` on the unsharded model over several AdamW steps on
data x pipeline x tensor (ZeRO-1) and on a tied GPT-2 over pipeline x tensor, in float64.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from mesh_snippets import MEGATRON  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402
from meshllm_dsl.runtime.train.program import lr_at  # noqa: E402
from meshllm_dsl.verify.equivalence import load_generated  # noqa: E402

LLAMA = "model m = llama { vocab = 32, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 32, dtype = fp32 }"
GPT2 = "model m = gpt2 { vocab = 32, hidden = 32, layers = 2, heads = 4, positions = 16 }  # tied head (the family default)"
OPT = "    optimizer adamw { lr = 0.01, clip = 0.02, warmup = 2, decay_steps = 4, min_lr = 0.001 ZERO }"

PLANS = {
    "llama_d2_p2_t2_zero1": (
        "mesh m { axes data = 2, pipeline = 2, tensor = 2 }\n" + LLAMA + "\nplan p on m for m {\n    batch = 4\n"
        "    seq = 6\n    microbatches = 2\n    layout { batch -> data }\n" + MEGATRON
        + "    stages over pipeline balanced\n    schedule 1f1b\n" + OPT.replace("ZERO", ", zero 1") + "\n}\n"
    ),
    "gpt2_tied_p2_t2": (
        "mesh m { axes pipeline = 2, tensor = 2 }\n" + GPT2 + "\nplan p on m for m {\n    batch = 4\n    seq = 6\n"
        "    microbatches = 2\n    shard blocks.*.attn.qkv column(tensor)\n    shard blocks.*.attn.o row(tensor)\n"
        "    shard blocks.*.mlp.up column(tensor)\n    shard blocks.*.mlp.down row(tensor)\n"
        "    shard embed vocab_parallel(tensor)\n    shard lm_head column(tensor)\n    stages over pipeline balanced\n    schedule gpipe\n"
        + OPT.replace("ZERO", "") + "\n}\n"
    ),
}



def _compare_job(ctx: Any, path: str, steps: int) -> tuple[dict[str, float], list[float]]:
    import torch

    from meshllm_dsl.runtime.jobs.compare import compare_to_reference
    from meshllm_dsl.runtime.train.program import Built

    program = load_generated(path).PROGRAM
    norms: list[float] = []
    real = Built.clip_grads

    def spy(self: Any, max_norm: float) -> float:
        norms.append(real(self, max_norm))
        return norms[-1]

    Built.clip_grads = spy  # type: ignore[method-assign]
    try:
        errs = compare_to_reference(program, ctx.mesh(program.axes), dtype=torch.float64, steps=steps)
    finally:
        Built.clip_grads = real  # type: ignore[method-assign]
    return errs, norms


@pytest.mark.parametrize("name", list(PLANS))
def test_clipping_and_schedule_equal_the_unsharded_model(name: str, pool: WorkerPool, tmp_path: Path) -> None:
    result = check_text(PLANS[name], f"{name}.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    plan = result.plans["p"]
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", PLANS[name]))
    per_rank = pool.run(_compare_job, plan.mesh.devices, str(path), 5)
    for rank, (errs, norms) in enumerate(per_rank):
        bad = {k: v for k, v in errs.items() if not v <= 1e-10}
        assert not bad, f"rank {rank}: {bad}"
        assert {f"grad_norm@{k}" for k in range(5)} <= set(errs)
        # The clip really bit (else the test would not test it), and every rank saw the same norm.
        assert len(norms) == 5 and all(n > 0.02 for n in norms)
        assert norms == per_rank[0][1]


def test_learning_rate_schedule() -> None:
    s = {"lr": 1.0, "warmup": 4, "decay_steps": 10, "min_lr": 0.1}
    assert [lr_at(s, k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(s, 4) == 1.0
    assert lr_at(s, 7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(s, 10) == pytest.approx(0.1) and lr_at(s, 1000) == pytest.approx(0.1)
    assert lr_at({"lr": 0.5}, 123) == 0.5  # no schedule: constant
    assert lr_at({"lr": 0.5, "warmup": 2}, 5) == 0.5  # warmup only


@pytest.mark.parametrize(
    ("given", "bad", "code"),
    [("clip = 0.02", "clip = 0", "E0307"), ("clip = 0.02", "clip = -1", "E0307"),
     ("warmup = 2", "warmup = 2.5", "E0304"), ("decay_steps = 4", "decay_steps = -3", "E0307"),
     ("clip = 0.02", "clipp = 1.0", "E0203")],
)
def test_bad_loop_settings_are_located_errors(given: str, bad: str, code: str) -> None:
    text = PLANS["llama_d2_p2_t2_zero1"].replace(given, bad)
    result = check_text(text, "x.mesh")
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == [code], [d.message for d in errors]
    assert errors[0].span is not None and errors[0].help
