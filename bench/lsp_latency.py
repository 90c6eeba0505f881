"""Latency of `meshc lsp` as an editor sees it: a real server subprocess, JSON-RPC over stdio.

Measures, each N times, median and p95 in milliseconds:
  - diagnostics after an edit (didChange -> publishDiagnostics), which includes the server's
    debounce (adaptive: twice the last analysis time, 30 to 300 ms), and after an edit and a save at once (didSave analyses at once, no
    debounce: the analysis itself plus the transport);
  - hover on a shard rule and completion inside `column(` of examples/llama2_70b.mesh;
for examples/llama2_70b.mesh, a 10,000-block spec (tiny_llama with layers = 10000) and a file of
10,000 declarations (text size, not model size).

    python bench/lsp_latency.py [-n 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "lsp"))
from _common import print_table  # noqa: E402
from lsp_client import Client  # noqa: E402

from meshllm_dsl.lsp.server import DEBOUNCE_MAX_S, DEBOUNCE_MIN_S  # noqa: E402


def _pos(text: str, needle: str, delta: int = 0) -> dict[str, int]:
    off = text.index(needle) + delta
    return {"line": text.count("\n", 0, off), "character": off - (text.rfind("\n", 0, off) + 1)}


def _stats(xs: list[float]) -> tuple[str, str]:
    """(median, p95) in ms."""
    xs = sorted(x * 1000 for x in xs)
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
    return f"{statistics.median(xs):.1f} ms", f"{p95:.1f} ms"


def _open(c: Client, path: Path, text: str) -> str:
    """Open (or reopen) a document and wait for the diagnostics of this opening, not an earlier one."""
    from lsp_client import uri

    before = c.diag_count.get(uri(path), 0)
    u = c.open(path, text)
    c.wait_diagnostics(u, after=before, timeout=300)
    return u


def diagnostics_after(c: Client, path: Path, text: str, edit_at: str, n: int, save: bool) -> list[float]:
    u = _open(c, path, text)
    times = []
    version = 1
    pos = _pos(text, edit_at)
    for i in range(n):
        version += 1
        count = c.diag_count.get(u, 0)
        # alternate a harmless edit: a space typed, then deleted, inside the plan
        change = ({"range": {"start": pos, "end": pos}, "text": " "} if i % 2 == 0 else
                  {"range": {"start": pos, "end": {"line": pos["line"], "character": pos["character"] + 1}}, "text": ""})
        t = time.perf_counter()
        c.notify("textDocument/didChange", {"textDocument": {"uri": u, "version": version}, "contentChanges": [change]})
        if save:
            c.notify("textDocument/didSave", {"textDocument": {"uri": u}})
        c.wait_diagnostics(u, after=count, timeout=float(__import__("os").environ.get("LSP_BENCH_TIMEOUT", "300")))
        times.append(time.perf_counter() - t)
    return times


def requests(c: Client, path: Path, text: str, method: str, pos: dict[str, int], n: int) -> list[float]:
    u = _open(c, path, text)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        c.request(method, {"textDocument": {"uri": u}, "position": pos})
        times.append(time.perf_counter() - t)
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30)
    args = ap.parse_args()
    tmp = Path(__file__).resolve().parent / ".lsp_bench"
    tmp.mkdir(exist_ok=True)
    llama = (ROOT / "examples" / "llama2_70b.mesh").read_text()
    big = (ROOT / "examples" / "tiny_llama.mesh").read_text().replace("layers = 4", "layers = 10000")
    many = llama + "".join(f"mesh m{i} {{ axes a = {i % 8 + 1} }}\n" for i in range(10000))
    specs = [("llama2_70b.mesh", llama, "    batch"), ("10,000 blocks", big, "    batch"),
             ("10,000 declarations", many, "    batch")]
    c = Client(cwd=ROOT)
    try:
        print(f"meshc lsp latency, {args.n} runs each (debounce {DEBOUNCE_MIN_S * 1000:.0f} to {DEBOUNCE_MAX_S * 1000:.0f} ms)")
        rows = [("", "spec", "median", "p95")]
        for i, (name, text, at) in enumerate(specs):
            path = tmp / f"spec{i}.mesh"
            rows.append(("diagnostics after an edit", name, *_stats(diagnostics_after(c, path, text, at, args.n, False))))
            rows.append(("diagnostics after a save", name, *_stats(diagnostics_after(c, path, text, at, args.n, True))))
        for i, (name, text, _) in enumerate(specs[:2]):
            path = tmp / f"req{i}.mesh"
            rows.append(("hover on a shard rule", name,
                         *_stats(requests(c, path, text, "textDocument/hover", _pos(text, "blocks.*.attn", 3), args.n))))
            rows.append(("completion in column(", name,
                         *_stats(requests(c, path, text, "textDocument/completion", _pos(text, "column(tensor)", 7), args.n))))
        print_table(rows, align="ll")
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
