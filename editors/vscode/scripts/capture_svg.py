"""Draw images/hover-and-diagnostic.svg from a real `meshc lsp` session.

Starts the server, opens examples/llama2_70b.mesh with stage 0 given 60 of the 80 blocks (a W0701
warning), asks for the hover on the first shard rule, and draws what an editor shows: the code, the
squiggle under the diagnostic's range, the hover and the diagnostic's message. Every text in the
picture is the server's answer. Run: python editors/vscode/scripts/capture_svg.py
"""

from __future__ import annotations

import re
import sys
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "lsp"))
from lsp_client import Client  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "images" / "hover-and-diagnostic.svg"
FIRST, LAST = 19, 34  # 0-based lines of the file shown
CW, LH = 8.4, 19  # character width and line height (monospace 14px)


def main() -> int:
    text = (ROOT / "examples" / "llama2_70b.mesh").read_text()
    text = text.replace("blocks[0:40]", "blocks[0:60]").replace("blocks[40:80]", "blocks[60:80]")
    lines = text.split("\n")
    c = Client(cwd=ROOT)
    try:
        u = c.open(ROOT / "bench" / "picture.mesh", text)
        [diag] = c.wait_diagnostics(u)
        hline = next(i for i, x in enumerate(lines) if "shard blocks.*.attn.{q,k,v}" in x)
        hover = c.request("textDocument/hover", {"textDocument": {"uri": u},
                                                 "position": {"line": hline, "character": 22}})
    finally:
        c.close()
    hover_lines = [re.sub(r"\*\*|`", "", x) for x in hover["contents"]["value"].split("\n") if x.strip()][:8]
    diag_lines = [f"{diag['code']}: {x}" if i == 0 else x for i, x in enumerate(diag["message"].split("\n"))]

    gutter = 48
    # the hover sits right of the code, below the hovered line, so it hides neither the code nor the squiggle
    hx, hy = gutter + (max(len(lines[i]) for i in range(FIRST, LAST + 1)) + 3) * CW, 0.0
    hw = max(len(x) for x in hover_lines) * CW + 20
    width = int(max(hx + hw + 20, 120 * CW))
    height = (LAST - FIRST + 1) * LH + 30 + len(diag_lines) * LH + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="14">',
           f'<rect width="{width}" height="{height}" fill="#1e1e1e"/>']

    def y(i: int) -> float:
        return 20 + (i - FIRST) * LH

    for i in range(FIRST, LAST + 1):
        out.append(f'<text x="8" y="{y(i)}" fill="#858585">{i + 1}</text>')
        out.append(f'<text x="{gutter}" y="{y(i)}" fill="#d4d4d4" xml:space="preserve">{escape(lines[i])}</text>')
    # the squiggle under the diagnostic's range
    r = diag["range"]
    x0, x1 = gutter + r["start"]["character"] * CW, gutter + r["end"]["character"] * CW
    yy = y(r["start"]["line"]) + 4
    path = f"M{x0},{yy} " + " ".join(f"l3,{2 if k % 2 else -2}" for k in range(int((x1 - x0) / 3)))
    out.append(f'<path d="{path}" stroke="#cca700" fill="none" stroke-width="1.2"/>')
    # the hover, below the hovered line
    hy = y(hline) + 8
    out.append(f'<rect x="{hx}" y="{hy}" width="{hw}" height="{len(hover_lines) * LH + 10}" fill="#252526" stroke="#454545"/>')
    for k, x in enumerate(hover_lines):
        out.append(f'<text x="{hx + 10}" y="{hy + 18 + k * LH}" fill="#cccccc" xml:space="preserve">{escape(x)}</text>')
    # the problems panel line
    py = y(LAST) + 30
    for k, x in enumerate(diag_lines):
        out.append(f'<text x="8" y="{py + k * LH}" fill="{"#cca700" if k == 0 else "#cccccc"}" xml:space="preserve">{escape(x[:115])}</text>')
    out.append("</svg>")
    OUT.write_text("\n".join(out) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
