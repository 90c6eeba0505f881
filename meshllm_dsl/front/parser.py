"""Text -> typed AST (meshllm_dsl.front.ast), with Lark's LALR parser over grammar/mesh.lark.

Syntax errors become diagnostics (E0101 unexpected token, E0102 unexpected character) that name
what the parser expected there; they never escape as Lark exceptions.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import re
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from meshllm_dsl.codes import E0101, E0102, E0201, E0304, E0307, E0311
from meshllm_dsl.diagnostics import Diagnostic, Label, SpecError, insert
from meshllm_dsl.front import ast, parse_tables
from meshllm_dsl.front.limits import MAX_EXPR_DEPTH, MAX_INT_DIGITS
from meshllm_dsl.front.source import SourceFile, Span

if TYPE_CHECKING:  # Lark is imported only when the fast path hands a parse over (errors, rare input)
    from lark import Lark, Token
    from lark.exceptions import UnexpectedInput
    from lark.lexer import ContextualLexer

# Human names for the grammar's terminals, used in "expected ..." help lines.
_TERMINAL_NAMES = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "STRING": "a string",
    "SCHEDULE_NAME": "a schedule name",
    "LBRACE": "`{`",
    "RBRACE": "`}`",
    "LPAR": "`(`",
    "RPAR": "`)`",
    "LSQB": "`[`",
    "RSQB": "`]`",
    "COMMA": "`,`",
    "EQUAL": "`=`",
    "COLON": "`:`",
    "DOT": "`.`",
    "STAR": "`*`",
    "SLASH": "`/`",
    "PLUS": "`+`",
    "MINUS": "`-`",
    "__ANON_0": "`->`",
    "$END": "end of file",
}


@functools.lru_cache(maxsize=1)
def grammar() -> Lark:
    """The grammar as a plain Lark parser (parse trees, `.grammar`), for tools and tests such as
    hypothesis.extra.lark; meshc itself parses with the tables of meshllm_dsl.front.parse_tables."""
    from lark import Lark

    return Lark.open_from_package(
        "meshllm_dsl.grammar", "mesh.lark", propagate_positions=True,
        **parse_tables.lark_options(),
    )


def _describe(term: str) -> str:
    if term in _TERMINAL_NAMES:
        return _TERMINAL_NAMES[term]
    pattern = _lark_parser()[0].get_terminal(term).pattern
    if pattern.type == "str":
        return f"`{pattern.value}`"
    return term.lower()


class _Tok(tuple):  # type: ignore[type-arg]
    """A token as the AST builder sees it: (type, text, start offset, end offset). A tuple is several
    times cheaper to make than Lark's Token (a str subclass built in Python)."""

    __slots__ = ()


_NAMES = frozenset({"NAME", "SCHEDULE_NAME"})

# One rule of the tables (meshllm_dsl.front.parse_tables): origin, length, builder method, `?rule` pass-through,
# kept children (index, splice a helper rule's list, Nones before it) or None for all, Nones after.
Rule = tuple[str, int, str, bool, "tuple[tuple[int, bool, int], ...] | None", int]


