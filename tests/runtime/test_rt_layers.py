"""The runtime's fused layers against the plain formulas they replace, bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import meshllm_dsl.runtime as rt  # noqa: E402 - after the torch skip
from meshllm_dsl.runtime.model.rope import llama3_inv_freq  # noqa: E402

# The attention's rope_scaling as generated code passes it: transformers' field names.
LLAMA3 = (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
          ("original_max_position_embeddings", 8192))


def _hf_rotary(q, k, pos, theta, scaling=None):  # type: ignore[no-untyped-def]
    """HF's apply_rotary_pos_emb with rotate_half, cos / sin computed in float32."""
    d = q.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if scaling is not None:
        sc = dict(scaling)
        inv_freq = llama3_inv_freq(inv_freq, sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                                   sc["original_max_position_embeddings"])
    emb = torch.cat([pos.float().unsqueeze(-1) * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().to(q.dtype).unsqueeze(-2), emb.sin().to(q.dtype).unsqueeze(-2)

    def rotate_half(x):  # type: ignore[no-untyped-def]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("batched_pos", [False, True])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rotary_equals_rotate_half_bit_for_bit(dtype: str, batched_pos: bool, scaling: tuple | None) -> None:
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    q, gq = (torch.randn(3, 16, 4, 32, generator=gen).to(dt) for _ in range(2))
    k, gk = (torch.randn(3, 16, 2, 32, generator=gen).to(dt) for _ in range(2))
    pos = torch.arange(7, 23)
    if batched_pos:  # [b, s]: each sequence at its own offset
        pos = torch.arange(16) + torch.tensor([[0], [5], [9]])
    results = []
    for rotary in (_hf_rotary, rt.apply_rotary):
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = rotary(qi, ki, pos, 500000.0, scaling)
        torch.autograd.backward(out, (gq, gk))
        results.append([*out, qi.grad, ki.grad])
    with torch.no_grad():  # the path without autograd
        results.append([*rt.apply_rotary(q, k, pos, 500000.0, scaling), *results[0][2:]])
    want = results[0]
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_rotary_backward_only_for_what_needs_it() -> None:
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    k = torch.randn(1, 4, 2, 8)
    out_q, out_k = rt.apply_rotary(q, k, torch.arange(4), 10000.0)
    (out_q.sum() + out_k.sum()).backward()
    assert q.grad is not None and k.grad is None
