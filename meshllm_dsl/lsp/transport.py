"""The stdio transport of `meshc lsp`: Content-Length framing that a client's mistakes cannot wedge.

pygls' own stdio loop trusts the header: `Content-Length: 10**12` asks `read` for a terabyte (the
server dies), and a length larger than the body makes it swallow every later message into that
body (the server lives on, deaf). Here what a header may announce is bounded, and the reader
resynchronises on the next header instead:

- a body is read as it arrives, never more than MAX_BODY_BYTES, and never past the next
  `Content-Length: N` line: such a line (with its raw line break) cannot occur inside a JSON text
  (raw line breaks are not allowed inside JSON strings, and the word outside one is not JSON), so
  finding it inside a declared body means the body was shorter than announced;
- bytes that are not a header before a header are skipped, and said so;
- a message announced larger than MAX_BODY_BYTES is skipped up to the next header.

Every problem is one line on stderr (stdout carries the protocol). `FrameReader` is the framing
alone (bytes in, bodies and problems out), so it can be tested without a process. `Dispatcher`
decodes and type-checks each body before pygls handles it, so that every request is answered;
`serve_stdio` runs both and exits when stdin closes, without waiting on a running analysis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import attrs
import cattrs
from pygls.exceptions import JsonRpcException
from pygls.io_ import StdoutWriter
from pygls.protocol import JsonRPCProtocol
from pygls.protocol.json_rpc import JsonRPCNotification, JsonRPCRequestMessage

# A spec is a few hundred lines and the server refuses to analyse one over 8 MiB (server.MAX_BYTES);
# JSON escaping can grow a text several times over. Past this a message is a client bug.
MAX_BODY_BYTES = 64 * 2**20
# The header lines after Content-Length (in practice one Content-Type line) are short.
MAX_HEADER_BYTES = 8 * 2**10
# Enough of a buffer's tail to keep a header that arrives split over two reads.
_TAIL = 256
_CONTENT_LENGTH = re.compile(rb"content-length[ \t]*:[ \t]*(\d+)[ \t]*\r?\n", re.IGNORECASE)
_CONTENT_LENGTH_NAME = re.compile(rb"content-length[ \t]*:", re.IGNORECASE)
_HEADER_LINE = re.compile(rb"[A-Za-z0-9!#$%&'*+.^_`|~-]+[ \t]*:[^\r\n]*\r?")  # an RFC 9110 token, a colon
_DIGITS = len(str(MAX_BODY_BYTES)) + 1


@attrs.frozen
class Body:
    """A message body to decode; `problem` says what was wrong with its framing, if anything."""

    data: bytes
    problem: str | None = None


@attrs.frozen
class Problem:
    """A framing problem with no body to answer (logged; `reply` when the client gets an error)."""

    message: str
    reply: bool = False


def _show(data: bytes, limit: int = 60) -> str:
    return repr(bytes(data[:limit])) + ("..." if len(data) > limit else "")


class FrameReader:
    """Content-Length framing over a byte stream fed in pieces of any size."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.length: int | None = None  # the body being read; None while reading headers
        self.scanned = 0  # where the next search for a header starts (the tail is searched again)
        self.skipped = 0  # bytes skipped since the last header
        self.skipped_head = b""  # how the skipped bytes began (for the log)
        self.oversize = False  # the bytes being skipped are the body of a message that was too large

    def feed(self, data: bytes) -> list[Body | Problem]:
        self.buf += data
        out: list[Body | Problem] = []
        while self._step(out):
            pass
        return out

    def eof(self) -> list[Body | Problem]:
        out: list[Body | Problem] = []
        if self.length is not None:
            out.append(Problem(f"the input ended inside a message body ({len(self.buf)} of the "
                               f"{self.length} bytes its Content-Length announced)"))
        else:
            self._skip(len(self.buf))
            if self.skipped:
                out.append(Problem(f"the input ended after {self.skipped} bytes that are not a message "
                                   f"(they began {_show(self.skipped_head)})"))
        self.buf.clear()
        return out

    def _skip(self, n: int) -> None:
        """Drop `n` bytes off the buffer, counting them unless they are blank or an oversized body."""
        if not self.oversize and bytes(self.buf[:n]).strip():
            if not self.skipped:
                self.skipped_head = bytes(self.buf[:min(n, 61)])
            self.skipped += n
        del self.buf[:n]
        self.scanned = 0

    def _step(self, out: list[Body | Problem]) -> bool:
        """Take one thing off the buffer; False when more input is needed."""
        if self.length is not None:
            return self._body(out)
        m = self._header()
        if m is None:
            if self.scanned > MAX_HEADER_BYTES:  # what lies before `scanned` holds no header
                self._skip(self.scanned)
            return False
        if m.start() > 0:
            before = bytes(self.buf[:m.start()])
            # Other headers (Content-Type) may come first; they carry nothing this server uses.
            if all(not line.strip() or _HEADER_LINE.fullmatch(line) for line in before.split(b"\n")):
                del self.buf[:m.start()]
                self.scanned = 0
            else:
                self._skip(m.start())
            return True
        if self.skipped:
            out.append(Problem(f"skipped {self.skipped} bytes that are not a message header "
                               f"(they began {_show(self.skipped_head)})"))
        self.skipped, self.oversize = 0, False
        digits = m.group(1).lstrip(b"0") or b"0"
        announced = int(digits[:_DIGITS])
        # The header block ends at an empty line; other header lines may come before it.
        pos = m.end()
        while True:
            nl = self.buf.find(b"\n", pos)
            if nl < 0:
                if len(self.buf) - pos > MAX_HEADER_BYTES:
                    out.append(Problem(f"a message header has no end after {MAX_HEADER_BYTES} bytes; skipped",
                                       reply=True))
                    del self.buf[:m.end()]
                    return True
                return False
            if nl - m.end() > MAX_HEADER_BYTES:
                out.append(Problem(f"a message header has no end after {MAX_HEADER_BYTES} bytes; skipped",
                                   reply=True))
                del self.buf[:m.end()]
                return True
            line = bytes(self.buf[pos:nl + 1])
            if not line.strip():
                break
            if _CONTENT_LENGTH.fullmatch(line):
                out.append(Problem(f"a header announcing {digits.decode()} bytes is followed by another "
                                   "Content-Length before its empty line; the first is ignored"))
                del self.buf[:pos]
                return True
            if not _HEADER_LINE.fullmatch(line.rstrip(b"\n")):
                out.append(Problem(f"a message header holds a line that is not a header, {_show(line)}; "
                                   "the message is skipped", reply=True))
                del self.buf[:pos]
                return True
            pos = nl + 1
        del self.buf[:nl + 1]
        if len(digits) > _DIGITS or announced > MAX_BODY_BYTES:
            shown = digits.decode() if len(digits) <= 30 else f"a {len(digits)}-digit number of"
            out.append(Problem(f"a message announces {shown} bytes (Content-Length); the limit is "
                               f"{MAX_BODY_BYTES // 2**20} MiB: skipped up to the next header", reply=True))
            self.oversize = True
            return True
        self.length = announced
        return True

    def _header(self) -> re.Match[bytes] | None:
        """The first complete Content-Length line in the buffer; None (and `scanned` set where to
        look next) while there is none."""
        while True:
            name = _CONTENT_LENGTH_NAME.search(self.buf, self.scanned)
            if name is None:
                self.scanned = max(self.scanned, len(self.buf) - _TAIL)
                return None
            m = _CONTENT_LENGTH.match(self.buf, name.start())
            if m is not None:
                return m
            if self.buf.find(b"\n", name.end()) < 0 and len(self.buf) - name.start() <= MAX_HEADER_BYTES:
                self.scanned = name.start()  # its line has not all arrived
                return None
            self.scanned = name.end()  # "Content-Length:" not followed by a number: not a header

    def _body(self, out: list[Body | Problem]) -> bool:
        assert self.length is not None
        # A header that starts inside the announced body: the body was shorter than announced.
        m = _CONTENT_LENGTH.search(self.buf, self.scanned, min(len(self.buf), self.length + _TAIL))
        if m is not None and m.start() < self.length:
            out.append(Body(bytes(self.buf[:m.start()]),
                            f"a message announced {self.length} bytes but the next header came after "
                            f"{m.start()}; read it as {m.start()} bytes"))
            del self.buf[:m.start()]
        elif len(self.buf) >= self.length:
            out.append(Body(bytes(self.buf[:self.length])))
            del self.buf[:self.length]
        else:
            self.scanned = max(0, len(self.buf) - _TAIL)
            return False
        self.length, self.scanned = None, 0
        return True


