"""Routing of a mixture-of-experts layer: top-k choice, capacity dropping and the router losses.

The contract the experts' code (runtime/moe/experts.py, and expert-parallel dispatch) relies on: ``route``
maps router logits to each token's top-k weights [T, k] and expert ids [T, k] int64; a (token,
choice) pair dropped for capacity has id ``DROPPED`` (-1) and weight 0, so it reaches no expert
(``experts_swiglu`` already skips ids outside its local experts) and the token keeps its residual.

Capacity (``capacity = F`` on the layer, dropless when 0): each expert takes at most
ceil(F * T * top_k / experts) of the T tokens one forward routes (one microbatch on one data-parallel
rank, as Switch Transformer and Megatron count it). Pairs past an expert's capacity are dropped in
token order: the (token, choice) pairs are visited by token position in the flattened [b * s]
batch, and for one token by its choice rank (best first); an expert keeps the first pairs it gets.
Deterministic, and the same on every rank of a tensor group (the router is replicated). Under
context parallelism T and the order are those of the whole sequences, as unsharded: each rank's ids
are gathered over the context axes and put in position order before counting (``keep``).

Router losses, added to the training loss on the tokens of each forward (microbatch x data-parallel
rank, as transformers computes them per forward and DDP / gradient accumulation average them):
- the load-balancing loss, exactly transformers' ``load_balancing_loss_func`` over every moe layer's
  router logits of that forward together: experts * sum_e f_e P_e, with f_e the share of top-k
  assignments to expert e and P_e its mean router probability, both over all layers' rows at once
  (a product of sums, not a sum over layers), times ``aux_loss_coef``. It is computed from the
  router's own top-k, before capacity drops anything, as transformers does. Under context
  parallelism one forward's sequences are spread over the context ranks: the sums are reduced over
  them before the product (``sequence_sum``).
- the router z-loss of ST-MoE (Zoph et al. 2022, eq. 5): per layer the mean over tokens of
  logsumexp(logits)^2, summed over the layers (as ST-MoE and Megatron add one per router), times
  ``z_loss_coef``.
- DeepSeek-V3's complementary sequence-wise balance loss (paper eqs. 17-20; DeepSeek-V2's
  ``seq_aux``): per layer and per sequence of T tokens, sum_i f_i P_i with f_i = E / (k T) x the
  pairs the layer routed to expert i (after capacity: the pairs it kept) and P_i the mean over the
  sequence of each token's affinities normalised to sum 1 (sigmoid scores over their sum; softmax
  probabilities), averaged over the sequences, summed over the layers, times ``seq_aux_loss``
  (alpha). Under context parallelism each sequence's pair counts are summed over the context ranks
  first (no gradient), so each rank's f_i x its part of P_i adds up over them (``sequence_sum``).
All are made of sums over layers (``RouterLosses.statistics``), so with pipeline stages each stage
adds its layers' sums to the previous stage's and sends them on beside its activations; the last
stage's ``RouterLosses.loss`` then equals the whole forward's (runtime/train/program.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from meshllm_dsl.runtime.model import description

__all__ = ["CORRECTION", "DROPPED", "LOAD", "RouterLog", "RouterLosses", "balance", "balanced_routers", "capacity_of",
           "choose_sigmoid", "count_load", "keep_within_capacity", "load_balancing_loss", "record", "recording", "route",
           "sequence_aux_loss", "update_correction", "z_loss"]

DROPPED = -1  # the expert id of a (token, choice) pair dropped for capacity


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 as transformers does; float64 (exactness tests) stays float64.
    return torch.promote_types(dtype, torch.float32)


def capacity_of(capacity: float, tokens: int, top_k: int, experts: int) -> int | None:
    """Pairs one expert may take of ``tokens`` tokens: ceil(F * tokens * top_k / experts); None: dropless."""
    if not capacity:
        return None
    return math.ceil(capacity * tokens * top_k / experts)


def keep_within_capacity(idx: Tensor, experts: int, limit: int) -> Tensor:
    """[T, k] bool: which (token, choice) pairs fit their expert's capacity ``limit``, in token
    order (row-major over [T, k]: token position first, then choice rank)."""
    flat = idx.reshape(-1)  # [T k] in token order
    onehot = F.one_hot(flat, experts)  # [T k, E]
    # The position of each pair among the pairs of its expert, counted in token order.
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # [T k]
    return (position < limit).reshape(idx.shape)


@dataclass
class RouterLog:
    """Each moe layer's routing in the forwards recorded, in call order: logits [T, E] with autograd
    (for the router losses; only with ``keep_logits``) and chosen ids [T, k] after capacity; and,
    for the profile, the pairs each expert received per layer (keyed by the router weight, in the
    order layers were first seen, which is this rank's layer order under every schedule)."""

    keep_logits: bool = True
    logits: list[Tensor] = field(default_factory=list)
    chosen: list[Tensor] = field(default_factory=list)
    counts: dict[int, list[int]] = field(default_factory=dict)  # id(router weight) -> pairs per expert
    dropped: dict[int, int] = field(default_factory=dict)  # id(router weight) -> pairs dropped for capacity

    def add(self, logits: Tensor, chosen: Tensor, weight: Tensor | None) -> None:
        if self.keep_logits:
            self.logits.append(logits)
            self.chosen.append(chosen.detach())
            return
        flat = chosen.detach().reshape(-1)
        got = torch.bincount(flat[flat >= 0], minlength=logits.shape[-1]).tolist()
        key = id(weight)
        prev = self.counts.setdefault(key, [0] * len(got))
        self.counts[key] = [a + b for a, b in zip(prev, got)]
        self.dropped[key] = self.dropped.get(key, 0) + int((flat < 0).sum())

    def per_layer(self) -> list[tuple[list[int], int]]:
        """(pairs per expert, pairs dropped) of each layer seen, in this rank's layer order."""
        return [(c, self.dropped[k]) for k, c in self.counts.items()]


_ACTIVE: list[RouterLog] = []


@contextmanager
def recording(active: bool = True, keep_logits: bool = True) -> Iterator[RouterLog]:
    """Collect every ``route`` call of the forwards inside (a fresh log; nothing when not active).
    Calls made while autograd runs a backward (recompute of a checkpointed block) are not forwards
    of the batch and are left out."""
    log = RouterLog(keep_logits)
    if not active:
        yield log
        return
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)


