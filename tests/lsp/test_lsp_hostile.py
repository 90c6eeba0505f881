"""`meshc lsp` against a hostile (or buggy) client: broken framing, unreadable bodies, fields out of
range, requests about documents that are not open, a client that goes away while the server is busy.

The rule each table checks: every request is answered (a result, or a JSON-RPC error response;
id null where the message could not be read far enough to know its id), the server keeps
answering the requests that follow, and it exits when its stdin closes. The framing itself
(`FrameReader`) is checked in process; everything else over a real stdio connection, one server
process per table.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("pygls")

from lsp_client import Client, uri  # noqa: E402
from lsprotocol import types as lsp  # noqa: E402

from meshllm_dsl.lsp import transport  # noqa: E402
from meshllm_dsl.lsp.transport import Body, FrameReader, Problem  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "llama2_70b.mesh"
SMALL = "mesh m {\n    axes a = 2\n}\n"
NOT_OPEN = "file:///nowhere/not-open.mesh"


def frame(body: bytes | dict, length: int | None = None, header: bytes = b"Content-Length: %d\r\n\r\n") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (header % (len(data) if length is None else length) if b"%d" in header else header) + data


def request(rid: int, method: str = "textDocument/documentSymbol", params: object = None, **extra: object) -> dict:
    msg = {"jsonrpc": "2.0", "id": rid, "method": method,
           "params": params if params is not None else {"textDocument": {"uri": "file:///x.mesh"}}}
    return {**msg, **extra}


# -- the framing, in process

def _events(data: bytes, piece: int) -> list[Body | Problem]:
    reader = FrameReader()
    out: list[Body | Problem] = []
    for i in range(0, len(data), piece):
        out += reader.feed(data[i:i + piece])
    return out + reader.eof()


def _summary(events: list[Body | Problem]) -> list[str]:
    """Each event as `body:<json>` (`short:` when its framing was wrong), `problem` or `reply`."""
    out = []
    for e in events:
        if isinstance(e, Body):
            out.append(("short:" if e.problem else "body:") + e.data.decode("utf-8", "replace").strip())
        else:
            out.append("reply" if e.reply else "problem")
    return out


A, B = frame({"a": 1}), frame({"b": 2})
FRAMING = [
    ("two messages", A + B, ["body:{\"a\": 1}", "body:{\"b\": 2}"]),
    ("Content-Length 10**12", frame(b'{"x": 0}', 10**12) + A, ["reply", "body:{\"a\": 1}"]),
    ("a 5000-digit Content-Length", b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n{}" + A, ["reply", "body:{\"a\": 1}"]),
    ("Content-Length larger than the body", frame(b'{"s": 1}', 10_000) + A + B,
     ["short:{\"s\": 1}", "body:{\"a\": 1}", "body:{\"b\": 2}"]),
    ("Content-Length smaller than the body", frame(b'{"long": "xxxxxxxx"}', 8) + A,
     ["body:{\"long\":", "problem", "body:{\"a\": 1}"]),
    ("garbage lines before a header", b"hello\r\nnot a header\r\n" + A, ["problem", "body:{\"a\": 1}"]),
    ("garbage right before a header", b"}}" + A, ["problem", "body:{\"a\": 1}"]),
    ("a line inside the header that is not a header", b"Content-Length: 2\r\nbad line\r\n\r\n{}" + A,
     ["reply", "problem", "body:{\"a\": 1}"]),
    ("no empty line after the header", b"Content-Length: 8\r\n{\"a\": 1}" + B, ["reply", "problem", "body:{\"b\": 2}"]),
    ("two Content-Length lines", b"Content-Length: 99\r\n" + A, ["problem", "body:{\"a\": 1}"]),
    ("Content-Type first, lower case, LF only", b"Content-Type: application/vscode-jsonrpc; charset=utf-8\n"
     b"content-length:8\n\n{\"a\": 1}", ["body:{\"a\": 1}"]),
    # raw line breaks cannot occur in a JSON string: an escaped header inside one is text, not a header
    ("a header quoted inside a body", frame({"q": "\r\nContent-Length: 12\r\n\r\n"}) + A,
     ['body:{"q": "\\r\\nContent-Length: 12\\r\\n\\r\\n"}', "body:{\"a\": 1}"]),
    ("a header that never ends", b"Content-Length: 2\r\nX-Long: " + b"y" * (transport.MAX_HEADER_BYTES + 10) + b"\r\n\r\n{}" + A,
     ["reply", "problem", "body:{\"a\": 1}"]),
    ("kilobytes of garbage, no header", b"\x00\xff" * 20_000 + A, ["problem", "body:{\"a\": 1}"]),
    ("input ends inside a body", A + frame(b'{"cut', 100), ["body:{\"a\": 1}", "problem"]),
    ("input ends inside garbage", A + b"trailing", ["body:{\"a\": 1}", "problem"]),
]


@pytest.mark.parametrize(("data", "want"), [c[1:] for c in FRAMING], ids=[c[0] for c in FRAMING])
def test_framing_resynchronises_on_the_next_header(data: bytes, want: list[str]) -> None:
    # the same events whatever pieces the stream arrives in (here: one read, 7 bytes, one byte)
    for piece in (len(data), 7, 1):
        assert _summary(_events(data, piece)) == want, piece


def test_framing_holds_a_bounded_buffer_while_skipping() -> None:
    reader = FrameReader()
    reader.feed(b"Content-Length: 999999999999\r\n\r\n")
    for _ in range(20):  # 20 MiB of an oversized body, never held
        assert reader.feed(b"x" * 2**20) == []
        assert len(reader.buf) <= transport.MAX_HEADER_BYTES + 2**20
    assert _summary(reader.feed(A)) == ["body:{\"a\": 1}"]


# -- the wire: one server, a table of hostile messages, each followed by requests that must be answered

@pytest.fixture(scope="module")
def client():
    c = Client(cwd=ROOT)
    yield c
    c.close()


@pytest.fixture(scope="module")
def doc(client: Client, tmp_path_factory: pytest.TempPathFactory) -> str:
    u = client.open(tmp_path_factory.mktemp("hostile") / "open.mesh", SMALL)
    assert client.wait_diagnostics(u) == []
    return u


def _answered_after(client: Client, doc: str, n: int = 3) -> None:
    """`n` ordinary requests, each answered with the open document's outline."""
    ids = []
    for _ in range(n):
        rid = client.new_id()
        client._send(request(rid, params={"textDocument": {"uri": doc}}))
        ids.append(rid)
    for rid in ids:
        got = client.wait_response(rid, timeout=30)
        assert [s["name"] for s in got["result"]] == ["m"], got


