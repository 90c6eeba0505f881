"""The Qwen3 pack: `Qwen3ForCausalLM` (config.json `model_type` "qwen3") is the `llama` family.

Its config reads as every Llama-shaped one (meshllm_dsl/families/llama_config.py); what differs is
the record below.

What the layer kinds do for it: q and k normalised per head before rotary (`qk_norm = head`, one
head_dim scale shared by the heads).
"""

from __future__ import annotations

from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import FamilyPack

PACK = FamilyPack(
    "Qwen3ForCausalLM", "qwen3", "llama", read_llama_shaped, LLAMA_NAMES, title="Qwen3", tp_export=True,
    checkpoint_qk_norm="head", default_positions=32768, refuses_use_sliding_window=True, qk_norm="head")