class _Builder:
    """Builds AST nodes bottom-up as the LALR parser reduces (nothing is walked recursively, no parse
    tree is built); every node gets the span of the text it came from.

    `reducer` makes one rule's reduction: it sees the rule's raw children (keywords and punctuation
    included) to bound the node from its first raw child to its last, as Lark's `propagate_positions`
    computes it (an inlined `?rule` widens the "container" of the node it passes through, so
    `(a + b) * c` spans its parentheses), then shapes the children as Lark's tree builder would and
    calls the rule's method. Both the fast path and Lark's parser run these reductions, so both build
    the same AST. One builder serves one parse at a time (`reset`).
    """

    def __init__(self) -> None:
        # id(node) -> (node, ...): the node is held so its id cannot be reused during the parse.
        # Cleared in place: the reducers hold these dicts.
        self._depth: dict[int, tuple[Any, int]] = {}  # operators nested in an expression
        self._container: dict[int, tuple[Any, int | None, int | None]] = {}
        self.reset(_EMPTY)

    def reset(self, source: SourceFile) -> None:
        self.source = source
        self.span = source.span
        self.diagnostics: list[Diagnostic] = []
        self._depth.clear()
        self._container.clear()
        self._pos: tuple[int | None, int | None] = (None, None)

    def _start(self, children: list[Any]) -> int | None:
        for c in children:
            if type(c) is _Tok:
                return c[2]  # type: ignore[no-any-return]
            entry = self._container.get(id(c))
            if entry is not None and entry[0] is c and entry[1] is not None:
                return entry[1]
        return None

    def _end(self, children: list[Any]) -> int | None:
        for c in reversed(children):
            if type(c) is _Tok:
                return c[3]  # type: ignore[no-any-return]
            entry = self._container.get(id(c))
            if entry is not None and entry[0] is c and entry[2] is not None:
                return entry[2]
        return None

    def reducer(self, rule: Rule, signature: tuple[str, tuple[str, ...]]) -> Callable[[list[Any]], Any]:
        _origin, _size, name, expand1, keep, append_none = rule
        method = getattr(self, name, None)
        if method is None:
            # Lark's helper rules for `x*` / `x+` give a list that the parent splices; any other rule
            # without a method is a `?rule` that always passes its one child through.
            method = _helper if name.startswith("_") else functools.partial(_no_builder, name)
        expansion = signature[1]
        # Terminals sit where the rule has them (a `?rule` converts a NAME before passing it up).
        first_is_token = bool(expansion) and expansion[0].isupper()
        last_is_token = bool(expansion) and expansion[-1].isupper()
        names_at = tuple(i for i, sym in enumerate(expansion) if sym in _NAMES)
        container, first, last, Name = self._container, self._start, self._end, ast.Name  # noqa: N806

        def reduce(children: list[Any]) -> Any:
            start = children[0][2] if first_is_token else first(children)
            end = children[-1][3] if last_is_token else last(children)
            for i in names_at:
                c = children[i]
                children[i] = Name(c[1], Span(self.source, c[2] or 0, c[3] or 0))
            self._pos = (start, end)
            if keep is None:
                kept = children
            else:  # as Lark's ChildFilterLALR
                kept = []
                for i, splice, nones in keep:
                    if nones:
                        kept += [None] * nones
                    if splice:
                        if kept:
                            kept += children[i]
                        else:
                            kept = children[i]
                    else:
                        kept.append(children[i])
                if append_none:
                    kept += [None] * append_none
            res = kept[0] if expand1 and len(kept) == 1 else method(kept)
            if res is not None:
                container[id(res)] = (res, start, end)
            return res

        return reduce

    def _int(self, tok: _Tok) -> int:
        """An integer literal, refused (located, not a ValueError) when it has too many digits."""
        digits = tok[1].replace("_", "")
        if len(digits.lstrip("0")) > MAX_INT_DIGITS:
            self.diagnostics.append(Diagnostic(
                E0307, f"integer literal with {len(digits)} digits is out of range", self._tok(tok),
                label=f"more than {MAX_INT_DIGITS} digits",
                help="sizes, counts and dims in a spec are at most 2**40; write the value you mean"))
            return 1
        return int(digits)

    def _nested(self, node: ast.Expr, *children: ast.Expr) -> ast.Expr:
        depth = 1 + max((self._depth_of(c) for c in children), default=0)
        self._depth[id(node)] = (node, depth)
        if depth == MAX_EXPR_DEPTH + 1:
            self.diagnostics.append(_too_deep(node.span))
        return node

    def _depth_of(self, node: Any) -> int:
        entry = self._depth.get(id(node))
        return entry[1] if entry is not None and entry[0] is node else 0

    def _span(self) -> Any:
        start, end = self._pos
        if start is None or end is None:
            return None
        return self.span(start, end)

    def _tok(self, tok: _Tok) -> Any:
        return self.span(tok[2] or 0, tok[3] or 0)

    # -- expressions
    def int_lit(self, c: list[_Tok]) -> ast.IntLit:
        return ast.IntLit(self._int(c[0]), self._span())

    def float_lit(self, c: list[_Tok]) -> ast.FloatLit:
        lit = ast.FloatLit(c[0][1], self._span())
        if not math.isfinite(lit.value) or (lit.value == 0 and any(ch in "123456789" for ch in lit.text.split("e")[0].split("E")[0])):
            self.diagnostics.append(Diagnostic(
                E0307, f"`{lit.text}` is out of range", lit.span,
                label="overflows to infinity" if not math.isfinite(lit.value) else "underflows to 0",
                help="numbers in a spec must be finite 64-bit floats: at most about 1e308 in size, and not so small they round to 0"))
            return ast.FloatLit("1.0", lit.span)
        return lit

    def str_lit(self, c: list[_Tok]) -> ast.StrLit:
        return ast.StrLit(c[0][1][1:-1], self._span())

    def name_ref(self, c: list[ast.Name]) -> ast.Name:
        return c[0]

    def neg(self, c: list[ast.Expr]) -> ast.Neg:
        return self._nested(ast.Neg(c[0], self._span()), c[0])  # type: ignore[return-value]

    def _bin(op: str):  # type: ignore[no-untyped-def]  # noqa: N805 - a builder of methods
        def build(self: _Builder, c: list[ast.Expr]) -> ast.BinOp:
            return self._nested(ast.BinOp(op, c[0], c[1], self._span()), c[0], c[1])  # type: ignore[return-value]

        return build

    add = _bin("+")
    sub = _bin("-")
    mul = _bin("*")
    div = _bin("/")

    def list_lit(self, c: list[Any]) -> ast.ListLit:
        return ast.ListLit(tuple(e for e in c if e is not None), self._span())

    def setting(self, c: list[Any]) -> ast.Setting:
        return ast.Setting(c[0], c[1], self._span())

    def _scalars(self, settings: Any, where: str) -> None:
        """Lists are values of a model's settings and a layer's arguments only: a list in a mesh,
        device, plan, optimizer or precision setting is refused here, where it was written."""
        for s in settings:
            if isinstance(s, ast.Setting) and isinstance(s.value, ast.ListLit):
                self.diagnostics.append(Diagnostic(
                    E0304, f"`{s.name.value}` in {where} takes one value, not a list", s.value.span,
                    label="a list", help="lists are values of model settings and layer arguments only "
                    "(such as longrope's rope_short_factor); give a single number or name here"))

    def every_setting(self, c: list[Any]) -> ast.Setting:
        return ast.Setting(c[0], c[1], self._span(), every=c[2])

    def setting_list(self, c: list[ast.Setting]) -> tuple[ast.Setting, ...]:
        return tuple(c)

    # -- items
    def start(self, c: list[Any]) -> ast.Module:
        return ast.Module(tuple(c), self._span())

    def include(self, c: list[_Tok]) -> ast.Include:
        tok = c[0]
        return ast.Include(ast.StrLit(tok[1][1:-1], self._tok(tok)), self._span())

    def device(self, c: list[Any]) -> ast.DeviceDecl:
        self._scalars(c[1], "a device")
        return ast.DeviceDecl(c[0], c[1], self._span())

    def mesh(self, c: list[Any]) -> ast.MeshDecl:
        axes: list[ast.AxisDecl] = []
        settings: list[ast.Setting] = []
        for stmt in c[1:]:
            if isinstance(stmt, ast.Setting):
                settings.append(stmt)
            else:
                axes.extend(stmt)
        self._scalars(settings, "a mesh")
        return ast.MeshDecl(c[0], tuple(axes), tuple(settings), self._span())

    def axes(self, c: list[ast.AxisDecl]) -> list[ast.AxisDecl]:
        return list(c)

    def axis(self, c: list[Any]) -> ast.AxisDecl:
        return ast.AxisDecl(c[0], c[1], self._span())

    def family(self, c: list[Any]) -> ast.FamilyDecl:
        params = tuple(p for p in c[1:] if isinstance(p, ast.Param))
        body = tuple(s for s in c[1:] if isinstance(s, (ast.LayerDecl, ast.RepeatDecl)))
        return ast.FamilyDecl(c[0], params, body, self._span())

    def param(self, c: list[Any]) -> ast.Param:
        return ast.Param(c[0], c[1], self._span())

    def model_from_family(self, c: list[Any]) -> ast.ModelDecl:
        return ast.ModelDecl(c[0], c[1], c[2], (), self._span())

    def model_inline(self, c: list[Any]) -> ast.ModelDecl:
        settings, body = c[1]
        return ast.ModelDecl(c[0], None, settings, body, self._span())

    def model_body(self, c: list[Any]) -> tuple[tuple[ast.Setting, ...], tuple[ast.LayerStmt, ...]]:
        settings = tuple(s for s in c if isinstance(s, ast.Setting))
        body = tuple(s for s in c if not isinstance(s, ast.Setting))
        return settings, body

    def layer(self, c: list[Any]) -> ast.LayerDecl:
        return ast.LayerDecl(c[0], c[1], self._span())

    def repeat(self, c: list[Any]) -> ast.RepeatDecl:
        return ast.RepeatDecl(c[0], c[1], tuple(c[2:]), self._span())

    def call(self, c: list[Any]) -> ast.Call:
        args = [a for a in c[1:] if a is not None]
        positional = tuple(a for a in args if not isinstance(a, ast.Setting))
        kwargs = tuple(a for a in args if isinstance(a, ast.Setting))
        return ast.Call(c[0], positional, kwargs, self._span())

    # -- plans
    def plan(self, c: list[Any]) -> ast.PlanDecl:
        self._scalars(c[3:], "a plan")
        return ast.PlanDecl(c[0], c[1], c[2], tuple(c[3:]), self._span())

    def shard(self, c: list[Any]) -> ast.ShardStmt:
        return ast.ShardStmt(c[0], c[1], self._span())

    def loss(self, c: list[Any]) -> ast.LossStmt:
        return ast.LossStmt(c[0], self._span())

    def rule(self, c: list[Any]) -> ast.Rule:
        return ast.Rule(c[0], tuple(a for a in c[1:] if a is not None), self._span())

    def layout(self, c: list[Any]) -> ast.LayoutStmt:
        return ast.LayoutStmt(tuple(e for e in c if e is not None), self._span())

    def layout_entry(self, c: list[Any]) -> ast.LayoutEntry:
        return ast.LayoutEntry(c[0], tuple(c[1:]), self._span())

    def stages(self, c: list[Any]) -> ast.StagesStmt:
        axis, virtual, placement, body = c
        if body == "balanced":
            return ast.StagesStmt(axis, virtual, True, (), self._span(), placement)
        return ast.StagesStmt(axis, virtual, False, tuple(body), self._span(), placement)

    def virtual(self, c: list[Any]) -> ast.Expr:
        return c[0]  # type: ignore[no-any-return]

    def placement(self, c: list[Any]) -> ast.Name:
        return c[0]  # type: ignore[no-any-return]

    def balanced(self, c: list[Any]) -> str:
        return "balanced"

    def stage_map(self, c: list[ast.StageEntry]) -> list[ast.StageEntry]:
        return list(c)

    def stage_entry(self, c: list[Any]) -> ast.StageEntry:
        index = ast.IntLit(self._int(c[0]), self._tok(c[0]))
        return ast.StageEntry(index, tuple(i for i in c[1:] if i is not None), self._span())

    def stage_item(self, c: list[Any]) -> ast.StageItem:
        name, bounds = c
        start, stop = bounds if bounds is not None else (None, None)
        return ast.StageItem(name, start, stop, self._span())

    def slice(self, c: list[_Tok]) -> tuple[int, int]:
        return self._int(c[0]), self._int(c[1])

    def schedule(self, c: list[Any]) -> ast.ScheduleStmt:
        return ast.ScheduleStmt(c[0], self._span())

    def optimizer(self, c: list[Any]) -> ast.OptimizerStmt:
        zeros = [s for s in c[1:] if isinstance(s, ast.ZeroStmt)]
        zero = zeros[0] if zeros else None
        for extra in zeros[1:]:
            self.diagnostics.append(Diagnostic(
                E0201, "`zero` is given twice in one optimizer", extra.span, label="second `zero`",
                secondary=(Label(zeros[0].span, "first here"),) if zeros[0].span else (),  # type: ignore[arg-type]
                help="give the ZeRO stage once"))
        settings = tuple(s for s in c[1:] if isinstance(s, ast.Setting))
        self._scalars(settings, "an optimizer")
        return ast.OptimizerStmt(c[0], zero, settings, self._span())

    def precision(self, c: list[Any]) -> ast.PrecisionStmt:
        self._scalars(c[0], "precision")
        return ast.PrecisionStmt(c[0], self._span())

    def precision_rule(self, c: list[Any]) -> ast.PrecisionRule:
        self._scalars((c[1],), "precision")
        return ast.PrecisionRule(c[0], c[1], self._span())

    def zero(self, c: list[Any]) -> ast.ZeroStmt:
        stage = ast.IntLit(self._int(c[0]), self._tok(c[0]))
        return ast.ZeroStmt(stage, tuple(a for a in c[1:] if a is not None), self._span())

    # -- paths
    def path(self, c: list[ast.PathSegment]) -> ast.Path:
        return ast.Path(tuple(c), self._span())

    def name_segment(self, c: list[ast.Name]) -> ast.PathSegment:
        return ast.PathSegment("name", (c[0].value,), span=c[0].span)

    def star_segment(self, c: list[Any]) -> ast.PathSegment:
        return ast.PathSegment("star", span=self._span())

    def index_segment(self, c: list[_Tok]) -> ast.PathSegment:
        return ast.PathSegment("index", index=self._int(c[0]), span=self._tok(c[0]))

    def alt_segment(self, c: list[ast.Name]) -> ast.PathSegment:
        return ast.PathSegment("alt", tuple(n.value for n in c), span=self._span())


