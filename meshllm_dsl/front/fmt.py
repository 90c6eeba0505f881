"""AST -> canonical .mesh text (`meshc fmt`).

Comments are kept: a comment on its own line stays before the item or statement that follows it,
and a trailing comment stays at the end of its line. Canonical layout: 4-space indent, one statement
per line, `a = b` with single spaces, one blank line between top-level items.
"""

from __future__ import annotations

from meshllm_dsl.front import ast
from meshllm_dsl.front.source import SourceFile

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def format_expr(e: ast.Value, parent: int = 0, right: bool = False) -> str:
    if isinstance(e, ast.ListLit):
        return f"[{', '.join(format_expr(x) for x in e.items)}]"
    if isinstance(e, ast.IntLit):
        return str(e.value)
    if isinstance(e, ast.FloatLit):
        return e.text
    if isinstance(e, ast.StrLit):
        return f'"{e.value}"'
    if isinstance(e, ast.Name):
        return e.value
    if isinstance(e, ast.Neg):
        return "-" + format_expr(e.operand, 3)
    prec = _PREC[e.op]
    text = f"{format_expr(e.left, prec)} {e.op} {format_expr(e.right, prec, right=True)}"
    # Left-associative: a right operand of equal precedence needs parentheses (a - (b - c)).
    if prec < parent or (right and prec == parent):
        return f"({text})"
    return text


# A list setting longer than this (with its indent) is printed one row of items per line.
_WIDTH = 100


def _setting(s: ast.Setting, indent: int = 0) -> str:
    every = f" every {format_expr(s.every)}" if s.every is not None else ""
    text = f"{s.name.value} = {format_expr(s.value)}{every}"
    if not isinstance(s.value, ast.ListLit) or 4 * indent + len(text) <= _WIDTH or indent == 0:
        return text
    # Phi-3's 48 rope factors: rows of items under the name, the bracket closed on its own line
    pad = "    " * (indent + 1)
    rows, row = [], ""
    for item in (format_expr(x) + "," for x in s.value.items):
        if row and len(pad) + len(row) + 1 + len(item) > _WIDTH:
            rows.append(row)
            row = ""
        row = f"{row} {item}" if row else item
    rows.append(row)
    return f"{s.name.value} = [\n" + "\n".join(pad + r for r in rows) + "\n" + "    " * indent + "]"


def _rule(r: ast.Rule) -> str:
    if not r.axes:
        return r.name.value
    return f"{r.name.value}({', '.join(a.value for a in r.axes)})"


def _call(c: ast.Call, lead: int = 0) -> str:
    """`func(args)`; ``lead``: the columns before it on its line. A call longer than _WIDTH wraps its
    arguments, as many to a line as fit, each line after the first aligned under the first argument."""
    args = [format_expr(a) for a in c.args] + [_setting(k) for k in c.kwargs]
    one = f"{c.func.value}({', '.join(args)})"
    if lead + len(one) <= _WIDTH or len(args) < 2:
        return one
    column = lead + len(c.func.value) + 1
    rows, row = [], ""
    for i, arg in enumerate(args):
        item = arg + ("," if i < len(args) - 1 else ")")
        if row and column + len(row) + 1 + len(item) > _WIDTH:
            rows.append(row)
            row = ""
        row = f"{row} {item}" if row else item
    rows.append(row)
    return f"{c.func.value}(" + ("\n" + " " * column).join(rows)


