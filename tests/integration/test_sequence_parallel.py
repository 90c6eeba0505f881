"""Sequence parallelism (`layout { seq -> tensor }`) on real gloo processes vs the unsharded reference.

Each plan is compiled by meshc and trained for 3 AdamW steps on the shared worker pool, in float32
and float64; logits, step-0 gradients (norm weights included: their per-rank gradients are partial
until the runtime sums them over the tensor axis), the loss at every step and every parameter
afterwards must match the reference model trained in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from mesh_snippets import MEGATRON  # noqa: E402
from reference_jobs import compare_job  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool  # noqa: E402
from meshllm_dsl.verify.equivalence import load_generated  # noqa: E402

LLAMA = "model m = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }"
# GPT-2: learned positions (added, then the sum is split along the sequence), LayerNorm weights and
# biases, row-layer biases added after the reduce-scatter (partial gradients too), a tied head.
GPT2 = "model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }"
GPT2_TP = "layout { heads -> tensor, ffn -> tensor, vocab -> tensor, seq -> tensor }"
SP = "layout { seq -> tensor }"


def _spec(axes: str, body: str, model: str = LLAMA, seq: int = 8) -> str:
    return f"mesh m {{ axes {axes} }}\n{model}\nplan p on m for m {{\n    batch = 4\n    seq = {seq}\n{body}\n}}\n"


CASES: dict[str, str] = {
    "tensor2": _spec("tensor = 2", MEGATRON + SP),
    "tensor4": _spec("tensor = 4", MEGATRON + SP, LLAMA.replace("kv_heads = 2", "kv_heads = 4")),
    "gpt2_tensor2": _spec("tensor = 2", GPT2_TP, GPT2),
    "data2_tensor2_zero1": _spec(
        "data = 2, tensor = 2", MEGATRON + "layout { batch -> data, seq -> tensor }\n optimizer adamw { zero 1 }"
    ),
    "microbatches2_tensor2_clip": _spec(
        "tensor = 2", MEGATRON + SP + "\n microbatches = 2\n optimizer adamw { clip = 0.01 }"
    ),
    # The collectives inside the recomputed region run again in backward; gradients must not double.
    "recompute_blocks_tensor2": _spec("tensor = 2", MEGATRON + SP + "\n recompute = blocks"),
    "recompute_attention_gpt2_data2_tensor2": _spec(
        "data = 2, tensor = 2",
        "recompute = attention\n layout { batch -> data, heads -> tensor, ffn -> tensor, vocab -> tensor, seq -> tensor }",
        GPT2,
    ),
    # Two mesh axes: the sequence chunks follow the flattened coordinate, like the heads' chunks.
    "two_axes": _spec("a = 2, b = 2", MEGATRON.replace("(tensor)", "(b, a)") + "layout { seq -> b * a }",
                      LLAMA.replace("kv_heads = 2", "kv_heads = 4")),
    # Between pipeline stages the residual stream is [mb, s / t, hidden].
    "pipeline2_tensor2_1f1b": _spec(
        "pipeline = 2, tensor = 2", MEGATRON + SP + "\n microbatches = 2\n stages over pipeline balanced\n schedule 1f1b"
    ),
    "gpt2_tied_pipeline2_tensor2_recompute": _spec(
        "pipeline = 2, tensor = 2", GPT2_TP + "\n microbatches = 2\n recompute = blocks\n stages over pipeline balanced", GPT2
    ),
    "interleaved_tensor2": _spec(
        "pipeline = 2, tensor = 2",
        MEGATRON + SP + "\n microbatches = 4\n stages over pipeline virtual 2 balanced\n schedule interleaved_1f1b",
        LLAMA.replace("layers = 2", "layers = 4"),
    ),
    "data2_pipeline2_tensor2": _spec(
        "data = 2, pipeline = 2, tensor = 2",
        MEGATRON + "layout { batch -> data, seq -> tensor }\n microbatches = 2\n stages over pipeline balanced",
    ),
    # With ZeRO 2 / 3 (FSDP2) the norms' partial gradients are DTensors over the data ranks: their
    # local slices are summed over tensor (an all-reduce on the DTensor itself has no sharding rule).
    "data2_tensor2_zero3_precision": _spec(
        "data = 2, tensor = 2",
        MEGATRON + "layout { batch -> data, seq -> tensor }\n optimizer adamw { zero 3 }\n"
        " precision { params = fp32, master = fp32, reduce = fp32 }",
    ),
    # ZeRO 1 with master weights (the distributed optimizer, FSDP2): gradients accumulated whole over
    # the microbatches, the norms' partial ones summed over tensor on the data shards.
    "data2_tensor2_zero1_master": _spec(
        "data = 2, tensor = 2",
        MEGATRON + "layout { batch -> data, seq -> tensor }\n microbatches = 2\n optimizer adamw { zero 1 }\n"
        " precision { params = bf16, master = fp32 }",
    ),
    "gpt2_data2_pipeline2_tensor2_zero2": _spec(
        "data = 2, pipeline = 2, tensor = 2",
        "layout { batch -> data, heads -> tensor, ffn -> tensor, vocab -> tensor, seq -> tensor }\n microbatches = 2\n"
        " stages over pipeline balanced\n optimizer adamw { zero 2 }",
        GPT2,
    ),
    # A replicated head (gathered with a split backward) and a replicated embedding (split after it).
    "replicated_head_and_embedding": _spec(
        "tensor = 2",
        MEGATRON.replace("vocab_parallel(tensor)", "replicate").replace("lm_head column(tensor)", "lm_head replicate") + SP,
    ),
}





@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_plan_matches_unsharded_reference(name: str, pool: WorkerPool, tmp_path: Path) -> None:
    result = check_text(CASES[name], f"{name}.mesh")
    assert result.ok, [str(d.message) for d in result.errors]
    (plan,) = result.plans.values()
    assert plan.roles.sequence in (("tensor",), ("a", "b"))
    path = tmp_path / f"{name}.py"
    text = render_plan(plan, f"{name}.mesh", CASES[name])
    assert "rt.reduce_scatter_seq(" in text and "rt.gather_seq_linear(" in text
    assert f"partial_grad={plan.roles.sequence!r}" in text
    path.write_text(text)
    per_rank = pool.run(compare_job, plan.mesh.devices, str(path))
    for rank, errs in enumerate(per_rank):
        for dtype, by_key in errs.items():
            assert any(k.startswith("grad ") and "norm" in k for k in by_key), "norm gradients are compared"
            bad = {k: v for k, v in by_key.items() if not v <= TOLERANCE[dtype]}
            assert not bad, f"rank {rank}, {dtype}: {bad}"


def _generate_job(ctx: RankContext, path: str) -> list[list[int]]:
    from meshllm_dsl.runtime.model.generate import greedy_generate
    from meshllm_dsl.runtime.model.reference import build_reference

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=5)
    # 5 prompt tokens then 1 at a time: neither splits over the tensor axis, so decoding keeps the
    # sequence whole (the sequence-parallel operators act as their tensor-parallel counterparts).
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    out = greedy_generate(built, prompt, 6)
    ref = build_reference(program.model, torch.float32, seed=5)
    tokens = prompt
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.cat([tokens, ref(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens), (out.tolist(), tokens.tolist())
    # A full forward of a sequence that splits runs sequence-parallel, and gives the same logits.
    full = built.forward(tokens[:, :8])
    assert torch.allclose(full, ref(tokens[:, :8]), atol=1e-5)
    return out.tolist()


@pytest.mark.parametrize("name", ["gpt2_tensor2", "pipeline2_tensor2_1f1b"])
def test_sequence_parallel_plan_decodes_like_the_reference(name: str, pool: WorkerPool, tmp_path: Path) -> None:
    result = check_text(CASES[name], f"{name}.mesh")
    (plan,) = result.plans.values()
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", CASES[name]))
    outs = pool.run(_generate_job, plan.mesh.devices, str(path))
    assert all(o == outs[0] for o in outs)