def choose_sigmoid(logits: Tensor, top_k: int, renormalize: bool, bias: Tensor, groups: int = 1,
                   topk_groups: int = 1, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``, GLM-4.5's the same): logits
    [T, E] -> (weights [T, k], ids [T, k]).

    Scores are sigmoid(logits) in float32 (float64 stays float64). The correction ``bias`` [E] is
    added to the scores only to choose the experts; the weights are the chosen experts' plain
    scores. With ``groups`` > 1 the experts are ``groups`` contiguous groups of E / groups; a group
    scores the sum of its two best (biased) scores, and each token chooses only among the experts of
    its ``topk_groups`` best groups. ``renormalize``: the chosen weights divided by their sum
    (+ 1e-20, as transformers); then multiplied by ``scaling`` (routed_scaling_factor)."""
    scores = torch.sigmoid(logits.to(compute_dtype(logits.dtype)))  # [T, E]
    choice = scores + bias.to(scores.dtype)  # [T, E] for choosing only
    if groups > 1:
        t, e = choice.shape
        by_group = choice.view(t, groups, e // groups)  # [T, G, E / G]
        group_scores = by_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        best = torch.topk(group_scores, topk_groups, dim=-1)[1]  # [T, topk_groups]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)  # [T, G]
        allowed = allowed[:, :, None].expand(t, groups, e // groups).reshape(t, e)
        choice = choice.masked_fill(~allowed, float("-inf"))
    idx = torch.topk(choice, top_k, dim=-1)[1]  # [T, k], best first
    top = scores.gather(1, idx)
    if renormalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * scaling, idx


def route(x: Tensor, weight: Tensor, top_k: int, renormalize: bool, weights_fp32: bool,
          capacity: float = 0.0, keep: Callable[[Tensor, int, float], Tensor] | None = None, *,
          scoring: str = "softmax", bias: Tensor | None = None, groups: int = 1, topk_groups: int = 1,
          scaling: float = 1.0, load: Tensor | None = None,
          router_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Router of one MoE layer: x [T, H], weight [E, H] -> (chosen weights [T, k], chosen expert
    ids [T, k] int64, router logits [T, E]).

    ``weights_fp32``: keep the chosen weights in float32 instead of casting them to the
    logits' dtype. ``capacity``: the capacity factor (0: dropless); dropped
    pairs get id ``DROPPED`` and weight 0 (the kept weights are not renormalised again). ``keep``:
    (ids [T, k], experts, factor) -> which pairs fit, when the T rows are part of a forward spread over ranks
    (context parallelism: ContextShard.keep_within_capacity counts in the whole sequence's order).
    ``scoring = "sigmoid"``: DeepSeek-V3's router (``choose_sigmoid``: ``bias``, ``groups``,
    ``topk_groups``, ``scaling``); softmax scoring takes ``scaling`` too (DeepSeek-V2's).
    ``load`` [E]: the pairs each expert receives are added to it (``count_load``).
    ``router_bias`` [E]: the router's own bias (GPT-OSS), part of the logits."""
    logits = F.linear(x, weight, router_bias)  # [T, E]
    if scoring == "sigmoid":
        assert bias is not None, "sigmoid scoring chooses with the correction bias"
        top, idx = choose_sigmoid(logits, top_k, renormalize, bias, groups, topk_groups, scaling)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=compute_dtype(logits.dtype))
        top, idx = torch.topk(probs, top_k, dim=-1)  # [T, k]; ties go to the lower expert id, as in HF
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        if scaling != 1.0:
            top = top * scaling
    if not weights_fp32:
        top = top.to(logits.dtype)
    limit = capacity_of(capacity, x.shape[0], top_k, weight.shape[0])
    if limit is not None:
        fits = keep(idx, weight.shape[0], capacity) if keep is not None else keep_within_capacity(idx, weight.shape[0], limit)
        idx = torch.where(fits, idx, torch.full_like(idx, DROPPED))
        top = top * fits
    record(logits, idx, weight)
    if load is not None:
        count_load(load, idx)
    return top, idx, logits


