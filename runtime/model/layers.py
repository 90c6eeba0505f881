"""Layers and functions called by generated stage modules.

Numerics follow HF ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` so their checkpoints load unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from meshllm_dsl.runtime.data.corpus import IGNORE  # a target the loss skips (torch's ignore_index)
from meshllm_dsl.runtime.model import decode, documents, rope
from meshllm_dsl.runtime.model.decode import DecodeSession, KVCache
from meshllm_dsl.runtime.parallel.collectives import all_gather_cat, uses_module_forward

__all__ = [
    "DecodeSession",
    "KVCache",
    "LayerNorm",
    "RMSNorm",
    "VocabParallelEmbedding",
    "activation",
    "apply_rotary",
    "attention",
    "masked_attention",
    "cross_entropy",
    "mask_vocab",
    "positions",
    "row_matmul",
    "sink_attention",
    "vocab_parallel_cross_entropy",
]

LayerNorm = nn.LayerNorm


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # HF upcasts half precision to float32; float64 (used by exactness tests) stays float64.
    return torch.promote_types(dtype, torch.float32)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    in_dtype = x.dtype
    h = x.to(_compute_dtype(in_dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(in_dtype)


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    """RMSNorm with an offset: x normalised and scaled by (offset + weight), both in fp32, then
    cast to x's dtype (offset 1: the weight is stored as its difference from one)."""
    h = x.to(_compute_dtype(x.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (offset + weight.to(h.dtype))).to(x.dtype)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm that keeps only its input and the fp32 reciprocal RMS per token for backward.

    Plain autograd over ``_rms_norm`` also keeps an fp32 copy of the input (half precision) and
    the normalised tensor the weight multiplies: up to 3 x [tokens, dim] where backward needs one.
    The gradient is written out (d/dh of h r with r = rsqrt(mean(h^2) + eps)):
    dh = r (dn - h r^2 mean(dn h)), in the same dtypes autograd would use.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        in_dtype = x.dtype
        h = x.to(_compute_dtype(in_dtype))
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (h * rstd).to(in_dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        in_dtype = x.dtype
        h = x.to(rstd.dtype)
        gw = None
        if ctx.needs_input_grad[1]:
            n = (h * rstd).to(in_dtype)
            gw = (grad * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            dn = (grad * weight).to(rstd.dtype)
            c = (dn * h).mean(-1, keepdim=True)
            # dh = rstd (dn - h r^2 c) with the products in place, in the order that expression
            # takes them (so bit for bit): three [tokens, dim] buffers in the compute dtype at
            # once (h, dn and one), not the expression's five.
            t = h * (rstd * rstd)
            dn.sub_(t.mul_(c)).mul_(rstd)
            del t
            gx = dn.to(in_dtype)
        return gx, gw, None


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32, scale in the input dtype (as HF does).

    When training, only the input and the reciprocal RMS are kept for backward (``_RMSNormFn``).
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, scale_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.scale_fp32 = scale_fp32  # weight * x in fp32, then the cast (offset 0 below)

    def forward(self, x: Tensor) -> Tensor:
        if self.offset or self.scale_fp32:
            return offset_rms_norm(x, self.weight, self.eps, self.offset)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, start + local_num) of the full table.

    Tokens outside the shard produce zeros, so the output is Partial over the vocab axis: generated
    code sums it with ``reduce_from``.  With ``start=0`` and the full vocab it is a plain embedding.
    """

    def __init__(self, local_num: int, dim: int, start: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_num, dim).normal_(0.0, 0.02))
        self.start = start

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


def positions(seq: int, device: torch.device | str | None = None, offset: int = 0) -> Tensor:
    """Token positions offset .. offset + seq - 1 (int64), after any cached tokens when decoding; in a
    packed step (runtime/model/documents.py) the rows' own positions [b, seq] (restarting at each
    document with `positions = restart`)."""
    session = decode.active()
    if session is not None:
        offset += session.offset
    else:
        packing = documents.active()
        if packing is not None and packing.positions is not None:
            return packing.positions.to(device)
    return torch.arange(offset, offset + seq, device=device, dtype=torch.long)


def _rotate(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x cos + rotate_half(x) sin, as roll(x, d / 2) sin_signed: [.., head_dim] in and out."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class _Rotary(torch.autograd.Function):
    """x cos + rotate_half(x) sin for q and k as one Function.

    rotate_half(x) sin = roll(x, d / 2) sin_signed, with sin_signed = (-sin_1, sin_2) over the two
    halves, so forward is 4 kernels per tensor and backward, dx = g cos + roll(g sin_signed, d / 2)
    (a half-roll is its own inverse), 4 more; autograd over rotate_half's chunk / neg / cat took
    about twice as many.  Bit for bit the same values: only signs move between factors.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, cos: Tensor, sin_signed: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(cos, sin_signed)
        return _rotate(q, cos, sin_signed), _rotate(k, cos, sin_signed)

    @staticmethod
    def backward(ctx: Any, gq: Tensor, gk: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        cos, sin_signed = ctx.saved_tensors
        half = cos.shape[-1] // 2
        dq = gq * cos + (gq * sin_signed).roll(half, -1) if ctx.needs_input_grad[0] else None
        dk = gk * cos + (gk * sin_signed).roll(half, -1) if ctx.needs_input_grad[1] else None
        return dq, dk, None, None


def apply_rotary(
    q: Tensor,
    k: Tensor,
    pos: Tensor,
    theta: float,
    scaling: tuple[tuple[str, Any], ...] | None = None,
    rotary_dim: int | None = None,
) -> tuple[Tensor, Tensor]:
    """HF Llama rotary (rotate_half) on q, k shaped [b, s, heads, head_dim]; pos is [s] or [b, s].

    ``scaling``: the rope scaling's (field, value) pairs, HF's names (runtime/model/rope.py).
    ``rotary_dim``: partial rotary (HF's head_dim x partial_rotary_factor): only each head's first
    rotary_dim values turn, with frequencies over rotary_dim; the rest pass unchanged (HF's
    ``apply_rotary_pos_emb`` with cos / sin of rotary_dim).  None: every dim.
    """
    if rotary_dim is not None and rotary_dim != q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :rotary_dim], k[..., :rotary_dim], pos, theta, scaling)
        return (torch.cat((q_rot, q[..., rotary_dim:]), dim=-1), torch.cat((k_rot, k[..., rotary_dim:]), dim=-1))
    d = q.shape[-1]
    # dynamic and longrope read the largest position + 1 (a host sync only for them)
    seq_len = int(pos.max()) + 1 if rope.depends_on_length(scaling) else 0
    inv_freq, attention_factor = rope.inv_freq(d, float(theta), scaling, seq_len, q.device)
    # cos/sin are computed in float32 (as HF does), scaled by yarn's / longrope's attention factor,
    # and only then cast to the activation dtype.
    freqs = pos.to(torch.float32).unsqueeze(-1) * inv_freq  # [.., s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    sin_signed = torch.cat((-sin[..., : d // 2], sin[..., d // 2 :]), dim=-1)
    cos, sin_signed = cos.unsqueeze(-2), sin_signed.unsqueeze(-2)  # broadcast over heads
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotary.apply(q, k, cos, sin_signed)
    return _rotate(q, cos, sin_signed), _rotate(k, cos, sin_signed)


