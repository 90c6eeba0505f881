"""Model family packs: one module per Hugging Face model family, each holding what is specific to it
as a `FamilyPack` record (meshllm_dsl/families/pack.py), and the registry below.

Torch-free, and importing nothing of the compiler (only the standard library, attrs, the runtime's
torch-free `json_values` and these modules): `meshc import-hf` and the runtime read the same records.
A new family is its pack here, its `family` in stdlib/families.mesh, and its tests.
"""

from __future__ import annotations

from meshllm_dsl.families import (
    deepseek_v3,
    gemma,
    glm4_moe,
    gpt2,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from meshllm_dsl.families.pack import FamilyPack

# In the order `meshc import-hf` lists them as supported.
PACKS: tuple[FamilyPack, ...] = (
    llama.PACK, mistral.PACK, qwen2.PACK, qwen3.PACK, phi3.PACK, olmo2.PACK, gpt2.PACK,
    gemma.GEMMA2, gemma.GEMMA3,
    mixtral.PACK, qwen2_moe.PACK, qwen3_moe.PACK, gpt_oss.PACK, deepseek_v3.PACK,
    glm4_moe.PACK,
)
BY_ARCHITECTURE: dict[str, FamilyPack] = {p.architecture: p for p in PACKS}
BY_MODEL_TYPE: dict[str, FamilyPack] = {p.model_type: p for p in PACKS}
SUPPORTED: tuple[str, ...] = tuple(BY_ARCHITECTURE)


def exported_families() -> dict[str, tuple[FamilyPack, ...]]:
    """`.mesh` family -> its architectures `meshc export` is proven for, in the registry's order."""
    out: dict[str, tuple[FamilyPack, ...]] = {}
    for p in PACKS:
        if p.tp_export:
            out[p.family] = (*out.get(p.family, ()), p)
    return out

__all__ = ["BY_ARCHITECTURE", "BY_MODEL_TYPE", "PACKS", "SUPPORTED", "FamilyPack", "exported_families"]
