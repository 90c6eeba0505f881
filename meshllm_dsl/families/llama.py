"""The Llama pack: `LlamaForCausalLM` (config.json `model_type` "llama") is the `llama` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.
"""

from __future__ import annotations

from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import FamilyPack

PACK = FamilyPack(
    "LlamaForCausalLM", "llama", "llama", read_llama_shaped, title="Llama", tp_export=True,
    default_positions=2048)
