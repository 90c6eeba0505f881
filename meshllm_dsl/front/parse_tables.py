"""The LALR tables of grammar/mesh.lark as plain data, cached per user so `meshc` needs no Lark to parse.

Lark builds the tables (0.2-0.5 s) and, with its own import, is most of `meshc check`'s start-up.
Here they are taken from Lark once: the parse table, each rule's shape (which children the tree
keeps, where `[x]` leaves a None, which `?rule` passes its one child through) exactly as Lark's
ParseTreeBuilder computes it, and what meshllm_dsl.front.parser's lexer needs. Lark's own serialized
parser rides along for the error path, which still runs Lark (its diagnostics, its recovery).

The cache is plain data in marshal's format (Lark's serialized parser inside it is a pickle, read
only on the error path), so it lives only in a directory private to this user: never in the install,
which may be read-only, nor the shared temp dir. Its name carries Lark's version, Python's, FORMAT
and a checksum of the grammar, and the file holds the grammar's full text and Lark's version, which
must match: a stale, foreign, truncated or corrupt file is rebuilt. It is written to a temporary
name and renamed, so a reader never sees half a file. Without a usable cache directory the tables
are built in memory each run. MESHLLM_NO_CACHE=1 turns the cache off.
"""

from __future__ import annotations

import marshal
import os
import re
import sys
import zlib
from typing import Any

# Bump when the layout of the tables below changes.
FORMAT = 1

Tables = dict[str, Any]


def grammar_text() -> bytes:
    import meshllm_dsl.grammar as package

    try:
        with open(os.path.join(os.path.dirname(package.__file__ or ""), "mesh.lark"), "rb") as f:
            return f.read()
    except OSError:  # installed somewhere without plain files (a zip)
        from importlib import resources

        return resources.files(package).joinpath("mesh.lark").read_bytes()


def lark_options() -> dict[str, Any]:
    return {"parser": "lalr", "lexer": "contextual", "maybe_placeholders": True}


def cache_name(text: bytes, lark_version: str) -> str:
    """The cache file's name: what the tables depend on besides the grammar's full text, which the
    file holds and is compared with (a checksum of it here keeps two grammars from sharing a file)."""
    tag = f"{lark_version}-py{sys.version_info[0]}{sys.version_info[1]}-f{FORMAT}-{zlib.crc32(text):08x}"
    return f"mesh-tables-{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}.marshal"


def cache_dir() -> str | None:
    """The private per-user cache directory, or None where there is none to trust."""
    if os.environ.get("MESHLLM_NO_CACHE"):
        return None
    try:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "meshllm")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.stat(folder)
        if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o022):
            return None
        return folder
    except OSError:
        return None


def lark_version() -> str:
    """Lark's version, read from its source: importing Lark (or importlib.metadata) costs more than
    the rest of `meshc check`."""
    import importlib.util

    spec = importlib.util.find_spec("lark")
    if spec is not None and spec.origin:
        try:
            with open(spec.origin, encoding="utf-8") as f:
                m = re.search(r"^__version__\b[^=]*=\s*[\"']([^\"']+)[\"']", f.read(), re.MULTILINE)
            if m:
                return m.group(1)
        except OSError:
            pass
    import lark

    return str(lark.__version__)


def load_tables() -> Tables:
    text = grammar_text()
    version = lark_version()
    folder = cache_dir()
    path = os.path.join(folder, cache_name(text, version)) if folder else None
    if path is not None:
        try:
            with open(path, "rb") as f:
                tables = marshal.load(f)
            if isinstance(tables, dict) and tables.get("grammar") == text and tables.get("lark_version") == version:
                return tables
        except Exception:  # noqa: BLE001 - missing, truncated or foreign: rebuild it
            pass
    tables = build_tables(text, version)
    if path is not None:
        write_atomic(path, marshal.dumps(tables))
    return tables


def write_atomic(path: str, data: bytes) -> bool:
    """Write to a temporary file beside `path` and rename it over; False (and no file) on failure."""
    import tempfile

    folder = os.path.dirname(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".marshal")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def build_tables(text: bytes, version: str) -> Tables:
    """Build the grammar with Lark and take out what the parser's fast path runs on."""
    import io

    from lark import Lark
    from lark.parse_tree_builder import ExpandSingleChild
    from lark.parsers.lalr_analysis import Shift

    lark = Lark(text.decode("utf-8"), **lark_options())
    table = lark.parser.parser._parse_table  # type: ignore[attr-defined]
    rules: list[Any] = []
    signatures: list[tuple[str, tuple[str, ...]]] = []  # to match Lark's rules on the error path
    index: dict[Any, int] = {}
    for rule, chain in lark._parse_tree_builder.rule_builders:
        expand1 = any(w is ExpandSingleChild for w in chain)
        filters = [w for w in chain if w is not ExpandSingleChild]
        assert len(filters) <= 1, chain
        keep: tuple[tuple[int, bool, int], ...] | None = None
        append_none = 0
        if filters:
            args = filters[0].args
            if len(args) == 1:  # ChildFilterLALR_NoPlaceholders(to_include)
                keep = tuple((i, expand, 0) for i, expand in args[0])
            else:  # ChildFilterLALR(to_include, append_none)
                keep = tuple((i, expand, add_none) for i, expand, add_none in args[0])
                append_none = args[1]
        name = str(rule.alias or rule.options.template_source or rule.origin.name)  # plain str: no Lark to unpickle
        index[rule] = len(rules)
        rules.append((str(rule.origin.name), len(rule.expansion), name, expand1, keep, append_none))
        signatures.append((str(rule.origin.name), tuple(str(sym.name) for sym in rule.expansion)))
    # One dict per state: symbol -> shift/goto target (>= 0) or ~rule (< 0) to reduce. Lark numbers
    # its states differently from build to build; numbered here in the order a walk from the start
    # state meets them, the same grammar always gives the same tables.
    number = {table.start_states["start"]: 0}
    order = [table.start_states["start"]]
    for state in order:
        for sym in sorted(table.states[state]):
            action, arg = table.states[state][sym]
            if action is Shift and arg not in number:
                number[arg] = len(order)
                order.append(arg)
    actions: list[dict[str, int]] = []
    for state in order:
        acts = {}
        for sym in sorted(table.states[state]):
            action, arg = table.states[state][sym]
            acts[str(sym)] = number[arg] if action is Shift else ~index[arg]
        actions.append(acts)
    terminals = {str(t.name): t for t in lark.terminals}
    literals = {str(t.pattern.value): str(t.name) for t in lark.terminals if t.pattern.type == "str"}
    word = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    order = [t.name for t in lark.parser.lexer.root_lexer.terminals]  # type: ignore[attr-defined]
    saved = io.BytesIO()
    lark.save(saved)
    return {
        "grammar": text,
        "lark_version": version,
        "actions": actions,
        "start": 0,
        "end": number[table.end_states["start"]],
        "rules": rules,
        "signatures": signatures,
        "ignore": [str(terminals[n].pattern.to_regexp()) for n in sorted(lark.lexer_conf.ignore)],
        "patterns": {n: str(t.pattern.to_regexp()) for n, t in terminals.items() if t.pattern.type == "re"},
        "keywords": {v: n for v, n in literals.items() if word.fullmatch(v)},
        "punct": {v: n for v, n in literals.items() if not word.fullmatch(v)},
        "float_first": order.index("FLOAT") < order.index("INT") if {"FLOAT", "INT"} <= set(order) else False,
        "lark": saved.getvalue(),
    }
