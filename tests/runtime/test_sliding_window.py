"""Sliding-window attention: the decoding cache holds no more than the window and still gives what
attention over the whole sequence gives; the planner's KV cache knows the window; the checker's
rules for windows and post norms."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.runtime.model.layers import DecodeSession, attention  # noqa: E402

WINDOW = 3


def test_decoding_cache_holds_at_most_the_window_and_matches_full_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    b, s, h, kvh, d = 2, 14, 4, 2, 8
    q, k, v = (torch.randn(b, s, n, d, generator=gen, dtype=torch.float64) for n in (h, kvh, kvh))
    whole = attention(q, k, v, window=WINDOW)  # [b, s, h * d]: every position at once
    # the same without the window differs, so the window is what this checks
    assert (whole - attention(q, k, v)).abs().max() > 1e-3
    session = DecodeSession()
    got = []
    for start, stop in [(0, 8), *((i, i + 1) for i in range(8, s))]:  # prefill, then token by token
        with session.step(stop - start):
            got.append(attention(q[:, start:stop], k[:, start:stop], v[:, start:stop], window=WINDOW))
        assert session.caches[0].length <= WINDOW - 1  # never the whole history
    assert torch.allclose(torch.cat(got, dim=1), whole, atol=1e-12, rtol=0)


def test_softcap_and_scale_change_attention_as_hf_computes_them() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=gen, dtype=torch.float64) * 3 for _ in range(3))
    scale, cap = 24 ** -0.5, 2.0
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    want = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v).reshape(1, 5, 8)
    assert torch.allclose(attention(q, k, v, scale=scale, softcap=cap), want, atol=1e-12, rtol=0)


def _plan(window: int) -> object:
    text = ("mesh m { axes tensor = 2 }\n"
            "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
            f" dtype = fp32, window = {window} }}\n"
            "plan p on m for m { batch = 4  seq = 8\n"
            "    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor } }\n")
    result = check_text(text, "w.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    return result.plans["p"]


def test_planner_kv_cache_holds_the_window_only() -> None:
    from meshllm_dsl.planner.analyze import analyze
    from meshllm_dsl.planner.formulas import kv_cache_bytes

    windowed, full = _plan(WINDOW), _plan(0)
    per_position = 4 * 2 * 2 * 8 * 4  # layers x (k, v) x kv heads x head_dim x fp32
    assert kv_cache_bytes(full, 8) == per_position * 8
    assert kv_cache_bytes(windowed, 8) == per_position * WINDOW
    assert kv_cache_bytes(windowed, 2) == per_position * 2  # shorter than the window: all of it
    kv = [rc.kv_cache_bytes for rc in analyze(windowed).ranks]
    assert kv == [b * WINDOW // 8 for b in (rc.kv_cache_bytes for rc in analyze(full).ranks)]


BLOCK = """model m = {family} {{
    embed = embedding(64, 32)
    blocks = repeat(2) {{
{body}
    }}
    norm = rmsnorm(32)
    lm_head = linear(32, 64)
}}
"""


def _codes(body: str) -> list[tuple[str, str | None]]:
    text = BLOCK.format(family="", body=body).replace("model m =  {", "model m {")
    return [(d.code, d.span.text.split("(")[0] if d.span else None) for d in check_text(text, "b.mesh").diagnostics]


def test_global_every_needs_a_window() -> None:
    found = _codes("        n1 = rmsnorm(32)\n        attn = attention(32, 4, global_every = 2)\n"
                   "        n2 = rmsnorm(32)\n        mlp = mlp(32, 64)")
    assert [c for c, _ in found] == ["E0304"]


def test_a_post_norm_must_follow_a_sublayer() -> None:
    found = _codes("        post = rmsnorm(32, post = true)\n        attn = attention(32, 4)\n"
                   "        n2 = rmsnorm(32)\n        mlp = mlp(32, 64)")
    assert found == [("E0308", "post = rmsnorm")]
    # pre and post norms around each sublayer (Gemma) check clean
    assert _codes("        a = rmsnorm(32)\n        attn = attention(32, 4)\n        b = rmsnorm(32, post = true)\n"
                  "        c = rmsnorm(32)\n        mlp = mlp(32, 64)\n        d = rmsnorm(32, post = true)") == []


def test_planner_activations_count_the_window_mask_and_the_soft_capped_core() -> None:
    from meshllm_dsl.planner.analyze import analyze

    windowed, full = _plan(WINDOW), _plan(0)
    # 4 windowed blocks on each rank, one [8, 8] boolean mask each, per microbatch
    assert [a.activation_bytes - b.activation_bytes for a, b in zip(analyze(windowed).ranks, analyze(full).ranks)] \
        == [4 * 8 * 8] * len(analyze(full).ranks)
    text = ("mesh m { axes one = 1 }\n"
            "model m = gemma2 { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, window = 3,"
            " dtype = fp32 }\nplan p on m for m { batch = 1  seq = 8 }\n")

    def act(t: str) -> int:
        return analyze(check_text(t, "g.mesh").plans["p"]).ranks[0].activation_bytes

    alternating, all_global = act(text), act(text.replace("window = 3,", "window = 3, global_every = 1,"))
    assert alternating - all_global == 8 * 8  # block 0 windowed (one mask), block 1 global
    # the soft-capped core keeps tanh output, fp32 softmax and probabilities per head: 12 bytes x 4 x 8 x 8 per block
    assert all_global > 2 * 12 * 4 * 8 * 8