def _syntax_diagnostic(source: SourceFile, err: UnexpectedInput) -> Diagnostic:
    from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedToken

    pos = getattr(err, "pos_in_stream", None)
    if isinstance(err, UnexpectedToken) and err.token is not None:
        tok = err.token
        if tok.type == "$END":
            start = end = len(source.text)
            found = "end of file"
        else:
            start, end = tok.start_pos or 0, tok.end_pos or 0
            found = f"`{tok}`"
        # LALR merges lookaheads of states, so `err.expected` can list tokens that are not valid here
        # (`)` after a mesh axis); the interactive parser replays each candidate and keeps the real ones.
        candidates = set(err.expected)
        ip = getattr(err, "interactive_parser", None)
        if ip is not None:
            # The precise set is a nicety: on any failure keep Lark's own.
            with contextlib.suppress(Exception):
                candidates = set(ip.accepts()) or candidates
        expected = sorted({_describe(t) for t in candidates})
        unclosed = _unclosed_block_note(source, start)
        if unclosed is not None:
            note, opened, at = unclosed
            # What the parser would accept (`=`, a setting's value) only misleads: the keyword was
            # never meant as a setting.
            return Diagnostic(E0101, f"unexpected {found}", source.span(start, end), label="not expected here",
                              note=note, help=f"add `}}` to close the block opened on line {opened}",
                              suggestions=insert(source.span(at, at), False, "}\n\n", "Insert the missing `}`"))
        missing = _missing_close(source, start, {t for t in candidates})
        if missing is not None:
            at, close, opened_line = missing
            line = source.position(at)[0]
            return Diagnostic(
                E0101, f"missing `{close}` at the end of line {line}", source.span(at, at),
                label=f"expected `{close}` here",
                note=f"the `{_OPENERS[close]}` on line {opened_line} is still open, and line {source.position(start)[0]} "
                f"starts with {found}, which cannot continue it",
                help=f"add `{close}` at the end of line {line}",
                suggestions=insert(source.span(at, at), False, close, f"Insert the missing `{close}`"))
        return Diagnostic(
            E0101,
            f"unexpected {found}",
            source.span(start, end),
            label="not expected here",
            help=f"expected {_or_list(expected)}" if expected else None,
        )
    if isinstance(err, UnexpectedCharacters):
        start = pos if pos is not None else 0
        ch = source.text[start : start + 1]
        # The lexer's "allowed" set is the state's terminals, which reads as nonsense next to a character
        # that starts no token anywhere; say what tokens look like instead.
        if ch == '"':
            help_ = 'a string must end with `"` on the same line, e.g. `include "models.mesh"`'
        elif ch.isprintable() and not ch.isspace():
            help_ = ("names are ASCII letters, digits and `_`, numbers are decimal, comments start with `#`; "
                     f"`{ch}` is not part of the language")
        else:
            help_ = "remove it: .mesh files are plain ASCII text"
        shown = f"`{ch}`" if ch.isprintable() and ch != "`" else repr(ch)
        return Diagnostic(
            E0102,
            f"unexpected character {shown}",
            source.span(start, start + 1),
            label="not valid here",
            help=help_,
        )
    assert isinstance(err, UnexpectedEOF)
    expected = sorted({_describe(t) for t in err.expected})
    end = len(source.text)
    return Diagnostic(
        E0101,
        "unexpected end of file",
        source.span(end, end),
        label="file ends here",
        help=f"expected {_or_list(expected)}" if expected else None,
    )


