"""The checker on `mla`: what it refuses, each with its code at the setting or rule that asks for it
(examples/errors/*mla* hold one golden of each)."""

from __future__ import annotations

import pytest

from meshllm_dsl.checker import check_text


def _spec(call_extra: str = "", axes: str = "one = 1", body: str = "") -> str:
    return (f"mesh m {{ axes {axes} }}\nmodel t {{\n    vocab = 64, hidden = 32, layers = 2, heads = 4, ffn = 48, dtype = fp32\n"
            "    embed = embedding(vocab, hidden)\n    blocks = repeat(layers) {\n        attn_norm = rmsnorm(hidden)\n"
            f"        attn = mla(hidden, heads, 8, 6, 4, 5, q_lora_rank = 16{call_extra})\n"
            "        mlp_norm = rmsnorm(hidden)\n        mlp = mlp(hidden, ffn)\n    }\n"
            "    norm = rmsnorm(hidden)\n    lm_head = linear(hidden, vocab)\n}\n"
            f"plan p on m for t {{\n    batch = 4\n    seq = 8\n{body}}}\n")


TP = "    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n"


@pytest.mark.parametrize(("extra", "axes", "body", "code", "at"), [
    # yarn's settings without rope_type = yarn: read by nothing, refused at the setting
    (", rope_factor = 4.0", "one = 1", "", "E0304", "4.0"),
    (", rope_mscale = 1.0", "one = 1", "", "E0304", "1.0"),
    (", rope_type = yarn, rope_factor = 0.5", "one = 1", "", "E0304", "mla("),
    (", qk_rope_head_dim = 3", "one = 1", "", "E0304", "3"),
    # a down-projection split by any rule: column, or row (by the hidden dim)
    ("", "tensor = 2", TP + "    shard blocks.*.attn.q_a replicate\n    shard blocks.*.attn.kv_a column(tensor)\n",
     "E0405", "column(tensor)"),
    ("", "tensor = 2", TP + "    shard blocks.*.attn.kv_a replicate\n    shard blocks.*.attn.q_a row(tensor)\n",
     "E0405", "row(tensor)"),
    # the up-projections split differently, and o row-parallel after replicated heads
    ("", "tensor = 2", "    layout { ffn -> tensor, vocab -> tensor }\n    shard blocks.*.attn.{q_a,kv_a,kv_b,o} replicate\n"
     "    shard blocks.*.attn.q_b column(tensor)\n", "E0402", "replicate"),
    ("", "tensor = 2", "    layout { ffn -> tensor, vocab -> tensor }\n    shard blocks.*.attn.{q_a,kv_a,q_b,kv_b} replicate\n"
     "    shard blocks.*.attn.o row(tensor)\n", "E0402", "row(tensor)"),
    # Megatron sequence parallelism
    ("", "tensor = 2", TP.replace(" }", ", seq -> tensor }") + "    shard blocks.*.attn.{q_a,kv_a} replicate\n",
     "E0309", "seq -> tensor"),
])
def test_mla_refusals(extra: str, axes: str, body: str, code: str, at: str) -> None:
    text = _spec(extra, axes, body)
    if "qk_rope_head_dim = 3" in extra:
        text = text.replace("mla(hidden, heads, 8, 6, 4, 5, ", "mla(hidden, heads, 8, 6, qk_rope_head_dim = 3, v_head_dim = 5, ").replace(
            ", qk_rope_head_dim = 3)", ")")
    diags = check_text(text, "t.mesh").diagnostics
    assert [d.code for d in diags] == [code], [(d.code, d.message) for d in diags]
    d = diags[0]
    assert d.span is not None and text[d.span.start:d.span.end].startswith(at), text[d.span.start:d.span.end]
    assert d.help


def test_a_whole_mla_plan_needs_no_rule_for_it() -> None:
    assert check_text(_spec(", rope_type = yarn, rope_factor = 4.0, rope_mscale = 1.0, rope_mscale_all_dim = 1.0"),
                      "t.mesh").ok
