"""The OLMo 2 pack: `Olmo2ForCausalLM` (config.json `model_type` "olmo2") is the `olmo2` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.
"""

from __future__ import annotations

from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import FamilyPack

PACK = FamilyPack(
    "Olmo2ForCausalLM", "olmo2", "olmo2", read_llama_shaped, title="OLMo 2", tp_export=True,
    default_positions=2048, ignores_mlp_bias=True, default_norm_eps=1e-5)
