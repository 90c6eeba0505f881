"""The planner on an `mla` layer at DeepSeek-V3's sizes: its parameters as transformers counts them,
its flops with the nope + rope dims for q.k and v_head_dim for p.v, and its KV cache as the latent
(kv_lora_rank + qk_rope_head_dim values per token and layer), not heads x head_dim."""

from __future__ import annotations

import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.ir import PlanIR
from meshllm_dsl.parallel.costs import HeldUnit
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.formulas import (
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_gather_bytes_per_layer,
)
from meshllm_dsl.planner.time import model_flops_per_token
from meshllm_dsl.primitives import REGISTRY

# DeepSeek-V3's attention (config.json): 61 layers, hidden 7168, 128 heads, q_lora_rank 1536,
# kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128; its YaRN rope scaling.
V3 = dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, layers=61)
MLA = ("mla(hidden, heads, 512, 128, 64, 128, q_lora_rank = 1536, rope_type = yarn, rope_factor = 40.0, "
       "rope_original_positions = 4096, rope_mscale = 1.0, rope_mscale_all_dim = 1.0)")


def _plan(axes: str = "one = 1", body: str = "", seq: int = 4096, batch: int = 1) -> PlanIR:
    # A dense feed-forward (the routed experts are another layer's): what the attention costs is what is checked.
    text = (f"mesh m {{ axes {axes} }}\nmodel v3 {{\n    vocab = 129280, hidden = 7168, layers = 61, heads = 128, "
            f"ffn = 18432, dtype = bf16\n    embed = embedding(vocab, hidden)\n    blocks = repeat(layers) {{\n"
            f"        attn_norm = rmsnorm(hidden)\n        attn = {MLA}\n        mlp_norm = rmsnorm(hidden)\n"
            "        mlp = mlp(hidden, ffn)\n    }\n    norm = rmsnorm(hidden)\n    lm_head = linear(hidden, vocab)\n}\n"
            f"plan p on m for v3 {{\n    batch = {batch}\n    seq = {seq}\n{body}}}\n")
    result = check_text(text, "v3.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    return result.plans["p"]


def _attn(plan: PlanIR):  # type: ignore[no-untyped-def]
    (rep,) = plan.model.repeats
    return next(u for u in rep.body if u.kind == "mla")


def test_parameters_are_transformers_deepseek_v3_attention_s() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg = DeepseekV3Config()  # DeepSeek-V3's own sizes are the config's defaults
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (7168, 128, 1536, 512)
    with torch.device("meta"):
        hf = DeepseekV3Attention(cfg, layer_idx=0)
    want = sum(p.numel() for p in hf.parameters())
    assert _attn(_plan()).numel == want == 187_107_328
    h, qk = V3["heads"], V3["nope"] + V3["rope"]
    assert want == (7168 * 1536 + 1536 + 1536 * h * qk + 7168 * (512 + 64) + 512
                    + 512 * h * (V3["nope"] + V3["v"]) + h * V3["v"] * 7168)


def test_kv_cache_is_the_latent() -> None:
    plan = _plan()
    # 61 layers x (512 + 64) values x 2 bytes (bf16)
    assert kv_bytes_per_token(plan) == 70_272 == 61 * 576 * 2
    assert kv_cache_bytes(plan, 4096) == 70_272 * 4096
    # per-head keys and values would be 61 x 128 x (192 + 128) x 2 bytes: 71 times as much
    assert kv_bytes_per_token(plan) * 60 < 61 * 128 * (192 + 128) * 2
    # every tensor rank keeps the whole latent (it is replicated), at the plan's batch and seq
    tp = _plan("tensor = 8", "    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n"
               "    shard blocks.*.attn.{q_a,kv_a} replicate\n", batch=2)
    rep = analyze(tp)
    assert {rc.kv_cache_bytes for rc in rep.ranks} == {70_272 * 4096 * 2}


def test_flops_count_nope_plus_rope_for_scores_and_v_head_dim_for_values() -> None:
    plan, seq = _plan(), 4096
    unit = _attn(plan)
    weights = sum(t.numel for leaf in unit.leaves for t in leaf.params if len(t.shape) == 2)
    h = V3["heads"]
    core = 2 * seq * h * (V3["nope"] + V3["rope"]) + 2 * seq * h * V3["v"]  # q.k and p.v per token, forward
    assert REGISTRY["mla"].flops_per_token(unit, seq) == 2 * weights + core
    work = REGISTRY["mla"].work(plan, HeldUnit(unit, "", 1, (), None), seq, seq, 1, True)
    scores, values = [mm for mm in work.matmuls if mm.core]
    assert (scores.m, scores.n, scores.k, scores.count) == (seq, seq, 192, h)
    assert (values.m, values.n, values.k, values.count) == (seq, 128, seq, h)
    # the model's training flops per token: three times every layer's forward products
    mlp = 3 * 7168 * 18432 * 2
    assert model_flops_per_token(plan) == 3 * (61 * (2 * weights + core + mlp) + 2 * 7168 * 129280)


def test_context_parallelism_gathers_the_latent_not_the_heads() -> None:
    """Under context parallelism each layer all-gathers the normed latent and the rotated shared key
    ([mb, s, 512 + 64], one call; runtime ContextShard.gather_latent), not every head's k and v, and
    each rank then up-projects the whole sequence's latents through its kv_b shard."""
    plan = _plan("tensor = 8, cp = 2", "    layout { heads -> tensor, ffn -> tensor, vocab -> tensor, seq -> cp }\n"
                 "    shard blocks.*.attn.{q_a,kv_a} replicate\n", seq=4096)
    # per microbatch and layer: the whole sequence's latent and rotary key, bf16, whatever the heads
    # (the heads' k [16 heads, 192] and v [16 heads, 128] would be 4096 x 16 x 320 x 2, 8.9 x more)
    assert kv_gather_bytes_per_layer(plan) == 4096 * (512 + 64) * 2
    rc = analyze(plan).ranks[0]
    gathers = [(c.op, c.calls, c.payload_bytes // c.calls) for c in rc.comms if c.kind == "context"]
    # one all-gather per layer and microbatch forward, its reduce-scatter in backward
    assert gathers == [("all_gather", 61, 4096 * 576 * 2), ("reduce_scatter", 61, 4096 * 576 * 2)], gathers
    unit = _attn(plan)
    kv_b = next(leaf for leaf in unit.leaves if leaf.name == "kv_b")
    held = HeldUnit(unit, "blocks.0.", 1, plan.block_class("blocks", 0).placements, None)
    assert held.placement(kv_b).axes == ("tensor",)
    work = REGISTRY["mla"].work(plan, held, 2048, 4096, 1, True)
    products = {mm.leaf: (mm.m, mm.n, mm.k) for mm in work.matmuls if not mm.core}
    # the rank's own 2048 tokens through q_a, q_b, kv_a and o; every rank's 4096 through its kv_b shard
    assert products["attn.kv_b"] == (4096, 16 * (128 + 128), 512)
    assert products["attn.kv_a"][0] == products["attn.q_b"][0] == products["attn.o"][0] == 2048


def test_tensor_parallel_all_reduces_carry_the_latents_and_the_residual_stream() -> None:
    """Per block and microbatch under tensor 8: f's backward all-reduce of the normed query latent,
    the normed latent and the rotary key concatenated ([b, s, 1536 + 512 + 64]), and o's sum of the
    residual stream ([b, s, 7168]) with the mlp's f and g: 70 % fewer bytes in f than the
    residual stream's width would say."""
    plan = _plan("tensor = 8", "    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n"
                 "    shard blocks.*.attn.{q_a,kv_a} replicate\n", seq=4096, batch=1)
    rc = analyze(plan).ranks[0]
    tokens, e = 4096, 2
    by_size = {c.payload_bytes // c.calls: c.calls for c in rc.comms if c.kind == "tensor" and c.op == "all_reduce"}
    assert by_size[tokens * e * (1536 + 512 + 64)] == 61  # one per block
    # o's g, the mlp's f and g per block; the vocab-parallel embedding's sum and the head's f
    assert by_size[tokens * e * 7168] == 61 * 3 + 2


def test_recompute_attention_reruns_kv_b_over_the_gathered_latents() -> None:
    """`recompute = attention` reruns mla's region from the latents: backward's rerun is the core and
    kv_b's up-projection of the whole sequence's gathered latents (4096 tokens under context 2, the
    rank's own 2048 queries), priced as recompute work with the core."""
    from meshllm_dsl.parallel.devices import PROFILES
    from meshllm_dsl.planner.float8 import product_seconds
    from meshllm_dsl.planner.time import unit_forward_time

    layout = ("    layout { heads -> tensor, ffn -> tensor, vocab -> tensor, seq -> cp }\n"
              "    shard blocks.*.attn.{q_a,kv_a} replicate\n    recompute = attention\n")
    plan, device = _plan("tensor = 8, cp = 2", layout, seq=4096), PROFILES["h100"]
    unit = _attn(plan)
    held = HeldUnit(unit, "blocks.0.", 61, plan.block_class("blocks", 0).placements, None)
    (kv_b,) = [mm for mm in REGISTRY["mla"].work(plan, held, 2048, 4096, 1, True).matmuls if mm.leaf == "attn.kv_b"]
    assert (kv_b.m, kv_b.n, kv_b.k) == (4096, 16 * (128 + 128), 512)
    core_s = unit_forward_time(plan, device, held, 2048, 4096, 1, True).core_s
    kv_b_s = product_seconds(plan, device, held, kv_b)
    assert kv_b_s > 0 and core_s > 0
    rc = analyze(plan, device).ranks[0]
    kernels_s = rc.recompute_s - 61 * (core_s + kv_b_s)  # the host time of the rerun's kernels
    assert 0 <= kernels_s < 0.01 * rc.recompute_s, (rc.recompute_s, core_s, kv_b_s)
    from meshllm_dsl.planner.report import report_text

    assert "recomputes the attention core and `kv_b` before it in backward" in report_text(analyze(plan, device))
