"""`meshc report FILE.jsonl`: the per-step metrics `meshc run --metrics` writes, drawn as hand-written
SVG line charts (no drawing dependency): the loss per step and the tokens/s per step.

``read_metrics`` is strict about what it needs (a JSON object per line with an integer ``step`` and
the charted numbers, or null) and names ``file:line`` for anything else; a blank last line, or one
cut off by a killed run, is the only leniency: a run killed mid-write leaves at most that.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path
from typing import Any

__all__ = ["CHARTS", "MetricsError", "line_chart", "read_metrics", "series", "write_report"]

FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
# (key in each line, chart title, file stem)
CHARTS = (("loss", "loss", "loss"), ("tokens_per_s", "tokens/s", "tokens_per_s"))


class MetricsError(Exception):
    """A metrics file that cannot be drawn; the message names file:line."""


def _number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step objects of a `--metrics` file, in file order."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise MetricsError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise MetricsError(f"{path}: cannot read it ({err.strerror or err})") from None
    lines = text.split("\n")
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                break  # the last line of a run killed while writing it
            raise MetricsError(f"{path}:{number}: not JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise MetricsError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise MetricsError(f"{path}:{number}: `step` must be a non-negative integer, got {json.dumps(step)}")
        for key, _, _ in CHARTS:
            if key not in row:
                raise MetricsError(f"{path}:{number}: no `{key}` (a `meshc run --metrics` file has it on every line)")
            if not _number(row[key]):
                raise MetricsError(f"{path}:{number}: `{key}` must be a number or null, got {json.dumps(row[key])}")
        rows.append(row)
    if not rows:
        raise MetricsError(f"{path}: no steps (an empty metrics file)")
    return rows


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out, v = [], first
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.3g}"
    return f"{v:,.4g}"


def line_chart(points: list[tuple[int, float]], title: str, source: str, width: int = 720, height: int = 360) -> str:
    """One series ``(step, value)`` as an SVG line chart with axes, ticks and a title."""
    left, right, top, bottom = 72, 20, 40, 48
    w, h = width - left - right, height - top - bottom
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if y0 == y1:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad

    def sx(x: float) -> float:
        return left + (w * (x - x0) / (x1 - x0) if x1 > x0 else w / 2)

    def sy(y: float) -> float:
        return top + h - h * (y - y0) / (y1 - y0)

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        f"<text x='{width / 2:.1f}' y='22' text-anchor='middle' font-size='15' font-weight='bold' {FONT}>"
        f"{escape(title)} per step</text>",
        f"<text x='{width - right}' y='{height - 8}' text-anchor='end' font-size='10' fill='#666' {FONT}>{escape(source)}</text>",
        f"<rect x='{left}' y='{top}' width='{w}' height='{h}' fill='none' stroke='#888'/>",
    ]
    for t in _ticks(y0, y1):
        y = sy(t)
        out.append(f"<line x1='{left}' y1='{y:.1f}' x2='{left + w}' y2='{y:.1f}' stroke='#e4e4e4'/>")
        out.append(f"<text x='{left - 6}' y='{y + 4:.1f}' text-anchor='end' font-size='11' {FONT}>{_label(t)}</text>")
    for t in _ticks(float(x0), float(x1)) if x1 > x0 else [float(x0)]:
        if t != int(t):
            continue
        x = sx(t)
        out.append(f"<line x1='{x:.1f}' y1='{top + h}' x2='{x:.1f}' y2='{top + h + 4}' stroke='#888'/>")
        out.append(f"<text x='{x:.1f}' y='{top + h + 18}' text-anchor='middle' font-size='11' {FONT}>{int(t)}</text>")
    out.append(f"<text x='{left + w / 2:.1f}' y='{top + h + 36}' text-anchor='middle' font-size='12' {FONT}>step</text>")
    if points:
        path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(points))
        out.append(f"<path d='{path}' fill='none' stroke='#1f6fb4' stroke-width='1.8'/>")
        if len(points) <= 60:
            out += [f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2.5' fill='#1f6fb4'/>" for x, y in points]
    else:
        out.append(f"<text x='{left + w / 2:.1f}' y='{top + h / 2:.1f}' text-anchor='middle' font-size='13' "
                   f"fill='#666' {FONT}>no finite values</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every step with a finite ``key``; a step repeated (a resumed run appends the
    steps after its checkpoint again) keeps its last value."""
    by_step: dict[int, float] = {}
    for row in rows:
        v = row.get(key)
        if v is not None and math.isfinite(v):
            by_step[row["step"]] = float(v)
        else:
            by_step.pop(row["step"], None)
    return sorted(by_step.items())


def write_report(path: Path, out_dir: Path) -> list[Path]:
    """Draw every chart of ``path`` into ``out_dir`` (made if missing); the files written."""
    from meshllm_dsl.runtime.outputs import OutputError, write_output

    rows = read_metrics(path)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"--out {out_dir}: exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot make {out_dir}: {err.strerror or err}") from None
    written = []
    for key, title, stem in CHARTS:
        target = out_dir / f"{path.stem}.{stem}.svg"
        write_output(target, line_chart(series(rows, key), title, path.name).encode())
        written.append(target)
    return written
