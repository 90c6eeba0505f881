"""Runtime imported by code that ``meshc compile`` generates (``import meshllm_dsl.runtime as rt``).

Depends only on torch, numpy and the standard library.
"""

from .collectives import copy_to, gather_from, reduce_from, split_to
from .layers import (
    KVCache,
    LayerNorm,
    RMSNorm,
    VocabParallelEmbedding,
    activation,
    apply_rotary,
    attention,
    cross_entropy,
    positions,
    vocab_parallel_cross_entropy,
)
from .mesh import Mesh
from .shards import ShardSpec, full_init, gather_full, gather_module, load_full, local_slice

__all__ = [
    "Mesh",
    "copy_to",
    "reduce_from",
    "gather_from",
    "split_to",
    "RMSNorm",
    "LayerNorm",
    "VocabParallelEmbedding",
    "KVCache",
    "positions",
    "apply_rotary",
    "attention",
    "activation",
    "cross_entropy",
    "vocab_parallel_cross_entropy",
    "ShardSpec",
    "full_init",
    "local_slice",
    "gather_full",
    "load_full",
    "gather_module",
]
