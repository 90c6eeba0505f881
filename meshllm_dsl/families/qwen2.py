"""The Qwen2 pack: `Qwen2ForCausalLM` (config.json `model_type` "qwen2") is the `llama` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.
"""

from __future__ import annotations

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import FamilyPack

PACK = FamilyPack(
    "Qwen2ForCausalLM", "qwen2", "llama", read_llama_shaped, LLAMA_NAMES, title="Qwen2", tp_export=True,
    has_mlp_bias_field=False, default_positions=32768, refuses_use_sliding_window=True, qkv_bias_built_in=True)
