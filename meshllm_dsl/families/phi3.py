"""The Phi-3 pack: `Phi3ForCausalLM` (config.json `model_type` "phi3") is the `llama` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.
"""

from __future__ import annotations

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import FamilyPack

PACK = FamilyPack(
    "Phi3ForCausalLM", "phi3", "llama", read_llama_shaped, LLAMA_NAMES, title="Phi-3", tp_export=True,
    default_positions=4096, honours_sliding_window=True, longrope_only=True,
    longrope_default_original=4096,
    fused_projections={"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                       "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))})
