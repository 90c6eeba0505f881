"""The pygls wiring: LSP requests in, `analysis` answers out, over stdio.

Each open document keeps its latest `Analysis` (what is published) and the latest one that
understood the file's declarations (what completion falls back on while the text does not parse).
Changes are debounced: typing schedules one analysis a short pause after the last keystroke (twice
the document's last analysis time, between DEBOUNCE_MIN_S and DEBOUNCE_MAX_S, so a spec that
checks in 10 ms shows its diagnostics well under 100 ms while a huge one is not re-checked on every
keystroke); open and save analyse at once. Nothing a document contains may stop the server: any failure of the front end
becomes a diagnostic on the document. Nothing a client sends may stop it either: `transport` frames,
decodes and checks every message (pygls' own stdio loop is not used), a request about a document
that is not open gets an empty result, and the server exits when its stdin closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import attrs
from lsprotocol import types as lsp
from pygls.lsp.server import LanguageServer
from pygls.uris import from_fs_path, to_fs_path

from meshllm_dsl import __version__
from meshllm_dsl.diagnostics import Diagnostic, Label
from meshllm_dsl.front.load import PRELUDE
from meshllm_dsl.lsp import completion
from meshllm_dsl.lsp.analysis import Analysis, Loc, span_loc

DEBOUNCE_MIN_S, DEBOUNCE_MAX_S = 0.03, 0.3
SOURCE = "meshc"
# Larger documents are not analysed: a .mesh spec is a few hundred lines; megabytes are a mistake
# (a binary, a generated blob) that must not freeze the editor.
MAX_BYTES = 8 * 2**20

log = logging.getLogger("meshllm.lsp")

_KIND = {
    "mesh": lsp.SymbolKind.Namespace, "model": lsp.SymbolKind.Class, "family": lsp.SymbolKind.Interface,
    "plan": lsp.SymbolKind.Module, "device": lsp.SymbolKind.Object, "include": lsp.SymbolKind.File,
    "axis": lsp.SymbolKind.Field, "layer": lsp.SymbolKind.Property, "param": lsp.SymbolKind.TypeParameter,
    "shard": lsp.SymbolKind.Event, "stages": lsp.SymbolKind.Array,
}
_COMPLETION_KIND = {
    "keyword": lsp.CompletionItemKind.Keyword, "axis": lsp.CompletionItemKind.EnumMember,
    "path": lsp.CompletionItemKind.Field, "family": lsp.CompletionItemKind.Class,
    "param": lsp.CompletionItemKind.Property, "device": lsp.CompletionItemKind.Value,
    "rule": lsp.CompletionItemKind.Function, "schedule": lsp.CompletionItemKind.EnumMember,
    "value": lsp.CompletionItemKind.Value, "mesh": lsp.CompletionItemKind.Module,
    "model": lsp.CompletionItemKind.Class, "function": lsp.CompletionItemKind.Function,
    "dim": lsp.CompletionItemKind.Variable, "layer": lsp.CompletionItemKind.Field,
}


def _run(path: str, text: str) -> tuple[Analysis | str, float]:
    """Analyse a text (on the analysis thread or the loop): the analysis, or why there is none, and
    the seconds it took. Nothing a document holds may escape as an exception."""
    started = time.perf_counter()
    try:
        if len(text) > MAX_BYTES:
            return (f"the document is too large to analyse ({len(text) / 2**20:.0f} MiB; "
                    f"the language server stops at {MAX_BYTES // 2**20} MiB)"), 0.0
        return Analysis(path, text), time.perf_counter() - started
    except RecursionError:
        return "the document nests too deeply to analyse", time.perf_counter() - started
    except Exception as err:  # noqa: BLE001 - a spec must never take the server down
        log.error("analysis failed: %s", traceback.format_exc())
        return f"internal error in meshc ({type(err).__name__}: {err}); please report it", time.perf_counter() - started


class MeshServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__("meshc-lsp", __version__)
        self.analyses: dict[str, Analysis] = {}
        self.understood: dict[str, Analysis] = {}  # last analysis that saw the file's declarations
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.published: dict[str, set[str]] = {}  # root uri -> other uris it published to (includes)
        self.cost: dict[str, float] = {}  # seconds the last analysis of each document took
        self.open: set[str] = set()
        # One analysis thread: the event loop keeps reading messages and answering requests about
        # other documents while a large spec is checked (the analyses themselves run one at a time).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshc-analysis")
        self.jobs: dict[str, tuple[str, asyncio.Future[tuple[Analysis | str, float]]]] = {}

    # -- analysis
    def analyse(self, uri: str, force: bool = False) -> None:
        """Start analysing the document's current text on the analysis thread; publish when done."""
        pending = self.timers.pop(uri, None)
        if pending is not None:
            pending.cancel()  # this analysis serves the pending one too
        text = self.text_of(uri)
        if text is None:
            return
        if not force and uri in self.analyses and self.analyses[uri].text == text:
            return  # e.g. a save right after the debounced analysis of the same text
        job = self.jobs.get(uri)
        if job is not None and job[0] == text and not force:
            return  # already under way
        future = asyncio.get_running_loop().run_in_executor(self.executor, _run, to_fs_path(uri) or uri, text)
        self.jobs[uri] = (text, future)
        future.add_done_callback(lambda f: self.finish(uri, text, f, force))

    def finish(self, uri: str, text: str, future: asyncio.Future[tuple[Analysis | str, float]], force: bool) -> None:
        """Back on the event loop: keep and publish a finished analysis if its text is still current."""
        if self.jobs.get(uri, (None, None))[1] is future:
            del self.jobs[uri]
        if future.cancelled() or uri not in self.open or self.text_of(uri) != text:
            return  # closed or edited meanwhile: a newer analysis is scheduled
        if not force and uri in self.analyses and self.analyses[uri].text == text:
            return  # a request analysed this text first (`current`) and published it
        result, cost = future.result()
        self.cost[uri] = cost
        self.accept(uri, text, result)

    def accept(self, uri: str, text: str, result: Analysis | str) -> None:
        if isinstance(result, str):
            self.publish_failure(uri, result, text)
            return
        self.analyses[uri] = result
        if result.usable:
            self.understood[uri] = result
        self.publish(uri, result)

    def text_of(self, uri: str) -> str | None:
        """The open document's text; None for a document that is not open (pygls would read a file
        of that name from disk, or raise FileNotFoundError into the reply)."""
        if uri not in self.open:
            return None
        try:
            return self.workspace.get_text_document(uri).source
        except Exception:  # noqa: BLE001 - the document was closed meanwhile
            return None

    def is_open(self, uri: str, method: str) -> bool:
        """Whether a request is about an open document; one that is not gets an empty result."""
        if uri in self.open:
            return True
        log.warning("%s about %s, which is not open: empty result", method, uri[:200])
        return False

    def publish_failure(self, uri: str, message: str, text: str) -> None:
        self.analyses.pop(uri, None)
        end = lsp.Position(line=0, character=min(len(text.split("\n", 1)[0]), 200))
        d = lsp.Diagnostic(range=lsp.Range(start=lsp.Position(line=0, character=0), end=end), message=message,
                           severity=lsp.DiagnosticSeverity.Error, source=SOURCE, code="E0000")
        self.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(uri=uri, diagnostics=[d]))

    def publish(self, uri: str, a: Analysis) -> None:
        by_file = a.diagnostics_by_file()
        others: set[str] = set()
        # An error found in the shipped prelude (a family default that does not divide for this
        # model's dims) is this document's problem: show it where the document is involved.
        moved = [rehome(d, a.path) for d in by_file.pop("<stdlib>/" + PRELUDE, [])]
        by_file[a.path].extend(moved)
        for file, diags in by_file.items():
            target = uri if file == a.path else from_fs_path(file) or file
            if target != uri:
                if target in self.analyses:
                    continue  # an open document publishes its own diagnostics
                others.add(target)
            self.text_document_publish_diagnostics(
                lsp.PublishDiagnosticsParams(uri=target, diagnostics=[to_lsp(d, d in moved) for d in diags]))
        for stale in self.published.get(uri, set()) - others:
            if stale not in self.analyses:
                self.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(uri=stale, diagnostics=[]))
        self.published[uri] = others

    def refresh_includers(self, path: str) -> None:
        """Analyse again every open document that includes `path` (includes are read from disk)."""
        import os

        target = os.path.realpath(path)
        for uri, a in list(self.analyses.items()):
            if a.path != path and any(os.path.realpath(s.path) == target for s in a.decls.sources[1:]):
                self.analyse(uri, force=True)

    def schedule(self, uri: str) -> None:
        old = self.timers.pop(uri, None)
        if old is not None:
            old.cancel()
        delay = min(DEBOUNCE_MAX_S, max(DEBOUNCE_MIN_S, 2 * self.cost.get(uri, DEBOUNCE_MAX_S)))
        self.timers[uri] = asyncio.get_running_loop().call_later(delay, self.analyse, uri)

    def current(self, uri: str) -> Analysis | None:
        """The analysis of the document's text as it is now: a request about a position needs the
        text the client sees, so when the kept analysis is older it is redone here, at once."""
        text = self.text_of(uri)
        a = self.analyses.get(uri)
        if text is None or (a is not None and a.text == text):
            return a
        timer = self.timers.pop(uri, None)
        if timer is not None:
            timer.cancel()
        result, cost = _run(to_fs_path(uri) or uri, text)
        self.cost[uri] = cost
        self.accept(uri, text, result)
        return self.analyses.get(uri)

    def best(self, uri: str) -> Analysis | None:
        """The current analysis when it understood the file, else the last one that did."""
        a = self.current(uri)
        if a is not None and a.usable:
            return a
        return self.understood.get(uri) or a


