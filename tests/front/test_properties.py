"""Property tests: the front end never crashes, whatever the input, and fmt round-trips.

(a) strings generated from grammar/mesh.lark itself (hypothesis.extra.lark.from_lark) either parse or
    raise SpecError, and check_text always returns diagnostics;
(b) byte-level mutations of every example never make `meshc check` crash (exit 0 or 1, no traceback);
(c) parse -> fmt -> parse gives an equal AST (spans are not part of equality), fmt is idempotent and
    keeps every comment.

The default profile keeps the suite fast; `pytest --hypothesis-profile=thorough` runs many more examples.
"""

from __future__ import annotations

import os
import random
import tempfile

import pytest
from helpers import EXAMPLES, ROOT, meshc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark

from meshllm_dsl.checker import check_text
from meshllm_dsl.codes import CODES
from meshllm_dsl.diagnostics import SpecError, render_all, to_json
from meshllm_dsl.front import ast
from meshllm_dsl.front.fmt import format_expr, format_text
from meshllm_dsl.front.load import read_spec
from meshllm_dsl.front.parser import _keyword_as_name, grammar, parse
from meshllm_dsl.front.source import SourceFile

# Fast by default (the whole front-end suite stays well under a minute on 2 cores); the `thorough`
# profile (registered in tests/conftest.py, `pytest --hypothesis-profile=thorough`) runs 2000 each.
THOROUGH = settings.get_current_profile_name() == "thorough"
FEW = settings(max_examples=2000 if THOROUGH else 40, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.mesh"))

# Names a spec might use, including ones the checker must reject (keywords, dunders, reserved
# attributes) and the grammar's own keywords (the contextual lexer accepts them as names).
NAMES = [
    "m", "t", "p", "x", "data", "tensor", "pipeline", "blocks", "attn", "mlp", "q", "k", "v", "o", "up", "down",
    "embed", "lm_head", "norm", "hidden", "heads", "kv_heads", "ffn", "vocab", "layers", "batch", "seq",
    "microbatches", "column", "row", "replicate", "vocab_parallel", "cross_entropy", "llama", "gpt2",
    "embedding", "linear", "attention", "rmsnorm", "layernorm", "positional", "swiglu", "gelu", "true",
    "false", "bf16", "hosts", "devices", "device", "h100", "adamw", "lr", "class", "__import__", "forward",
    "import", "mesh", "plan", "repeat", "zero",
]


def _spaced(s: str) -> str:
    return f" {s} "


def _explicit() -> dict[str, st.SearchStrategy[str]]:
    """A strategy per terminal that keeps tokens apart (from_lark concatenates them without spaces)."""
    ex: dict[str, st.SearchStrategy[str]] = {}
    for term in grammar().terminals:
        if term.pattern.type == "str":
            ex[term.name] = st.just(_spaced(term.pattern.value))
    ex["NAME"] = st.sampled_from(NAMES).map(_spaced)
    ex["SCHEDULE_NAME"] = st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zb"]).map(_spaced)
    ex["INT"] = st.sampled_from(["0", "1", "2", "3", "4", "8", "12", "64", "1_024", "32000"]).map(_spaced)
    ex["FLOAT"] = st.sampled_from(["0.5", "1e-5", "2.5", "1.0e3"]).map(_spaced)
    ex["STRING"] = st.sampled_from(['"families.mesh"', '"no_such_file.mesh"', '""']).map(_spaced)
    ex["COMMENT"] = st.sampled_from(["# a comment\n", "#\n", "# {not code}\n"])
    ex["WS"] = st.sampled_from([" ", "\n", "\t"])
    return ex


GENERATED = from_lark(grammar(), explicit=_explicit())


def _comment_count(text: str) -> int:
    return sum(1 for tok in grammar().lex(text, dont_ignore=True) if tok.type == "COMMENT")


# ---------------------------------------------------------------- (a) generated from the grammar


@FEW
@given(GENERATED)
def test_generated_text_parses_or_raises_spec_error(text: str) -> None:
    try:
        parse(text)
    except SpecError as err:
        assert err.diagnostics and all(d.code in CODES for d in err.diagnostics)


@FEW
@given(GENERATED)
def test_generated_text_checks_without_raising(text: str) -> None:
    result = check_text(text)  # must return, whatever the input
    for d in result.diagnostics:
        assert d.code in CODES
        assert d.message
    render_all(result.diagnostics)
    to_json(result.diagnostics)


@FEW
@given(GENERATED)
def test_generated_text_round_trips_through_fmt(text: str) -> None:
    try:
        module = parse(text)
    except SpecError:
        assume(False)
        return
    formatted = format_text(text)
    assert parse(formatted) == module
    assert format_text(formatted) == formatted
    assert _comment_count(formatted) == _comment_count(text)


def test_generator_reaches_parseable_specs_with_comments() -> None:
    # The properties above are only worth something if the generator produces text that parses
    # (else they test only the error path) and carries comments (else the comment check is vacuous).
    seen: list[tuple[bool, bool]] = []

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(GENERATED)
    def sample(text: str) -> None:
        try:
            parse(text)
        except SpecError:
            seen.append((False, False))
            return
        seen.append((True, _comment_count(text) > 0))

    sample()
    parsed = sum(p for p, _ in seen)
    assert parsed >= len(seen) // 5, f"only {parsed}/{len(seen)} generated strings parse"
    assert any(c for _, c in seen), "no parseable generated string had a comment"


# ---------------------------------------------------------------- (a') lists, which few generated strings reach

# An item of a list as a user writes it: a number in any of its spellings, a name, a small expression.
_LIST_ITEM = st.one_of(
    st.integers(0, 10**9).map(str),
    st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False).map(lambda f: repr(abs(f))),
    st.sampled_from(["1.0", "2.5e3", "3E-2", "1_000", "hidden", "-1.5", "ffn / 2", "-(1 + heads)", "0.0"]),
)
_LIST_SEP = st.sampled_from([", ", ",", " ,\n        ", ",\n", ",  # why this factor\n    "])


