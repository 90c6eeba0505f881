"""Expert parallelism: each rank of the expert group holds experts / n of a moe layer's experts,
and every (token, choice) pair travels to the rank of its expert and back by all-to-all.

The token dispatcher of DeepSpeed-MoE, Megatron-Core (``MoEAlltoAllTokenDispatcher``) and
torchtitan (``expert_parallel.py``), dropless:

1. dispatch: pairs sorted by (expert, token, choice); ``all_to_all_single`` with uneven splits sends
   each rank the rows of its experts (first the [n, experts / n] counts, so receivers know them);
2. the received rows, grouped by source rank, are reordered to (expert, source rank, token index)
   and each local expert runs once on its contiguous rows;
3. combine: the reverse permutation and the reverse all-to-all bring every pair's output home,
   where it is weighted and added per token in expert order, as ``moe.experts_swiglu`` does.

Every order is fixed by the routing alone, so results are bit-reproducible from run to run.
The all-to-alls are functional collectives' ``all_to_all_single_autograd`` (torch 2.13 deprecates
``torch.distributed.nn.functional.all_to_all_single``): autograd-aware, its backward is the reverse
all-to-all, so the experts' weight gradients collect every rank's tokens
and the tokens' gradients return to the ranks they came from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from meshllm_dsl.runtime.moe.grouped import grouped_experts_ffn, grouped_runs, swiglu
from meshllm_dsl.runtime.parallel.collectives import gather_from, split_to

__all__ = ["ExpertsParallel", "experts_parallel"]


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    out = funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(out)  # a plain tensor: the rows are indexed right after


def _expert_major(counts: Tensor) -> Tensor:
    """The permutation taking rows received source-major ([n sources][local experts] blocks of
    ``counts`` [n, E_local] rows) to expert-major order (expert, source rank, token index)."""
    n, e_local = counts.shape
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).reshape(n, e_local)
    pieces = [torch.arange(int(starts[s, j]), int(starts[s, j] + counts[s, j]), device=counts.device)
              for j in range(e_local) for s in range(n)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=counts.device)


def _inverse(perm: Tensor) -> Tensor:
    """The permutation undoing ``perm`` (expert-major back to source-major)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def experts_parallel(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                     group: dist.ProcessGroup, biases: tuple[Tensor, Tensor] | None = None,
                     act: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
    """SwiGLU experts split over ``group`` (dropless, or less the pairs routing dropped): x [T, H] this rank's tokens, idx / weights
    [T, k] their experts (global ids) and routing weights -> sum_k weights * expert_idx(x), [T, H].

    ``gate`` / ``up`` [F_local, E_local, H] and ``down`` [H, E_local, F_local] (``StackedLinear``)
    hold experts r * E_local .. (r + 1) * E_local - 1 of rank r of ``group``; with F_local < F
    (tensor-parallel experts) the result is this rank's partial sum, as ``moe.moe_experts``'s.
    ``biases``: gate's and up's [F_local, E_local]; ``act``: as ``experts_swiglu``'s."""
    n, e_local = dist.get_world_size(group), gate.shape[1]
    # FSDP2 leaves the experts out (no other rank of its mesh holds them), so they stay in the
    # master dtype: compute in the activations' dtype, as FSDP2's cast gives the dense weights (a
    # no-op without `precision`, and under autocast, whose residual stream keeps the master dtype).
    # The cast's backward returns the gradient in the master dtype.
    gate, up, down = (w if w.dtype == x.dtype else w.to(x.dtype) for w in (gate, up, down))
    t, k = idx.shape
    flat = idx.reshape(-1)  # [T k] global expert of each (token, choice) pair
    # A pair dropped for capacity (id -1, runtime/moe/routing.py) goes to no rank and adds nothing.
    if bool((flat < 0).any()):
        kept = (flat >= 0).nonzero().squeeze(1)
        order = kept[torch.argsort(flat[kept], stable=True)]
    else:  # pairs by (expert, token, choice): by destination rank too
        order = torch.argsort(flat, stable=True)
    rows = order // k  # [T k] token of each sorted pair
    per_expert = torch.bincount(flat[order], minlength=n * e_local)  # [E] pairs this rank sends each expert
    counts = torch.empty_like(per_expert)
    # [n * E_local] -> [n * E_local] int64: pairs per (destination rank's local expert), exchanged so
    # each rank receives per (source rank, local expert).
    dist.all_to_all_single(counts, per_expert, group=group)
    counts = counts.view(n, e_local)
    send = per_expert.view(n, e_local).sum(1).tolist()
    recv = counts.sum(1).tolist()
    # dispatch: [T k, H] split send[r] rows per destination r -> [sum recv, H] split recv[s] per source s
    got = _all_to_all(x[rows], recv, send, group)
    perm = _expert_major(counts)
    h = got[perm]  # [sum recv, H] by (local expert, source rank, token index)
    per_local = counts.sum(0)  # [E_local] rows each local expert received
    gate_e, up_e, down_e = gate.transpose(0, 1), up.transpose(0, 1), down.transpose(0, 1)  # expert-major views
    if h.shape[0] and grouped_runs(h, gate_e, up_e, down_e):  # one _grouped_mm per projection (runtime/moe/grouped.py)
        gate_b, up_b = (None, None) if biases is None else (biases[0].t().to(x.dtype), biases[1].t().to(x.dtype))
        y = grouped_experts_ffn(h, per_local, gate_e, up_e, down_e, gate_b, up_b, None, act or swiglu)
    else:
        outs = []
        start = 0
        for e, m in enumerate(per_local.tolist()):
            he = h[start:start + m]
            g = F.linear(he, gate[:, e], None if biases is None else biases[0][:, e].to(x.dtype))
            u = F.linear(he, up[:, e], None if biases is None else biases[1][:, e].to(x.dtype))
            outs.append(F.linear(F.silu(g) * u if act is None else act(g, u), down[:, e]))  # [m, H]
            start += m
        y = torch.cat(outs) if outs else h
    back = _inverse(perm)
    # combine: [sum recv, H] source-major, recv[s] rows back to each source s -> [T k, H] in this
    # rank's sorted pair order
    ret = _all_to_all(y[back], send, recv, group)
    # The product in the weights' dtype (float32 with weights_fp32), then back, as experts_swiglu does.
    weighted = (ret * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add(0, rows, weighted)



class ExpertsParallel(nn.Module):
    """A moe layer whose experts are split over ranks: its ``router``, ``gate`` / ``up`` / ``down``
    (``StackedLinear``) and shared expert are set as attributes by the generated stage, as for a
    plain ``nn.Module``, so parameter names stay ``mlp.gate.weight`` etc.

    ``experts`` is the method the generated forward calls: FSDP2 hooks it
    (``register_fsdp_forward_method``) when it shards the experts over the batch ranks that
    replicate them (runtime/parallel/fsdp.py ``shard_stage``), all-gathering them before it and
    reduce-scattering their gradients after its backward; elsewhere it is ``experts_parallel``."""

    def experts(self, x: Tensor, idx: Tensor, weights: Tensor, group: dist.ProcessGroup,
                act: Callable[[Tensor, Tensor], Tensor] | None = None,
                split: dist.ProcessGroup | None = None) -> Tensor:
        """``split``: the ranks of the expert group that hold the same tokens (its tensor axes).
        Each routes 1 / |split| of them, rows r * T / n .. (r + 1) * T / n (torchtitan's EP over
        tp: ``ReordererSequenceParallel`` in ``expert_parallel.py`` takes the same rows and refuses
        an uneven split), and the outputs are all-gathered back in rank order (torchtitan leaves
        them a partial sum over tp, zero outside each rank's rows, reduced at the layer's end: the
        same values). The split's backward all-gathers the input's and the
        weights' gradients, whole and the same on every rank of ``split``; the gather's keeps its own
        rows. Decoding a number of tokens that does not split runs every rank's tokens whole (the
        experts see each token |split| times, each output is the same): forward only."""
        biases = (self.gate.bias, self.up.bias) if hasattr(self.gate, "bias") else None

        def run(x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
            return experts_parallel(x, idx, weights, self.gate.weight, self.up.weight, self.down.weight, group,
                                    biases=biases, act=act)

        if split is None:
            return run(x, idx, weights)
        n = dist.get_world_size(split)
        if x.shape[0] % n:
            if torch.is_grad_enabled():
                raise ValueError(f"{x.shape[0]} tokens do not split over {n} ranks (the checker requires it when training)")
            return run(x, idx, weights)
        own = idx.chunk(n)[dist.get_rank(split)]
        return gather_from(run(split_to(x, split, 0), own, split_to(weights, split, 0)), split, 0)
