"""`meshc fmt` wraps a layer call longer than the line width: as many arguments to a line as fit,
each line after the first aligned under the first argument; the result parses to the same AST and
formats to itself."""

from __future__ import annotations

from meshllm_dsl.front.fmt import _WIDTH, format_text

LONG = """\
model t {
    vocab = 64
    hidden = 32
    layers = 2
    blocks = repeat(layers) {
        mlp = moe(hidden, 16, 8, 2, scoring = sigmoid, groups = 4, topk_groups = 2, routed_scaling = 2.5, shared_experts = 1, shared_ffn = 32, balance_rate = 0.01, seq_aux_loss = 0.001)  # DeepSeek-style
        norm = rmsnorm(hidden)
    }
}
"""

WRAPPED = """\
model t {
    vocab = 64
    hidden = 32
    layers = 2
    blocks = repeat(layers) {
        mlp = moe(hidden, 16, 8, 2, scoring = sigmoid, groups = 4, topk_groups = 2,
                  routed_scaling = 2.5, shared_experts = 1, shared_ffn = 32, balance_rate = 0.01,
                  seq_aux_loss = 0.001)  # DeepSeek-style
        norm = rmsnorm(hidden)
    }
}
"""


def test_a_long_call_wraps_under_its_first_argument() -> None:
    out = format_text(LONG)
    assert out == WRAPPED, out
    assert all(len(line.split("  #")[0]) <= _WIDTH for line in out.splitlines())


def test_the_wrapped_call_formats_to_itself() -> None:
    assert format_text(WRAPPED) == WRAPPED


def test_a_short_call_stays_on_one_line() -> None:
    text = "model t {\n    norm = rmsnorm(hidden)\n}\n"
    assert format_text(text) == text
