"""Compiled plans on real gloo processes vs the unsharded reference (issue: compile and run).

Each case is a .mesh spec compiled by meshc; the generated module is imported on every rank of the
shared worker pool, trained for 3 AdamW steps and compared with the reference model trained in one
process: forward logits, step-0 gradients, the loss at every step and every parameter afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import meshllm_dsl.runtime as rt  # noqa: E402
from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.pool import RankContext, WorkerPool  # noqa: E402
from meshllm_dsl.runtime.reference import build_reference  # noqa: E402
from meshllm_dsl.verify import load_generated  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5

LLAMA = """
model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }
"""
GPT2 = """
model m = gpt2 { vocab = 64, hidden = 32, layers = 4, heads = 4, positions = 16 }
"""
TP = """
    shard blocks.*.attn.{q,k,v} column(tensor)
    shard blocks.*.attn.o row(tensor)
    shard blocks.*.mlp.{gate,up} column(tensor)
    shard blocks.*.mlp.down row(tensor)
    shard embed vocab_parallel(tensor)
    shard lm_head column(tensor)
"""


def _spec(axes: str, body: str, model: str = LLAMA) -> str:
    return f"mesh m {{ axes {axes} }}\n{model}\nplan p on m for m {{\n    batch = 8\n    seq = 8\n{body}\n}}\n"


CASES: dict[str, str] = {
    "tensor2": _spec("tensor = 2", TP),
    "pipeline2_gpipe": _spec("pipeline = 2", "microbatches = 2\n stages over pipeline balanced\n schedule gpipe"),
    "pipeline2_1f1b": _spec("pipeline = 2", "microbatches = 4\n stages over pipeline balanced\n schedule 1f1b"),
    "data2_zero1": _spec("data = 2", "layout { batch -> data }\n optimizer adamw { zero 1 over data }"),
    "pipeline2_tensor2": _spec("pipeline = 2, tensor = 2", TP + "microbatches = 2\n stages over pipeline balanced"),
    "interleaved": _spec("pipeline = 2", "microbatches = 4\n stages over pipeline virtual 2 balanced\n schedule interleaved_1f1b"),
    "gpt2_tied_pipeline2_tensor2": _spec(
        "pipeline = 2, tensor = 2",
        "microbatches = 2\n layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n stages over pipeline balanced",
        GPT2,
    ),
    "gpt2_tied_same_stage_tensor2": _spec(
        "tensor = 2", "layout { heads -> tensor, ffn -> tensor, vocab -> tensor }", GPT2
    ),
    "data2_pipeline2_tensor2": (ROOT / "examples" / "tiny_llama.mesh").read_text(),
}


def _job(ctx: RankContext, path: str) -> dict[str, float]:
    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    ref = build_reference(dict(program.model), torch.float32, seed=0)
    opt_kwargs = {"lr": 1e-3, **dict(program.optimizer)}
    ref_opt = torch.optim.AdamW(ref.parameters(), **opt_kwargs)
    gen = torch.Generator().manual_seed(5)
    vocab = program.vocab
    batches = [(torch.randint(0, vocab, (program.batch, program.seq), generator=gen),
                torch.randint(0, vocab, (program.batch, program.seq), generator=gen)) for _ in range(3)]
    errs: dict[str, float] = {"forward": (built.forward(batches[0][0]) - ref(batches[0][0])).abs().max().item()}
    for step, (tokens, targets) in enumerate(batches):
        loss = built.train_step(tokens, targets)
        ref_opt.zero_grad()
        ref_loss = rt.cross_entropy(ref(tokens), targets)
        ref_loss.backward()
        if step == 0:
            grads = built.full_grads()
            errs["grads@0"] = max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters())
        ref_opt.step()
        errs[f"loss@{step}"] = abs(loss - ref_loss.item())
    state = built.full_state_dict()
    ref_state = ref.state_dict()
    assert state.keys() == ref_state.keys(), sorted(set(state) ^ set(ref_state))
    errs["params@3"] = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    return errs


@pytest.fixture(scope="module")
def pool() -> Any:
    with WorkerPool(world_size=8) as p:
        yield p


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_plan_matches_unsharded_reference(name: str, pool: WorkerPool, tmp_path: Path) -> None:
    result = check_text(CASES[name], f"{name}.mesh")
    assert result.ok, [str(d.message) for d in result.errors]
    (plan,) = result.plans.values()
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", CASES[name]))
    per_rank = pool.run(_job, plan.mesh.devices, str(path))
    for rank, errs in enumerate(per_rank):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_meshc_verify_reports_equal_for_a_bundled_plan() -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "meshllm_dsl", "verify", str(ROOT / "examples" / "tiny_gpt2.mesh")],
        capture_output=True, text=True, timeout=300, cwd="/",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: EQUAL" in proc.stdout
    assert "tiny twin:" in proc.stdout
