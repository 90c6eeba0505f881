"""The OLMo 2 pack: `Olmo2ForCausalLM` (config.json `model_type` "olmo2") is the `olmo2` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.  Its config is Llama's: the norms after the sublayers and q / k normalised over the
whole projection are the olmo2 family's block itself, so no setting says them.

What the layer kinds do for it: norms after each sublayer only (`post`, no pre norm), RMSNorm with the
scale applied in fp32 before the cast back (`scale_fp32`, transformers' Olmo2RMSNorm), and q / k
normalised over the whole projection (`qk_norm = full`).
"""

from __future__ import annotations

from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import CheckpointNames, FamilyPack

# Llama's names, a norm after each sublayer and none before; its q / k norms (over the whole
# projection) are self_attn.{q,k}_norm, as per-head q / k norms are.
NAMES = CheckpointNames(
    layout="olmo2",
    top={"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"},
    blocks="model.layers", norms={"attn_post": "post_attention_layernorm", "mlp_post": "post_feedforward_layernorm"},
    attn=("self_attn", {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}),
    mlp=("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    transposed=False, positions=False, fused_qkv=False, norm="rmsnorm", act="swiglu",
)

PACK = FamilyPack(
    "Olmo2ForCausalLM", "olmo2", "olmo2", read_llama_shaped, NAMES, title="OLMo 2", tp_export=True,
    checkpoint_qk_norm="full", has_mlp_bias_field=False, default_positions=2048, ignores_mlp_bias=True, default_norm_eps=1e-5)
