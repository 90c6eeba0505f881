"""Incremental decoding's state: each attention layer's KV cache and the session a generation step
runs in (``DecodeSession``), read by the layers (layers.py: positions after the cached tokens, the
next cache per attention call) and by the collectives (runtime/parallel/collectives.py: while
decoding, the sequence is not sharded).

It sits below both so that neither imports the other for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


class KVCache:
    """Keys and values of one attention layer seen so far, [b, kv_heads_local, t, head_dim].

    With a sliding window only the last ``window - 1`` positions stay after a step: the next token
    attends to itself and those, never further back, so a windowed layer's cache never grows past
    the window however long the generation runs."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.seen = 0  # positions this cache has been given (the held ones are the last `length`)

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: Tensor, v: Tensor, window: int = 0) -> tuple[Tensor, Tensor]:
        """The held keys / values followed by the new ones (what this step attends to); keeps at most
        ``window - 1`` of them for the next step when ``window`` is set."""
        full_k = k if self.k is None else torch.cat([self.k, k], dim=2)
        full_v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.seen += k.shape[2]
        keep = full_k.shape[2] if not window else min(full_k.shape[2], window - 1)
        self.k, self.v = full_k[:, :, full_k.shape[2] - keep:], full_v[:, :, full_v.shape[2] - keep:]
        return full_k, full_v

    def reset(self) -> None:
        self.k = self.v = None
        self.seen = 0


class HeldCache(KVCache):
    """What ``attention`` reads of a cache whose caller already holds every position's keys and values
    (mla rebuilds them from its cached latent each step): how many positions it held and had seen
    before this step; its update hands back what it is given."""

    def __init__(self, held: int, seen: int) -> None:
        super().__init__()
        self.held, self.seen = held, seen

    @property
    def length(self) -> int:
        return self.held

    def update(self, k: Tensor, v: Tensor, window: int = 0) -> tuple[Tensor, Tensor]:
        return k, v


def latent_cache(latent: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor, HeldCache | None]:
    """mla's KV cache, what DeepSeek-V3 keeps (and transformers' DeepseekV3Attention): per token the
    normed latent ``latent`` [b, s, kv_lora_rank] and the rotated shared key ``k_pe`` [b, s, 1, rope],
    never the heads' keys and values. While decoding: every position's latent and key so far (this
    step's appended) and the ``HeldCache`` to hand ``attention``; else the inputs and None."""
    session = active()
    if session is None:
        return latent, k_pe, None
    cache = session.next_cache()
    held, seen = cache.length, cache.seen
    lat, pe = cache.update(latent.unsqueeze(1), k_pe.transpose(1, 2))  # [b, 1, t, r], [b, 1, t, rope]
    return lat.squeeze(1), pe.transpose(1, 2), HeldCache(held, seen)


class DecodeSession:
    """KV caches of one rank's attention layers during incremental decoding.

    Generated ``forward`` methods call ``attention(q, k, v)`` and ``positions(s, device)`` with no
    cache argument; while a session step is active, attention call number i of the forward uses
    cache i and positions start after the tokens already cached.  So any generated stage decodes
    incrementally unchanged, and each rank caches only its own kv heads: the cache is sharded over
    the tensor axis exactly like k and v.
    """

    def __init__(self) -> None:
        self.caches: list[KVCache] = []
        self.offset = 0
        self._calls = 0

    def next_cache(self) -> KVCache:
        if self._calls == len(self.caches):
            self.caches.append(KVCache())
        self._calls += 1
        return self.caches[self._calls - 1]

    @contextlib.contextmanager
    def step(self, seq: int) -> Iterator[None]:
        """One forward over ``seq`` new tokens; afterwards they count as cached."""
        global _ACTIVE
        self._calls, _ACTIVE = 0, self
        try:
            yield
        finally:
            _ACTIVE = None
        self.offset += seq


_ACTIVE: DecodeSession | None = None


def active() -> DecodeSession | None:
    """The session whose step is running now, None outside incremental decoding."""
    return _ACTIVE
