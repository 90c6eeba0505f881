"""The OLMo 2 pack: `Olmo2ForCausalLM` (config.json `model_type` "olmo2") is the `olmo2` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.  Its config is Llama's: the norms after the sublayers and q / k normalised over the
whole projection are the olmo2 family's block itself, so no setting says them.

What the layer kinds do for it: norms after each sublayer only (`post`, no pre norm), RMSNorm with the
scale applied in fp32 before the cast back (`scale_fp32`, transformers' Olmo2RMSNorm), and q / k
normalised over the whole projection (`qk_norm = full`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import FamilyPack


def _refuse_unfit(model: Mapping[str, Any], lay: Any, moe: bool, error: type[Exception]) -> None:
    """OLMo 2's checkpoints are its exact block: norms after the sublayers with q / k normalised over
    the whole projection, q, k, v and o biased alike, a dense MLP without bias. ``error`` for a model
    that has one without the other, which no transformers architecture computes."""
    attn = lay.attn
    why = ("its q / k norm is not over the whole projection (qk_norm = full)" if attn.get("qk_norm", "none") != "full"
           else "q, k, v and o are not biased alike (attention_bias covers all four)"
           if bool(attn.get("qkv_bias")) != bool(attn.get("o_bias")) else
           "its MLP has a bias" if lay.mlp.get("bias") else
           "its MLP is a mixture of experts" if moe else None)
    if why is not None:
        raise error(f"model `{model.get('name', 'model')}` has OLMo 2's norms after the sublayers, but {why}; "
                    "Olmo2ForCausalLM cannot hold it")


# Llama's names, a norm after each sublayer and none before; its q / k norms (over the whole
# projection) are self_attn.{q,k}_norm, as per-head q / k norms are.
NAMES = attrs.evolve(
    LLAMA_NAMES, layout="olmo2",
    norms={"attn_post": "post_attention_layernorm", "mlp_post": "post_feedforward_layernorm"},
    refuse_unfit=_refuse_unfit,
)

PACK = FamilyPack(
    "Olmo2ForCausalLM", "olmo2", "olmo2", read_llama_shaped, NAMES, title="OLMo 2", tp_export=True,
    checkpoint_qk_norm="full", has_mlp_bias_field=False, default_positions=2048, ignores_mlp_bias=True, default_norm_eps=1e-5)