_DECLARATIONS = ("mesh", "model", "family", "plan", "device", "include")


def _unclosed_block_note(source: SourceFile, start: int) -> tuple[str, int, int] | None:
    """When the parser stumbles right after a declaration keyword that sits inside a block, the
    usual cause is a `}` missing above it: the keyword was read as a setting name. The note, the
    line of the block's `{` that is still open, and the start of the keyword's line (where the `}` goes)."""
    before = source.text[:start].rstrip()
    word = before.rsplit(None, 1)[-1] if before.split() else ""
    if word not in _DECLARATIONS:
        return None
    opened = [p for p, ch in _open_brackets(source.text[: len(before) - len(word)]) if ch == "{"]
    if not opened:
        return None
    line = source.position(len(before) - len(word))[0]
    return (f"`{word}` on line {line} starts a new declaration, but a block above it is still open: is a `}}` missing?",
            source.position(opened[-1])[0], source.text.rfind("\n", 0, len(before) - len(word)) + 1)


_OPENERS = {")": "(", "}": "{", "]": "["}
_CLOSE_TOKENS = {"RPAR": ")", "RBRACE": "}", "RSQB": "]"}


def _open_brackets(text: str) -> list[tuple[int, str]]:
    """Positions and characters of the brackets in `text` still open at its end (comments and
    strings skipped)."""
    stack: list[tuple[int, str]] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "#":
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            continue
        if ch == '"':
            end = text.find('"', i + 1)
            i = n if end < 0 else end + 1
            continue
        if ch in "({[":
            stack.append((i, ch))
        elif ch in ")}]" and stack and stack[-1][1] == _OPENERS[ch]:
            stack.pop()
        i += 1
    return stack


