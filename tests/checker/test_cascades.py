"""One mistake, one diagnostic (issue 26, item 2): what follows only from a misspelt shard path is a
note on its E0502, and the parameters a partial layout leaves out are one E0501 whose help places them."""

from __future__ import annotations

import re

from helpers import ERRORS

from meshllm_dsl.checker import check_text

TYPO = (ERRORS / "E0502_misspelt_path.mesh").read_text()
PARTIAL = (ERRORS / "E0501_partial_layout.mesh").read_text()


def test_a_misspelt_path_is_one_error_with_the_corrected_path() -> None:
    (d,) = check_text(TYPO, "t.mesh").diagnostics
    assert d.code == "E0502" and d.help == "did you mean `blocks.*.attn.{q,k,v}`?"
    assert d.label == "no layer `atn` here"
    assert d.note is not None and all(f"`blocks.{{0-1}}.attn.{n}`" in d.note for n in "qkv")
    fixed = TYPO.replace("blocks.*.atn.{q,k,v}", re.search(r"`(.*)`", d.help).group(1))
    assert check_text(fixed, "t.mesh").diagnostics == ()


def test_a_parameter_the_typo_did_not_mean_keeps_its_own_error() -> None:
    text = TYPO.replace("    shard blocks.*.mlp.down row(tensor)\n", "")
    ds = check_text(text, "t.mesh").diagnostics
    assert sorted(d.code for d in ds) == ["E0501", "E0502"]
    uncovered = next(d for d in ds if d.code == "E0501")
    root = next(d for d in ds if d.code == "E0502")
    assert "mlp.down" in uncovered.message and "mlp.down" not in (root.note or "")
    assert "attn.q" in (root.note or "")


def test_a_typo_with_no_close_layer_lists_the_layers() -> None:
    text = TYPO.replace("blocks.*.atn.{q,k,v}", "blocks.*.zzz.{q,k,v}")
    ds = check_text(text, "t.mesh").diagnostics
    root = next(d for d in ds if d.code == "E0502")
    assert root.help is not None and root.help.startswith("layers are ") and root.note is None


def test_a_partial_layout_is_one_error_whose_help_completes_it() -> None:
    (d,) = check_text(PARTIAL, "p.mesh").diagnostics
    assert d.code == "E0501" and d.message == "7 parameters are not placed by any rule"
    assert d.note is not None and d.note.count("`") == 14  # each of the 7 named
    keys = re.findall(r"`(\w+ -> \w+)`", d.help or "")
    assert sorted(keys) == ["ffn -> tensor", "kv_heads -> tensor", "vocab -> tensor"]
    fixed = PARTIAL.replace("heads -> tensor }", "heads -> tensor, " + ", ".join(keys) + " }")
    assert check_text(fixed, "p.mesh").diagnostics == ()


def test_shard_rules_left_out_are_one_error_naming_each_rule() -> None:
    text = TYPO.replace("blocks.*.atn.{q,k,v}", "blocks.*.attn.{q,k,v}").replace(
        "    shard blocks.*.mlp.down row(tensor)\n", "").replace("    shard embed vocab_parallel(tensor)\n", "")
    (d,) = check_text(text, "t.mesh").diagnostics
    assert d.code == "E0501" and d.message.startswith("2 parameters")
    rules = re.findall(r"`(shard [^`]+)`", d.help or "")
    assert rules == ["shard embed vocab_parallel(tensor)", "shard blocks.*.mlp.down row(tensor)"]
    fixed = text.replace("    shard lm_head", "".join(f"    {r}\n" for r in rules) + "    shard lm_head")
    assert check_text(fixed, "t.mesh").diagnostics == ()


def test_a_layer_that_failed_to_build_is_not_reported_again_where_it_is_referenced() -> None:
    # `embed` cannot be built without `hidden`; the head's `tie = embed` is no second mistake.
    text = "mesh m {\n    axes data = 2\n    device = cpu\n}\nmodel x = llama { vocab = 64, hiden = 32 }\n"
    ds = check_text(text, "t.mesh").diagnostics
    assert "E0202" not in {d.code for d in ds}
    typo = next(d for d in ds if d.code == "E0203")
    assert typo.help is not None and typo.help.startswith("did you mean `hidden`?")
    # A reference to a layer that is truly missing is still reported.
    bad = "mesh m {\n    axes data = 2\n    device = cpu\n}\nfamily f(v, h) {\n    head = linear(h, v, tie = nope)\n}\n" \
          "model x = f { v = 8, h = 4 }\n"
    assert "E0202" in {d.code for d in check_text(bad, "t.mesh").diagnostics}
