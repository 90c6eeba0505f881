"""In-process sweeps of the language server's analysis: no position and no prefix of a spec may make a
feature raise (the server would answer with an error instead of a result). The protocol itself is
tested over stdio in test_lsp_server.py."""

from __future__ import annotations

from pathlib import Path

from meshllm_dsl.lsp import completion
from meshllm_dsl.lsp.analysis import Analysis

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "llama2_70b.mesh"


def test_every_position_of_an_example_answers() -> None:
    text = LLAMA.read_text()
    a = Analysis(str(LLAMA), text)
    hovered = 0
    for off in range(len(text) + 1):
        hovered += a.hover(off) is not None
        a.definition(off)
        a.references(off)
        completion.complete(a, off)
    assert hovered > len(text) // 4  # most of a spec is names with something to say


def test_every_prefix_of_an_example_is_analysed_without_raising() -> None:
    """What the server sees while a file is typed from the top: each prefix parses or fails with
    exactly one syntax diagnostic, and completion, outline and quick fixes still answer."""
    text = LLAMA.read_text()
    for cut in range(0, len(text), 7):
        a = Analysis(str(LLAMA), text[:cut])
        syntax = [d for d in a.diagnostics if d.code in ("E0101", "E0102")]
        assert len(syntax) <= 1
        a.symbols()
        completion.complete(a, cut)
        for d in a.diagnostics:
            a.fixes(d)


LONGROPE = """mesh m { axes tensor = 2 }
model phi = llama {
    vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32
    rope_type = longrope, rope_factor = 4.0, rope_original_positions = 6
    rope_short_factor = [1.0, 1.25,
        1.5, ffn / 32]
    rope_long_factor = [1.0, 2.0, 4.0, 8.0]
}
plan p on m for phi {
    batch = 4, seq = 8
    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""


def test_a_spec_with_lists_answers_at_every_position_and_prefix() -> None:
    """Lists (longrope's factors, spanning lines, with a dim inside): every position and every prefix
    answers without raising; hover shows a list as the language writes it, and a dim used inside a
    list is a reference to it."""
    a = Analysis("phi.mesh", LONGROPE)
    assert not [d for d in a.diagnostics if d.is_error]
    for off in range(len(LONGROPE) + 1):
        a.hover(off)
        a.definition(off)
        a.references(off)
        completion.complete(a, off)
    for end in range(len(LONGROPE) + 1):
        b = Analysis("phi.mesh", LONGROPE[:end])
        completion.complete(b, end)
        b.hover(max(0, end - 1))
    hovered = a.hover(LONGROPE.index("rope_short_factor"))
    assert hovered is not None and "[1.0, 1.25, 1.5, 2.0]" in hovered[0], hovered
    inside = LONGROPE.index("ffn / 32")
    used = a.hover(inside)
    assert used is not None and "parameter `ffn`" in used[0], used
    assert a.definition(inside)


def test_plan_hover_says_where_the_master_weights_live() -> None:
    # ZeRO 1 with `precision` shards them (the distributed optimizer); ZeRO 0 keeps them whole.
    base = ("mesh g { axes data = 4 }\nmodel m = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, ffn = 64, "
            "dtype = bf16 }\nplan p on g for m {\n batch = 8\n seq = 8\n layout { batch -> data }\n"
            " precision { params = bf16, master = fp32 }\n optimizer adamw { ZERO }\n}\n")
    said = {}
    for zero in ("zero 1", "lr = 1e-3"):
        text = base.replace("ZERO", zero)
        got = Analysis("p.mesh", text).hover(text.index("plan p") + 5)
        assert got is not None
        said[zero] = got[0]
    assert ("master weights in fp32 sharded over data with the moments (Megatron's distributed optimizer, FSDP2), "
            "gradients reduced in fp32") in said["zero 1"]
    assert "master weights in fp32 whole on every rank" in said["lr = 1e-3"]


def test_the_expert_rule_is_completed_and_hovered() -> None:
    # `shard PATH expert(D)`: offered among the rules; hovering the path lists the moe layer's weights
    # with the experts' split, hovering the rule says what it does.
    text = ("mesh m { axes data = 2 }\nmodel mx = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, ffn = 48, "
            "experts = 4, dtype = fp32 }\nplan p on m for mx {\n    layout { batch -> data }\n"
            "    shard blocks.*.mlp expert(data)\n}\n")
    a = Analysis("p.mesh", text)
    path = a.hover(text.index("blocks.*.mlp"))
    assert path is not None and "`blocks.{0-1}.mlp.gate` replicate, experts over data" in path[0]
    assert "[48, 4, 32] -> [48, 2, 32]" in path[0]
    rule = a.hover(text.index("expert(data)") + 1)
    assert rule is not None and "moe layer's experts" in rule[0]
    cut = text.index("expert(data)")
    typing = Analysis("p.mesh", text[:cut] + "\n}\n")
    items = completion.complete(typing, cut)
    assert ("expert", "expert()") in [(i.label, i.insert) for i in items]
