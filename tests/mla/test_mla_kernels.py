"""The kernels an `mla` layer launches, planned vs counted by `meshc run --profile` on gloo ranks
(the planner's host time on CPU devices is kernels x the device's kernel cost). Counted 2026-12-04, torch 2.13
CPU: 699, 756 and 601, each as planned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from reference_jobs import profile_job  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.parallel.devices import PROFILES  # noqa: E402
from meshllm_dsl.planner.analyze import analyze  # noqa: E402

MODEL = ("model m {{\n    vocab = 64, hidden = 32, layers = 2, heads = 4, ffn = 48, dtype = fp32\n"
         "    embed = embedding(vocab, hidden)\n    blocks = repeat(layers) {{\n        attn_norm = rmsnorm(hidden)\n"
         "        attn = mla(hidden, heads, 8, 6, 4, 5{q})\n"
         "        mlp_norm = rmsnorm(hidden)\n        mlp = mlp(hidden, ffn)\n    }}\n"
         "    norm = rmsnorm(hidden)\n    lm_head = linear(hidden, vocab)\n}}\n")
TP = ("    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n"
      "    shard blocks.*.attn.{q_a,kv_a} replicate\n")
PLANS = {
    "single_latent_q": ("one = 1", "", ", q_lora_rank = 16"),
    "tensor2_latent_q": ("tensor = 2", TP, ", q_lora_rank = 16"),
    "single_direct_q_halves": ("one = 1", "", ", rope_interleave = false"),
}


@pytest.mark.parametrize("plan", PLANS)
def test_planned_kernels_match_the_runtime(plan: str, pool: Any, tmp_path: Path) -> None:
    axes, body, q = PLANS[plan]
    if "q_lora" not in q:
        body = body.replace("{q_a,kv_a}", "kv_a")
    text = f"mesh m {{ axes {axes} }}\n{MODEL.format(q=q)}plan p on m for m {{\n    batch = 4\n    seq = 8\n{body}}}\n"
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    p = result.plans["p"]
    path = tmp_path / "gen.py"
    path.write_text(render_plan(p, "t.mesh", text))
    rc = analyze(p, PROFILES["cpu"]).ranks[0]
    for rank, got in enumerate(pool.run(profile_job, p.mesh.devices, str(path), str(tmp_path / "profile"))):
        print(plan, rank, "planned", rc.kernels, "counted", got["kernels"], f"{rc.kernels / got['kernels']:.3f}")
        assert rc.kernels == pytest.approx(got["kernels"], rel=0.02), (rank, rc.kernels, got["kernels"])
        # the tensor axis' all-reduces: calls and bytes as logged (f's over the concatenated latents)
        planned = [(c.calls, c.payload_bytes) for c in rc.comms if c.kind == "tensor" and c.op == "all_reduce"]
        logged = [(c["calls"], c["bytes"]) for c in got["collectives"] if c["axes"] == "tensor" and c["op"] == "all_reduce"]
        print(plan, "all_reduce planned", planned, "logged", logged)
        assert (sum(n for n, _ in planned), sum(b for _, b in planned)) == (sum(n for n, _ in logged), sum(b for _, b in logged))
