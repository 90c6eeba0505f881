"""runtime/moe/experts.py against transformers' own MoE blocks and load-balancing loss, in process."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.mixtral.modeling_mixtral import (
    MixtralSparseMoeBlock,
    load_balancing_loss_func,
)
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from meshllm_dsl.runtime.moe import experts as moe

H, F, E, K = 16, 24, 6, 2


def _redrawn(block: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return block.eval()


def _ours(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
          renormalize: bool, weights_fp32: bool, first: int = 0, n: int | None = None) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=1)  # HF fuses [gate | up] along the ffn rows
    n = n or gate.shape[0]
    w, idx, _ = moe.route(x, router, K, renormalize, weights_fp32)
    return moe.experts_swiglu(x, idx, w, gate[first:first + n], up[first:first + n], down[first:first + n], first)


def test_mixtral_block_matches_transformers() -> None:
    cfg = tf.MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)
    block = _redrawn(MixtralSparseMoeBlock(cfg), 0)
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
    want = block(x.clone())
    x2 = x.reshape(-1, H)
    got = _ours(x2, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, True, True)
    torch.testing.assert_close(got.reshape(3, 5, H), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_qwen2_moe_block_with_shared_expert_matches_transformers(norm_topk: bool) -> None:
    cfg = tf.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F, shared_expert_intermediate_size=20,
                            num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk)
    block = _redrawn(Qwen2MoeSparseMoeBlock(cfg), 2)
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(3))
    want = block(x.clone()).reshape(-1, H)
    x2 = x.reshape(-1, H)
    routed = _ours(x2, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, norm_topk, False)
    se = block.shared_expert
    shared = se.down_proj(torch.nn.functional.silu(se.gate_proj(x2)) * se.up_proj(x2))
    got = routed + torch.sigmoid(block.shared_expert_gate(x2)) * shared
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Without the renormalisation the chosen weights do not sum to one: the setting is visible.
    w, _, _ = moe.route(x2, block.gate.weight, K, norm_topk, False)
    assert torch.allclose(w.sum(-1), torch.ones(w.shape[0])) == norm_topk


def test_experts_split_over_ranks_and_ffn_sum_to_the_whole() -> None:
    """Expert parallelism's and tensor parallelism's local pieces add up to the full layer."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(11, H, generator=gen)
    router = torch.randn(E, H, generator=gen)
    gate_up, down = torch.randn(E, 2 * F, H, generator=gen), torch.randn(E, H, F, generator=gen)
    whole = _ours(x, router, gate_up, down, True, True)
    by_rank = sum(_ours(x, router, gate_up, down, True, True, first, 2) for first in (0, 2, 4))
    torch.testing.assert_close(by_rank, whole, rtol=1e-5, atol=1e-5)
    w, idx, _ = moe.route(x, router, K, True, True)
    gate, up = gate_up.chunk(2, dim=1)
    by_ffn = sum(moe.experts_swiglu(x, idx, w, gate[:, sl], up[:, sl], down[:, :, sl])
                 for sl in (slice(0, F // 2), slice(F // 2, F)))
    torch.testing.assert_close(by_ffn, whole, rtol=1e-5, atol=1e-5)  # values ~10: fp32 sums in another order


def test_load_balancing_loss_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(5)
    layers = [torch.randn(13, E, generator=gen, requires_grad=True) for _ in range(3)]
    want = load_balancing_loss_func(tuple(layers), E, K)
    got = moe.load_balancing_loss(layers, E, K)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    gw = torch.autograd.grad(want, layers)
    gg = torch.autograd.grad(got, layers)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
