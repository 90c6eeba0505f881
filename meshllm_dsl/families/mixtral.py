"""The Mixtral pack: `MixtralForCausalLM` (config.json `model_type` "mixtral") is the `mixtral` family,
with mistral attention
(meshllm_dsl/families/moe_config.py reads it).

What the layer kinds do for it: the chosen experts' weights kept in float32 (`weights_fp32`).
"""

from __future__ import annotations

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.mistral import PACK as MISTRAL
from meshllm_dsl.families.moe_config import read_moe
from meshllm_dsl.families.pack import FamilyPack

PACK = FamilyPack(
    "MixtralForCausalLM", "mixtral", "mixtral", read_moe, LLAMA_NAMES, title="Mixtral",
    attention=MISTRAL)