def rehome(d: Diagnostic, path: str) -> Diagnostic:
    """`d` moved onto its first label in `path`, its own place kept as a label (see `publish`)."""
    here = next((lab for lab in d.secondary if lab.span.file == path), None)
    if here is None or d.span is None:
        return attrs.evolve(d, span=None)
    rest = tuple(lab for lab in d.secondary if lab is not here)
    return attrs.evolve(d, span=here.span, label=here.message,
                        secondary=(Label(d.span, d.label or "here"), *rest))


def to_range(loc: Loc) -> lsp.Range:
    return lsp.Range(start=lsp.Position(line=loc.start[0], character=loc.start[1]),
                     end=lsp.Position(line=loc.end[0], character=loc.end[1]))


def to_location(loc: Loc) -> lsp.Location:
    return lsp.Location(uri=from_fs_path(loc.file) or loc.file, range=to_range(loc))


def to_lsp(d: Diagnostic, moved: bool = False) -> lsp.Diagnostic:
    rng = to_range(span_loc(d.span)) if d.span is not None else lsp.Range(
        start=lsp.Position(line=0, character=0), end=lsp.Position(line=0, character=0))
    message = d.message
    if d.label:  # the caret's label in `meshc check`; an editor has only the message to show it
        message += f": {d.label}"
    if d.note:
        message += f"\nnote: {d.note}"
    if d.help:
        message += f"\nhelp: {d.help}"
    related = [lsp.DiagnosticRelatedInformation(location=to_location(span_loc(lab.span)), message=lab.message)
               for lab in d.secondary]
    return lsp.Diagnostic(
        range=rng, message=message, code=d.code, source=SOURCE,
        severity=lsp.DiagnosticSeverity.Error if d.is_error else lsp.DiagnosticSeverity.Warning,
        related_information=related or None,
        code_description=None,
        # `moved`: found in the prelude, shown here (its own place is the first related location)
        data={"help": d.help, "moved": moved} if d.help or moved else None,
    )


