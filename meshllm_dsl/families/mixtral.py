"""The Mixtral pack: `MixtralForCausalLM` (config.json `model_type` "mixtral") is the `mixtral` family,
with mistral attention
(meshllm_dsl/families/moe_config.py reads it).

What the layer kinds do for it: the chosen experts' weights kept in float32 (`weights_fp32`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.mistral import PACK as MISTRAL
from meshllm_dsl.families.moe_config import check_full_width_experts, read_moe
from meshllm_dsl.families.pack import ExpertNames, FamilyPack


def _write_config(moe: Mapping[str, Any]) -> dict[str, Any]:
    return {"intermediate_size": int(moe["ffn"]), "num_local_experts": int(moe["experts"]),
            "router_jitter_noise": 0.0}


EXPERTS = ExpertNames(
    "block_sparse_moe",
    {"router": "gate", "gate": "experts.{e}.w1", "up": "experts.{e}.w3", "down": "experts.{e}.w2"},
    weights_fp32=True, renormalised=True, fits="no shared expert, fp32 weights, renormalised",
    write_config=_write_config, check_config=check_full_width_experts)

PACK = FamilyPack(
    "MixtralForCausalLM", "mixtral", "mixtral", read_moe, LLAMA_NAMES, title="Mixtral",
    attention=MISTRAL, experts=EXPERTS, tp_export=True, ep_export=True)