# name, the bytes (`{id}` is the id of a request inside them, or None), what that request gets
# (None: not answerable, its id unreadable; "result"; or an error code), the codes of id-null errors
WIRE = [
    ("Content-Length 10**12", lambda i, d: frame(request(i, params={"textDocument": {"uri": d}}), 10**12), None, [-32600]),
    ("a 5000-digit Content-Length", lambda i, d: b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n{}", None, [-32600]),
    ("Content-Length larger than the body",
     lambda i, d: frame(request(i, params={"textDocument": {"uri": d}}), 100_000), "result", []),
    ("Content-Length smaller than the body", lambda i, d: frame(request(i), 30), None, [-32700]),
    ("garbage header lines", lambda i, d: b"hello\r\nnot: a header: really\r\n\x00\r\n\r\n"
     + frame(request(i, params={"textDocument": {"uri": d}})), "result", []),
    ("a line inside the header that is not a header",
     lambda i, d: b"Content-Length: 40\r\n== not a header ==\r\n\r\n" + json.dumps(request(i)).encode(), None, [-32600]),
    ("body not JSON", lambda i, d: frame(b"{this is not json}"), None, [-32700]),
    ("body not UTF-8", lambda i, d: frame(b'{"jsonrpc": "2.0", "id": 1, "method": "\xff\xfe"}'), None, [-32700]),
    ("empty body", lambda i, d: frame(b""), None, [-32700]),
    ("body a JSON array (a batch)", lambda i, d: frame(json.dumps([request(i)]).encode()), None, [-32600]),
    ("body a JSON string", lambda i, d: frame(b'"textDocument/hover"'), None, [-32600]),
    ("body a JSON number", lambda i, d: frame(b"42"), None, [-32600]),
    ("body null", lambda i, d: frame(b"null"), None, [-32600]),
    ("id an object", lambda i, d: frame({**request(i), "id": {"n": i}}), None, [-32600]),
    ("id a boolean", lambda i, d: frame({**request(i), "id": True}), None, [-32600]),
    ("id a float", lambda i, d: frame({**request(i), "id": 1.5}), None, [-32600]),
    ('"jsonrpc" 1.0', lambda i, d: frame(request(i, jsonrpc="1.0")), -32600, []),
    ('no "jsonrpc"', lambda i, d: frame({k: v for k, v in request(i).items() if k != "jsonrpc"}), -32600, []),
    ("method a number", lambda i, d: frame(request(i, method=5)), -32600, []),  # type: ignore[arg-type]
    ("neither method nor id", lambda i, d: frame({"jsonrpc": "2.0", "params": {}}), None, [-32600]),
    ("an unknown method", lambda i, d: frame(request(i, method="meshc/nothing")), -32601, []),
    ("an unknown method, no params", lambda i, d: frame({"jsonrpc": "2.0", "id": i, "method": "meshc/nothing"}), -32601, []),
    ("an unknown notification", lambda i, d: frame({"jsonrpc": "2.0", "method": "meshc/nothing"}), None, []),
    ("params missing", lambda i, d: frame({"jsonrpc": "2.0", "id": i, "method": "textDocument/hover"}), -32602, []),
    ("params an array", lambda i, d: frame(request(i, method="textDocument/hover", params=[1, 2])), -32602, []),
    ("a response to no request", lambda i, d: frame({"jsonrpc": "2.0", "id": 99_999, "result": None}), None, []),
    ("an error response to no request",
     lambda i, d: frame({"jsonrpc": "2.0", "id": 99_998, "error": {"code": 1, "message": "x"}}), None, []),
    ("a second initialize", lambda i, d: frame(request(i, method="initialize", params={"processId": None, "capabilities": {}})),
     -32600, []),
    ("an unknown command", lambda i, d: frame(request(i, method="workspace/executeCommand", params={"command": "rm -rf"})),
     -32602, []),
    ("didChange of a document not open", lambda i, d: frame({"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
        "textDocument": {"uri": NOT_OPEN, "version": 2}, "contentChanges": [{"text": "x"}]}}), None, []),
    ("didClose of a document not open", lambda i, d: frame({"jsonrpc": "2.0", "method": "textDocument/didClose",
                                                           "params": {"textDocument": {"uri": NOT_OPEN}}}), None, []),
    ("didChange with a negative range", lambda i, d: frame({"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
        "textDocument": {"uri": d, "version": 2},
        "contentChanges": [{"range": {"start": {"line": -1, "character": 0}, "end": {"line": 0, "character": -5}},
                            "text": "x"}]}}), None, []),
    ("didSave of a document not open", lambda i, d: frame({"jsonrpc": "2.0", "method": "textDocument/didSave",
                                                          "params": {"textDocument": {"uri": NOT_OPEN}}}), None, []),
    ("watched files that are not files", lambda i, d: frame({"jsonrpc": "2.0", "method": "workspace/didChangeWatchedFiles",
        "params": {"changes": [{"uri": "http://example.com/a.mesh", "type": 2}, {"uri": "", "type": 1}]}}), None, []),
    ("a notebook change for no notebook", lambda i, d: frame({"jsonrpc": "2.0", "method": "notebookDocument/didChange",
        "params": {"notebookDocument": {"uri": "file:///nb.ipynb", "version": 2}, "change": {
            "cells": {"textContent": [{"document": {"uri": NOT_OPEN, "version": 2}, "changes": [{"text": "x"}]}]}}}}),
     None, []),
    ("a notebook close for no notebook", lambda i, d: frame({"jsonrpc": "2.0", "method": "notebookDocument/didClose",
        "params": {"notebookDocument": {"uri": "file:///nb.ipynb"}, "cellTextDocuments": [{"uri": NOT_OPEN}]}}), None, []),
    ("a folder removed that was never added", lambda i, d: frame({
        "jsonrpc": "2.0", "method": "workspace/didChangeWorkspaceFolders", "params": {"event": {
            "added": [], "removed": [{"uri": "file:///nowhere", "name": "nowhere"}]}}}), None, []),
    ("a cancel for no request", lambda i, d: frame({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": 12345}}),
     None, []),
    ("didOpen with no text", lambda i, d: frame({"jsonrpc": "2.0", "method": "textDocument/didOpen",
                                                "params": {"textDocument": {"uri": NOT_OPEN}}}), None, []),
]


@pytest.mark.parametrize(("make", "answer", "unaddressed"), [c[1:] for c in WIRE], ids=[c[0] for c in WIRE])
def test_hostile_messages_are_answered_and_the_server_keeps_answering(
        client: Client, doc: str, make, answer, unaddressed: list[int]) -> None:
    before = len(client.unaddressed)
    rid = client.new_id()
    client.send_raw(make(rid, doc))
    _answered_after(client, doc)  # answered in order: whatever the hostile message gets came first
    got = [e["error"]["code"] for e in client.unaddressed[before:]]
    assert got == unaddressed
    assert all(e["error"]["message"] for e in client.unaddressed[before:])
    if answer is None:
        assert rid not in client.responses
    else:
        response = client.wait_response(rid, timeout=5)
        if answer == "result":
            assert "result" in response, response
        else:
            assert response["error"]["code"] == answer, response
            assert response["error"]["message"]
    # a notification the client could not have meant never becomes an error popup
    shown = []
    while not client.notes.empty():
        shown.append(client.notes.get())
    assert not [n for n in shown if n.get("method") == "window/showMessage"], shown
    assert client.proc.poll() is None


def test_content_length_larger_than_the_body_then_65_requests_all_answered(client: Client, doc: str) -> None:
    rid = client.new_id()
    client.send_raw(frame(request(rid, params={"textDocument": {"uri": doc}}), 2**20))
    _answered_after(client, doc, 65)
    assert "result" in client.wait_response(rid, timeout=5)
    assert any(b"announced 1048576 bytes but the next header came after" in line for line in client.stderr)


# -- every request the server registers, with each field a client can get wrong

def _registered_requests() -> set[str]:
    from meshllm_dsl.lsp.server import server

    fm = server.protocol.fm
    return {m for m in {*fm.features, *fm.builtin_features}
            if m in lsp.METHOD_TO_TYPES and lsp.METHOD_TO_TYPES[m][1] is not None}


def _pos(line: object = 0, character: object = 0) -> dict:
    return {"line": line, "character": character}


def _params(method: str, u: str, pos: dict) -> dict:
    doc = {"textDocument": {"uri": u}}
    if method == "textDocument/references":
        return {**doc, "position": pos, "context": {"includeDeclaration": True}}
    if method == "textDocument/codeAction":
        return {**doc, "range": {"start": pos, "end": pos}, "context": {"diagnostics": []}}
    if method == "textDocument/formatting":
        return {**doc, "options": {"tabSize": pos["line"], "insertSpaces": True}}
    if method == "textDocument/documentSymbol":
        return doc
    return {**doc, "position": pos}


POSITIONED = ["textDocument/hover", "textDocument/definition", "textDocument/references",
              "textDocument/completion", "textDocument/codeAction"]
DOCUMENT = [*POSITIONED, "textDocument/formatting", "textDocument/documentSymbol"]
# each hostile position: whether it is an error (outside LSP's uinteger) or a result (past the end: clamped)
POSITIONS = [
    ("negative line", _pos(-1, 0), "error"),
    ("negative character", _pos(0, -1), "error"),
    ("both negative", _pos(-5, -7), "error"),
    ("line past uinteger", _pos(2**31, 0), "error"),
    ("character a string", _pos(0, "x"), "error"),
    ("character a numeral", _pos(0, "3"), "error"),
    ("line a fraction", _pos(1.5, 0), "error"),
    ("line a boolean", _pos(True, 0), "error"),
    ("line null", _pos(None, 0), "error"),
    ("line past the end", _pos(10**6, 0), "result"),
    ("character past the end", _pos(0, 10**6), "result"),
    ("both past the end", _pos(2**31 - 1, 2**31 - 1), "result"),
]


def test_the_tables_cover_every_request_the_server_registers() -> None:
    # initialize, shutdown and executeCommand are in the lifecycle and wire tables
    assert _registered_requests() <= {*DOCUMENT, "initialize", "shutdown", "workspace/executeCommand"}


@pytest.mark.parametrize("method", DOCUMENT)
def test_every_bad_field_of_every_request_is_answered(client: Client, doc: str, method: str) -> None:
    for name, pos, want in POSITIONS:
        if method == "textDocument/formatting":
            # its only number is tabSize: the same range check; a huge one is a real (if odd) setting
            pos = _pos(pos["line"], 0)
            if pos["line"] == 0:
                continue
        if method == "textDocument/documentSymbol":
            continue
        got = client.call(method, _params(method, doc, pos), timeout=30)
        if want == "error":
            assert got.get("error", {}).get("code") == -32602, (name, got)
            field = "tab_size" if method == "textDocument/formatting" else ("line" if "line" in name or "both" in name
                                                                            else "character")
            assert method in got["error"]["message"] and field in got["error"]["message"], (name, got)
        else:
            assert "result" in got, (name, got)
    # cattrs alone would read the uri 5 as "5" and {"a": 1} as "{'a': 1}": a wrong type is an error
    for bad in ({"textDocument": None}, {"textDocument": {}}, {"textDocument": {"uri": {"a": 1}}},
                {"textDocument": {"uri": 5}}, None):
        params = {**_params(method, doc, _pos()), **bad} if bad is not None else None
        got = client.call(method, params, timeout=30)
        assert got.get("error", {}).get("code") == -32602 and got["error"]["message"], (bad, got)
    if method == "textDocument/references":  # bool("false") would be True
        got = client.call(method, {**_params(method, doc, _pos()), "context": {"includeDeclaration": "false"}})
        assert "expected true or false" in got["error"]["message"], got
    # a completion past the end of a line replaces up to where the line ends, not past it
    if method == "textDocument/completion":
        got = client.call(method, _params(method, doc, _pos(1, 10**6)))["result"]
        ends = {i["textEdit"]["range"]["end"]["character"] for i in got["items"] if i.get("textEdit")}
        assert ends <= {len("    axes a = 2")}


@pytest.mark.parametrize("method", DOCUMENT)
def test_a_request_about_a_document_not_open_gets_an_empty_result(client: Client, tmp_path: Path, method: str) -> None:
    # a file that exists on disk but is not open: pygls would read it, or raise FileNotFoundError into
    # the reply where it does not exist
    on_disk = tmp_path / "closed.mesh"
    on_disk.write_text("mesh  m{axes a=2}\n")
    for u in (NOT_OPEN, uri(on_disk), "untitled:Untitled-1", "not a uri at all"):
        got = client.call(method, _params(method, u, _pos(0, 1) if method != "textDocument/formatting" else _pos(4)))
        assert "error" not in got, got
        assert got["result"] in (None, [], {"isIncomplete": False, "items": []}), (u, got)
    # nor is the file on disk analysed (diagnostics published for a document the editor never opened)
    assert uri(on_disk) not in client.diagnostics
    assert not [line for line in client.stderr if b"Traceback" in line or b"FileNotFoundError" in line]


# -- the lifecycle: before initialize, after shutdown, and a client that goes away

def test_requests_before_initialize_and_after_shutdown_get_errors_and_stdin_closed_ends_it() -> None:
    c = Client(cwd=ROOT, initialize=False)
    try:
        got = c.call("textDocument/hover", {"textDocument": {"uri": NOT_OPEN}, "position": _pos()})
        assert got["error"]["code"] == -32002
        c.notify("textDocument/didOpen", {"textDocument": {"uri": NOT_OPEN, "languageId": "mesh", "version": 1,
                                                           "text": SMALL}})
        # a client that prefers UTF-8 columns still gets UTF-16, which is what the server counts in
        got = c.initialize({"general": {"positionEncodings": ["utf-8", "utf-16"]}})
        assert got["capabilities"]["positionEncoding"] == "utf-16"
        assert c.request("textDocument/documentSymbol", {"textDocument": {"uri": NOT_OPEN}}) == []  # not opened
        text = 'include "\U0001F600.mesh" include "x.mesh"\n'  # the emoji is 2 UTF-16 units, 4 UTF-8 bytes
        u = c.open(ROOT / "emoji.mesh", text)
        starts = sorted(d["range"]["start"]["character"] for d in c.wait_diagnostics(u))
        assert starts == [8, text.index('"x.mesh"') + 1]
        assert c.request("shutdown", None) is None
        # requests sent just before the client closes stdin are still answered (here: refused)
        ids = [c.new_id() for _ in range(20)]
        c.send_raw(b"".join(frame(request(i, params={"textDocument": {"uri": NOT_OPEN}})) for i in ids))
        # the client goes without `exit`: after a shutdown request that is a clean end (0)
        assert c.proc.stdin is not None
        c.proc.stdin.close()
        assert c.proc.wait(timeout=10) == 0
        c.reader.join(timeout=10)
        for i in ids:
            got = c.responses[i]
            assert got["error"]["code"] == -32600 and "shutting down" in got["error"]["message"]
    finally:
        if c.proc.poll() is None:
            c.proc.kill()


def _big() -> str:
    # tens of seconds of checking: far longer than the server may take to notice its client is gone
    return LLAMA.read_text() + "".join(f"mesh m{i} {{ axes a = {i % 8 + 1} }}\n" for i in range(48_000))


@pytest.mark.parametrize("busy", ["analysis thread", "event loop"])
def test_the_server_exits_when_its_stdin_closes_while_busy(tmp_path: Path, busy: str) -> None:
    c = Client(cwd=ROOT)
    try:
        if busy == "analysis thread":  # the document is checked off the event loop
            c.open(tmp_path / "big.mesh", _big())
        else:  # a hover on changed text checks it on the loop, at once
            u = c.open(tmp_path / "a.mesh", SMALL)
            c.notify("textDocument/didChange", {"textDocument": {"uri": u, "version": 2},
                                                "contentChanges": [{"text": _big()}]})
            c._send(request(c.new_id(), method="textDocument/hover",
                            params={"textDocument": {"uri": u}, "position": _pos()}))
        time.sleep(0.5)  # the analysis is under way
        assert c.proc.poll() is None
        closed = time.monotonic()
        assert c.proc.stdin is not None
        c.proc.stdin.close()
        try:
            code = c.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 10 s after its stdin closed ({busy})")
        took = time.monotonic() - closed
        assert took < 3, took
        assert code == 1  # no shutdown request came first: as for an `exit` without one
    finally:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()