# JSON-RPC 2.0 and LSP error codes
PARSE_ERROR, INVALID_REQUEST, INVALID_PARAMS = -32700, -32600, -32602
SERVER_NOT_INITIALIZED = -32002
# After the client closes stdin the server still answers what it had read (a client may send its
# requests and close stdin before reading the answers), but no one message gets longer than
# EXIT_GRACE_S (an analysis on the event loop), nor all of them together longer than EXIT_LIMIT_S.
EXIT_GRACE_S, EXIT_LIMIT_S = 0.5, 2.0

log = logging.getLogger("meshllm.lsp")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def strict_scalars(converter: cattrs.Converter) -> None:
    """Make the converter refuse a JSON value of the wrong type where cattrs would coerce it
    (`str({"a": 1})` as a uri, `int("7")` as a line, `bool("false")` as True)."""

    def string(value: Any, _: Any) -> str:
        if isinstance(value, str):
            return value
        raise TypeError(f"expected a string, got {_kind(value)}")

    def integer(value: Any, _: Any) -> int:
        if type(value) is int:
            return value
        if type(value) is float and value.is_integer():
            return int(value)
        raise TypeError(f"expected an integer, got {_kind(value)} ({json.dumps(value)[:40]})")

    def number(value: Any, _: Any) -> float:
        if type(value) in (int, float):
            return float(value)
        raise TypeError(f"expected a number, got {_kind(value)}")

    def boolean(value: Any, _: Any) -> bool:
        if type(value) is bool:
            return value
        raise TypeError(f"expected true or false, got {_kind(value)} ({json.dumps(value)[:40]})")

    for kind, hook in ((str, string), (int, integer), (float, number), (bool, boolean)):
        converter.register_structure_hook(kind, hook)