CORRECTION = "e_score_correction_bias"  # a sigmoid router's bias buffer (transformers' name)
LOAD = "expert_load"  # a balanced router's buffer: pairs per expert since the last optimizer step


def count_load(load: Tensor, idx: Tensor) -> None:
    """Add the (token, choice) pairs each expert receives (ids [T, k], dropped pairs left out) to
    ``load`` [E], the layer's count over a training step for the correction bias's update
    (``update_correction``). Only in training forwards: not under no_grad (evaluation, inference)
    and not in a recompute inside backward (the forward already counted those tokens)."""
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return
    flat = idx.detach().reshape(-1)
    with torch.no_grad():
        load.add_(torch.bincount(flat[flat >= 0], minlength=load.shape[0]))


def update_correction(bias: Tensor, load: Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437 section 2.1.2): after the
    optimizer step, bias_e += rate * sign(mean(load) - load_e), ``load`` the step's pairs per expert
    counted over every rank that routed tokens (summed over the ranks first: ``balance``); then the
    count starts again from zero. In place on the buffers; the same on every rank, which all hold
    the same summed load. (torchtitan also subtracts the update's mean, which moves every score by
    the same amount and so chooses the same experts; the paper's rule is kept.)"""
    with torch.no_grad():
        mean = load.to(torch.float64).mean()
        bias.add_(rate * torch.sign(mean - load.to(torch.float64)).to(bias.dtype))
        load.zero_()


def balanced_routers(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The routers among ``modules`` (and their submodules) whose correction bias moves
    (``balance_rate`` set: they count their load in ``LOAD``), in module order."""
    return [m for module in modules for m in module.modules() if hasattr(m, LOAD)]


def balance(routers: Sequence[nn.Module], group: dist.ProcessGroup | None) -> None:
    """After an optimizer step: every balanced router's step load summed over ``group`` (the ranks
    that routed this step's tokens to the same layers: every rank but other pipeline stages'), in
    one all-reduce of the layers' counts side by side, then each bias updated (``update_correction``).
    The counts are integers, so the sum and the update are exact and the same on every rank. Ranks
    of a tensor group count the same tokens; that scales every count alike and leaves each
    sign(mean - load) as it is."""
    if not routers:
        return
    loads = torch.cat([getattr(r, LOAD) for r in routers])  # [layers * E] int64
    if group is not None:
        dist.all_reduce(loads, group=group)
    for r, load in zip(routers, loads.split([getattr(r, LOAD).numel() for r in routers])):
        update_correction(getattr(r, CORRECTION), load, float(r.balance_rate))
        getattr(r, LOAD).zero_()


def record(logits: Tensor, chosen: Tensor, weight: Tensor | None = None) -> None:
    """Note one layer's routing (``weight``: its router's, naming the layer) in the logs being recorded."""
    if not _ACTIVE or torch._C._current_graph_task_id() != -1:  # none, or a recompute inside backward
        return
    for log in _ACTIVE:
        log.add(logits, chosen, weight)


def load_balancing_loss(logits: Sequence[Tensor], experts: int, top_k: int,
                        attention_mask: Tensor | None = None) -> Tensor:
    """transformers' ``load_balancing_loss_func``: over every layer's router logits [T, E] together,
    experts * sum_e f_e P_e with f_e the top-k assignments per row and P_e the mean router
    probability, both summed over the layers before the product. ``attention_mask`` [b, s] (T = b * s
    rows) weighs each row as transformers does (meshllm's training batches have no padding: None)."""
    # float32 sums as transformers' (float64 stays float64, for the exactness tests).
    device, acc = logits[0].device, compute_dtype(logits[0].dtype)
    tokens_per_expert = torch.zeros(experts, dtype=acc, device=device)
    prob_sum = torch.zeros(experts, dtype=acc, device=device)
    rows: Tensor | float = 0.0
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=acc)
    for layer in logits:
        probs = torch.softmax(layer, dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        if mask is None:
            tokens_per_expert = tokens_per_expert + torch.bincount(chosen.reshape(-1), minlength=experts).to(acc)
            prob_sum = prob_sum + probs.to(acc).sum(dim=0)
            rows = rows + layer.shape[0]
        else:
            tokens_per_expert = tokens_per_expert + torch.zeros(experts, dtype=acc, device=device).scatter_add_(
                0, chosen.reshape(-1), mask.repeat_interleave(top_k))
            prob_sum = prob_sum + (probs.to(acc) * mask[:, None]).sum(dim=0)
            rows = rows + mask.sum()
    return (tokens_per_expert / rows * (prob_sum / rows)).sum() * experts


def z_loss(logits: Sequence[Tensor]) -> Tensor:
    """ST-MoE's router z-loss: per layer mean_t logsumexp(logits_t)^2, summed over the layers."""
    return sum((torch.logsumexp(layer.to(compute_dtype(layer.dtype)), dim=-1).square().mean() for layer in logits),
               torch.zeros((), dtype=compute_dtype(logits[0].dtype), device=logits[0].device))


def _affinities(logits: Tensor, scoring: str) -> Tensor:
    """[T, E] each token's affinities normalised to sum 1 (DeepSeek-V3's s'_{i,t}: its sigmoid scores
    over their sum; a softmax router's probabilities, DeepSeek-V2's), in the accumulation dtype."""
    x = logits.to(compute_dtype(logits.dtype))
    if scoring == "sigmoid":
        scores = torch.sigmoid(x)
        return scores / scores.sum(dim=-1, keepdim=True)
    return torch.softmax(x, dim=-1)


def _chosen_per_sequence(chosen: Tensor, sequences: int, experts: int, dtype: torch.dtype) -> Tensor:
    """[B, E] each sequence's (token, choice) pairs per expert of ``chosen`` [B s, k] (dropped pairs
    left out), no gradient."""
    ids = chosen.detach().reshape(sequences, -1)  # [B, s k]
    kept = ids >= 0
    return torch.zeros(sequences, experts, dtype=dtype, device=ids.device).scatter_add_(
        1, ids.clamp(min=0), kept.to(dtype))


def sequence_aux_loss(logits: Sequence[Tensor], chosen: Sequence[Tensor], sequences: int, top_k: int,
                      scoring: str) -> Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (paper eqs. 17-20, without alpha), per
    layer and summed over the layers: for each sequence of T tokens, sum_i f_i P_i with
    f_i = E / (k T) x the pairs routed to expert i and P_i = 1 / T x sum_t s'_{i,t} (``_affinities``),
    averaged over the ``sequences`` (DeepSeek-V2's `seq_aux`: ``(ce * scores.mean(1)).sum(1).mean()``).
    ``logits`` [B T, E] and ``chosen`` [B T, k] per layer (pairs dropped for capacity not counted)."""
    first = logits[0]
    total = torch.zeros((), dtype=compute_dtype(first.dtype), device=first.device)
    for layer, ids in zip(logits, chosen, strict=True):
        e = layer.shape[-1]
        p = _affinities(layer, scoring).reshape(sequences, -1, e)  # [B, T, E]
        t = p.shape[1]
        f = _chosen_per_sequence(ids, sequences, e, p.dtype) * (e / (top_k * t))  # [B, E]
        total = total + (f * p.mean(dim=1)).sum(dim=1).mean()
    return total


@dataclass(frozen=True)
class RouterLosses:
    """The router terms a model adds to its training loss (from its MODEL description's moe layers)."""

    experts: int
    top_k: int
    aux_loss_coef: float
    z_loss_coef: float
    seq_aux_loss: float = 0.0  # DeepSeek-V3's sequence-wise balance loss's alpha
    scoring: str = "softmax"

    @classmethod
    def of(cls, model: Mapping[str, Any]) -> RouterLosses | None:
        """None when no moe layer asks for a router loss."""
        moes = description.moe_layers(model)
        wanted = [s for s in moes if s.get("aux_loss_coef") or s.get("z_loss_coef") or s.get("seq_aux_loss")]
        if not wanted:
            return None
        first = wanted[0]
        keys = ("experts", "top_k", "aux_loss_coef", "z_loss_coef", "seq_aux_loss", "scoring")
        if any(tuple(s.get(k) for k in keys) != tuple(first.get(k) for k in keys) for s in moes):
            # transformers' loss concatenates every layer's logits: one experts / top_k for the model.
            raise ValueError("the router losses need every moe layer to have the same experts, top_k and coefficients")
        return cls(int(first["experts"]), int(first["top_k"]), float(first.get("aux_loss_coef") or 0.0),
                   float(first.get("z_loss_coef") or 0.0), float(first.get("seq_aux_loss") or 0.0),
                   str(first.get("scoring") or "softmax"))

    @property
    def width(self) -> int:
        """Elements of ``statistics``: [pairs per expert | probability sums | rows | sequence-wise
        loss | z-loss sum]."""
        return 2 * self.experts + 3

    def statistics(self, logits: Sequence[Tensor], carried: Tensor | None, dtype: torch.dtype,
                   device: torch.device, chosen: Sequence[Tensor] = (), sequences: int = 1,
                   sequence_counts: Callable[[Tensor], Tensor] | None = None, parts: int = 1) -> Tensor:
        """[2 E + 3] the sums the router losses are made of, over the layers of ``logits`` added to
        ``carried`` (those of earlier layers of the same forward, from an earlier pipeline stage):
        top-k pairs per expert (no gradient, as transformers' f), router probability summed over the
        rows per expert (with gradient: P), rows, the sequence-wise loss's terms (with gradient) and
        the layers' z-loss terms (with gradient). Additive over layers, so a pipeline stage sends them
        on with its activations and the last stage's ``loss`` equals the loss of the whole forward
        (``dtype``: the accumulation dtype).

        The sequence-wise loss (``seq_aux_loss``) needs ``chosen`` (each layer's [T, k] ids) and the
        ``sequences`` the T rows are of. Under context parallelism the rows are this rank's 1 / ``parts``
        of each sequence: ``sequence_counts`` sums each sequence's pairs per expert over the context
        ranks first (no gradient), so this rank's term f_i x its share of P_i is additive over them
        (``loss`` sums it over the context ranks with the rest)."""
        e = self.experts
        if carried is None:
            carried = torch.zeros(self.width, dtype=dtype, device=device)
        counts, probs, rows = carried[:e], carried[e:2 * e], carried[2 * e]
        seq, z = carried[2 * e + 1], carried[2 * e + 2]
        for layer in logits:  # the same sums, in the same order, as load_balancing_loss and z_loss
            p = torch.softmax(layer, dim=-1)
            _, top = torch.topk(p, self.top_k, dim=-1)
            counts = counts + torch.bincount(top.reshape(-1), minlength=e).to(dtype)
            probs = probs + p.to(dtype).sum(dim=0)
            rows = rows + layer.shape[0]
            z = z + torch.logsumexp(layer.to(dtype), dim=-1).square().mean()
        if self.seq_aux_loss:
            for layer, ids in zip(logits, chosen, strict=True):
                a = _affinities(layer, self.scoring).to(dtype).reshape(sequences, -1, e)  # [B, T / parts, E]
                t = a.shape[1] * parts  # the whole sequence's tokens
                pairs = _chosen_per_sequence(ids, sequences, e, dtype)  # [B, E] this rank's part
                if sequence_counts is not None:
                    pairs = sequence_counts(pairs).detach()  # [B, E] the whole sequences'
                seq = seq + (pairs * (e / (self.top_k * t)) * (a.sum(dim=1) / t)).sum(dim=1).mean()
        return torch.cat([counts, probs, rows.reshape(1), seq.reshape(1), z.reshape(1)])

    def loss(self, stats: Tensor, sequence_sum: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """coef x load-balancing loss + alpha x sequence-wise loss + z coef x z-loss from a whole
        forward's ``statistics``. ``sequence_sum``: under context parallelism the rows are this rank's
        part of the sequences; pairs, probability sums, rows and the sequence-wise terms are summed
        over every context rank before the product (ContextShard.sequence_sum). The z-loss, a mean
        over tokens, is averaged like the cross-entropy."""
        e = self.experts
        if sequence_sum is not None:
            # [2 E + 2] pairs per expert, probability sums, rows, sequence-wise terms -> the same over
            # the whole sequences.
            stats = torch.cat([sequence_sum(stats[:2 * e + 2]), stats[2 * e + 2:]])
        counts, rows = stats[:e].detach(), stats[2 * e].detach()  # f_e carries no gradient
        total = torch.zeros((), dtype=stats.dtype, device=stats.device)
        if self.aux_loss_coef:
            total = total + self.aux_loss_coef * (counts / rows * (stats[e:2 * e] / rows)).sum() * e
        if self.seq_aux_loss:
            total = total + self.seq_aux_loss * stats[2 * e + 1]
        if self.z_loss_coef:
            total = total + self.z_loss_coef * stats[2 * e + 2]
        return total

    def __call__(self, log: RouterLog, sequences: int = 1) -> Tensor:
        """coef x load-balancing loss + alpha x sequence-wise loss + z coef x z-loss of one forward's
        routing (of ``sequences`` whole sequences), straight from the logits (the unsharded
        reference's; the plans go through ``statistics`` and ``loss``)."""
        first = log.logits[0]
        total = torch.zeros((), dtype=compute_dtype(first.dtype), device=first.device)
        if self.aux_loss_coef:
            total = total + self.aux_loss_coef * load_balancing_loss(log.logits, self.experts, self.top_k)
        if self.seq_aux_loss:
            total = total + self.seq_aux_loss * sequence_aux_loss(log.logits, log.chosen, sequences, self.top_k,
                                                                  self.scoring)
        if self.z_loss_coef:
            total = total + self.z_loss_coef * z_loss(log.logits)
        return total