server = MeshServer()


def _offset(a: Analysis, pos: lsp.Position) -> int:
    return a.lines.offset((pos.line, pos.character))


def _position(pos: tuple[int, int]) -> lsp.Position:
    return lsp.Position(line=pos[0], character=pos[1])


@server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: MeshServer, params: lsp.DidOpenTextDocumentParams) -> None:
    ls.open.add(params.text_document.uri)
    ls.analyse(params.text_document.uri, force=True)


@server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: MeshServer, params: lsp.DidChangeTextDocumentParams) -> None:
    ls.schedule(params.text_document.uri)


@server.feature(lsp.TEXT_DOCUMENT_DID_SAVE)
def did_save(ls: MeshServer, params: lsp.DidSaveTextDocumentParams) -> None:
    ls.analyse(params.text_document.uri)
    ls.refresh_includers(to_fs_path(params.text_document.uri) or "")


@server.feature(lsp.WORKSPACE_DID_CHANGE_WATCHED_FILES)
def watched_files(ls: MeshServer, params: lsp.DidChangeWatchedFilesParams) -> None:
    for change in params.changes:
        ls.refresh_includers(to_fs_path(change.uri) or "")


@server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: MeshServer, params: lsp.DidCloseTextDocumentParams) -> None:
    uri = params.text_document.uri
    ls.open.discard(uri)
    timer = ls.timers.pop(uri, None)
    if timer is not None:
        timer.cancel()
    ls.analyses.pop(uri, None)
    ls.understood.pop(uri, None)
    for other in [uri, *ls.published.pop(uri, set())]:
        ls.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(uri=other, diagnostics=[]))


