"""Runtime imported by code that ``meshc compile`` generates (``import meshllm_dsl.runtime as rt``).

Depends only on torch, numpy and the standard library.
"""

from . import launch
from .collectives import copy_to, gather_from, reduce_from, split_to
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
from .program import Built, Program
from .shards import ShardSpec, full_init, gather_full, gather_module, load_full, local_slice

__all__ = [
    "Built",
    "DecodeSession",
    "KVCache",
    "LayerNorm",
    "Mesh",
    "Program",
    "RMSNorm",
    "ShardSpec",
    "VocabParallelEmbedding",
    "activation",
    "apply_rotary",
    "attention",
    "copy_to",
    "cross_entropy",
    "full_init",
    "gather_from",
    "gather_full",
    "gather_module",
    "greedy_generate",
    "launch",
    "load_full",
    "mask_vocab",
    "local_slice",
    "positions",
    "reduce_from",
    "split_to",
    "vocab_parallel_cross_entropy",
]
