"""Runtime imported by code that ``meshc compile`` generates (``import meshllm_dsl.runtime as rt``).

Depends only on torch, numpy and the standard library.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import launch
    from .collectives import (
        copy_to,
        copy_to_linear,
        gather_from,
        gather_seq,
        gather_seq_linear,
        reduce_from,
        reduce_scatter_seq,
        split_seq,
        split_to,
    )
    from .context import ContextShard
    from .generate import greedy_generate
    from .layers import (
        DecodeSession,
        KVCache,
        LayerNorm,
        RMSNorm,
        VocabParallelEmbedding,
        activation,
        apply_rotary,
        attention,
        cross_entropy,
        mask_vocab,
        positions,
        vocab_parallel_cross_entropy,
    )
    from .mesh import Mesh
    from .moe import StackedLinear, moe_experts, moe_route
    from .moe_dispatch import ExpertsParallel, experts_parallel
    from .program import Built, Program
    from .qk_norm import rms_norm, split_rms_norm
    from .remat import recompute, recompute_ops
    from .shards import ShardSpec, full_init, gather_full, gather_module, load_full, local_slice

# Names resolve on first use (PEP 562), so ``import meshllm_dsl.runtime.pool`` (meshc verify's
# parent process) does not import torch, and a rank imports launch / generate only if it uses them.
_WHERE = {
    "launch": "",
    **dict.fromkeys(
        (
            "copy_to",
            "copy_to_linear",
            "gather_from",
            "gather_seq",
            "gather_seq_linear",
            "reduce_from",
            "reduce_scatter_seq",
            "split_seq",
            "split_to",
        ),
        "collectives",
    ),
    "ContextShard": "context",
    "greedy_generate": "generate",
    **dict.fromkeys(
        (
            "DecodeSession",
            "KVCache",
            "LayerNorm",
            "RMSNorm",
            "VocabParallelEmbedding",
            "activation",
            "apply_rotary",
            "attention",
            "cross_entropy",
            "mask_vocab",
            "positions",
            "vocab_parallel_cross_entropy",
        ),
        "layers",
    ),
    "Mesh": "mesh",
    **dict.fromkeys(("StackedLinear", "moe_experts", "moe_route"), "moe"),
    **dict.fromkeys(("ExpertsParallel", "experts_parallel"), "moe_dispatch"),
    **dict.fromkeys(("rms_norm", "split_rms_norm"), "qk_norm"),
    **dict.fromkeys(("Built", "Program"), "program"),
    "recompute": "remat",
    "recompute_ops": "remat",
    **dict.fromkeys(
        ("ShardSpec", "full_init", "gather_full", "gather_module", "load_full", "local_slice"),
        "shards",
    ),
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = import_module(f"{__name__}.{where or name}")
    if where:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "Built",
    "ContextShard",
    "DecodeSession",
    "KVCache",
    "LayerNorm",
    "Mesh",
    "Program",
    "RMSNorm",
    "ShardSpec",
    "StackedLinear",
    "VocabParallelEmbedding",
    "activation",
    "apply_rotary",
    "attention",
    "recompute",
    "recompute_ops",
    "copy_to",
    "copy_to_linear",
    "cross_entropy",
    "ExpertsParallel",
    "experts_parallel",
    "full_init",
    "gather_from",
    "gather_seq",
    "gather_seq_linear",
    "gather_full",
    "gather_module",
    "greedy_generate",
    "launch",
    "load_full",
    "mask_vocab",
    "local_slice",
    "moe_experts",
    "moe_route",
    "positions",
    "reduce_from",
    "reduce_scatter_seq",
    "rms_norm",
    "split_rms_norm",
    "split_seq",
    "split_to",
    "vocab_parallel_cross_entropy",
]
