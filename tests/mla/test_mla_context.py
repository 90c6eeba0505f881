"""`mla` under context parallelism gathers its latents, not its heads: each layer all-gathers the normed
latent and the rotated shared key ([b, s, kv_lora_rank + qk_rope_head_dim], one call; runtime
ContextShard.gather_latent) and every rank up-projects every rank's latents through its kv_b shard.
The all-gathers `meshc run --profile` logs on gloo ranks are the planner's, call for call and byte for
byte, at the latent's width (the heads' k and v would be heads x (nope + rope + v_head_dim) per token);
the sharded runs themselves are EQUAL to the reference in tests/mla/test_mla_plans.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from reference_jobs import profile_job  # noqa: E402
from test_mla_plans import spec  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.parallel.devices import PROFILES  # noqa: E402
from meshllm_dsl.planner.analyze import analyze  # noqa: E402

# test_mla_plans' model: 2 layers, 4 heads, kv_lora_rank 8, qk_nope 6, qk_rope 4, v_head_dim 5; fp32,
# batch 4 x seq 8: 12 values per token gathered, where every head's k and v are 4 x (6 + 4 + 5) = 60
LATENT = 8 + 4


@pytest.mark.parametrize("plan", ["context2", "tensor2_context2"])
def test_the_context_all_gathers_carry_the_latent_as_planned(plan: str, pool: Any, tmp_path: Path) -> None:
    text = spec("latent_q", plan)
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    p = result.plans["p"]
    code = render_plan(p, "t.mesh", text)
    # the generated forward gathers the latents and attends over keys it up-projected from them
    assert code.count("self.ctx.gather_latent(latent, k_pe)") == 1  # the block class, once
    assert "self.ctx.gathered_attention(q, k, v" in code and "self.ctx.attention(" not in code
    path = tmp_path / "gen.py"
    path.write_text(code)
    rc = analyze(p, PROFILES["cpu"]).ranks[0]
    planned = {c.op: (c.calls, c.payload_bytes) for c in rc.comms if c.kind == "context"}
    # one all-gather per layer forward (2 layers, 1 microbatch) of the whole batch's latents, fp32
    assert planned["all_gather"] == (2, 2 * 4 * 8 * LATENT * 4), planned
    for rank, got in enumerate(pool.run(profile_job, p.mesh.devices, str(path), str(tmp_path / "profile"))):
        logged = {c["op"]: (c["calls"], c["bytes"]) for c in got["collectives"] if c["axes"] == "cp"}
        print(plan, rank, "planned", planned, "logged", logged)
        assert logged.get("all_gather") == planned["all_gather"], (rank, logged, planned)
        # and one reduce-scatter of their gradients per layer backward
        assert logged["reduce_scatter_single"][0] == planned["reduce_scatter"][0], (rank, logged, planned)
