"""Context parallelism: each rank of the context axes holds a slice of every sequence through the
whole model (``layout { seq -> cp }`` over an axis that splits no weight).

Load balance (torchtitan's head-tail): the sequence is cut into ``2 n`` equal chunks and context rank
``i`` holds chunks ``i`` and ``2 n - 1 - i``, so under the causal mask every rank attends to the same
number of (query, key) pairs. Rotary takes each token's global position. Packed rows under a
document mask may instead be spread by their documents (`context_balance = per_document | ptrr`,
runtime/parallel/context_layout.py): each row then has its own ``order`` (its positions in rank
order), which ``local`` / ``unshard`` take and the step's ``Packing`` carries to attention.

Attention all-gathers K and V over the axis (the Llama 3 paper's choice) instead of passing blocks
around a ring with an online softmax: torch 2.13's own ``context_parallel`` (ring attention over
DTensor) refuses CPU tensors ("aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered", measured on gloo here), and the gather is exact (one softmax
over all keys, no rescaling), moves only the kv heads under GQA, and keeps sliding windows and soft
capping as they are: each query's mask is computed from global positions. Its cost is one
[b, s, kv_heads, head_dim] buffer each for K and V per layer, which ring attention would avoid.
Backward reduce-scatters dK / dV, so each rank's K / V projections get the gradient of every
rank's queries (collectives.py's sequence gather, the same autograd pair Megatron's sequence
parallelism uses). mla gathers what its keys and values are up-projected from instead, the normed
latent and the rotated shared key (``gather_latent``: kv_lora_rank + rope values per token, DeepSeek-V3's
576 where its heads' k and v are 40,960), and attends with ``gathered_attention``; both attentions
mask in ``_over_all_keys``.

The loss of a rank is the mean over its tokens; every rank holds the same number of them, so the
mean of those means over the axis is the global mean, and the parameters (replicated over the
axis) get their gradients averaged over it like a batch axis (program.py). A moe model's routing is
per token and so local; its load-balancing loss is a product of statistics of the whole sequence,
which ``sequence_sum`` reduces over the axis before the product (runtime/moe/routing.py); the
z-loss is a mean over tokens like the cross-entropy and needs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from meshllm_dsl.runtime.model import decode, documents, layers
from meshllm_dsl.runtime.moe.routing import capacity_of, keep_within_capacity
from meshllm_dsl.runtime.parallel import context_layout
from meshllm_dsl.runtime.parallel.collectives import _GatherSeq, all_gather_cat, all_reduce_sum
from meshllm_dsl.runtime.parallel.mesh import Mesh

SEQ_DIM = 1  # tokens [b, s], activations [b, s, ...]

# Inside a decoding session: whether this forward is a prompt's prefill split over the context axes
# (generate.py); the steps after it feed one token, the same on every rank, against a gathered cache.
_SPLIT_PREFILL = False


@contextlib.contextmanager
def split_prefill() -> Iterator[None]:
    """The forward inside runs on this rank's chunks of the prompt and fills every rank's KV caches
    with the whole prompt's keys and values, in position order."""
    global _SPLIT_PREFILL
    _SPLIT_PREFILL = True
    try:
        yield
    finally:
        _SPLIT_PREFILL = False


class _SumOverSequence(torch.autograd.Function):
    """A statistic of the whole sequence from each context rank's part: forward sums over the group;
    backward sums the gradients too, since every rank's loss reads the same sum (so each rank's part
    gets the gradient of all of them; averaging the parameters' gradients over the axis then leaves
    exactly the gradient of the one loss)."""

    @staticmethod
    def forward(ctx: object, x: Tensor, group: object) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return all_reduce_sum(x, group)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None  # type: ignore[attr-defined]


def _take(t: Tensor, index: Tensor) -> Tensor:
    """``t`` [b, s, ...] at each row's own positions ``index`` [b, k] along dim 1 -> [b, k, ...]."""
    index = index.reshape(*index.shape, *([1] * (t.dim() - 2))).expand(*index.shape, *t.shape[2:])
    return t.gather(1, index)


