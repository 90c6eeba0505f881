"""The Qwen2-MoE pack: `Qwen2MoeForCausalLM` (config.json `model_type` "qwen2_moe") is the `qwen2_moe` family,
with qwen2 attention
(meshllm_dsl/families/moe_config.py reads it).

What the layer kinds do for it: a shared SwiGLU expert behind a sigmoid gate (`shared_expert`,
`shared_ffn`), the chosen weights cast to the activations' dtype (`weights_fp32 = false`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.moe_config import check_own_width_experts, read_moe
from meshllm_dsl.families.pack import ExpertNames, FamilyPack
from meshllm_dsl.families.qwen2 import PACK as QWEN2


def _write_config(moe: Mapping[str, Any]) -> dict[str, Any]:
    return {"moe_intermediate_size": int(moe["ffn"]), "shared_expert_intermediate_size": int(moe["shared_ffn"]),
            "intermediate_size": int(moe["shared_ffn"]), "num_experts": int(moe["experts"]),
            "norm_topk_prob": bool(moe["norm_topk_prob"]), "decoder_sparse_step": 1, "mlp_only_layers": [],
            "use_sliding_window": False, "qkv_bias": True}


EXPERTS = ExpertNames(
    "mlp",
    {"router": "gate", "gate": "experts.{e}.gate_proj", "up": "experts.{e}.up_proj", "down": "experts.{e}.down_proj",
     "shared_gate": "shared_expert.gate_proj", "shared_up": "shared_expert.up_proj",
     "shared_down": "shared_expert.down_proj", "shared_router": "shared_expert_gate"},
    weights_fp32=False, renormalised=None, fits="a shared expert, weights in the activations' dtype",
    write_config=_write_config, check_config=check_own_width_experts)

PACK = FamilyPack(
    "Qwen2MoeForCausalLM", "qwen2_moe", "qwen2_moe", read_moe, LLAMA_NAMES, title="Qwen2-MoE",
    attention=QWEN2, built_in_settings=("attn_bias", "attn_out_bias"),
    experts_width_field="moe_intermediate_size", experts=EXPERTS, shared_expert=True, tp_export=True, ep_export=True)