@st.composite
def list_spec(draw: st.DrawFn) -> str:
    """A model whose settings are lists of any length, spelled over one line or many, with comments
    between items, an optional trailing comma; maybe a list where only a single value goes."""
    settings = []
    for i in range(draw(st.integers(1, 3))):
        items = draw(st.lists(_LIST_ITEM, max_size=40))
        seps = [draw(_LIST_SEP) for _ in items[1:]]
        body = "".join(x + sep for x, sep in zip(items, seps)) + (items[-1] if items else "")
        trailing = draw(st.sampled_from(["", ",", ",\n"])) if items else ""
        settings.append(f"    f{i} = [{body}{trailing}]")
    tail = draw(st.sampled_from(["", "plan p on m for m { batch = [1, 2] }\n", "plan p on m for m { seq = 8 }\n"]))
    return "model m = llama {\n" + "\n".join(settings) + "\n}\n" + tail


@FEW
@given(list_spec())
def test_lists_round_trip_through_fmt_and_both_parsers_agree(text: str) -> None:
    fast, lark = assert_same_ast(text)
    assert fast[0] != "handed over"  # lists take the fast path
    try:
        module = parse(text)
    except SpecError as err:  # only the list in a plan is refused, where it was written
        assert "batch = [1, 2]" in text and [d.code for d in err.diagnostics] == ["E0304"]
        return
    lists = [s.value for s in module.items[0].settings]  # type: ignore[union-attr]
    assert all(isinstance(v, ast.ListLit) for v in lists)
    formatted = format_text(text)
    assert parse(formatted) == module
    assert format_text(formatted) == formatted
    assert _comment_count(formatted) == _comment_count(text)
    assert max(len(line) for line in formatted.splitlines()) <= 100 or any(
        len(format_expr(x)) > 90 for v in lists for x in v.items)  # type: ignore[union-attr]
    render_all(check_text(text).diagnostics)  # checks without raising, whatever the items are


# ---------------------------------------------------------------- (b) byte mutations of the examples


