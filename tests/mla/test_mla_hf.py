"""The `mla` layer against transformers' own `DeepseekV3Attention`, in float64.

A tiny attention is built from a DeepseekV3Config (a query latent or a direct q projection, rotary
pairs interleaved or in halves, YaRN with DeepSeek's mscale and mscale_all_dim, biases), its weights
redrawn normal(0, 0.3) away from HF's init, and copied into the layer meshllm's reference model builds
from the compiled MODEL description of the same settings written as a .mesh `mla(...)`. Outputs and
the gradients of the input and of every weight agree (transformers' latent RMSNorm normalises in
float32 whatever the input dtype, so the agreement is float32's, not float64's). The sharded forward
is proven equal to this reference by tests/mla/test_mla_plans.py.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.lower import model_description  # noqa: E402
from meshllm_dsl.runtime.model import reference  # noqa: E402

HIDDEN, HEADS, SEQ = 32, 4, 12
# HF module name -> meshllm's (leaf, parameter)
NAMES = {
    "q_a_proj": ("q_a", None), "q_a_layernorm": ("q_a", "norm"), "q_b_proj": ("q_b", None), "q_proj": ("q", None),
    "kv_a_proj_with_mqa": ("kv_a", None), "kv_a_layernorm": ("kv_a", "norm"), "kv_b_proj": ("kv_b", None),
    "o_proj": ("o", None),
}
CASES: dict[str, dict[str, Any]] = {
    "query_latent_interleaved": dict(q_lora_rank=16, rope_interleave=True),
    "direct_q_halves_bias": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True),
    # DeepSeek-V3's rope_scaling, at a factor the tiny model can tell apart from 1, with mscale_all_dim
    # different from mscale so both the cos / sin factor and the logits' scale differ from 1
    "yarn_mscale_all_dim": dict(q_lora_rank=16, rope_interleave=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4, beta_fast=32,
        beta_slow=1, mscale=1.0, mscale_all_dim=0.8)),
}


def _config(case: dict[str, Any]) -> Any:
    cfg = DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                           kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                           max_position_embeddings=160, **{"rope_parameters": dict(rope_type="default", rope_theta=10000.0),
                                                          **case})
    cfg._attn_implementation = "eager"
    return cfg


def _mesh_call(cfg: Any) -> str:
    """The .mesh `mla(...)` of the config's attention."""
    rp = cfg.rope_parameters
    args = [f"kv_lora_rank = {cfg.kv_lora_rank}", f"qk_nope_head_dim = {cfg.qk_nope_head_dim}",
            f"qk_rope_head_dim = {cfg.qk_rope_head_dim}", f"v_head_dim = {cfg.v_head_dim}",
            f"q_lora_rank = {cfg.q_lora_rank or 0}", f"rope_theta = {float(rp['rope_theta'])!r}",
            f"rope_interleave = {str(bool(cfg.rope_interleave)).lower()}",
            f"bias = {str(bool(cfg.attention_bias)).lower()}"]
    if rp["rope_type"] == "yarn":
        args += ["rope_type = yarn", f"rope_factor = {float(rp['factor'])!r}",
                 f"rope_original_positions = {rp['original_max_position_embeddings']}",
                 f"rope_beta_fast = {float(rp['beta_fast'])!r}", f"rope_beta_slow = {float(rp['beta_slow'])!r}",
                 f"rope_mscale = {float(rp['mscale'])!r}", f"rope_mscale_all_dim = {float(rp['mscale_all_dim'])!r}"]
    return f"mla(hidden, heads, {', '.join(args)})"


def _ours(cfg: Any) -> Any:
    text = (f"mesh m {{ axes one = 1 }}\nmodel t {{\n    vocab = 16, hidden = {HIDDEN}, heads = {HEADS}, dtype = fp64\n"
            f"    embed = embedding(vocab, hidden)\n    blocks = repeat(1) {{\n        attn_norm = rmsnorm(hidden)\n"
            f"        attn = {_mesh_call(cfg)}\n    }}\n    norm = rmsnorm(hidden)\n    lm_head = linear(hidden, vocab)\n}}\n"
            "plan p on m for t { batch = 1, seq = 12 }\n")
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    desc = model_description(result.plans["p"])
    spec = next(x for x in desc["layers"] if x["kind"] == "repeat")["body"][1]
    assert spec["kind"] == "mla"
    return reference._SUBLAYERS["mla"](spec).double()


def _copy(hf: Any, ours: Any) -> None:
    with torch.no_grad():
        for name, p in hf.named_parameters():
            module, what = name.rsplit(".", 1)
            leaf, param = NAMES[module]
            getattr(getattr(ours, leaf), param or what).copy_(p)


@pytest.mark.parametrize("case", CASES)
def test_mla_equals_transformers_deepseek_v3_attention(case: str) -> None:
    torch.manual_seed(0)
    cfg = _config(CASES[case])
    hf = DeepseekV3Attention(cfg, layer_idx=0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)  # away from HF's init (norm scales of one, zero biases)
    ours = _ours(cfg)
    _copy(hf, ours)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    x = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(x_hf, pos)
    mask = torch.full((SEQ, SEQ), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    want, _ = hf(x_hf, (cos, sin), mask)
    got = ours(x_ours)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert x_hf.grad is not None and x_ours.grad is not None
    assert (x_ours.grad - x_hf.grad).abs().max().item() < 1e-5 * x_hf.grad.abs().max().item()
    for name, p in hf.named_parameters():
        module, what = name.rsplit(".", 1)
        leaf, param = NAMES[module]
        mine = getattr(getattr(ours, leaf), param or what)
        assert p.grad is not None and mine.grad is not None
        assert (mine.grad - p.grad).abs().max().item() < 1e-5 * p.grad.abs().max().item(), name
    # the settings reach the layer: the yarn case's logits are scaled by mscale(40, 0.8)^2 / sqrt(10)
    if case == "yarn_mscale_all_dim":
        import math
        m = 0.1 * 0.8 * math.log(40.0) + 1.0
        assert ours.scale == pytest.approx(10 ** -0.5 * m * m) and hf.scaling == pytest.approx(ours.scale)
