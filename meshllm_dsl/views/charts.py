"""Two charts from the planner as hand-written SVG (no drawing dependency), as views/svg.py draws.

`memory_svg`: each pipeline rank's memory at the step's peak as a stacked bar (weights, gradients,
optimizer states, FSDP2 buffers, activations, transients) against the device's capacity: which rank
is full, and of what.

`suggest_svg`: every plan `meshc suggest` analysed, step time against peak memory, with the Pareto
front (no other plan is both faster and smaller) joined and the suggested plans numbered, and the
memory the device allows marked: what each second bought in memory.
"""

from __future__ import annotations

from html import escape

from meshllm_dsl.planner.records import PlanReport, RankClass

FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
GIB = 2**30

# (label, colour, bytes of a rank)
PARTS: tuple[tuple[str, str], ...] = (
    ("weights", "#4e79a7"), ("gradients", "#f28e2b"), ("optimizer states", "#59a14f"),
    ("FSDP2 buffers", "#b07aa1"), ("activations", "#e15759"), ("transients", "#9c755f"),
)


def _parts(r: RankClass) -> tuple[int, ...]:
    return (r.weight_bytes, r.grad_bytes, r.optimizer_bytes, r.gather_buffer_bytes + r.grad_accum_bytes,
            r.activation_bytes, r.transient_bytes)


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "start", fill: str = "#111") -> str:
    return f"<text x='{x:.1f}' y='{y:.1f}' {FONT} font-size='{size}' text-anchor='{anchor}' fill='{fill}'>{escape(s)}</text>"


def _svg(width: int, height: int, body: list[str]) -> str:
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>\n"
            f"<rect width='{width}' height='{height}' fill='white'/>\n" + "\n".join(body) + "\n</svg>\n")


def memory_svg(report: PlanReport) -> str:
    """A bar per pipeline rank, its parts stacked left to right, the device's memory as a line."""
    ranks = report.ranks
    capacity = report.device.memory_bytes
    scale_to = max([capacity, *(r.training_bytes for r in ranks)])
    left, width, bar, gap, top = 120, 640, 22, 10, 56
    height = top + len(ranks) * (bar + gap) + 70
    x = lambda b: left + width * b / scale_to  # noqa: E731
    body = [_text(10, 24, f"plan {report.plan.name}: memory per device at the step's peak "
                          f"({report.device.name}, {capacity / GIB:.0f} GiB)", 15)]
    for i, r in enumerate(ranks):
        y = top + i * (bar + gap)
        body.append(_text(10, y + bar * 0.7, f"pipeline {r.coord}" if report.plan.roles.pipeline else "every rank", 12))
        start = 0
        for (name, colour), size in zip(PARTS, _parts(r)):
            if size:
                body.append(f"<rect x='{x(start):.1f}' y='{y}' width='{x(start + size) - x(start):.1f}' height='{bar}' "
                            f"fill='{colour}'><title>{escape(name)}: {size / GIB:.2f} GiB</title></rect>")
            start += size
        body.append(_text(x(start) + 6, y + bar * 0.7, f"{r.training_bytes / GIB:.1f} GiB", 11))
    bottom = top + len(ranks) * (bar + gap)
    body.append(f"<line x1='{x(capacity):.1f}' y1='{top - 8}' x2='{x(capacity):.1f}' y2='{bottom}' stroke='#d00' "
                "stroke-width='2' stroke-dasharray='5,3'/>")
    body.append(_text(x(capacity), top - 12, "device memory", 11, "middle", "#d00"))
    lx = 10
    for name, colour in PARTS:
        body.append(f"<rect x='{lx}' y='{bottom + 22}' width='12' height='12' fill='{colour}'/>")
        body.append(_text(lx + 16, bottom + 32, name, 11))
        lx += 24 + 7 * len(name)
    return _svg(left + width + 120, height, body)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better), by the first."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def suggest_svg(points: list[tuple[str, float, int]], ranked: list[str], limit_bytes: int, title: str) -> str:
    """`points`: (candidate, step seconds, peak bytes) of every analysed plan; `ranked`: the suggested
    candidates in order; `limit_bytes`: the peak a suggested plan may reach."""
    left, top, width, height = 70, 50, 640, 380
    mem = [p[2] / GIB for p in points] or [1.0]
    step = [p[1] for p in points] or [1.0]
    x_hi = max(max(mem), limit_bytes / GIB) * 1.05
    y_hi = max(step) * 1.05
    x = lambda v: left + width * v / x_hi  # noqa: E731
    y = lambda v: top + height - height * v / y_hi  # noqa: E731
    body = [_text(10, 24, title, 15),
            f"<line x1='{left}' y1='{top + height}' x2='{left + width}' y2='{top + height}' stroke='#333'/>",
            f"<line x1='{left}' y1='{top}' x2='{left}' y2='{top + height}' stroke='#333'/>",
            _text(left + width / 2, top + height + 36, "peak memory per device (GiB)", 12, "middle"),
            f"<text x='18' y='{top + height / 2}' {FONT} font-size='12' text-anchor='middle' "
            f"transform='rotate(-90 18 {top + height / 2})'>step time (s)</text>"]
    for k in range(6):
        gx, gy = x_hi * k / 5, y_hi * k / 5
        body.append(_text(x(gx), top + height + 16, f"{gx:.0f}", 10, "middle"))
        body.append(_text(left - 6, y(gy) + 4, f"{gy:.2g}", 10, "end"))
    body.append(f"<line x1='{x(limit_bytes / GIB):.1f}' y1='{top}' x2='{x(limit_bytes / GIB):.1f}' y2='{top + height}' "
                "stroke='#d00' stroke-dasharray='5,3'/>")
    body.append(_text(x(limit_bytes / GIB) - 4, top + 12, "fits left of here", 11, "end", "#d00"))
    for key, s, b in points:
        body.append(f"<circle cx='{x(b / GIB):.1f}' cy='{y(s):.1f}' r='2.5' fill='#9aa' fill-opacity='0.6'>"
                    f"<title>{escape(key)}: {s:.3g} s, {b / GIB:.1f} GiB</title></circle>")
    front = pareto_front([(p[2], p[1]) for p in points])
    path = " ".join(f"{x(points[i][2] / GIB):.1f},{y(points[i][1]):.1f}" for i in front)
    if path:
        body.append(f"<polyline points='{path}' fill='none' stroke='#1f5fa8' stroke-width='1.5'/>")
    for i in front:
        body.append(f"<circle cx='{x(points[i][2] / GIB):.1f}' cy='{y(points[i][1]):.1f}' r='3.5' fill='#1f5fa8'/>")
    where = {key: (s, b) for key, s, b in points}
    for n, key in enumerate(ranked, 1):
        if key in where:
            s, b = where[key]
            body.append(f"<circle cx='{x(b / GIB):.1f}' cy='{y(s):.1f}' r='6' fill='none' stroke='#e15759' stroke-width='2'/>")
            body.append(_text(x(b / GIB) + 8, y(s) - 6, f"#{n}", 12, "start", "#e15759"))
    body.append(_text(left + width - 4, top + height + 52, f"{len(points)} plans analysed; blue: the Pareto front "
                      "(none both faster and smaller); red: suggested", 11, "end"))
    return _svg(left + width + 30, top + height + 70, body)