def _missing_close(source: SourceFile, start: int, expected: set[str]) -> tuple[int, str, int] | None:
    """A `)` (or `]`) missing at the end of a line: the parser only stumbles on the next line's
    first token, which is where Lark reports it. Where the bracket belongs (the end of the last
    token before), which one, and the line its opener is on; None unless that is what happened."""
    before = source.text[:start].rstrip()
    if not before or source.position(len(before))[0] == source.position(start)[0]:
        return None  # the unexpected token continues the same line: not a bracket left open
    stack = _open_brackets(before)
    if not stack or stack[-1][1] not in "([":
        return None
    close = {"(": ")", "[": "]"}[stack[-1][1]]
    if close not in {_CLOSE_TOKENS.get(t, t) for t in expected}:
        return None
    return len(before), close, source.position(stack[-1][0])[0]


def _or_list(items: list[str]) -> str:
    if len(items) > 8:
        items = items[:8] + ["..."]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _keyword_as_name(err: UnexpectedInput) -> bool:
    """Resume a parse that stopped at a keyword used as a name, such as a dim called `zero`.

    LALR merges the lookaheads of states with the same core, so after an expression the contextual
    lexer also accepts keywords that may follow an expression elsewhere (`zero` in an optimizer
    block, `shard` in a plan): `mesh m { axes a = 1  zero = 2 }` lexes `zero` as the keyword, although
    `mesh m { zero = 2  axes a = 1 }` reads it as a name. Where the parser can take a NAME, feed the
    keyword's text as one and go on; any other error ends the parse (the caller reports it).
    """
    from lark import Token
    from lark.exceptions import UnexpectedToken

    if not isinstance(err, UnexpectedToken) or err.token is None or err.token.type in ("NAME", "$END"):
        return False
    tok = err.token
    if not _NAME_RE.fullmatch(str(tok)) or "NAME" not in err.interactive_parser.choices():
        return False
    err.interactive_parser.feed_token(Token.new_borrow_pos("NAME", str(tok), tok))
    return True


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building a large acyclic structure (an AST, the
    checked plans): each generation-2 pass would walk every node built so far, which cost 20-30% of
    checking a large spec. Nothing built here forms cycles, so nothing is left for it to find."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_source(source: SourceFile) -> ast.Module:
    """Parse one file; raises SpecError with a syntax diagnostic on bad input.

    The fast path (`_FastParser`) parses what it can; a file with a syntax error or unusual input is
    parsed again from the start by Lark's own parser, which reports the error or recovers from it."""
    fast, builder = _fast_parser()
    with _PARSE_LOCK, paused_gc():
        try:
            builder.reset(source)
            module: Any = _HANDED_OVER
            if fast is not None:
                module = fast.parse(source.text)
            if module is _HANDED_OVER:
                builder.reset(source)
                module = _lark_parse(source)
        finally:
            diagnostics = builder.diagnostics
            builder.reset(_EMPTY)  # drop the references to this parse's nodes
    if diagnostics:
        raise SpecError(diagnostics)
    assert isinstance(module, ast.Module)
    return module


