"""Compiled plans on real gloo processes vs the unsharded reference (issue: compile and run).

Each case is a .mesh spec compiled by meshc; the generated module is imported on every rank of the
shared worker pool, trained for 3 AdamW steps and compared with the reference model trained in one
process: forward logits, step-0 gradients, the loss at every step and every parameter afterwards.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mesh_snippets import MEGATRON  # noqa: E402
from reference_jobs import assert_spec_matches_reference  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool  # noqa: E402
from meshllm_dsl.verify.equivalence import load_generated  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

LLAMA = """
model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }
"""
GPT2 = """
model m = gpt2 { vocab = 64, hidden = 32, layers = 4, heads = 4, positions = 16 }
"""
DENSE_MOE = """
model m {
    vocab = 64
    hidden = 32
    embed = embedding(vocab, hidden)
    dense = repeat(1) {
        attn_norm = rmsnorm(hidden)
        attn = attention(hidden, 4, 2)
        mlp_norm = rmsnorm(hidden)
        mlp = mlp(hidden, 64, act = swiglu)
    }
    blocks = repeat(3) {
        attn_norm = rmsnorm(hidden)
        attn = attention(hidden, 4, 2)
        mlp_norm = rmsnorm(hidden)
        mlp = moe(hidden, 16, 4, 2)
    }
    norm = rmsnorm(hidden)
    lm_head = linear(hidden, vocab)
}
"""


def _spec(axes: str, body: str, model: str = LLAMA) -> str:
    return f"mesh m {{ axes {axes} }}\n{model}\nplan p on m for m {{\n    batch = 8\n    seq = 8\n{body}\n}}\n"


CASES: dict[str, str] = {
    "tensor2": _spec("tensor = 2", MEGATRON),
    "pipeline2_gpipe": _spec("pipeline = 2", "microbatches = 2\n stages over pipeline balanced\n schedule gpipe"),
    "pipeline2_1f1b": _spec("pipeline = 2", "microbatches = 4\n stages over pipeline balanced\n schedule 1f1b"),
    "data2_zero1": _spec("data = 2", "layout { batch -> data }\n optimizer adamw { zero 1 over data }"),
    "pipeline2_tensor2": _spec("pipeline = 2, tensor = 2", MEGATRON + "microbatches = 2\n stages over pipeline balanced"),
    "interleaved": _spec("pipeline = 2", "microbatches = 4\n stages over pipeline virtual 2 balanced\n schedule interleaved_1f1b"),
    "gpt2_tied_pipeline2_tensor2": _spec(
        "pipeline = 2, tensor = 2",
        "microbatches = 2\n layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n stages over pipeline balanced",
        GPT2,
    ),
    "gpt2_tied_same_stage_tensor2": _spec(
        "tensor = 2", "layout { heads -> tensor, ffn -> tensor, vocab -> tensor }", GPT2
    ),
    # one dim split over two axes, listed against mesh order: chunks follow the mesh order
    "tensor_over_two_axes_out_of_order": _spec(
        "a = 2, b = 2", MEGATRON.replace("(tensor)", "(b, a)"), LLAMA.replace("kv_heads = 2", "kv_heads = 4")
    ),
    "data2_pipeline2_tensor2": (ROOT / "examples" / "tiny_llama.mesh").read_text(),
    # Activation recomputation: the tensor-parallel f / g collectives run again inside the recomputed
    # region, under pipeline schedules, with data parallelism and ZeRO-1; gradients must not double.
    "recompute_blocks_pipeline2_tensor2_1f1b": _spec(
        "pipeline = 2, tensor = 2", MEGATRON + "microbatches = 2\n recompute = blocks\n stages over pipeline balanced\n schedule 1f1b"
    ),
    "recompute_attention_pipeline2_tensor2_gpipe": _spec(
        "pipeline = 2, tensor = 2", MEGATRON + "microbatches = 2\n recompute = attention\n stages over pipeline balanced\n schedule gpipe"
    ),
    "recompute_blocks_interleaved": _spec(
        "pipeline = 2", "microbatches = 4\n recompute = blocks\n stages over pipeline virtual 2 balanced\n schedule interleaved_1f1b"
    ),
    "recompute_blocks_gpt2_data2_tensor2_zero1": _spec(
        "data = 2, tensor = 2",
        "recompute = blocks\n layout { batch -> data, heads -> tensor, ffn -> tensor, vocab -> tensor }\n optimizer adamw { zero 1 }",
        GPT2,
    ),
    # ZeRO 2 / 3 by FSDP2 over the data ranks, composed with the hand-written tensor parallelism,
    # pipeline schedules, tied weights across stages and gradient clipping.
    "data2_tensor2_zero3_clip": _spec(
        "data = 2, tensor = 2", MEGATRON + "microbatches = 2\n layout { batch -> data }\n optimizer adamw { zero 3\n clip = 0.01 }"
    ),
    "gpt2_tied_data2_pipeline2_tensor2_zero2_1f1b": _spec(
        "data = 2, pipeline = 2, tensor = 2",
        "microbatches = 2\n layout { batch -> data, heads -> tensor, ffn -> tensor, vocab -> tensor }\n"
        " stages over pipeline balanced\n schedule 1f1b\n optimizer adamw { zero 2\n clip = 0.05 }",
        GPT2,
    ),
    # `precision`: compared with every dtype set to float32 / float64, so FSDP2's
    # MixedPrecisionPolicy casts and reduction dtype run while the comparison stays exact.
    "precision_data2_tensor2_zero3": _spec(
        "data = 2, tensor = 2",
        MEGATRON + "layout { batch -> data }\n precision { params = bf16, master = fp32, reduce = fp32 }\n optimizer adamw { zero 3 }",
    ),
    # One data rank: FSDP2 over a group of one, so `precision` still applies.
    "precision_data1_tensor2_zero3": _spec(
        "data = 1, tensor = 2", MEGATRON + "layout { batch -> data }\n precision { params = bf16, master = fp32 }\n optimizer adamw { zero 3 }"
    ),
    # Recomputation reruns a block's forward in backward: FSDP2 gathers its weights again.
    "recompute_blocks_data2_tensor2_zero3": _spec(
        "data = 2, tensor = 2", MEGATRON + "microbatches = 2\n recompute = blocks\n layout { batch -> data }\n optimizer adamw { zero 3 }"
    ),
    "tiny_llama_zero3_interleaved": (ROOT / "examples" / "tiny_llama.mesh").read_text().replace(
        "zero 1", "zero 3").replace("stages over pipeline balanced", "stages over pipeline virtual 2 balanced").replace(
        "schedule 1f1b", "schedule interleaved_1f1b"),
    "recompute_tiny_llama_data2_pipeline2_tensor2": (ROOT / "examples" / "tiny_llama.mesh").read_text().replace(
        "    batch = 8", "    batch = 8\n    recompute = blocks"
    ),
    # Blocks of two kinds (a dense block, then moe blocks: issue 38): the example's data x pipeline x
    # tensor with the experts over data; interleaved stages under context parallelism, a stage's range
    # crossing from one repeat into the other; ZeRO-3 with every other block of each kind recomputed.
    "block_kinds_data2_pipeline2_tensor2": (ROOT / "examples" / "tiny_dense_moe.mesh").read_text(),
    # The deepseek_v3 family's example: latent attention, dense then sigmoid-routed moe blocks, the
    # experts over data inside tensor parallelism.
    "tiny_deepseek_data2_tensor2": (ROOT / "examples" / "tiny_deepseek.mesh").read_text(),
    "block_kinds_interleaved_context2": _spec("pipeline = 2, cp = 2", "microbatches = 4\n layout { seq -> cp }\n"
                                              " stages over pipeline virtual 2 balanced\n schedule interleaved_1f1b",
                                              DENSE_MOE),
    "block_kinds_zero3_recompute_every2": _spec("data = 2, tensor = 2", MEGATRON.replace("blocks.*", "*.*").replace(
        "shard *.*.mlp.{gate,up} column(tensor)", "shard dense.*.mlp.{gate,up} column(tensor)").replace(
        "shard *.*.mlp.down row(tensor)", "shard dense.*.mlp.down row(tensor)") + "layout { batch -> data, experts -> data }\n"
        " shard blocks.*.mlp.{router,gate,up,down} replicate\n recompute = blocks every 2\n optimizer adamw { zero 3 }",
        DENSE_MOE.replace("repeat(1)", "repeat(2)")),
}





@pytest.mark.parametrize("name", list(CASES))
def test_compiled_plan_matches_unsharded_reference(name: str, pool: WorkerPool, tmp_path: Path) -> None:
    assert_spec_matches_reference(pool, CASES[name], name, tmp_path)


def test_meshc_verify_reports_equal_for_a_bundled_plan() -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "meshllm_dsl", "verify", str(ROOT / "examples" / "tiny_gpt2.mesh")],
        capture_output=True, text=True, timeout=300, cwd="/",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: EQUAL" in proc.stdout
    assert "tiny twin:" in proc.stdout


def _precision_job(ctx: RankContext, path: str) -> dict[str, Any]:
    from meshllm_dsl.runtime.train.launch import synthetic_batch

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    losses = [built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 7, s)) for s in range(2)]
    params = built.parameters()
    state = built.optimizer.state[params[0]]
    return {
        "param": {str(p.dtype) for p in params},
        "optim": {str(v.dtype) for k, v in state.items() if k != "step"},
        "logits": str(built.run_stages(torch.zeros(2, 8, dtype=torch.long)).dtype),
        "losses": losses,
    }


def test_precision_keeps_fp32_master_weights_and_computes_in_bf16(pool: WorkerPool, tmp_path: Path) -> None:
    text = CASES["precision_data2_tensor2_zero3"]
    (plan,) = check_text(text, "p.mesh").plans.values()
    path = tmp_path / "p.py"
    path.write_text(render_plan(plan, "p.mesh", text))
    got = pool.run(_precision_job, plan.mesh.devices, str(path))[0]
    assert got["param"] == {"torch.float32"} and got["optim"] == {"torch.float32"}
    assert got["logits"] == "torch.bfloat16"
    assert all(math.isfinite(x) for x in got["losses"]) and got["losses"][1] < got["losses"][0]
