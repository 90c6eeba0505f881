"""Mixture-of-experts: top-k routing, stacked SwiGLU experts and the load-balancing loss.

Numerics follow transformers' mixture-of-experts models (``*TopKRouter``, ``*Experts``,
``load_balancing_loss_func``): softmax of the router logits in float32, top-k of the
probabilities, optional renormalisation of the chosen k, and the chosen weights kept in float32
or cast back to the activation dtype (``weights_fp32``). Routing itself (top-k, capacity, the router
losses) lives in runtime/moe/routing.py; dropless unless the layer sets a capacity factor.

Used by both the unsharded reference model (runtime/model/reference.py) and generated stages; the
experts' ffn may be split over a tensor axis like the dense MLP's (gate / up column, down row).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshllm_dsl.runtime.moe.grouped import Activation, grouped_experts_ffn, grouped_runs, swiglu
from meshllm_dsl.runtime.moe.routing import capacity_of as _capacity_of
from meshllm_dsl.runtime.moe.routing import (
    choose_sigmoid,
    compute_dtype,
    count_load,
    keep_within_capacity,
    load_balancing_loss,
    record,
    route,
)

__all__ = ["ReferenceMoE", "StackedLinear", "clamped_swiglu", "experts_swiglu",
           "load_balancing_loss", "moe_expert_bias", "moe_experts", "moe_route", "route"]


class StackedLinear(nn.Module):
    """The same linear layer of every expert, one weight [out, experts, in]: the experts dim in the
    middle so a column rule splits dim 0 and a row rule the last, as for nn.Linear. With
    ``bias_experts`` a bias [out, bias_experts] too (GPT-OSS's experts): the experts this rank holds,
    or all of them for a bias added after the experts' sum (the down projection's)."""

    def __init__(self, experts: int, in_features: int, out_features: int, bias_experts: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, experts, in_features).normal_(0.0, 0.02))
        if bias_experts:
            self.bias = nn.Parameter(torch.zeros(out_features, bias_experts))


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    """GPT-OSS's experts' activation (transformers' GptOssExperts._apply_gate): the gate clamped
    above at ``limit``, up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
    Element-wise, so a tensor-parallel slice of the ffn computes its own part."""
    def act(gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return act


def moe_expert_bias(idx: Tensor, weights: Tensor, bias: Tensor) -> Tensor:
    """The down projection's bias of each token's chosen experts, weighted: idx / weights [T, k],
    bias [H, E] (every expert's) -> sum_k weights * bias[:, idx], [T, H] in the weights' dtype.
    Added once after the experts' partial sums are reduced (a row layer's bias), so each rank of a
    tensor group computes it whole; a dropped pair (id -1, weight 0) adds nothing."""
    picked = bias.t()[idx.clamp(min=0)]  # [T, k, H]
    return (picked.to(weights.dtype) * weights[..., None]).sum(1)


def experts_swiglu(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                   first: int = 0, *, gate_bias: Tensor | None = None, up_bias: Tensor | None = None,
                   down_bias: Tensor | None = None, act: Activation = swiglu) -> Tensor:
    """Dropless SwiGLU experts: x [T, H], idx / weights [T, k] -> sum_k weights * expert_idx(x), [T, H].

    ``gate`` / ``up`` [E_local, F_local, H] and ``down`` [E_local, H, F_local] (expert-major) hold experts
    ``first`` .. ``first + E_local - 1``; an id outside them contributes nothing (another rank's
    expert). With F_local < F (tensor-parallel experts) the result is this rank's partial sum.
    Each expert runs once on the tokens routed to it, in expert order, and the weighted outputs
    are added per token in that order (as transformers' index_add_ loop does).

    An expert computes ``down(act(gate(h) + gate_bias, up(h) + up_bias)) + down_bias`` (biases
    [E_local, F_local] / [E_local, H], each added after its matmul; ``act`` SwiGLU unless given).
    With F_local < F leave ``down_bias`` out and add ``moe_expert_bias`` once after the sum over
    the tensor ranks, as a row-parallel layer's bias is added (runtime/model/layers.py ``row_matmul``).

    One ``torch._grouped_mm`` per projection where ``grouped_runs`` says it can (runtime/moe/grouped.py:
    float32 / bfloat16 / float16 in aligned layouts), else a loop of ``F.linear`` over the experts;
    the two compute the same products in the same order."""
    t, k = idx.shape
    n_local = gate.shape[0]
    flat = idx.reshape(-1) - first  # [T k] local expert id of each (token, choice)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat.clamp(-1, n_local).add(1), minlength=n_local + 2)[1 : n_local + 1]
    start = int((flat < 0).sum())
    rows = order // k  # [T k] token of each pair, in expert order
    if grouped_runs(x, gate, up, down):
        n = int(counts.sum())
        if n == 0:
            return torch.zeros_like(x)
        sel, pairs = order[start : start + n], rows[start : start + n]
        y = grouped_experts_ffn(x[pairs], counts, gate, up, down, gate_bias, up_bias, down_bias, act)
        return torch.zeros_like(x).index_add(0, pairs, (y * weights.reshape(-1)[sel, None]).to(x.dtype))
    outs, pairs_of = [], []
    for e, n in enumerate(counts.tolist()):
        if n:
            sel = order[start : start + n]
            h = x[rows[start : start + n]]  # [n, H]
            y = _expert_ffn(h, e, gate, up, down, gate_bias, up_bias, down_bias, act)  # [n, H]
            # The product in the weights' dtype (float32 with weights_fp32), then back, as HF does.
            outs.append((y * weights.reshape(-1)[sel, None]).to(x.dtype))
            pairs_of.append(rows[start : start + n])
        start += n
    out = torch.zeros_like(x)
    if outs:
        out = out.index_add(0, torch.cat(pairs_of), torch.cat(outs))
    return out


def _expert_ffn(h: Tensor, e: int, gate: Tensor, up: Tensor, down: Tensor, gate_bias: Tensor | None,
                up_bias: Tensor | None, down_bias: Tensor | None, act: Activation) -> Tensor:
    """Local expert ``e`` on its rows h [n, H] with biases and ``act``: the loop's form of
    ``grouped_experts_ffn`` (each bias added after its matmul, as there)."""
    g, u = F.linear(h, gate[e]), F.linear(h, up[e])
    if gate_bias is not None:
        g = g + gate_bias[e]
    if up_bias is not None:
        u = u + up_bias[e]
    y = F.linear(act(g, u), down[e])
    return y if down_bias is None else y + down_bias[e]


def moe_route(x: Tensor, weight: Tensor, top_k: int, renormalize: bool, weights_fp32: bool,
              capacity: float = 0.0, keep: Callable[[Tensor, int, float], Tensor] | None = None,
              **keywords: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``route`` (runtime/moe/routing.py) as generated code calls it (keywords: DeepSeek's scoring /
    bias / groups / topk_groups / scaling / load, GPT-OSS's router_bias)."""
    return route(x, weight, top_k, renormalize, weights_fp32, capacity, keep, **keywords)


def moe_experts(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                first: int = 0, *, gate_bias: Tensor | None = None, up_bias: Tensor | None = None,
                down_bias: Tensor | None = None, act: Activation = swiglu) -> Tensor:
    """``experts_swiglu`` on ``StackedLinear`` weights: gate / up [F_local, E_local, H], down
    [H, E_local, F_local] (the layout parameters and checkpoints of meshllm keep), and their biases
    likewise: gate / up [F_local, E_local], down [H, E_local]; ``act`` as there."""
    def expert_major(b: Tensor | None) -> Tensor | None:
        return None if b is None else b.t()
    return experts_swiglu(x, idx, weights, gate.transpose(0, 1), up.transpose(0, 1), down.transpose(0, 1), first,
                          gate_bias=expert_major(gate_bias), up_bias=expert_major(up_bias),
                          down_bias=expert_major(down_bias), act=act)


class ReferenceMoE(nn.Module):
    """The unsharded reference of a ``moe`` layer (runtime/model/reference.py), computed densely: every
    expert on every token, combined by a [T, E] matrix that is zero off each token's top k. A
    different computation from ``experts_swiglu``'s sort-and-gather, so equivalence tests compare
    two implementations."""

    def __init__(self, spec: Mapping[str, Any], index: int = 0) -> None:
        super().__init__()
        hid, ffn, n_exp = spec["hidden"], spec["ffn"], spec["experts"]
        self.hidden, self.experts, self.top_k = hid, n_exp, spec["top_k"]
        self.renormalize, self.weights_fp32 = bool(spec["norm_topk_prob"]), bool(spec["weights_fp32"])
        self.capacity = float(spec.get("capacity") or 0.0)
        self.router = nn.Linear(hid, n_exp, bias=bool(spec.get("router_bias")))
        # DeepSeek-V3's router (runtime/moe/routing.py choose_sigmoid): the correction bias a buffer of
        # the router, as generated stages hold it; the step's load counted for its update.
        self.sigmoid = spec.get("scoring", "softmax") == "sigmoid"
        self.groups, self.topk_groups = int(spec.get("groups", 1)), int(spec.get("topk_groups", 1))
        self.scaling = float(spec.get("routed_scaling", 1.0))
        if self.sigmoid:
            self.router.register_buffer("e_score_correction_bias", torch.zeros(n_exp))
            if spec.get("balance_rate"):
                self.router.register_buffer("expert_load", torch.zeros(n_exp, dtype=torch.long), persistent=False)
                self.router.balance_rate = float(spec["balance_rate"])
        biased = n_exp if spec.get("expert_bias") else 0
        self.gate, self.up = StackedLinear(n_exp, hid, ffn, biased), StackedLinear(n_exp, hid, ffn, biased)
        self.down = StackedLinear(n_exp, ffn, hid, biased)
        self.act = clamped_swiglu(float(spec["swiglu_alpha"]), float(spec["swiglu_limit"])) \
            if spec.get("act") == "swiglu_clamped" else None
        self.shared = spec.get("shared_ffn") is not None
        self.shared_gated = self.shared and not spec.get("shared_experts")  # Qwen2-MoE's sigmoid gate
        if self.shared:
            sf = spec["shared_ffn"]
            self.shared_gate, self.shared_up = nn.Linear(hid, sf, bias=False), nn.Linear(hid, sf, bias=False)
            self.shared_down = nn.Linear(sf, hid, bias=False)
            if self.shared_gated:
                self.shared_router = nn.Linear(hid, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        t = x.reshape(-1, self.hidden)
        logits = self.router(t)
        if self.sigmoid:
            top, idx = choose_sigmoid(logits, self.top_k, self.renormalize, self.router.e_score_correction_bias,
                                      self.groups, self.topk_groups, self.scaling)
        else:
            probs = torch.softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)
            top, idx = probs.topk(self.top_k, dim=-1)
            if self.renormalize:
                top = top / top.sum(-1, keepdim=True)
            if self.scaling != 1.0:
                top = top * self.scaling
        if not self.weights_fp32:
            top = top.to(logits.dtype)
        limit = _capacity_of(self.capacity, t.shape[0], self.top_k, self.experts)
        keep = None if limit is None else keep_within_capacity(idx, self.experts, limit)
        if keep is not None:
            top = top * keep  # a dropped pair weighs 0
        record(logits, idx if keep is None else torch.where(keep, idx, -1), self.router.weight)
        if hasattr(self.router, "expert_load"):
            count_load(self.router.expert_load, idx if keep is None else torch.where(keep, idx, -1))
        dense = torch.zeros(t.shape[0], self.experts, dtype=top.dtype).scatter(1, idx, top)  # [T, E]
        g = torch.einsum("th,feh->tef", t, self.gate.weight)
        u = torch.einsum("th,feh->tef", t, self.up.weight)
        biased = hasattr(self.down, "bias")
        if biased:  # [F, E] -> [1, E, F]
            g, u = g + self.gate.bias.t()[None], u + self.up.bias.t()[None]
        y = torch.einsum("tef,hef->teh", F.silu(g) * u if self.act is None else self.act(g, u), self.down.weight)  # [T, E, H] every expert
        if biased:
            y = y + self.down.bias.t()[None]
        out = (y * dense[..., None]).sum(1).to(t.dtype)
        if self.shared:
            s = self.shared_down(F.silu(self.shared_gate(t)) * self.shared_up(t))
            out = out + (torch.sigmoid(self.shared_router(t)) * s if self.shared_gated else s)
        return out.view_as(x)
