"""The Llama pack: `LlamaForCausalLM` (config.json `model_type` "llama") is the `llama` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.
"""

from __future__ import annotations

from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import CheckpointNames, FamilyPack

# Llama's tensor names, shared by every architecture that stores its tensors as Llama does.
NAMES = CheckpointNames(
    layout="llama",
    top={"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"},
    blocks="model.layers", norms={"attn_pre": "input_layernorm", "mlp_pre": "post_attention_layernorm"},
    attn=("self_attn", {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}),
    mlp=("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    transposed=False, positions=False, fused_qkv=False, norm="rmsnorm", act="swiglu",
)

PACK = FamilyPack(
    "LlamaForCausalLM", "llama", "llama", read_llama_shaped, NAMES, title="Llama", tp_export=True,
    default_positions=2048)