def deinterleave(x: Tensor) -> Tensor:
    """[.., d] with rotary pairs adjacent, (x0, x1), (x2, x3), .., as halves (x0, x2, .. | x1, x3, ..): what
    rotate_half rotates as HF's ``apply_rotary_pos_emb_interleave`` does (DeepSeek's rope_interleave)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _allowed(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """[s, t] True where query position q_pos[i] may attend to key position k_pos[j]: causal, and
    within the last ``window`` positions (itself included) when a window is set (HF's
    ``sliding_window_overlay``: kv_idx > q_idx - window). Positions [b, s] / [b, t] (each row's
    own, under a context balance by documents) give [b, s, t]."""
    k, q = k_pos.unsqueeze(-2), q_pos.unsqueeze(-1)
    allowed = k <= q
    if window:
        allowed &= k > q - window
    return allowed


def _softcapped_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, softcap: float) -> Tensor:
    """Attention with logits soft-capped (tanh(x / cap) * cap) before the mask, softmax in fp32 (as
    HF's eager attention, which soft-capping needs: SDPA has none). q [b, h, s, d], k / v
    [b, kvh, t, d] -> [b, h, s, d]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=_compute_dtype(q.dtype)).to(q.dtype) @ v


def sink_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, sinks: Tensor) -> Tensor:
    """Attention with a learned logit per head in the softmax's denominator (GPT-OSS's sinks, as
    transformers' eager attention): each head's scores get one more column, its sink, that takes
    probability but carries no value. q [b, h, s, d], k / v [b, kvh, t, d], sinks [h] -> [b, h, s, d].
    SDPA has no such column, so the scores are written out; the softmax in fp32 (fp64 stays fp64)."""
    b, h, s, _ = q.shape
    rep = h // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dtype = _compute_dtype(q.dtype)
    scores = ((q @ k.transpose(-1, -2)) * scale).to(dtype).masked_fill(~allowed, float("-inf"))
    combined = torch.cat([scores, sinks.to(dtype).reshape(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # the sink's share dropped: it has no value
    return probs.to(v.dtype) @ v


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: KVCache | None = None,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal GQA attention: q [b, s, h, d], k [b, s, kvh, d], v [b, s, kvh, dv] -> [b, s, h * dv].

    KV head j serves query heads j*n_rep .. (j+1)*n_rep - 1 (HF ``repeat_kv``), which is also what
    makes column-sharding q, k, v by heads consistent.  With a cache, the new tokens attend to
    every cached position and causally among themselves.  ``window``: each token attends to the
    last ``window`` positions only (itself included: sliding-window layers), and a
    decoding cache holds no more than that.  ``scale``: the logit scale (default 1 / sqrt(d));
    ``softcap``: logits become tanh(x / softcap) * softcap; ``sinks`` [h]: a logit per head in the
    softmax's denominator (``sink_attention``; this rank's heads).  In a packed step
    (runtime/model/documents.py) a token attends only to earlier tokens of its own document.
    """
    b, s, h, d = q.shape
    session = decode.active()
    if kv_cache is None and session is not None:
        kv_cache = session.next_cache()
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    past = held = 0
    if kv_cache is not None:
        held, past = kv_cache.length, kv_cache.seen
        kh, vh = kv_cache.update(kh, vh, window)
    packing = documents.active() if kv_cache is None else None  # decoding: one sequence, no packing
    if packing is not None and packing.documents is None:
        packing = None
    if past == 0 and packing is None and not window and not softcap and sinks is None:
        # enable_gqa: the kernel reads kv head j for query heads j*n_rep.. itself, so backward keeps
        # k and v at kv_heads rather than copies repeated to every query head.
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=h != kh.shape[1], scale=scale)
    else:
        q_pos = past + torch.arange(s, device=q.device)
        k_pos = past - held + torch.arange(kh.shape[2], device=q.device)
        out = masked_attention(qh, kh, vh, q_pos, k_pos, packing, window, scale, softcap, sinks)
    return out.transpose(1, 2).reshape(b, s, h * vh.shape[-1])  # v's head dim (mla's v_head_dim)


def masked_attention(qh: Tensor, kh: Tensor, vh: Tensor, q_pos: Tensor, k_pos: Tensor,
                     packing: documents.Packing | None, window: int = 0, scale: float | None = None,
                     softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """Attention of queries at sequence positions ``q_pos`` [s] (or [b, s]) over keys at ``k_pos`` [t]
    (or [b, t]): causal,
    within ``window``, and with ``packing``'s document numbers within one document. qh [b, h, s, d],
    kh / vh [b, kvh, t, d] -> [b, h, s, dv].

    Packed rows train through torch's flex_attention with a block mask on CUDA (blocks no document
    reaches are skipped) and through SDPA with an explicit boolean mask elsewhere (torch 2.13's
    flex_attention has no CPU backward: NotImplementedError)."""
    d = qh.shape[-1]
    gqa = qh.shape[1] != kh.shape[1]
    if packing is not None and sinks is None and qh.device.type == "cuda":
        return flex_masked_attention(qh, kh, vh, q_pos, k_pos, packing, window, scale, softcap)
    allowed = documents.same_document(_allowed(q_pos, k_pos, window), packing)
    if sinks is not None:
        if softcap:
            raise ValueError("attention sinks with soft-capped logits: no family has both")
        return sink_attention(qh, kh, vh, allowed, 1.0 / math.sqrt(d) if scale is None else scale, sinks)
    if softcap:
        return _softcapped_attention(qh, kh, vh, allowed, 1.0 / math.sqrt(d) if scale is None else scale, softcap)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, enable_gqa=gqa, scale=scale)


_FLEX: Callable[..., Tensor] | None = None


@torch.compiler.disable  # compiled on its own (``_FLEX``), also inside a compiled block
def flex_masked_attention(qh: Tensor, kh: Tensor, vh: Tensor, q_pos: Tensor, k_pos: Tensor,
                          packing: documents.Packing, window: int = 0, scale: float | None = None,
                          softcap: float = 0.0) -> Tensor:
    """``masked_attention`` through torch's flex_attention (compiled once per process) with a
    BlockMask of the same pairs: causal by sequence position, within the window, same document."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    assert packing.documents is not None and packing.keys is not None
    q_docs, k_docs = packing.documents.to(qh.device), packing.keys.to(qh.device)
    # Sequence positions per row ([b, s] / [b, t]): shared ones broadcast over the rows.
    q_seq, k_seq = q_pos.expand(q_docs.shape).to(qh.device), k_pos.expand(k_docs.shape).to(qh.device)

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        seen = (k_seq[b, k] <= q_seq[b, q]) & (q_docs[b, q] == k_docs[b, k])
        if window:
            seen = seen & (k_seq[b, k] > q_seq[b, q] - window)
        return seen

    # Within one forward the positions are a function of the rows and the lengths (sequence order, or
    # the context ranks' layout), so the layers share one mask per window: built once, not per layer.
    key = (window, qh.shape[2], kh.shape[2], str(qh.device))
    block_mask = packing.block_masks.get(key)
    if block_mask is None:
        block_mask = create_block_mask(mask_mod, qh.shape[0], None, qh.shape[2], kh.shape[2], device=qh.device)
        packing.block_masks[key] = block_mask
    score_mod = None
    if softcap:
        def score_mod(score: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return torch.tanh(score / softcap) * softcap
    out = _FLEX(qh, kh, vh, score_mod=score_mod, block_mask=block_mask, scale=scale,
                enable_gqa=qh.shape[1] != kh.shape[1])
    return out


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """Element-wise activation by name (swiglu is spelled out by generated code with silu)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}"
        ) from None


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean token cross-entropy of full logits [..., V] against targets [...], over the targets that
    are not ``IGNORE``; 0 (with zero gradients) when every target is ignored."""
    flat = logits.reshape(-1, logits.shape[-1]).to(_compute_dtype(logits.dtype))
    t = targets.reshape(-1)
    loss = F.cross_entropy(flat, t, ignore_index=IGNORE)
    # No target counted: torch's mean is 0 / 0 (its backward writes no row, so the gradients are 0);
    # the loss is 0, chosen on the device (no host sync).
    return torch.where((t != IGNORE).any(), loss, torch.zeros_like(loss))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, group: ProcessGroup, vocab_start: int
    ) -> Tensor:
        x = logits.reshape(-1, logits.shape[-1]).to(_compute_dtype(logits.dtype))
        t = targets.reshape(-1)
        n_local = x.shape[-1]
        counted = t != IGNORE  # [N] the targets the loss counts
        local_t = t - vocab_start
        outside = (local_t < 0) | (local_t >= n_local) | ~counted
        local_t = local_t.masked_fill(outside, 0)
        # Each shard's own log-sum-exp, stable against its own max; the global one combines them.
        local_max = x.max(dim=-1).values  # [N]
        exp = (x - local_max.unsqueeze(-1)).exp_()  # in place: one [N, Vl] buffer, the saved softmax
        local_lse = exp.sum(dim=-1).log_().add_(local_max)
        # [N]: the target logit lives on exactly one rank; the others contribute zero.
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        # [1, 2, N] per rank -> [t, 2, N]: one all-gather over the vocab axis (not an all-reduce of
        # the max and then one of the sums, so one wait per step); the logits themselves never move.
        shards = all_gather_cat(torch.stack([local_lse, target_logit]).unsqueeze(0), group, 0)
        lse = torch.logsumexp(shards[:, 0], dim=0)
        # [N] 1 / (counted targets) where counted, 0 where ignored (0 everywhere when none counts)
        weight = counted.to(x.dtype) / counted.sum().clamp(min=1)
        loss = ((lse - shards[:, 1].sum(0)) * weight).sum()
        # exp(x - max) * exp(max - lse) = softmax, in place.
        ctx.save_for_backward(exp.mul_((local_max - lse).exp_().unsqueeze(-1)), local_t, outside, weight)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, local_t, outside, weight = ctx.saved_tensors
        # In place, as Megatron does: the saved softmax becomes the gradient, so backward needs
        # no second [N, Vl] buffer (this Function's graph is never run backward twice).
        g = softmax
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= (~outside).to(g.dtype)
        g.mul_((weight * grad).unsqueeze(-1))  # ignored targets' rows get none
        return g.to(ctx.dtype).reshape(ctx.shape), None, None, None


def vocab_parallel_cross_entropy(
    local_logits: Tensor, targets: Tensor, group: ProcessGroup | None, vocab_start: int
) -> Tensor:
    """Mean token cross-entropy of logits sharded over the vocab (last dim) across ``group``, over
    the targets that are not ``IGNORE``.

    ``local_logits`` holds columns [vocab_start, vocab_start + V_local); the full logits are never
    gathered.  The result (and its gradient) equals ``cross_entropy`` of the gathered logits.
    """
    if group is None:
        return cross_entropy(local_logits, torch.where(targets == IGNORE, targets, targets - vocab_start))
    return _VocabParallelCE.apply(local_logits, targets, group, vocab_start)


def mask_vocab(logits: Tensor, start: int, used: int) -> Tensor:
    """Logits of padded vocab rows (global column >= ``used``) set to the dtype's lowest value.

    ``logits`` holds columns [start, start + n) of the padded vocab.  Masked columns then take no
    part in the softmax, the loss or the argmax, and receive no gradient.
    """
    n = logits.shape[-1]
    if start + n <= used:
        return logits
    padded = torch.arange(start, start + n, device=logits.device) >= used
    return logits.masked_fill(padded, torch.finfo(logits.dtype).min)


def row_matmul(layer: nn.Module, x: Tensor) -> Tensor:
    """``x @ layer.weight.T`` without the bias, in the layer's own matmul: a row-parallel layer's
    partial product, whose bias is added once after the sum over the tensor ranks.  A float8 layer
    computes in float8 only through its forward: with a bias it runs with the bias left out."""
    if not uses_module_forward(layer):
        return F.linear(x, layer.weight)
    if getattr(layer, "bias", None) is None:
        return layer(x)
    return torch.func.functional_call(layer, {"bias": None}, (x,), strict=False)