def _field_errors(err: BaseException) -> str:
    """What was wrong with a message's fields, one `path: why` per field (cattrs' own paths)."""

    def why(exc: BaseException, type_: Any) -> str:
        if type(exc) is ValueError and type_ is None:  # an lsprotocol validator (a uinteger's range)
            return str(exc).rstrip(".")
        if type(exc) is TypeError:  # `strict_scalars`
            return str(exc)
        return cattrs.v.format_exception(exc, type_)

    try:
        return "; ".join(cattrs.transform_error(err, path="$", format_exception=why))
    except Exception:  # noqa: BLE001 - a description must not fail where the error is the client's
        return f"{type(err).__name__}: {err}"


class Dispatcher:
    """Decodes message bodies and hands them to a pygls protocol, so that every request is answered:
    where pygls drops a message it cannot read (a body that is not JSON, fields of the wrong type),
    the client gets an error response (with the request's id where it has one, else id null)."""

    def __init__(self, protocol: JsonRPCProtocol, screen: Callable[[str, Any], str | None] | None = None) -> None:
        self.protocol = protocol
        # `screen(method, params)` sees each message pygls is about to handle: it may adjust the
        # params, or name a reason to refuse the message (a notification is then dropped: an edit
        # to a document that is not open, which pygls would turn into an error popup).
        self.screen = screen
        self.initialized = False

    def error(self, msg_id: int | str | None, code: int, message: str) -> None:
        log.warning("%s", message)
        # written as a plain object: the converter would drop `"id": null`, which JSON-RPC requires
        self.protocol._send_data({"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}})

    def problem(self, p: Problem) -> None:
        if p.reply:
            self.error(None, INVALID_REQUEST, p.message)
        else:
            log.warning("%s", p.message)

    def body(self, b: Body) -> None:
        if b.problem:
            log.warning("%s", b.problem)
        try:
            raw = json.loads(b.data)
        except ValueError as err:  # also a body that is not UTF-8
            self.error(None, PARSE_ERROR, f"a message body is not JSON ({err}); it began {_show(b.data)}")
            return
        if not isinstance(raw, dict):
            self.error(None, INVALID_REQUEST, f"a message is {_kind(raw)}, expected a JSON-RPC object")
            return
        has_id, msg_id, method = "id" in raw, raw.get("id"), raw.get("method")
        if has_id and (type(msg_id) not in (int, str)):
            self.error(None, INVALID_REQUEST, f"a message's id is {_kind(msg_id)}, expected an integer or a string")
            return
        reply_to = msg_id if has_id and method is not None else None
        if raw.get("jsonrpc") != "2.0":
            got = raw.get("jsonrpc")
            self.error(reply_to, INVALID_REQUEST, f'a message\'s "jsonrpc" is {json.dumps(got)[:40]}, expected "2.0"')
            return
        if method is None:
            if not has_id:
                self.error(None, INVALID_REQUEST, 'a message has neither "method" nor "id"')
                return
            self.response(raw)
            return
        if not isinstance(method, str):
            self.error(reply_to, INVALID_REQUEST, f'a message\'s "method" is {_kind(method)}, expected a string')
            return
        if has_id and method != "initialize" and not self.initialized:
            self.error(msg_id, SERVER_NOT_INITIALIZED, f"{method}: the server is not initialized yet")
            return
        if has_id and self.protocol._shutdown:
            self.error(msg_id, INVALID_REQUEST, f"{method}: the server is shutting down")
            return
        kind = self.protocol.get_message_type(method)
        if kind is None:  # unknown to LSP: pygls answers a request MethodNotFound
            raw.setdefault("params", None)
            kind = JsonRPCRequestMessage if has_id else JsonRPCNotification
        try:
            message = self.protocol._converter.structure(raw, kind)
        except Exception as err:  # noqa: BLE001 - any field the client got wrong
            if has_id:
                self.error(msg_id, INVALID_PARAMS, f"{method}: {_field_errors(err)}")
            else:
                log.warning("%s (a notification): %s; ignored", method, _field_errors(err))
            return
        if method == "initialize":
            if self.initialized:
                self.error(msg_id, INVALID_REQUEST, "initialize: the server is initialized already")
                return
            self.initialized = True
        elif not self.initialized and method != "exit":
            log.warning("%s before initialize; ignored", method)
            return
        reason = self.screen(method, message.params) if self.screen is not None else None
        if reason and has_id:
            self.error(msg_id, INVALID_PARAMS, f"{method}: {reason}")
            return
        if reason:
            log.warning("%s: %s; ignored", method, reason)
            return
        self.protocol.handle_message(message)

    def response(self, raw: dict[str, Any]) -> None:
        """A response to one of the server's own requests (e.g. window/workDoneProgress/create)."""
        try:
            self.protocol.handle_message(self.protocol.structure_message(raw))
        except Exception as err:  # noqa: BLE001 - the server's requests are never essential
            log.warning("a response from the client could not be read (%s); ignored", err)


class _ClientErrorsWithoutTraceback(logging.Filter):
    """pygls logs a request's JSON-RPC error (an unknown command: the client's mistake) with the
    traceback of its own raise; one line says it. Real failures keep their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], JsonRpcException):
            record.msg = f"{record.getMessage()}: {record.exc_info[1]}"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


def serve_stdio(protocol: JsonRPCProtocol, screen: Callable[[str, Any], str | None] | None = None) -> NoReturn:
    """Serve LSP on this process's stdin / stdout until `exit` or until the client closes stdin.

    Reading runs on its own thread (a blocking `os.read`, which returns what has arrived), the
    messages are handled on the event loop. The process ends with `os._exit`: the analysis thread
    may be in the middle of a large spec, and nothing it does matters once the client is gone."""
    strict_scalars(protocol._converter)
    dispatcher = Dispatcher(protocol, screen)
    logging.getLogger("pygls.protocol.json_rpc").addFilter(_ClientErrorsWithoutTraceback())
    stdin_fd = sys.stdin.buffer.fileno()
    protocol.set_writer(StdoutWriter(sys.stdout.buffer))
    loop = asyncio.new_event_loop()
    done: asyncio.Future[int] = loop.create_future()

    def finish(code: int) -> None:
        if not done.done():
            done.set_result(code)

    in_hand: list[float] = []  # when the message being handled was taken up (empty: none)

    def handle(event: Body | Problem) -> None:
        if done.done():
            return
        in_hand.append(time.monotonic())
        try:
            if isinstance(event, Problem):
                dispatcher.problem(event)
            else:
                dispatcher.body(event)
        except SystemExit as stop:  # pygls' `exit` handler
            finish(stop.code if isinstance(stop.code, int) else 1)
        except Exception as err:  # noqa: BLE001 - no message may take the server down
            if isinstance(err, BrokenPipeError) or sys.stdout.buffer.closed:  # (ValueError once closed)
                log.warning("the client stopped reading (%s); exiting", err)
                finish(1)
            else:
                log.exception("a message could not be handled")
        finally:
            in_hand.clear()

    def read() -> None:
        frames = FrameReader()
        while True:
            try:
                data = os.read(stdin_fd, 1 << 16)
            except OSError:
                data = b""
            for event in frames.feed(data) if data else frames.eof():
                loop.call_soon_threadsafe(handle, event)
            if not data:
                break
        code = 0 if protocol._shutdown else 1
        log.info("the client closed stdin; exiting")
        loop.call_soon_threadsafe(finish, code)
        closed = time.monotonic()
        while True:  # the loop gets to `finish` unless one message holds it: do not wait on that one
            time.sleep(0.05)
            now = time.monotonic()
            taken = in_hand[:1]  # a copy: the loop clears the list
            started = taken[0] if taken else now
            if now - started > EXIT_GRACE_S or now - closed > EXIT_LIMIT_S:
                _exit(code)

    threading.Thread(target=read, name="meshc-lsp-stdin", daemon=True).start()
    _exit(loop.run_until_complete(done))


def _exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - the client may have closed its end
            pass
    os._exit(code)
