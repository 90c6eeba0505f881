"""Mixture-of-experts: top-k routing, stacked SwiGLU experts and the load-balancing loss.

Numerics follow transformers' Mixtral / Qwen2-MoE / Qwen3-MoE (``*TopKRouter``, ``*Experts``,
``load_balancing_loss_func``): softmax of the router logits in float32, top-k of the
probabilities, optional renormalisation of the chosen k, and the chosen weights kept in float32
(Mixtral) or cast back to the activation dtype (Qwen). Dropless: every token reaches all k experts.

Used by both the unsharded reference model (runtime/reference.py) and generated stages; the
experts' ffn may be split over a tensor axis like the dense MLP's (gate / up column, down row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["experts_swiglu", "load_balancing_loss", "route"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 as transformers does; float64 (exactness tests) stays float64.
    return torch.promote_types(dtype, torch.float32)


def route(x: Tensor, weight: Tensor, top_k: int, renormalize: bool,
          weights_fp32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Router of one MoE layer: x [T, H], weight [E, H] -> (chosen weights [T, k], chosen expert
    ids [T, k] int64, router logits [T, E]).

    ``weights_fp32``: keep the chosen weights in float32 (Mixtral) instead of casting them to the
    logits' dtype (Qwen2-MoE / Qwen3-MoE)."""
    logits = F.linear(x, weight)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=_compute_dtype(logits.dtype))
    top, idx = torch.topk(probs, top_k, dim=-1)  # [T, k]; ties go to the lower expert id, as in HF
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    if not weights_fp32:
        top = top.to(logits.dtype)
    return top, idx, logits


def experts_swiglu(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                   first: int = 0) -> Tensor:
    """Dropless SwiGLU experts: x [T, H], idx / weights [T, k] -> sum_k weights * expert_idx(x), [T, H].

    ``gate`` / ``up`` [E_local, F_local, H] and ``down`` [E_local, H, F_local] hold experts
    ``first`` .. ``first + E_local - 1``; an id outside them contributes nothing (another rank's
    expert). With F_local < F (tensor-parallel experts) the result is this rank's partial sum.
    Each expert runs once on the tokens routed to it, in expert order, and the weighted outputs
    are added per token in that order (as transformers' index_add_ loop does)."""
    t, k = idx.shape
    n_local = gate.shape[0]
    flat = idx.reshape(-1) - first  # [T k] local expert id of each (token, choice)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat.clamp(-1, n_local).add(1), minlength=n_local + 2)[1 : n_local + 1]
    start = int((flat < 0).sum())
    rows = order // k  # [T k] token of each pair, in expert order
    outs, pairs = [], []
    for e, n in enumerate(counts.tolist()):
        if n:
            sel = order[start : start + n]
            h = x[rows[start : start + n]]  # [n, H]
            y = F.linear(F.silu(F.linear(h, gate[e])) * F.linear(h, up[e]), down[e])  # [n, H]
            # The product in the weights' dtype (float32 for Mixtral), then back, as HF does.
            outs.append((y * weights.reshape(-1)[sel, None]).to(x.dtype))
            pairs.append(rows[start : start + n])
        start += n
    out = torch.zeros_like(x)
    if outs:
        out = out.index_add(0, torch.cat(pairs), torch.cat(outs))
    return out


def load_balancing_loss(logits: list[Tensor], experts: int, top_k: int) -> Tensor:
    """transformers' ``load_balancing_loss_func`` without an attention mask: over every layer's
    router logits [T, E] together, experts * sum_e f_e P_e with f_e the share of (token, choice)
    assignments per row and P_e the mean router probability, both summed over the layers before
    the product (not a mean of per-layer losses)."""
    tokens_per_expert = torch.zeros(experts, dtype=torch.float32, device=logits[0].device)
    prob_sum = torch.zeros(experts, dtype=torch.float32, device=logits[0].device)
    rows = 0
    for layer in logits:
        probs = torch.softmax(layer, dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        tokens_per_expert = tokens_per_expert + torch.bincount(chosen.reshape(-1), minlength=experts).float()
        prob_sum = prob_sum + probs.float().sum(dim=0)
        rows += layer.shape[0]
    return (tokens_per_expert / rows * (prob_sum / rows)).sum() * experts