def _lark_parse(source: SourceFile) -> Any:
    from lark.exceptions import UnexpectedInput

    parser = _lark_parser()[0]
    try:
        return parser.parse(source.text, on_error=_keyword_as_name)
    except UnexpectedInput as err:
        raise SpecError([_syntax_diagnostic(source, err)]) from None


_PARSE_LOCK = threading.Lock()
_EMPTY = SourceFile("<none>", "")
_HANDED_OVER = object()


@functools.lru_cache(maxsize=1)
def _tables() -> parse_tables.Tables:
    return parse_tables.load_tables()


@functools.lru_cache(maxsize=1)
def _fast_parser() -> tuple[_FastParser | None, _Builder]:
    builder = _Builder()
    tables = _tables()
    reducers = [builder.reducer(rule, sig) for rule, sig in zip(tables["rules"], tables["signatures"], strict=True)]
    return _FastParser.create(tables, reducers), builder


@functools.lru_cache(maxsize=1)
def _lark_parser() -> tuple[Lark, _Builder]:
    """Lark's parser from the cached tables, reducing with the fast path's builder (so both build
    the same AST), with `_FastLexer` in front of its contextual lexer."""
    import io

    from lark import Lark
    from lark.lexer import ContextualLexer

    tables = _tables()
    fast, builder = _fast_parser()
    parser = Lark.load(io.BytesIO(tables["lark"]))
    frontend = parser.parser
    if isinstance(frontend.lexer, ContextualLexer):
        frontend.lexer = _FastLexer(frontend.lexer, parser.terminals, parser.lexer_conf.ignore)
    by_rule = {rule: i for i, rule in enumerate(tables["signatures"])}
    callbacks = parser._callbacks  # the dict the LALR parser calls into (shared, not copied)
    for rule in list(callbacks):
        if not isinstance(rule, str):  # rules, not lexer callbacks
            signature = (rule.origin.name, tuple(sym.name for sym in rule.expansion))
            callbacks[rule] = _from_lark(builder.reducer(tables["rules"][by_rule[signature]], signature))
    return parser, builder


