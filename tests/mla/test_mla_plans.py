"""The `mla` layer in compiled plans: tensor, context and pipeline parallel runs against the unsharded
reference model on the shared pool of gloo ranks (logits, every gradient, the loss at each of 3 AdamW
steps and every parameter after them, in float32 and float64), and the generated forward's collectives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from reference_jobs import assert_spec_matches_reference  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402

# A query latent, rotary pairs interleaved (DeepSeek-V3's layout); and a direct q projection with
# rotary halves, biases and YaRN with DeepSeek's mscale / mscale_all_dim (DeepSeek-V2-Lite's shape).
MLA = {
    "latent_q": "q_lora_rank = 16",
    "direct_q_yarn": ("q_lora_rank = 0, rope_interleave = false, bias = true, rope_type = yarn, rope_factor = 8.0, "
                      "rope_original_positions = 4, rope_mscale = 1.0, rope_mscale_all_dim = 0.7"),
}


def model(settings: str) -> str:
    return ("model m {\n    vocab = 64, hidden = 32, layers = 2, heads = 4, ffn = 48, dtype = fp32\n"
            "    embed = embedding(vocab, hidden)\n    blocks = repeat(layers) {\n        attn_norm = rmsnorm(hidden)\n"
            f"        attn = mla(hidden, heads, 8, 6, 4, 5, {settings})\n"
            "        mlp_norm = rmsnorm(hidden)\n        mlp = mlp(hidden, ffn)\n    }\n"
            "    norm = rmsnorm(hidden)\n    lm_head = linear(hidden, vocab)\n}\n")


TP = ("    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n"
      "    shard blocks.*.attn.{q_a,kv_a} replicate\n")
PLANS = {  # mesh axes, plan lines
    "single": ("one = 1", ""),
    "tensor2": ("tensor = 2", TP),
    "context2": ("cp = 2", "    layout { seq -> cp }\n"),
    # the heads split over tensor, every rank's latents gathered over cp and up-projected by each kv_b shard
    "tensor2_context2": ("tensor = 2, cp = 2", TP.replace("vocab -> tensor }", "vocab -> tensor, seq -> cp }")),
    "pipeline2": ("pipeline = 2", "    microbatches = 2\n    stages over pipeline balanced\n"),
    # the recomputed region from the latents: kv_b's up-projection, k and v and the core rerun in
    # backward (under context parallelism over the gathered latents, every rank's)
    "tensor2_recompute": ("tensor = 2", TP + "    recompute = attention\n"),
    "context2_recompute": ("cp = 2", "    layout { seq -> cp }\n    recompute = attention\n"),
    "tensor2_context2_recompute": ("tensor = 2, cp = 2", TP.replace("vocab -> tensor }", "vocab -> tensor, seq -> cp }")
                                   + "    recompute = attention\n"),
    # everything at once, the attention core recomputed in backward
    "pipeline2_tensor2_context2": ("pipeline = 2, tensor = 2, cp = 2", TP.replace("vocab -> tensor }", "vocab -> tensor, seq -> cp }")
                                   + "    microbatches = 2\n    stages over pipeline balanced\n    recompute = attention\n"),
}


def spec(kind: str, plan: str) -> str:
    axes, body = PLANS[plan]
    if kind == "direct_q_yarn":
        body = body.replace("{q_a,kv_a}", "kv_a")
    return f"mesh m {{ axes {axes} }}\n{model(MLA[kind])}plan p on m for m {{\n    batch = 4\n    seq = 8\n{body}}}\n"


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("kind", MLA)
def test_sharded_mla_equals_the_reference(kind: str, plan: str, pool: Any, tmp_path: Path) -> None:
    assert_spec_matches_reference(pool, spec(kind, plan), f"mla_{kind}_{plan}", tmp_path)


def _code(kind: str, plan: str) -> str:
    text = spec(kind, plan)
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    return render_plan(result.plans["p"], "t.mesh", text)


def test_tensor_parallel_mla_splits_heads_and_keeps_the_latents_whole() -> None:
    code = _code("latent_q", "tensor2")
    assert "self.attn.q_a = nn.Linear(32, 16, bias=False)  # replicated" in code
    assert "self.attn.kv_a = nn.Linear(32, 12, bias=False)  # replicated" in code
    assert "self.attn.q_b = nn.Linear(16, 20, bias=False)  # column(tensor): 2 of 4 heads" in code
    assert "self.attn.kv_b = nn.Linear(8, 22, bias=False)  # column(tensor): 2 of 4 heads" in code
    assert "self.attn.o = nn.Linear(10, 32, bias=False)  # row(tensor): 2 of 4 heads" in code
    # one f on the normed latents and the shared rotary key (their norms' gradients are then whole), not on x
    assert "whole = rt.copy_to(torch.cat([q, latent, k_pe], dim=-1), self.g_tensor)" in code
    assert "q_in, latent, k_pe = whole.split([16, 8, 4], dim=-1)" in code
    assert code.count("rt.copy_to(") == 1  # the mlp and the head have their fused copy_to_linear
    assert "rt.copy_to(h" not in code and "copy_to_linear" not in code.split("class Block")[1].split("self.mlp")[0]
    assert code.count("out = rt.reduce_from(out, self.g_tensor)") == 2  # mla's and the mlp's
    # the direct q projection reads the block's input through its own f
    direct = _code("direct_q_yarn", "tensor2")
    assert "whole = rt.copy_to(torch.cat([h, latent, k_pe], dim=-1), self.g_tensor)" in direct
    assert "q = self.attn.q(q_in).view(b, s, 2, 10)" in direct
    assert "rt.deinterleave" not in direct and "rt.deinterleave" in code
    assert "('mscale', 1.0), ('mscale_all_dim', 0.7)" in direct


def test_recomputed_mla_region_starts_from_the_latents() -> None:
    """`recompute = attention`: the region rerun in backward takes q, the latent and the rotary key
    (under context parallelism every rank's, gathered before it) and runs kv_b, k and v and the core."""
    for plan, attention in (("tensor2_recompute", "rt.attention"), ("context2_recompute", "self.ctx.gathered_attention")):
        code = _code("latent_q", plan)
        forward = code.split("class Block")[1].split("def params")[0]
        region = forward.split("def attend(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:")[1]
        region = region.split("a = rt.recompute(attend, q, latent, k_pe)")[0]
        heads = 2 if plan.startswith("tensor") else 4
        assert f"            kv = self.attn.kv_b(latent).view(b, -1, {heads}, 11)" in region, region
        assert f"            return {attention}(q, k, v, scale=" in region, region
        assert forward.count("self.attn.kv_b(") == 1 and "rt.recompute(" + attention not in forward
    # without recomputation the same statements run inline
    assert "def attend" not in _code("latent_q", "context2")


def _generate_job(ctx: Any, path: str, prompt_len: int) -> dict[str, Any]:
    """Greedy decoding of the compiled plan against the reference recomputing the whole sequence at
    every step, and the shapes every KV cache was handed."""
    from meshllm_dsl.runtime.model import decode
    from meshllm_dsl.runtime.model.generate import greedy_generate
    from meshllm_dsl.runtime.model.reference import build_reference
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=5)
    # Matrices drawn normal(0, 0.02) give a near-constant next token; 20 times that (0.4), in the
    # sharded model and the reference alike, makes the greedy tokens vary with what is cached.
    with torch.no_grad():
        for module in built.modules.values():
            for p in module.parameters():
                if p.dim() >= 2:
                    p.mul_(20.0)
    prompt = torch.randint(0, 64, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    cached: list[tuple[int, ...]] = []
    update = decode.KVCache.update

    def spy(self: Any, k: Any, v: Any, window: int = 0) -> Any:
        cached.append(tuple(k.shape) + tuple(v.shape))
        return update(self, k, v, window)

    decode.KVCache.update = spy  # type: ignore[method-assign]
    try:
        out = greedy_generate(built, prompt, 6)
    finally:
        decode.KVCache.update = update  # type: ignore[method-assign]
    ref = build_reference(program.model, torch.float32, seed=5)
    tokens = prompt
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() >= 2:
                p.mul_(20.0)
        for _ in range(6):
            tokens = torch.cat([tokens, ref(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens), (out.tolist(), tokens.tolist())
    return {"tokens": out.tolist(), "cached": sorted(set(cached))}


@pytest.mark.parametrize(("plan", "prompt_len"), [("single", 5), ("tensor2", 5), ("pipeline2", 5), ("context2", 8),
                                                  ("context2", 5), ("tensor2_context2", 8),
                                                  ("pipeline2_tensor2_context2", 8)])
def test_mla_decodes_like_the_reference_caching_the_latent(plan: str, prompt_len: int, pool: Any, tmp_path: Path) -> None:
    """Each layer's cache holds the normed latent [b, 1, t, 8] and the rotated shared key [b, 1, t, 4]
    (DeepSeek's 512 + 64 per token), whole on every rank: the prompt (8 tokens split over cp in
    chunks of 2, or 5 whole on every rank), then one token a step; never the heads' keys and values."""
    text = spec("latent_q", plan)
    result = check_text(text, "t.mesh")
    assert result.ok
    path = tmp_path / f"mla_{plan}.py"
    path.write_text(render_plan(result.plans["p"], "t.mesh", text))
    outs = pool.run(_generate_job, result.plans["p"].mesh.devices, str(path), prompt_len)
    assert all(o["tokens"] == outs[0]["tokens"] for o in outs)
    assert all(len(set(row[prompt_len:])) >= 3 for row in outs[0]["tokens"]), outs[0]["tokens"]  # not one token repeated
    cached = {shape for o in outs for shape in o["cached"]}
    assert cached == {(2, 1, prompt_len, 8, 2, 1, prompt_len, 4), (2, 1, 1, 8, 2, 1, 1, 4)}, cached


def test_mla_trains_in_float8_within_drift_of_bf16(pool: Any, tmp_path: Path) -> None:
    """torchao converts mla's five linear layers (emulated on the CPU) under tensor parallelism: every
    one is in the plan's float8 layers, and 20 AdamW steps stay within tests/runtime/test_float8.py's
    drift of the same plan in bf16."""
    pytest.importorskip("torchao")
    from reference_jobs import float8_job

    # every local dim a multiple of 16 (torchao's float8 operands), at 2 of 4 heads per rank
    text = ("mesh m {\n    axes tensor = 2\n    device = cpu\n}\n"
            + model("q_lora_rank = 32").replace("mla(hidden, heads, 8, 6, 4, 5,", "mla(hidden, heads, 32, 16, 16, 16,")
            .replace("hidden = 32", "hidden = 64").replace("ffn = 48", "ffn = 128").replace("dtype = fp32", "dtype = bf16")
            + "plan p on m for m {\n    batch = 4\n    seq = 32\n" + TP
            + "    precision { matmul = fp8_tensorwise }\n    optimizer adamw {\n        lr = 0.001\n    }\n}\n")
    result = check_text(text, "f8.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    plan = result.plans["p"]
    assert plan.float8 is not None and [p for p, _ in plan.float8.skipped] == ["lm_head"], plan.float8  # as torchtitan
    assert {p for p, _ in plan.float8.layers if ".attn." in p} == {
        f"blocks.{i}.attn.{n}" for i in (0, 1) for n in ("q_a", "q_b", "kv_a", "kv_b", "o")}
    path = tmp_path / "mla_f8.py"
    path.write_text(render_plan(plan, "f8.mesh", text))
    fp8 = pool.run(float8_job, 2, str(path), 20, False)
    bf16 = pool.run(float8_job, 2, str(path), 20, True)
    assert [r["float8_layers"] for r in fp8] == [16, 16]  # 2 blocks of 5 mla + 3 mlp linears
    assert all(r["losses"] == fp8[0]["losses"] for r in fp8)
    drift = [abs(a - b) / b for a, b in zip(fp8[0]["losses"], bf16[0]["losses"])]
    assert max(drift) <= 0.01, drift
    assert fp8[0]["losses"][-1] < fp8[0]["losses"][0]


def test_meshc_verify_of_the_bundled_mla_plan_is_equal() -> None:
    """`meshc verify examples/tiny_mla.mesh`: the tiny twin (heads split as the plan splits them, small
    latents and head dims, an even rope dim) under tensor 2 x context 2, EQUAL in float64."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "meshllm_dsl", "verify", str(root / "examples" / "tiny_mla.mesh")],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: EQUAL" in proc.stdout
    assert ("tiny twin: heads 4 -> 4, hidden 64 -> 16, kv_lora_rank 16 -> 8, qk_nope_head_dim 8 -> 4, "
            "qk_rope_head_dim 4 -> 4, v_head_dim 8 -> 4, q_lora_rank 32 -> 8") in proc.stdout
