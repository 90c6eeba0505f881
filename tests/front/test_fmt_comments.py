"""`meshc fmt` keeps each comment on the line it was written on (issue 26, item 8): inside family
parameters, a multi-line layout, mesh axes and an optimizer block whose zero comes last."""

from __future__ import annotations

from importlib.resources import files

import pytest

from meshllm_dsl.front.fmt import format_text

CASES = {
    "family parameters": """\
family f(
    vocab,
    hidden,  # the residual width
    # the number of blocks
    layers,
) {
    embed = embedding(vocab, hidden)
    norm = rmsnorm(hidden)
    lm_head = linear(hidden, vocab)
}
""",
    "family parameters, a comment after the last": """\
family f(
    vocab,
    # the last one is the width
) {
    norm = rmsnorm(vocab)
}
""",
    "layout": """\
plan p on m for t {
    layout {
        heads -> tensor,  # attention
        ffn -> tensor,  # mlp
        vocab -> tensor
    }
}
""",
    "mesh axes": """\
mesh m {
    axes data = 2,  # replicas
        tensor = 2  # within a host
}
""",
    "optimizer": """\
plan p on m for t {
    optimizer adamw {
        lr = 0.001  # small
        zero 1 over data
    }
}
""",
}


@pytest.mark.parametrize("text", CASES.values(), ids=CASES.keys())
def test_comments_stay_on_their_lines(text: str) -> None:
    assert format_text(text) == text  # already canonical: nothing moves
    assert format_text(format_text(text)) == format_text(text)


def test_the_shipped_families_keep_their_parameter_comments() -> None:
    text = (files("meshllm_dsl") / "stdlib" / "families.mesh").read_text()
    out = format_text(text)
    # each trailing comment is still on the line of the parameter it explains
    assert "    attn_bias = false,  # Qwen2: attn_bias = true" in out
    assert "    tie_embeddings = false,  # Llama 3.2 1B / 3B tie the head to the embedding" in out
    head, body = out.split(") {", 1)
    assert "# A padded vocabulary" in head and "# A padded vocabulary" not in body.split("}")[0]