@server.feature(lsp.TEXT_DOCUMENT_DOCUMENT_SYMBOL)
def document_symbol(ls: MeshServer, params: lsp.DocumentSymbolParams) -> list[lsp.DocumentSymbol]:
    if not ls.is_open(params.text_document.uri, lsp.TEXT_DOCUMENT_DOCUMENT_SYMBOL):
        return []
    a = ls.best(params.text_document.uri)
    if a is None:
        return []
    out = []
    for kind, name, whole, sel, children in a.symbols():
        out.append(lsp.DocumentSymbol(
            name=name, kind=_KIND.get(kind, lsp.SymbolKind.Object), detail=kind,
            range=to_range(span_loc(whole)), selection_range=to_range(span_loc(sel)),
            children=[lsp.DocumentSymbol(name=cn, kind=_KIND.get(ck, lsp.SymbolKind.Object), detail=ck,
                                         range=to_range(span_loc(cw)), selection_range=to_range(span_loc(cs)))
                      for ck, cn, cw, cs in children]))
    return out


@server.feature(lsp.TEXT_DOCUMENT_FORMATTING)
def formatting(ls: MeshServer, params: lsp.DocumentFormattingParams) -> list[lsp.TextEdit] | None:
    from meshllm_dsl.diagnostics import SpecError
    from meshllm_dsl.front.fmt import format_text

    uri = params.text_document.uri
    text = ls.text_of(uri) if ls.is_open(uri, lsp.TEXT_DOCUMENT_FORMATTING) else None
    if text is None:
        return None
    try:
        formatted = format_text(text, to_fs_path(uri) or uri)
    except (SpecError, RecursionError):
        return None  # a file that does not parse is left as it is; its diagnostic says why
    if formatted == text:
        return []
    lines = text.split("\n")
    end = lsp.Position(line=len(lines) - 1, character=len(lines[-1].encode("utf-16-le")) // 2)
    return [lsp.TextEdit(range=lsp.Range(start=lsp.Position(line=0, character=0), end=end), new_text=formatted)]


@server.feature(lsp.TEXT_DOCUMENT_HOVER)
def hover(ls: MeshServer, params: lsp.HoverParams) -> lsp.Hover | None:
    if not ls.is_open(params.text_document.uri, lsp.TEXT_DOCUMENT_HOVER):
        return None
    a = ls.current(params.text_document.uri)
    if a is None:
        return None
    got = a.hover(_offset(a, params.position))
    if got is None:
        return None
    text, span = got
    return lsp.Hover(contents=lsp.MarkupContent(kind=lsp.MarkupKind.Markdown, value=text), range=to_range(span_loc(span)))


@server.feature(lsp.TEXT_DOCUMENT_DEFINITION)
def definition(ls: MeshServer, params: lsp.DefinitionParams) -> list[lsp.Location]:
    if not ls.is_open(params.text_document.uri, lsp.TEXT_DOCUMENT_DEFINITION):
        return []
    a = ls.current(params.text_document.uri)
    if a is None:
        return []
    return [to_location(loc) for loc in a.definition(_offset(a, params.position))]


@server.feature(lsp.TEXT_DOCUMENT_REFERENCES)
def references(ls: MeshServer, params: lsp.ReferenceParams) -> list[lsp.Location]:
    if not ls.is_open(params.text_document.uri, lsp.TEXT_DOCUMENT_REFERENCES):
        return []
    a = ls.current(params.text_document.uri)
    if a is None:
        return []
    return [to_location(loc) for loc in a.references(_offset(a, params.position), params.context.include_declaration)]


@server.feature(lsp.TEXT_DOCUMENT_COMPLETION,
                # Word characters trigger completion anyway; these start a new context (a path
                # segment, a rule's axes, the next axis). A space would pop the list at every word.
                lsp.CompletionOptions(trigger_characters=[".", "(", ","]))
def complete(ls: MeshServer, params: lsp.CompletionParams) -> lsp.CompletionList:
    uri = params.text_document.uri
    now = ls.current(uri) if ls.is_open(uri, lsp.TEXT_DOCUMENT_COMPLETION) else None
    known = ls.best(uri) if now is not None else None
    if now is None or known is None:
        return lsp.CompletionList(is_incomplete=False, items=[])
    # The context is the text as it is now; the candidates come from the last analysis that understood it.
    offset = _offset(now, params.position)
    # a position past the end of its line or of the document counts as that end (as LSP says)
    cursor = _position(now.lines.position(offset))
    view = _View(known, now.text)
    items = []
    for it in completion.complete(view, offset):  # type: ignore[arg-type]
        edit = None
        if it.replace_from is not None:
            edit = lsp.TextEdit(range=lsp.Range(start=_position(now.lines.position(it.replace_from)), end=cursor),
                                new_text=it.insert or it.label)
        items.append(lsp.CompletionItem(
            label=it.label, kind=_COMPLETION_KIND.get(it.kind, lsp.CompletionItemKind.Text), detail=it.detail or None,
            insert_text=None if edit else it.insert, text_edit=edit,
            filter_text=None if edit is None else now.text[it.replace_from:offset] + it.label))  # type: ignore[index]
    return lsp.CompletionList(is_incomplete=False, items=items)


class _View:
    """An analysis with the text replaced by the document's current text (completion reads both)."""

    def __init__(self, a: Analysis, text: str) -> None:
        self._a = a
        self.text = text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._a, name)


