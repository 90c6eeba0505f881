"""Runtime imported by code that ``meshc compile`` generates (``import meshllm_dsl.runtime as rt``).

Depends only on torch, numpy and the standard library.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshllm_dsl.runtime.model.generate import greedy_generate
    from meshllm_dsl.runtime.model.layers import (
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
    from meshllm_dsl.runtime.model.qk_norm import rms_norm, split_rms_norm
    from meshllm_dsl.runtime.moe.dispatch import ExpertsParallel, experts_parallel
    from meshllm_dsl.runtime.moe.experts import StackedLinear, moe_experts, moe_route
    from meshllm_dsl.runtime.parallel.collectives import (
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
    from meshllm_dsl.runtime.parallel.context import ContextShard
    from meshllm_dsl.runtime.parallel.mesh import Mesh
    from meshllm_dsl.runtime.parallel.shards import (
        ShardSpec,
        full_init,
        gather_full,
        gather_module,
        load_full,
        local_slice,
    )
    from meshllm_dsl.runtime.train import launch
    from meshllm_dsl.runtime.train.program import Built, Program
    from meshllm_dsl.runtime.train.remat import recompute, recompute_ops

# Names resolve on first use (PEP 562), so ``import meshllm_dsl.runtime.jobs.pool`` (meshc verify's
# parent process) does not import torch, and a rank imports launch / generate only if it uses them.
# Modules generated code reaches as ``rt.<name>`` (``rt.launch.main``), wherever they live now.
_MODULES = {"launch": "train.launch"}
_WHERE = {
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
        "parallel.collectives",
    ),
    "ContextShard": "parallel.context",
    "greedy_generate": "model.generate",
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
        "model.layers",
    ),
    "Mesh": "parallel.mesh",
    **dict.fromkeys(("StackedLinear", "moe_experts", "moe_route"), "moe.experts"),
    **dict.fromkeys(("ExpertsParallel", "experts_parallel"), "moe.dispatch"),
    **dict.fromkeys(("rms_norm", "split_rms_norm"), "model.qk_norm"),
    **dict.fromkeys(("Built", "Program"), "train.program"),
    "recompute": "train.remat",
    "recompute_ops": "train.remat",
    **dict.fromkeys(
        ("ShardSpec", "full_init", "gather_full", "gather_module", "load_full", "local_slice"),
        "parallel.shards",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = import_module(f"{__name__}.{_MODULES[name]}")
    else:
        where = _WHERE.get(name)
        if where is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE) | set(_MODULES))


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
