"""The Qwen3-MoE pack: `Qwen3MoeForCausalLM` (config.json `model_type` "qwen3_moe") is the `qwen3_moe` family,
with qwen3 attention
(meshllm_dsl/families/moe_config.py reads it).

What the layer kinds do for it: q and k normalised per head (`qk_norm = head`), the chosen weights
cast to the activations' dtype (`weights_fp32 = false`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.moe_config import check_own_width_experts, read_moe
from meshllm_dsl.families.pack import ExpertNames, FamilyPack
from meshllm_dsl.families.qwen3 import PACK as QWEN3


def _write_config(moe: Mapping[str, Any]) -> dict[str, Any]:
    return {"moe_intermediate_size": int(moe["ffn"]), "num_local_experts": int(moe["experts"]),
            "norm_topk_prob": bool(moe["norm_topk_prob"]), "decoder_sparse_step": 1, "mlp_only_layers": [],
            "use_sliding_window": False}


EXPERTS = ExpertNames(
    "mlp",
    {"router": "gate", "gate": "experts.{e}.gate_proj", "up": "experts.{e}.up_proj", "down": "experts.{e}.down_proj"},
    weights_fp32=False, renormalised=None, fits="no shared expert, weights in the activations' dtype",
    write_config=_write_config, check_config=check_own_width_experts)

PACK = FamilyPack(
    "Qwen3MoeForCausalLM", "qwen3_moe", "qwen3_moe", read_moe, LLAMA_NAMES, title="Qwen3-MoE",
    attention=QWEN3, built_in_settings=("qk_norm",),
    experts_width_field="moe_intermediate_size", experts=EXPERTS, tp_export=True, ep_export=True)
