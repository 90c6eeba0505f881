"""The Qwen2-MoE pack: `Qwen2MoeForCausalLM` (config.json `model_type` "qwen2_moe") is the `qwen2_moe` family,
with qwen2 attention
(meshllm_dsl/families/moe_config.py reads it).

What the layer kinds do for it: a shared SwiGLU expert behind a sigmoid gate (`shared_expert`,
`shared_ffn`), the chosen weights cast to the activations' dtype (`weights_fp32 = false`).
"""

from __future__ import annotations

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.moe_config import read_moe
from meshllm_dsl.families.pack import FamilyPack
from meshllm_dsl.families.qwen2 import PACK as QWEN2

PACK = FamilyPack(
    "Qwen2MoeForCausalLM", "qwen2_moe", "qwen2_moe", read_moe, LLAMA_NAMES, title="Qwen2-MoE",
    attention=QWEN2, built_in_settings=("attn_bias", "attn_out_bias"),
    experts_width_field="moe_intermediate_size", shared_expert=True)
