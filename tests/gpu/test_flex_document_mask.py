"""Packed rows on CUDA: attention through flex_attention with a BlockMask (the path the runtime takes
there, runtime/model/layers.py) equals SDPA with the explicit boolean mask of the same pairs (the
path on CPU, proved EQUAL to each document alone in tests/runtime/test_document_mask.py), outputs and
q / k / v gradients. Skipped without a GPU: `pytest -m gpu tests/gpu`."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("kw", [{}, {"window": 100}, {"softcap": 30.0}, {"scale": 0.05}])
def test_flex_block_mask_equals_the_sdpa_mask(kw: dict[str, Any]) -> None:
    import torch.nn.functional as F

    from meshllm_dsl.runtime.jobs.compare import packed_batches
    from meshllm_dsl.runtime.model import documents, layers

    b, s, h, kvh, d = 2, 512, 8, 2, 64
    (batch,) = packed_batches(64, b, s, 1, 0, documents=True, restart=True)
    docs = batch.documents.cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, device="cuda", requires_grad=True) for n in (h, kvh, kvh))
    pos = torch.arange(s, device="cuda")
    packing = documents.Packing(docs, docs, None)
    out = layers.masked_attention(q, k, v, pos, pos, packing, **kw)  # flex on CUDA
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)

    allowed = documents.same_document(layers._allowed(pos, pos, kw.get("window", 0)), packing)
    if "softcap" in kw:
        want_out = layers._softcapped_attention(q, k, v, allowed, d ** -0.5, kw["softcap"])
    else:
        want_out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True, scale=kw.get("scale"))
    want = torch.autograd.grad(want_out, (q, k, v), grad)
    assert (out - want_out).abs().max() < 2e-5
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 2e-4


@pytest.mark.parametrize("balance", ["headtail", "per_document", "ptrr"])
def test_flex_block_mask_under_a_context_layout(balance: str) -> None:
    """Context rank 1 of 2's queries against keys gathered in rank order, each row spread by its
    documents (runtime/parallel/context_layout.py): flex equals the boolean mask, with gradients."""
    import torch.nn.functional as F

    from meshllm_dsl.runtime.jobs.compare import packed_batches
    from meshllm_dsl.runtime.model import documents, layers
    from meshllm_dsl.runtime.parallel import context_layout

    b, s, h, kvh, d = 2, 512, 8, 2, 64
    (batch,) = packed_batches(64, b, s, 1, 0, documents=True, restart=True)
    order = context_layout.layout(batch.documents, 2, balance).cuda()  # [b, s] positions in rank order
    docs = batch.documents.cuda()
    q_pos, k_pos = order[:, s // 2:], order
    packing = documents.Packing(docs.gather(1, q_pos), docs.gather(1, k_pos), None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, s // 2, d, generator=gen, device="cuda", requires_grad=True)
    k, v = (torch.randn(b, kvh, s, d, generator=gen, device="cuda", requires_grad=True) for _ in range(2))
    out = layers.masked_attention(q, k, v, q_pos, k_pos, packing)  # flex on CUDA
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    allowed = documents.same_document(layers._allowed(q_pos, k_pos, 0), packing)
    want_out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    want = torch.autograd.grad(want_out, (q, k, v), grad)
    assert (out - want_out).abs().max() < 2e-5
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 2e-4