@server.feature(lsp.TEXT_DOCUMENT_CODE_ACTION,
                lsp.CodeActionOptions(code_action_kinds=[lsp.CodeActionKind.QuickFix]))
def code_action(ls: MeshServer, params: lsp.CodeActionParams) -> list[lsp.CodeAction]:
    uri = params.text_document.uri
    a = ls.current(uri) if ls.is_open(uri, lsp.TEXT_DOCUMENT_CODE_ACTION) else None
    if a is None:
        return []
    lo = _offset(a, params.range.start)
    hi = _offset(a, params.range.end)
    out = []
    for d in a.diagnostics:
        if d.span is None or d.span.file != a.path or d.span.end < lo or d.span.start > hi:
            continue
        for fix in a.fixes(d):
            changes: dict[str, list[lsp.TextEdit]] = {}
            for loc, text in fix.edits:
                changes.setdefault(from_fs_path(loc.file) or loc.file, []).append(
                    lsp.TextEdit(range=to_range(loc), new_text=text))
            out.append(lsp.CodeAction(
                title=fix.title, kind=lsp.CodeActionKind.QuickFix, diagnostics=[to_lsp(d)],
                is_preferred=fix.preferred or None, edit=lsp.WorkspaceEdit(changes=changes)))
    return out


_EDITS = (lsp.TEXT_DOCUMENT_DID_CHANGE, lsp.TEXT_DOCUMENT_DID_SAVE, lsp.TEXT_DOCUMENT_DID_CLOSE)


def _screen(method: str, params: Any) -> str | None:
    """Each message before pygls handles it (see `transport.Dispatcher`)."""
    if method == lsp.INITIALIZE and params.capabilities.general is not None:
        # Every column here is counted in UTF-16 units (analysis.LineIndex); pygls would agree to
        # the client's first choice (Neovim offers UTF-8 first) and every column past a non-ASCII
        # character would be off. UTF-16 is what every client must support.
        params.capabilities.general.position_encodings = None
    # An edit, save or close of a document that was never opened makes pygls raise (KeyError)
    # and show the client an error popup: dropped with a line in the log.
    if method in _EDITS and params.text_document.uri not in server.open:
        return f"{params.text_document.uri[:200]} is not open"
    if (method == lsp.NOTEBOOK_DOCUMENT_DID_CHANGE
            and server.workspace.get_notebook_document(notebook_uri=params.notebook_document.uri) is None):
        return f"notebook {params.notebook_document.uri[:200]} is not open"
    return None


def serve() -> NoReturn:
    from meshllm_dsl.lsp.transport import serve_stdio

    logging.basicConfig(level=logging.WARNING)  # to stderr: stdout carries the protocol
    serve_stdio(server.protocol, _screen)
