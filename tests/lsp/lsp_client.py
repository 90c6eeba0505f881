"""A small LSP client for the tests: `meshc lsp` as a subprocess, JSON-RPC over its stdin / stdout.

Written here rather than taken from pygls so the tests exercise the wire format an editor sees
(Content-Length framing, JSON bodies) and not pygls talking to itself.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def server_command() -> list[str]:
    exe = shutil.which("meshc", path=str(Path(sys.executable).parent))
    return [exe, "lsp"] if exe else [sys.executable, "-m", "meshllm_dsl", "lsp"]


def uri(path: str | Path) -> str:
    return Path(path).resolve().as_uri()


class Client:
    def __init__(self, cwd: str | Path | None = None, initialize: bool = True) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(server_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, cwd=cwd, env=env)
        self.next_id = 0
        self.responses: dict[int, Any] = {}
        self.cond = threading.Condition()
        self.diagnostics: dict[str, list[dict[str, Any]]] = {}
        self.diag_count: dict[str, int] = {}
        self.notes: queue.Queue[dict[str, Any]] = queue.Queue()
        self.unaddressed: list[dict[str, Any]] = []  # error responses with id null (unreadable messages)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._drain, daemon=True).start()
        if initialize:
            self.initialize()

    def initialize(self, capabilities: dict[str, Any] | None = None) -> Any:
        got = self.request("initialize", {"processId": os.getpid(), "rootUri": None, "capabilities": capabilities or {}})
        self.notify("initialized", {})
        return got

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            headers: dict[str, str] = {}
            while True:
                line = out.readline()
                if not line:
                    with self.cond:
                        self.cond.notify_all()
                    return
                line = line.strip()
                if not line:
                    break
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            body = json.loads(out.read(int(headers["content-length"])))
            with self.cond:
                if body.get("id") is None and "error" in body:
                    self.unaddressed.append(body)
                elif "id" in body and "method" not in body:
                    self.responses[body["id"]] = body
                elif body.get("method") == "textDocument/publishDiagnostics":
                    u = body["params"]["uri"]
                    self.diagnostics[u] = body["params"]["diagnostics"]
                    self.diag_count[u] = self.diag_count.get(u, 0) + 1
                elif "id" in body:  # a request from the server (e.g. workDoneProgress): answer null
                    self._send({"jsonrpc": "2.0", "id": body["id"], "result": None})
                else:
                    self.notes.put(body)
                self.cond.notify_all()

    def _send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg).encode()
        self.send_raw(b"Content-Length: %d\r\n\r\n" % len(data) + data)

    def send_raw(self, data: bytes) -> None:
        """Bytes onto the server's stdin as they are (framing included, or not)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def new_id(self) -> int:
        with self.cond:
            self.next_id += 1
            return self.next_id

    def wait_response(self, rid: int | str, timeout: float = 60) -> dict[str, Any]:
        """The whole response to request `rid` (a result or an error)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while rid not in self.responses:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited ({self.proc.returncode}): {b''.join(self.stderr).decode()[-2000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no response to request {rid!r}")
                self.cond.wait(left)
            return self.responses.pop(rid)

    def call(self, method: str, params: Any, timeout: float = 60) -> dict[str, Any]:
        """Send a request and return its whole response, an error response included."""
        rid = self.new_id()
        self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        return self.wait_response(rid, timeout)

    def notify(self, method: str, params: Any) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": params})

    def request(self, method: str, params: Any, timeout: float = 60) -> Any:
        body = self.call(method, params, timeout)
        if "error" in body:
            raise RuntimeError(f"{method}: {body['error']}")
        return body["result"]

    def open(self, path: str | Path, text: str | None = None, version: int = 1) -> str:
        u = uri(path)
        if text is None:
            text = Path(path).read_bytes().decode("utf-8", errors="replace")
        self.notify("textDocument/didOpen", {"textDocument": {"uri": u, "languageId": "mesh", "version": version, "text": text}})
        return u

    def wait_diagnostics(self, u: str, after: int = 0, timeout: float = 60) -> list[dict[str, Any]]:
        """The diagnostics of `u` once more than `after` publications have arrived."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.diag_count.get(u, 0) <= after:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {b''.join(self.stderr).decode()[-2000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no diagnostics for {u}")
                self.cond.wait(left)
            return self.diagnostics[u]

    def close(self) -> None:
        try:
            self.request("shutdown", None, timeout=10)
            self.notify("exit", None)
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a test that failed may leave the server wedged
            self.proc.kill()
            self.proc.wait()