class _Printer:
    def __init__(self, source: SourceFile | None) -> None:
        self.lines: list[str] = []
        self.source = source
        self.comments = _comments(source.text) if source else []  # (offset, text, own_line)
        self.next_comment = 0

    def _flush_comments(self, before: int, indent: int) -> None:
        """Emit comments that start before `before`, each on its own line."""
        while self.next_comment < len(self.comments) and self.comments[self.next_comment][0] < before:
            _, text, _ = self.comments[self.next_comment]
            self.lines.append("    " * indent + text)
            self.next_comment += 1

    def _trailing(self, end: int) -> str:
        """A comment on the same source line as `end`, if any; it is consumed."""
        if self.source is None or self.next_comment >= len(self.comments):
            return ""
        offset, text, own_line = self.comments[self.next_comment]
        line_end = self.source.text.find("\n", end)
        line_end = len(self.source.text) if line_end < 0 else line_end
        if not own_line and end <= offset <= line_end:
            self.next_comment += 1
            return "  " + text
        return ""

    def _comment_within(self, node: object) -> bool:
        """A comment not yet printed lies inside `node`: print it over several lines, so each
        comment stays at the line it was written on instead of moving before or after it."""
        span = getattr(node, "span", None)
        return span is not None and self._comment_between(span.start, span.end)

    def _comment_between(self, start: int, end: int) -> bool:
        return any(start <= off < end for off, _, _ in self.comments[self.next_comment:])

    def line(self, indent: int, text: str, node: object) -> None:
        span = getattr(node, "span", None)
        if span is not None:
            self._flush_comments(span.start, indent)
        trailing = self._trailing(span.end) if span is not None else ""
        self.lines.append("    " * indent + text + trailing)

    def open(self, indent: int, text: str, node: object) -> None:
        """A line ending in `{`: trailing comments after the brace stay on it."""
        span = getattr(node, "span", None)
        if span is not None:
            self._flush_comments(span.start, indent)
        trailing = ""
        if span is not None and self.source is not None:
            brace = self.source.text.find("{", span.start)
            trailing = self._trailing(brace + 1) if brace >= 0 else ""
        self.lines.append("    " * indent + text + " {" + trailing)

    def close(self, indent: int, node: object) -> None:
        span = getattr(node, "span", None)
        if span is not None:
            self._flush_comments(span.end - 1, indent + 1)
        trailing = self._trailing(span.end) if span is not None else ""
        self.lines.append("    " * indent + "}" + trailing)

    # -- items
    def module(self, m: ast.Module) -> str:
        for i, item in enumerate(m.items):
            if i:
                self.lines.append("")
            self.item(item)
        if self.source is not None:
            self._flush_comments(len(self.source.text) + 1, 0)
        return "\n".join(self.lines).rstrip() + "\n" if self.lines else ""

    def item(self, item: ast.Item) -> None:
        if item.span is not None:
            self._flush_comments(item.span.start, 0)
        if isinstance(item, ast.Include):
            self.line(0, f'include "{item.path.value}"', item)
        elif isinstance(item, ast.DeviceDecl):
            self.open(0, f"device {item.name.value}", item)
            for s in item.settings:
                self.line(1, _setting(s), s)
            self.close(0, item)
        elif isinstance(item, ast.MeshDecl):
            self.open(0, f"mesh {item.name.value}", item)
            if item.axes:
                axes = [f"{a.name.value} = {format_expr(a.size)}" for a in item.axes]
                first, last = item.axes[0].span, item.axes[-1].span
                if first is not None and last is not None and self._comment_between(first.start, last.start):
                    for k, (a, text) in enumerate(zip(item.axes, axes)):
                        last = k == len(axes) - 1
                        self.line(1 if k == 0 else 2, ("axes " if k == 0 else "") + text + ("" if last else ","), a)
                else:
                    self.line(1, f"axes {', '.join(axes)}", item.axes[0])
            for s in item.settings:
                self.line(1, _setting(s), s)
            self.close(0, item)
        elif isinstance(item, ast.FamilyDecl):
            params = [p.name.value + (f" = {format_expr(p.default)}" if p.default is not None else "") for p in item.params]
            head = f"family {item.name.value}({', '.join(params)})"
            spans = [p.span for p in item.params if p.span is not None]
            close = self.source.text.find(")", spans[-1].end) if spans and self.source is not None else -1
            if len(head) > 96 or (close >= 0 and self._comment_between(spans[0].start, close)):
                self._flush_comments(item.span.start if item.span else 0, 0)
                self.lines.append(f"family {item.name.value}(")
                for p, text in zip(item.params, params):
                    self.line(1, f"{text},", p)
                if close >= 0:  # comments after the last parameter stay inside the parentheses
                    self._flush_comments(close, 1)
                head = ")"
            self.open(0, head, item)
            self.layers(item.body, 1)
            self.close(0, item)
        elif isinstance(item, ast.ModelDecl):
            if item.family is not None:
                self.open(0, f"model {item.name.value} = {item.family.value}", item)
            else:
                self.open(0, f"model {item.name.value}", item)
            for s in item.settings:
                if isinstance(s.value, ast.ListLit) and s.value.items and self._comment_within(s.value):
                    self.list_setting(s, 1)
                else:
                    self.line(1, _setting(s, 1), s)
            self.layers(item.body, 1)
            self.close(0, item)
        else:
            assert isinstance(item, ast.PlanDecl)
            self.open(0, f"plan {item.name.value} on {item.mesh.value} for {item.model.value}", item)
            for stmt in item.body:
                self.plan_stmt(stmt)
            self.close(0, item)

    def list_setting(self, s: ast.Setting, indent: int) -> None:
        """A list with comments among its items: one item per line, so each comment stays on the
        line of the item it was written after (or before)."""
        assert isinstance(s.value, ast.ListLit)
        if s.span is not None:
            self._flush_comments(s.span.start, indent)
        self.lines.append("    " * indent + f"{s.name.value} = [")
        for x in s.value.items:
            self.line(indent + 1, format_expr(x) + ",", x)
        if s.value.span is not None:
            self._flush_comments(s.value.span.end - 1, indent + 1)  # those before the `]`
        self.lines.append("    " * indent + "]" + (self._trailing(s.span.end) if s.span is not None else ""))

    def layers(self, body: tuple[ast.LayerStmt, ...], indent: int) -> None:
        for stmt in body:
            if isinstance(stmt, ast.LayerDecl):
                head = f"{stmt.name.value} = "
                self.line(indent, head + _call(stmt.call, 4 * indent + len(head)), stmt)
            else:
                self.open(indent, f"{stmt.name.value} = repeat({format_expr(stmt.count)})", stmt)
                self.layers(stmt.body, indent + 1)
                self.close(indent, stmt)

    def plan_stmt(self, s: ast.PlanStmt) -> None:
        if isinstance(s, ast.Setting):
            self.line(1, _setting(s), s)
        elif isinstance(s, ast.ShardStmt):
            self.line(1, f"shard {s.path} {_rule(s.rule)}", s)
        elif isinstance(s, ast.LossStmt):
            self.line(1, f"loss {_rule(s.rule)}", s)
        elif isinstance(s, ast.LayoutStmt):
            texts = [f"{e.dim.value} -> {' * '.join(a.value for a in e.axes)}" for e in s.entries]
            if texts and self._comment_within(s):
                self.open(1, "layout", s)
                for k, (e, text) in enumerate(zip(s.entries, texts)):
                    self.line(2, text + ("," if k < len(texts) - 1 else ""), e)
                self.close(1, s)
            else:
                self.line(1, f"layout {{ {', '.join(texts)} }}" if texts else "layout {}", s)
        elif isinstance(s, ast.StagesStmt):
            head = f"stages over {s.axis.value}"
            if s.virtual is not None:
                head += f" virtual {format_expr(s.virtual)}"
            if s.placement is not None:
                head += f" placement {s.placement.value}"
            if s.balanced:
                self.line(1, head + " balanced", s)
                return
            self.open(1, head, s)
            for e in s.entries:
                items = ", ".join(
                    i.name.value + (f"[{i.start}:{i.stop}]" if i.start is not None else "") for i in e.items
                )
                self.line(2, f"{e.index.value}: {items}", e)
            self.close(1, s)
        elif isinstance(s, ast.ScheduleStmt):
            self.line(1, f"schedule {s.name.value}", s)
        elif isinstance(s, ast.PrecisionStmt):
            self.line(1, f"precision {{ {', '.join(_setting(st) for st in s.settings)} }}", s)
        elif isinstance(s, ast.PrecisionRule):
            self.line(1, f"precision {s.path} {_setting(s.setting)}", s)
        else:
            assert isinstance(s, ast.OptimizerStmt)
            if s.zero is None and not s.settings:
                self.line(1, f"optimizer {s.name.value}", s)
                return
            self.open(1, f"optimizer {s.name.value}", s)
            members: list[tuple[int, str, object]] = [
                (st.span.start if st.span else 0, _setting(st), st) for st in s.settings]
            if s.zero is not None:
                over = f" over {' * '.join(a.value for a in s.zero.axes)}" if s.zero.axes else ""
                members.append((s.zero.span.start if s.zero.span else -1, f"zero {s.zero.stage.value}{over}", s.zero))
            # In the order written: the comments between them belong to the line they were on.
            for _, text, node in sorted(members, key=lambda m: m[0]):
                self.line(2, text, node)
            self.close(1, s)


def _comments(text: str) -> list[tuple[int, str, bool]]:
    """Every `#` comment outside strings: (offset, text, starts its own line)."""
    out = []
    i, n = 0, len(text)
    line_start = 0
    while i < n:
        ch = text[i]
        if ch == "\n":
            line_start = i + 1
        elif ch == '"':
            end = text.find('"', i + 1)
            nl = text.find("\n", i + 1)
            i = end if end >= 0 and (nl < 0 or end < nl) else (nl - 1 if nl >= 0 else n)
        elif ch == "#":
            end = text.find("\n", i)
            end = n if end < 0 else end
            own = text[line_start:i].strip() == ""
            out.append((i, text[i:end].rstrip(), own))
            i = end - 1
        i += 1
    return out


def format_module(module: ast.Module, source: SourceFile | None = None) -> str:
    """Canonical text of a module; pass its source to keep its comments."""
    return _Printer(source).module(module)


def format_text(text: str, path: str = "<string>") -> str:
    from meshllm_dsl.front.parser import parse_source

    source = SourceFile(path, text)
    return format_module(parse_source(source), source)
