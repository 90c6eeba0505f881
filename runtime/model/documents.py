"""Packed rows: which document each token belongs to and its rotary position, for the forward that
runs now.

``Built.train_step`` / ``Built.forward`` take a batch's ``documents`` / ``positions``
(runtime/data/corpus.py ``Batch``) and run each microbatch's forward inside ``packed(...)`` with that
microbatch's rows, so every attention layer of every block reads the same rows without a new
argument on every stage's forward.  Every rank holds the global batch, so nothing travels between
pipeline stages: a schedule's forward of microbatch j on any stage (``forward_one_chunk(j, ...)``)
runs inside microbatch j's rows, and a recomputed region keeps the rows of its forward for the rerun
in backward (runtime/train/remat.py), whenever the schedule runs that backward.

Attention is block-causal within documents: query ``i`` sees key ``j`` when ``j <= i`` (sequence
order) and both carry the same document number; a sliding window still counts sequence positions,
which within one document differ as its own positions do.  Rotary takes ``positions`` (restarting
at each document with `positions = restart`) instead of the row's 0 .. s - 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import Tensor

__all__ = ["Packing", "active", "packed", "same_document"]


@dataclass(frozen=True)
class Packing:
    """This rank's rows of the running forward.

    ``documents`` [b, s]: the document number of each of this rank's tokens (None: one stream,
    causal across documents); ``keys`` [b, t]: the document numbers of the keys its attention sees
    (under context parallelism every context rank's tokens in rank order, as K / V are gathered;
    else ``documents``); ``positions`` [b, s]: each token's rotary position (None: the row's).

    Under a context balance that depends on the rows (runtime/parallel/context_layout.py) each row's
    tokens are spread over the context ranks its own way: ``sequence`` [b, s] holds this rank's
    tokens' positions in their row and ``key_sequence`` [b, t] the gathered keys' (None: the static
    head-tail split, the same for every row)."""

    documents: Tensor | None
    keys: Tensor | None
    positions: Tensor | None
    sequence: Tensor | None = None
    key_sequence: Tensor | None = None
    # flex_attention's BlockMasks of these rows, built once and read by every attention layer of the
    # forward and its recomputation (runtime/model/layers.py flex_masked_attention).
    block_masks: dict[tuple[object, ...], object] = field(default_factory=dict, compare=False, repr=False)


_ACTIVE: Packing | None = None


def active() -> Packing | None:
    """The rows of the forward running now; None outside a packed step (every token attends to every
    earlier one of its row, at the row's positions).

    Inside a compiled block (`compile = blocks`) Dynamo reads the rows' tensors as the graph's
    inputs, not as constants: another microbatch's rows run the same graph (no recompile, counted in
    tests/runtime/test_compiled_blocks.py) and give the eager blocks' losses."""
    return _ACTIVE


@contextlib.contextmanager
def packed(packing: Packing | None) -> Iterator[None]:
    """Run the forward (and backward) inside with ``packing``'s rows; None changes nothing."""
    global _ACTIVE
    outer, _ACTIVE = _ACTIVE, packing
    try:
        yield
    finally:
        _ACTIVE = outer


def same_document(allowed: Tensor, packing: Packing | None) -> Tensor:
    """``allowed`` [s, t] or [b, s, t] (causal, windowed) narrowed to pairs within one document: [b, 1, s, t],
    broadcasting over heads; ``allowed`` itself without document numbers."""
    if packing is None or packing.documents is None:
        return allowed
    assert packing.keys is not None
    same = packing.documents[:, :, None] == packing.keys[:, None, :]  # [b, s, t]
    # ``allowed`` is [s, t] for positions shared by the rows, [b, s, t] for each row's own.
    return ((allowed if allowed.dim() == 3 else allowed[None]) & same)[:, None]