@st.composite
def mutated_example(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(EXAMPLE_FILES))
    data = bytearray(path.read_bytes())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["insert", "delete", "replace", "swap_lines"]))
        if op == "swap_lines":
            lines = bytes(data).split(b"\n")
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
            data = bytearray(b"\n".join(lines))
            continue
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        byte = draw(st.one_of(st.sampled_from(list(b"{}()[]:,.*=-/+#\"\n 0123456789abcxyz_")), st.integers(0, 255)))
        if op == "insert":
            data.insert(pos, byte)
        elif op == "delete" and data:
            del data[pos]
        elif data:
            data[pos] = byte
    return path.name, bytes(data)


@FEW
@given(mutated_example())
def test_mutated_examples_never_crash_meshc_check(case: tuple[str, bytes]) -> None:
    name, data = case
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        code, out, err = meshc("check", path)
        assert code in (0, 1), err
        assert "Traceback" not in out + err and "internal error" not in err
        code, out, err = meshc("check", "--format", "json", path)
        assert code in (0, 1), err


def test_mutation_smoke_with_fixed_seed() -> None:
    # Deterministic coverage independent of hypothesis's choices: every single-byte deletion in
    # the first 400 bytes of one example, which walks the parser through every construct's prefix.
    text = (EXAMPLES / "tiny_llama.mesh").read_text()
    rng = random.Random(0)
    for i in sorted(rng.sample(range(len(text)), 60)):
        check_text(text[:i] + text[i + 1 :])


# ---------------------------------------------------------------- (c) fmt round trip on the examples


@pytest.mark.parametrize("path", EXAMPLE_FILES + sorted((ROOT / "examples" / "errors").glob("*.mesh")),
                         ids=lambda p: p.stem)
def test_examples_round_trip_through_fmt(path) -> None:  # type: ignore[no-untyped-def]
    try:
        text = read_spec(path).text
        module = parse(text)
    except SpecError:
        return  # the syntax-error (E0101, E0102) and undecodable (E0104) examples have nothing to format
    formatted = format_text(text)
    assert parse(formatted) == module
    assert format_text(formatted) == formatted
    assert _comment_count(formatted) == _comment_count(text)
    assert [d.code for d in check_text(formatted).diagnostics] == [d.code for d in check_text(text).diagnostics]


# ---------------------------------------------------------------- (d) the fast lexer is Lark's lexer


def _token_stream(lark_parser, text: str) -> tuple[list[tuple[object, ...]], str | None]:  # type: ignore[no-untyped-def]
    """Every token the parser's lexer hands the parser, and how the parse ended."""
    from meshllm_dsl.front.parser import _lark_parser

    frontend = lark_parser.parser
    inner = frontend.lexer
    seen: list[tuple[object, ...]] = []

    class Recording:
        def lex(self, state, parser_state):  # type: ignore[no-untyped-def]
            for tok in inner.lex(state, parser_state):
                seen.append((tok.type, str(tok), tok.start_pos, tok.end_pos, tok.line, tok.column,
                             tok.end_line, tok.end_column))
                yield tok

    frontend.lexer = Recording()
    builder = _lark_parser()[1]
    builder.reset(SourceFile("<t>", text))
    try:
        lark_parser.parse(text, on_error=_keyword_as_name)
        outcome = None
    except Exception as err:  # noqa: BLE001 - the kind and position of the failure are compared
        outcome = f"{type(err).__name__} at {getattr(err, 'pos_in_stream', None)}"
    finally:
        frontend.lexer = inner
    return seen, outcome


def assert_same_tokens(text: str) -> None:
    from meshllm_dsl.front.parser import _lark_parser

    fast = _token_stream(_lark_parser()[0], text)
    lark = _token_stream(grammar(), text)
    assert fast == lark


@FEW
@given(GENERATED)
def test_fast_lexer_matches_larks_on_generated_text(text: str) -> None:
    assert_same_tokens(text)


