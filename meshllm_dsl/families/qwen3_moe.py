"""The Qwen3-MoE pack: `Qwen3MoeForCausalLM` (config.json `model_type` "qwen3_moe") is the `qwen3_moe` family,
with qwen3 attention
(meshllm_dsl/families/moe_config.py reads it).

What the layer kinds do for it: q and k normalised per head (`qk_norm = head`), the chosen weights
cast to the activations' dtype (`weights_fp32 = false`).
"""

from __future__ import annotations

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.moe_config import read_moe
from meshllm_dsl.families.pack import FamilyPack
from meshllm_dsl.families.qwen3 import PACK as QWEN3

PACK = FamilyPack(
    "Qwen3MoeForCausalLM", "qwen3_moe", "qwen3_moe", read_moe, LLAMA_NAMES, title="Qwen3-MoE",
    attention=QWEN3, built_in_settings=("qk_norm",),
    experts_width_field="moe_intermediate_size")