def _from_lark(reduce: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """A reduction that takes Lark's tokens (the builder reads `_Tok`s)."""
    from lark import Token

    def callback(children: list[Any]) -> Any:
        for i, c in enumerate(children):
            if isinstance(c, Token):
                children[i] = _Tok((c.type, str(c), c.start_pos, c.end_pos))
        return reduce(children)

    return callback


def _passes_through(rule: Rule, signature: tuple[str, tuple[str, ...]]) -> bool:
    _origin, size, _name, expand1, keep, append_none = rule
    return (size == 1 and expand1 and not append_none and keep in (None, ((0, False, 0),))
            and not signature[1][0].isupper())


def _helper(children: list[Any]) -> list[Any]:
    return children


def _no_builder(name: str, children: list[Any]) -> Any:
    raise AssertionError(f"grammar rule {name!r} has no AST builder")


class _FastParser:
    """An LALR driver over the cached tables with its lexer inline: Lark's parse loop and contextual
    lexer, less their per-token objects and calls (a tuple per token, one regex match that skips
    whitespace and comments and finds the token).

    The lexer types a token as Lark's contextual lexer would: by its first character it can only be
    a word (a keyword where the parser state takes it, else a NAME), a number (FLOAT tried before
    INT, as Lark orders them), a string or punctuation (longest first), and it is kept only where the
    state takes that type. Anything else -- a token the state does not take, a character no token
    starts with, a state whose terminals it does not know -- hands the whole file over to Lark
    (`_HANDED_OVER`), which reports the error or recovers. tests/front/test_properties.py checks
    that both build the same AST with the same spans.
    """

    _SIMPLE = frozenset({"NAME", "INT", "FLOAT", "STRING"})
    _WORD = r"[A-Za-z_][A-Za-z0-9_]*"

    def __init__(self, tables: parse_tables.Tables, reducers: list[Callable[[list[Any]], Any]]) -> None:
        pats = tables["patterns"]
        skip = "(?:" + "|".join(tables["ignore"]) + ")*"
        punct = "|".join(re.escape(p) for p in sorted(tables["punct"], key=lambda p: (-len(p), p)))
        self.token = re.compile(
            f"{skip}(?:(?P<w>{self._WORD})|(?P<FLOAT>{pats['FLOAT']})|(?P<INT>{pats['INT']})"
            f"|(?P<STRING>{pats['STRING']})|(?P<p>{punct}))?")
        self.schedule = re.compile(f"{skip}(?P<SCHEDULE_NAME>{pats['SCHEDULE_NAME']})?") if "SCHEDULE_NAME" in pats else None
        self.keywords, self.punct = tables["keywords"], tables["punct"]
        self.actions, self.start, self.end = tables["actions"], tables["start"], tables["end"]
        # A `?rule` with one nonterminal child passes it through untouched (its bounds are the
        # child's): such a reduction only changes the parser's state, so no reducer runs for it.
        self.rules = [
            (rule[0], rule[1], None if _passes_through(rule, signature) else reduce)
            for rule, signature, reduce in zip(tables["rules"], tables["signatures"], reducers, strict=True)
        ]
        # Per state, the lexer to use: self.token, self.schedule, or None (hand the file over).
        regex_terminals = frozenset(pats)
        self.lexers: list[Any] = []
        for acts in self.actions:
            acc = {sym for sym in acts if sym.isupper()}
            if not (acc & regex_terminals) - self._SIMPLE:
                self.lexers.append(self.token)
            elif acc == {"SCHEDULE_NAME"}:
                self.lexers.append(self.schedule)
            else:
                self.lexers.append(None)

    @classmethod
    def create(cls, tables: parse_tables.Tables, reducers: list[Callable[[list[Any]], Any]]) -> _FastParser | None:
        """The fast path, or None where the grammar has moved beyond what it knows."""
        pats = tables["patterns"]
        if not tables["float_first"] or pats.get("NAME") != cls._WORD or not cls._SIMPLE <= set(pats):
            return None
        return cls(tables, reducers)

    def parse(self, text: str) -> Any:
        actions, lexers, rules, keywords, punct = self.actions, self.lexers, self.rules, self.keywords, self.punct
        end_state = self.end
        states = [self.start]
        values: list[Any] = []
        pos, n = 0, len(text)
        while True:
            state = states[-1]
            lexer = lexers[state]
            if lexer is None:
                return _HANDED_OVER
            m = lexer.match(text, pos)
            kind = m.lastgroup
            if kind is None:
                if m.end() != n:
                    return _HANDED_OVER
                typ, tok = "$END", None
            else:
                start, pos = m.span(kind)
                value = text[start:pos]
                if kind == "w":
                    typ = keywords.get(value, "NAME")
                    if typ not in actions[state]:
                        typ = "NAME"
                elif kind == "p":
                    typ = punct[value]
                else:
                    typ = kind
                tok = _Tok((typ, value, start, pos))
            acts = actions[state]
            while True:
                action = acts.get(typ)
                if action is None:
                    return _HANDED_OVER
                if action >= 0:
                    if tok is None:
                        return _HANDED_OVER
                    states.append(action)
                    values.append(tok)
                    break
                origin, size, reduce = rules[~action]
                if reduce is None:
                    del states[-1]
                    target = actions[states[-1]][origin]
                    states.append(target)
                    if tok is None and target == end_state:
                        return values[-1]
                    acts = actions[target]
                    continue
                if size:
                    children = values[-size:]
                    del states[-size:]
                    del values[-size:]
                else:
                    children = []
                value = reduce(children)
                target = actions[states[-1]][origin]
                states.append(target)
                values.append(value)
                if tok is None and target == end_state:
                    return value
                acts = actions[target]


class _FastLexer:
    """Lark's contextual lexer with a fast path for the tokens a spec is made of.

    Lark's contextual lexer matches each token with the regex of the parser state's acceptable
    terminals; here one short regex per character class (word, number, string, punctuation) finds
    the token, and the state's acceptable set decides its type exactly as Lark would: a keyword where
    the state takes it, else a NAME where the state takes one. Anything else (a terminal this
    path does not know, a token the state does not accept, the start of an error) goes to Lark's
    own lexer at that position, so errors and unusual input behave exactly as before. Whitespace
    and comments are the grammar's ignored terminals. tests/front/test_parser.py compares the
    token streams of both lexers.
    """

    _SIMPLE = frozenset({"NAME", "INT", "FLOAT", "STRING"})

    def __init__(self, contextual: ContextualLexer, terminals: Any, ignore: Any) -> None:
        from lark import Token

        self.Token = Token
        self.contextual = contextual
        by_name = {t.name: t for t in terminals}
        self.ignore = frozenset(ignore)
        self.skip = re.compile("(?:" + "|".join(by_name[n].pattern.to_regexp() for n in sorted(self.ignore)) + ")*")
        literals = {t.pattern.value: t.name for t in terminals if t.pattern.type == "str"}
        self.keywords = {v: n for v, n in literals.items() if _NAME_RE.fullmatch(v)}
        self.punct = {v: n for v, n in literals.items() if not _NAME_RE.fullmatch(v)}
        self.punct_lengths = sorted({len(v) for v in self.punct}, reverse=True)
        self.word = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
        self.regex = {n: re.compile(by_name[n].pattern.to_regexp()) for n in self._SIMPLE if n in by_name}
        self.regex_terminals = frozenset(t.name for t in terminals if t.pattern.type == "re")
        # Lark's scanner tries terminals in its sorted order, first match wins: numbers take the fast
        # path only where it tries FLOAT before INT (so `1.5` is one FLOAT, as the fast path reads it).
        order = [t.name for t in contextual.root_lexer.terminals]
        self.float_first = "FLOAT" in order and "INT" in order and order.index("FLOAT") < order.index("INT")
        self.accepts: dict[int, tuple[frozenset[str], bool]] = {}

    def _accepts(self, parser_state: Any) -> tuple[frozenset[str], bool]:
        state = parser_state.position
        entry = self.accepts.get(state)
        if entry is None:
            acc = frozenset(parser_state.parse_conf.parse_table.states[state])
            # The fast path is exact only where the state's regex terminals are the ones it knows.
            entry = (acc, not ((acc & self.regex_terminals) - self._SIMPLE))
            self.accepts[state] = entry
        return entry

    def _classify(self, text: str, pos: int, acc: frozenset[str]) -> tuple[str, int] | None:
        ch = text[pos]
        if ch.isalpha() or ch == "_":
            m = self.word.match(text, pos)
            if m is None:
                return None
            w = m.group()
            kw = self.keywords.get(w)
            if kw is not None and kw in acc:
                return kw, m.end()
            if "NAME" in acc and self.regex["NAME"].fullmatch(w):
                return "NAME", m.end()
            return None
        if ch.isdigit():
            if not self.float_first:
                return None
            fm = self.regex["FLOAT"].match(text, pos) if "FLOAT" in self.regex else None
            if fm is not None:
                return ("FLOAT", fm.end()) if "FLOAT" in acc else None
            im = self.regex["INT"].match(text, pos) if "INT" in self.regex else None
            return ("INT", im.end()) if im is not None and "INT" in acc else None
        if ch == '"':
            m = self.regex["STRING"].match(text, pos) if "STRING" in self.regex else None
            return ("STRING", m.end()) if m is not None and "STRING" in acc else None
        for n in self.punct_lengths:
            word = text[pos : pos + n]
            typ = self.punct.get(word)
            if typ is not None:  # len(word), not n: at the end of the text `}` is all a 2-wide slice holds
                return (typ, pos + len(word)) if typ in acc else None
        return None

    def lex(self, lexer_state: Any, parser_state: Any) -> Iterator[Token]:
        text, end = lexer_state.text.text, lexer_state.text.end
        line_ctr = lexer_state.line_ctr
        skip = self.skip.match
        slow = None
        while True:
            pos = line_ctr.char_pos
            m = skip(text, pos, end)
            if m is not None and m.end() > pos:
                line_ctr.feed(m.group())
                pos = line_ctr.char_pos
            if pos >= end:
                return
            acc, fast = self._accepts(parser_state)
            hit = self._classify(text, pos, acc) if fast else None
            if hit is None:
                # Lark's lexer for this one token (and its errors), from this position.
                if slow is None:
                    slow = self.contextual.lex(lexer_state, parser_state)
                tok = next(slow, None)
                if tok is None:
                    return
                yield tok
                continue
            typ, stop = hit
            value = text[pos:stop]
            tok = self.Token(typ, value, pos, line_ctr.line, line_ctr.column)
            line_ctr.feed(value, False)
            tok.end_line, tok.end_column, tok.end_pos = line_ctr.line, line_ctr.column, stop
            lexer_state.last_token = tok
            yield tok


def _too_deep(span: Any) -> Diagnostic:
    return Diagnostic(
        E0311, f"expression nests more than {MAX_EXPR_DEPTH} operators", span,
        label="too deeply nested",
        help="compute the value and write it as a number, or name parts of it as dims")


def parse(text: str, path: str = "<string>") -> ast.Module:
    """Parse .mesh text into a Module (no includes resolved, nothing checked)."""
    return parse_source(SourceFile(path, text))