@FEW
@given(GENERATED, st.integers(0, 10_000), st.sampled_from(["", "@", "1.", "1e", "ab1", "\"x", "-", "->", "1_0.5", "\n#"]))
def test_fast_lexer_matches_larks_on_garbled_text(text: str, at: int, junk: str) -> None:
    at = at % (len(text) + 1)
    assert_same_tokens(text[:at] + junk + text[at:])


@pytest.mark.parametrize("path", sorted(EXAMPLES.rglob("*.mesh")), ids=lambda p: p.stem)
def test_fast_lexer_matches_larks_on_every_example(path) -> None:  # type: ignore[no-untyped-def]
    assert_same_tokens(path.read_bytes().decode("utf-8", errors="replace"))  # E0104_not_utf8 is Latin-1


# ---------------------------------------------------------------- (e) the fast parser builds what Lark's builds


def _with_spans(node: object) -> object:
    """The AST as nested tuples that include every span (AST equality leaves spans out)."""
    from meshllm_dsl.front.source import Span

    if isinstance(node, Span):
        return ("span", node.start, node.end)
    if isinstance(node, tuple):
        return tuple(_with_spans(n) for n in node)
    fields = getattr(type(node), "_fields", None)  # an AST node
    if fields is not None:
        return (type(node).__name__, *(_with_spans(getattr(node, f)) for f in fields))
    return node


def _both_parsers(text: str) -> tuple[object, object]:
    """What the fast path builds (or that it hands the file over), and what Lark's parser builds."""
    from meshllm_dsl.front.parser import _HANDED_OVER, _fast_parser, _lark_parse

    fast, builder = _fast_parser()
    assert fast is not None
    source = SourceFile("<t>", text)
    outcomes: list[object] = []
    for run in (fast.parse, lambda _text: _lark_parse(source)):
        builder.reset(source)
        try:
            result = run(source.text)
            outcomes.append("handed over" if result is _HANDED_OVER else _with_spans(result))
        except SpecError as err:
            outcomes.append(render_all(err.diagnostics))
        outcomes.append([d.code for d in builder.diagnostics])
    return outcomes[0:2], outcomes[2:4]


def assert_same_ast(text: str) -> tuple[object, object]:
    fast, lark = _both_parsers(text)
    if fast[0] != "handed over":  # else parse_source asks Lark, which then decides
        assert fast == lark
    return fast, lark


@FEW
@given(GENERATED)
def test_fast_parser_builds_larks_ast_on_generated_text(text: str) -> None:
    assert_same_ast(text)


@FEW
@given(GENERATED, st.integers(0, 10_000), st.sampled_from(["", "@", "1.", "1e", "ab1", "\"x", "-", "->", "1_0.5", "\n#", "}"]))
def test_fast_parser_builds_larks_ast_on_garbled_text(text: str, at: int, junk: str) -> None:
    at = at % (len(text) + 1)
    assert_same_ast(text[:at] + junk + text[at:])


@pytest.mark.parametrize("path", sorted(EXAMPLES.rglob("*.mesh")), ids=lambda p: p.stem)
def test_fast_parser_builds_larks_ast_on_every_example(path) -> None:  # type: ignore[no-untyped-def]
    text = path.read_bytes().decode("utf-8", errors="replace")
    fast, lark = assert_same_ast(text)
    if isinstance(lark[0], tuple) and "zero" not in text:
        assert fast[0] != "handed over"  # every example that parses takes the fast path


def test_fast_parser_hands_over_what_it_does_not_know() -> None:
    # A keyword read as a name after an expression is Lark's recovery (`_keyword_as_name`).
    src = "mesh m { axes a = 1  zero = 2 }"
    fast, lark = assert_same_ast(src)
    assert fast[0] == "handed over" and isinstance(lark[0], tuple)
    assert parse(src).items[0].settings[0].name.value == "zero"  # type: ignore[union-attr]


def test_spans_end_at_the_end_of_the_text() -> None:
    # Lark's path once read a closing `}` at the very end of a file as two characters wide.
    text = "mesh m { axes a = 1 }"
    fast, lark = assert_same_ast(text)
    assert fast == lark and fast[0][-1] == ("span", 0, len(text))  # type: ignore[index]