class ContextShard:
    """This rank's part of the sequence over ``axes``: which chunks, their positions, attention."""

    def __init__(self, mesh: Mesh, axes: tuple[str, ...], balance: str = "headtail") -> None:
        self.axes = tuple(axes)
        self.size = mesh.size(*self.axes)
        self.index = mesh.index(*self.axes)
        self.group = mesh.group(*self.axes)
        if balance not in context_layout.BALANCES:
            raise ValueError(f"unknown context balance {balance!r}; expected one of {', '.join(context_layout.BALANCES)}")
        self.balance = balance

    def row_order(self, documents: Tensor | None) -> Tensor | None:
        """[b, s] each row's positions in context-rank order under a balance by documents, from the
        rows' document numbers (host); None under head-tail, which every row shares."""
        if self.balance == "headtail" or documents is None:
            return None
        return context_layout.layout(documents, self.size, self.balance)

    def mine(self, order: Tensor) -> Tensor:
        """This rank's part of rows' ``order`` [b, s]: its tokens' positions in their rows [b, s / n]."""
        part = order.shape[1] // self.size
        return order[:, self.index * part : (self.index + 1) * part]

    def chunks(self, index: int | None = None) -> tuple[int, int]:
        """The two of the ``2 n`` chunks context rank ``index`` (default: this one) holds."""
        i = self.index if index is None else index
        return i, 2 * self.size - 1 - i

    def local(self, t: Tensor, dim: int = SEQ_DIM, order: Tensor | None = None) -> Tensor:
        """This rank's chunks of the global ``t`` along ``dim``, head then tail; with rows' ``order``
        ([b, s], ``row_order``) the tokens it names for this rank ([b, s, ...] along dim 1)."""
        if order is not None:
            return _take(t, self.mine(order).to(t.device))
        n = 2 * self.size
        if t.shape[dim] % n:
            raise ValueError(f"sequence of {t.shape[dim]} tokens does not split into {n} equal chunks "
                             f"over the context axes {' x '.join(self.axes)} ({self.size})")
        parts = t.chunk(n, dim=dim)
        head, tail = self.chunks()
        return torch.cat([parts[head], parts[tail]], dim=dim)

    def order(self, s_local: int) -> Tensor:
        """Global positions of the gathered sequence: rank 0's tokens, then rank 1's, ... [n * s_local]."""
        return torch.cat([self.indices(s_local, index=i) for i in range(self.size)])

    def in_rank_order(self, t: Tensor, dim: int = SEQ_DIM, order: Tensor | None = None) -> Tensor:
        """Every context rank's chunks of the global ``t`` along ``dim``, rank 0's then rank 1's, ...:
        the order K and V are gathered in (no communication: every rank holds the global batch)."""
        if order is not None:
            return _take(t, order.to(t.device))
        parts = t.chunk(2 * self.size, dim=dim)
        return torch.cat([parts[c] for i in range(self.size) for c in self.chunks(i)], dim=dim)

    def positions(self, s_local: int, device: torch.device | str | None = None, index: int | None = None) -> Tensor:
        """Rotary positions of the ``s_local`` tokens context rank ``index`` holds (int64): their
        global positions, or in a packed step the rows' own (this rank's chunks of them, [b, s_local])."""
        packing = documents.active()
        if index is None and decode.active() is None and packing is not None and packing.positions is not None:
            return packing.positions.to(device)
        return self.indices(s_local, device, index)

    def indices(self, s_local: int, device: torch.device | str | None = None, index: int | None = None) -> Tensor:
        """Global positions in the sequence of the ``s_local`` tokens context rank ``index`` holds (int64)."""
        if decode.active() is not None and not _SPLIT_PREFILL:  # decoding one token on every rank
            return layers.positions(s_local, device)
        c = s_local // 2
        head, tail = self.chunks(index)
        return torch.cat([torch.arange(head * c, head * c + c), torch.arange(tail * c, tail * c + c)]).to(device)

    def sequence_sum(self, x: Tensor) -> Tensor:
        """The sum over the context ranks of ``x`` (any shape, e.g. per-expert router statistics
        [experts]), with the autograd of a statistic every rank's loss reads (``_SumOverSequence``)."""
        if self.group is None:
            return x
        # [any] per rank -> [any], summed over the context axes; backward sums the gradients.
        return _SumOverSequence.apply(x, self.group)

    def capacity_keep(self, batch: int) -> Callable[[Tensor, int, float], Tensor]:
        """For ``rt.moe_route(keep=...)``: which (token, choice) pairs of this rank's ``batch`` x s / n
        tokens fit their expert's capacity, counted as the unsharded layer counts them: over the whole
        sequences' b x s tokens, in position order (runtime/moe/routing.py)."""
        def keep(idx: Tensor, experts: int, factor: float) -> Tensor:
            k = idx.shape[-1]
            if self.group is None or (decode.active() is not None and not _SPLIT_PREFILL):
                # One rank, or a decoding step: every rank routes the same whole tokens.
                limit = capacity_of(factor, idx.shape[0], k, experts)
                assert limit is not None
                return keep_within_capacity(idx, experts, limit)
            # [b s / n, k] ids per rank -> [b, s, k] in position order: the pairs the capacity counts.
            whole = self.unshard(idx.reshape(batch, -1, k))
            limit = capacity_of(factor, whole.shape[0] * whole.shape[1], k, experts)
            assert limit is not None
            fits = keep_within_capacity(whole.reshape(-1, k), experts, limit).reshape(whole.shape)
            return self.local(fits).reshape(idx.shape)

        return keep

    def unshard(self, local: Tensor, dim: int = SEQ_DIM, order: Tensor | None = None) -> Tensor:
        """The global sequence from every rank's ``local`` (no autograd): the inverse of ``local``
        (with the same rows' ``order``, along dim 1)."""
        if self.group is None:
            return local
        # [.., s / n, ..] per rank -> [.., s, ..] in rank order, then back to position order.
        gathered = all_gather_cat(local, self.group, dim)
        if order is not None:
            return _take(gathered, torch.argsort(order, dim=1).to(local.device))
        inverse = torch.argsort(self.order(local.shape[dim]).to(local.device))
        return gathered.index_select(dim, inverse)

    def latent_cache(self, latent: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor, decode.HeldCache | None]:
        """mla's latent cache (decode.latent_cache); a prompt prefilled split over the context axes
        caches the whole prompt's latents, every rank's chunks gathered in position order."""
        if self.group is not None and _SPLIT_PREFILL and decode.active() is not None:
            latent, k_pe = self.unshard(latent), self.unshard(k_pe)
        return decode.latent_cache(latent, k_pe)

    def gather_latent(self, latent: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor, decode.HeldCache | None]:
        """mla's keys and values before its up-projection, every context rank's: the normed latent
        [b, s / n, r] and the rotated shared key [b, s / n, 1, rope] (each rank rotated its own tokens
        at their global positions) -> [b, s, r], [b, s, 1, rope] in rank order, the order
        ``gathered_attention`` reads keys in; backward reduce-scatters their gradients. One all-gather
        of r + rope values per token instead of every head's k and v (DeepSeek-V3: 576 instead of
        128 x 320). While decoding: the latent cache (``latent_cache``), in position order."""
        if self.group is None or decode.active() is not None:
            return self.latent_cache(latent, k_pe)
        b, _, r = latent.shape
        rope = k_pe.shape[-1]
        # [b, s / n, r + rope] per rank -> [b, s, r + rope] in rank order: one collective for both.
        both = _GatherSeq.apply(torch.cat([latent, k_pe.reshape(b, -1, rope)], dim=-1), self.group)
        latent_all, pe_all = both.split([r, rope], dim=-1)
        return latent_all, pe_all.view(b, -1, 1, rope), None

    def attention(self, q: Tensor, k: Tensor, v: Tensor, window: int = 0, scale: float | None = None,
                  softcap: float = 0.0, sinks: Tensor | None = None,
                  kv_cache: decode.KVCache | None = None) -> Tensor:
        """Causal GQA attention of this rank's queries over every rank's keys: q [b, s / n, h, d],
        k [b, s / n, kvh, d], v [b, s / n, kvh, dv] -> [b, s / n, h * dv]. ``kv_cache`` (a HeldCache
        while decoding): k and v already hold every position so far, in position order."""
        decoding = decode.active() is not None
        if self.group is None or (decoding and not _SPLIT_PREFILL):
            # One rank, or a decoding step after the prefill: the new token is the same on every
            # rank and each rank's cache holds the whole sequence.
            return layers.attention(q, k, v, kv_cache=kv_cache, window=window, scale=scale, softcap=softcap, sinks=sinks)
        if decoding and kv_cache is not None:
            k_all, v_all = k, v  # the whole prompt's, rebuilt from the gathered latents
        elif decoding:
            session = decode.active()
            assert session is not None
            # Split prefill: [b, s / n, kvh, d] per rank -> [b, s, kvh, d] in position order, kept
            # whole in this layer's cache so the next tokens attend to the whole prompt.
            k_all, v_all = self.unshard(k), self.unshard(v)
            k_all, v_all = (t.transpose(1, 2) for t in session.next_cache().update(
                k_all.transpose(1, 2), v_all.transpose(1, 2), window))
        else:
            # [b, s / n, kvh, d] per rank -> [b, s, kvh, d] in rank order; backward reduce-scatters dK, dV.
            k_all = _GatherSeq.apply(k.contiguous(), self.group)
            v_all = _GatherSeq.apply(v.contiguous(), self.group)
        return self._over_all_keys(q, k_all, v_all, window, scale, softcap, sinks)

    def gathered_attention(self, q: Tensor, k: Tensor, v: Tensor, window: int = 0, scale: float | None = None,
                           softcap: float = 0.0, sinks: Tensor | None = None,
                           kv_cache: decode.KVCache | None = None) -> Tensor:
        """``attention`` over keys and values already every rank's (mla's, up-projected from
        ``gather_latent``'s latents): q [b, s / n, h, d], k [b, s, kvh, d] and v [b, s, kvh, dv] in
        rank order (while decoding: every position so far in position order, with ``kv_cache``)
        -> [b, s / n, h * dv]. Nothing is gathered here, so a recomputed core gathers nothing again."""
        decoding = decode.active() is not None
        if self.group is None or (decoding and not _SPLIT_PREFILL):
            return layers.attention(q, k, v, kv_cache=kv_cache, window=window, scale=scale, softcap=softcap, sinks=sinks)
        if decoding and kv_cache is None:
            raise ValueError("a split prefill's gathered attention needs the cache its keys were rebuilt from")
        return self._over_all_keys(q, k, v, window, scale, softcap, sinks)

    def _over_all_keys(self, q: Tensor, k_all: Tensor, v_all: Tensor, window: int, scale: float | None,
                       softcap: float, sinks: Tensor | None) -> Tensor:
        """This rank's queries q [b, s / n, h, d] over the whole sequence's keys k_all [b, s, kvh, d]
        and v_all [b, s, kvh, dv] (rank order; position order in a split prefill), each query masked
        by global positions: causal, its window, its document -> [b, s / n, h * dv]."""
        b, s, h, _ = q.shape
        decoding = decode.active() is not None
        packing = documents.active() if not decoding else None
        if packing is not None and packing.sequence is not None:
            # Each row spread by its documents: its queries' and gathered keys' own positions [b, .].
            assert packing.key_sequence is not None
            q_pos, k_pos = packing.sequence.to(q.device), packing.key_sequence.to(q.device)
        else:
            q_pos, k_pos = self.indices(s, q.device), self.order(s).to(q.device)
        if decoding:  # a split prefill's keys: the whole prompt, in position order
            k_pos = torch.arange(k_all.shape[1], device=q.device)
        qh, kh, vh = q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2)
        if packing is not None and packing.documents is None:
            packing = None
        # Each query's softmax is over every key it sees, all here: sinks and soft caps need nothing
        # more; in a packed step the keys' document numbers are every rank's, in rank order.
        out = layers.masked_attention(qh, kh, vh, q_pos, k_pos, packing, window, scale, softcap, sinks)
        return out.transpose(1, 2).reshape(b, s, h * vh.shape[-1])  # v's head dim (mla's v_head_dim)
