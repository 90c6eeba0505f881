"""The Mistral pack: `MistralForCausalLM` (config.json `model_type` "mistral") is the `llama` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.
"""

from __future__ import annotations

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import FamilyPack

PACK = FamilyPack(
    "MistralForCausalLM", "mistral", "llama", read_llama_shaped, LLAMA_NAMES, title="Mistral", tp_export=True,
    default_positions=4096 * 32, honours_sliding_window=True)
