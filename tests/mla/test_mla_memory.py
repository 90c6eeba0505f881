"""What an `mla` layer keeps for backward, planned vs measured: the activations per microbatch the
planner charges a rank against what `meshc run --profile`'s memory probe measures on gloo ranks
(measured 2026-12-04, torch 2.13 CPU: planned / measured 1.0014 single, 1.0010 tensor 2, 1.0006
context 2, 0.9998 and 0.9999 with `recompute = attention`; 2026-12-05, the latents gathered under context
parallelism: 1.0006 context 2, 1.0008 tensor 2 x context 2, 0.9999 context 2 with `recompute = attention`;
the recomputed region started from the latents, keeping q, the latent and the rotary key instead of the
heads' k and v: with `recompute = attention` 0.9999 single (21,091,365 -> 17,486,885 bytes), 0.9997 tensor 2
(13,687,296 -> 11,917,824), 0.9999 context 2 (12,577,285 -> 8,907,269), 0.9997 tensor 2 x context 2
(8,088,832 -> 6,253,824))."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from reference_jobs import memory_job  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.planner.analyze import analyze  # noqa: E402

MODEL = ("model m {\n    vocab = 256, hidden = 256, layers = 4, heads = 8, ffn = 512, dtype = fp32\n"
         "    embed = embedding(vocab, hidden)\n    blocks = repeat(layers) {\n        attn_norm = rmsnorm(hidden)\n"
         "        attn = mla(hidden, heads, 64, 32, 16, 32, q_lora_rank = 96)\n"
         "        mlp_norm = rmsnorm(hidden)\n        mlp = mlp(hidden, ffn)\n    }\n"
         "    norm = rmsnorm(hidden)\n    lm_head = linear(hidden, vocab)\n}\n")
TP = ("    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n"
      "    shard blocks.*.attn.{q_a,kv_a} replicate\n")
# (mesh axes, plan lines, whether the CPU's SDPA runs a fused kernel: causal without a mask it does;
# under context parallelism's mask of global positions it computes the probabilities and keeps them)
PLANS = {
    "single": ("one = 1", "", True),
    "tensor2": ("tensor = 2", TP, True),
    "context2": ("cp = 2", "    layout { seq -> cp }\n", False),
    # the heads split over tensor, every rank's latents gathered over cp into each kv_b shard
    "tensor2_context2": ("tensor = 2, cp = 2", TP.replace("vocab -> tensor }", "vocab -> tensor, seq -> cp }"), False),
    "single_recompute_attention": ("one = 1", "    recompute = attention\n", True),
    "tensor2_recompute_attention": ("tensor = 2", TP + "    recompute = attention\n", True),
    # the region from the latents rerun in backward (kv_b, k and v, the core): its output and log-sum-exp,
    # or its probabilities, and the whole sequence's k and v not kept; the gathered latents kept
    "context2_recompute_attention": ("cp = 2", "    layout { seq -> cp }\n    recompute = attention\n", False),
    "tensor2_context2_recompute_attention": ("tensor = 2, cp = 2", TP.replace("vocab -> tensor }", "vocab -> tensor, seq -> cp }")
                                             + "    recompute = attention\n", False),
}


@pytest.mark.parametrize("plan", PLANS)
def test_planned_activations_are_the_measured(plan: str, pool: Any, tmp_path: Path) -> None:
    axes, body, fused = PLANS[plan]
    text = f"mesh m {{ axes {axes} }}\n{MODEL}plan p on m for m {{\n    batch = 4\n    seq = 64\n{body}}}\n"
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    p = result.plans["p"]
    path = tmp_path / f"mla_{plan}.py"
    path.write_text(render_plan(p, "t.mesh", text))
    memory = pool.run(memory_job, p.mesh.devices, str(path))
    rc = analyze(p, flash_attention=fused).ranks[0]
    for rank, mem in enumerate(memory):
        saved = mem["activations_per_microbatch"]
        print(plan, rank, "measured", saved, "planned", rc.activation_bytes_per_microbatch,
              f"{rc.activation_bytes_per_microbatch / saved:.4f}")
        assert 0.995 * saved <= rc.activation_bytes_per_microbatch <= 1.005 * saved, (rank, saved, rc.activation_bytes_per_microbatch)
