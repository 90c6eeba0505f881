"""Two pictures of a plan as hand-written SVG (no drawing dependency): the device mesh and the schedule.

`mesh_svg`: every device as a cell of a grid (last axis across, the one before it down, any leading
axes as side-by-side panels), coloured by pipeline stage, darker per shard index, labelled with its
rank, coordinates, layers and shard.

`schedule_svg`: one timeline row per pipeline rank with the forward and backward pass of every
microbatch placed by simulating torch's own action order for the schedule (planner/schedule.py's
rank_order, every schedule torch ships) with backward = 2 x forward, split into an input backward
(I) and a weight backward (W) of one forward each for the zero-bubble schedules; each box as wide as
its cost, at its simulated start; the grey between the boxes is the bubble, the one `meshc plan`
prints.
"""

from __future__ import annotations

from html import escape

import attrs

from meshllm_dsl.ir import SPLIT_BACKWARD, PlanIR
from meshllm_dsl.planner.formulas import CLOSED_FORM_SCHEDULES, bubble_fraction
from meshllm_dsl.planner.schedule import (
    COST,
    dependency,
    overlapped_pairs,
    rank_order,
    schedule_cost,
    stages_per_rank,
)
from meshllm_dsl.views.explain import rank_rows, shard_axes

# Stage hues: distinct, colour-blind-friendly-ish (Okabe-Ito order, as HSL hues).
HUES = (210, 30, 150, 330, 50, 270, 190, 0, 100, 240, 300, 80)
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def _fill(stage: int, shard: int, shards: int) -> str:
    hue = HUES[stage % len(HUES)]
    light = 84 - (22 * shard / max(1, shards - 1) if shards > 1 else 0)
    return f"hsl({hue}, 65%, {light:.0f}%)"


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "middle", weight: str = "normal",
          fill: str = "#111") -> str:
    return (f"<text x='{x:.1f}' y='{y:.1f}' {FONT} font-size='{size}' text-anchor='{anchor}' "
            f"font-weight='{weight}' fill='{fill}'>{escape(s)}</text>")


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "\u2026"


def _wrap(s: str, n: int) -> list[str]:
    """`s` over lines of at most about `n` characters, broken after spaces (a word longer than a line
    keeps its own line): a cell shows all of its text, however many axes or layer ranges it has."""
    lines: list[str] = []
    parts = s.split("; ")
    for i, part in enumerate(parts):  # a `;` (between a rank's stages) always ends a line
        start = len(lines)
        for word in (part + (";" if i < len(parts) - 1 else "")).split(" "):
            if len(lines) > start and len(lines[-1]) + 1 + len(word) <= n:
                lines[-1] += " " + word
            else:
                lines.append(word)
    return lines or [""]


def _cell_lines(plan: PlanIR, rank: int, info: dict, host: int) -> list[tuple[str, int, str, str]]:  # type: ignore[type-arg]
    """A device cell's text, line by line: (text, font size, weight, colour)."""
    st = ",".join(str(s) for s in info["stages"])
    shard = f"shard {info['shard']}/{info['shards']}" if info["shards"] > 1 else "full copy"
    rep = f"  replica {info['replica']}" if info["replicas"] > 1 else ""
    return [
        (f"rank {rank}", 13, "bold", "#111"),
        *((t, 10, "normal", "#333") for t in _wrap(" ".join(f"{k}={v}" for k, v in info["coords"].items()), 28)),
        (f"stage {st}" + (f", host {host}" if plan.mesh.hosts > 1 else ""), 11, "normal", "#111"),
        *((t, 10, "normal", "#111") for t in _wrap(info["layers"], 28)),
        (shard + rep, 10, "normal", "#333"),
    ]


def mesh_svg(plan: PlanIR) -> str:
    mesh = plan.mesh
    axes = mesh.axes
    cols_axis = axes[-1]
    rows_axis = axes[-2] if len(axes) >= 2 else None
    lead = axes[:-2] if len(axes) >= 2 else ()
    n_cols = cols_axis.size
    n_rows = rows_axis.size if rows_axis else 1
    panels = 1
    for a in lead:
        panels *= a.size
    per_line = max(1, min(panels, 4 if n_cols <= 4 else 2))
    rows = rank_rows(plan)
    cells = {rank: _cell_lines(plan, rank, rows[rank], rank // mesh.devices_per_host) for rank in range(mesh.devices)}
    cw, gap, pad = 176, 10, 28
    ch = 12 + 16 * max(len(lines) for lines in cells.values())  # every cell as tall as the fullest
    panel_w = n_cols * (cw + gap) - gap + 2 * pad
    panel_h = n_rows * (ch + gap) - gap + 2 * pad + 18
    lines_of_panels = -(-panels // per_line)
    top = 64
    stage_count = len(plan.stages)
    legend_h = 22 * ((stage_count + 1) // 2) + 30
    width = max(per_line * panel_w + 20, 560)
    height = top + lines_of_panels * (panel_h + 12) + legend_h
    sharding = shard_axes(plan)
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>",
           f"<rect width='{width}' height='{height}' fill='white'/>",
           _text(10, 24, f"plan {plan.name}: {plan.model.name} on {mesh.name}", 16, "start", "bold"),
           _text(10, 44, " x ".join(f"{a.name} {a.size}" for a in axes) + f" = {mesh.devices} devices"
                 + (f", {mesh.hosts} hosts" if mesh.hosts > 1 else "")
                 + f"; colour = pipeline stage, darker = shard index over {' x '.join(sharding) or 'nothing'}", 12, "start")]
    for pi in range(panels):
        lead_coords: dict[str, int] = {}
        rest = pi
        for a in reversed(lead):
            lead_coords[a.name] = rest % a.size
            rest //= a.size
        px = 10 + (pi % per_line) * panel_w
        py = top + (pi // per_line) * (panel_h + 12)
        out.append(f"<rect x='{px}' y='{py}' width='{panel_w - 10}' height='{panel_h}' rx='8' fill='#f6f6f6' stroke='#bbb'/>")
        title = ", ".join(f"{k} = {v}" for k, v in lead_coords.items()) or mesh.name
        out.append(_text(px + 10, py + 18, title, 12, "start", "bold"))
        if rows_axis:
            out.append(_text(px + 10, py + panel_h - 8, f"\u2193 {rows_axis.name}   \u2192 {cols_axis.name}", 11, "start", fill="#555"))
        else:
            out.append(_text(px + 10, py + panel_h - 8, f"\u2192 {cols_axis.name}", 11, "start", fill="#555"))
        for r in range(n_rows):
            for c in range(n_cols):
                coords = dict(lead_coords)
                if rows_axis:
                    coords[rows_axis.name] = r
                coords[cols_axis.name] = c
                rank = mesh.rank_of(coords)
                info = rows[rank]
                stage = info["stages"][0] if info["stages"] else 0
                x = px + pad + c * (cw + gap)
                y = py + pad + 6 + r * (ch + gap)
                out.append(f"<rect x='{x}' y='{y}' width='{cw}' height='{ch}' rx='6' "
                           f"fill='{_fill(stage, info['shard'], info['shards'])}' stroke='#333' stroke-width='1.2'/>")
                for k, (text, size, weight, fill) in enumerate(cells[rank]):
                    out.append(_text(x + cw / 2, y + 17 + 16 * k, text, size, weight=weight, fill=fill))
    ly = top + lines_of_panels * (panel_h + 12) + 8
    out.append(_text(10, ly + 12, "stages", 12, "start", "bold"))
    from meshllm_dsl.planner.units import stage_label

    for i, s in enumerate(plan.stages):
        x = 10 + (i % 2) * (width // 2)
        y = ly + 22 + (i // 2) * 22
        out.append(f"<rect x='{x}' y='{y}' width='16' height='14' fill='{_fill(s.index, 0, 1)}' stroke='#333'/>")
        # about 6 px a character at this size: as much of the label as its half of the picture holds
        out.append(_text(x + 22, y + 12, _short(f"stage {s.index} ({plan.roles.pipeline or 'all'} {s.coord}): {stage_label(plan, s)}",
                                                max(60, (width // 2 - 30) // 6)), 11, "start"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- schedules


@attrs.frozen
class Op:
    rank: int
    kind: str  # "F" | "B" | "I" | "W"
    micro: int
    chunk: int  # local stage on this rank: stage // p (V: chunk 0 = stage r, chunk 1 = stage 2p - 1 - r)
    start: int
    end: int
    stage: int = -1  # the global stage index


def simulate(schedule: str, p: int, m: int, v: int) -> list[Op]:
    """Place every action of torch's own order (schedule.rank_order, the one the planner's memory
    and bubble come from): each rank runs its actions in turn, each starting when its input is ready
    (schedule.dependency; an overlapped DualPipeV pair once both its inputs are), each as long as
    schedule.COST says (a backward twice a forward, its I and W halves one each)."""
    v = stages_per_rank(schedule, v)
    stages = p * v
    orders = [[a for a in rank_order(schedule, p, v, m, r) if a is not None] for r in range(p)]
    pairs = [overlapped_pairs(schedule, p, m, r) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (I or B) | "W", stage, micro) -> end time
    free = [0.0] * p
    nxt = [0] * p
    ops: list[Op] = []
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if nxt[r] >= len(orders[r]):
                continue
            kind, stage, mb = orders[r][nxt[r]]
            deps = [dependency(orders[r][nxt[r]], stages)]
            if nxt[r] in pairs[r]:
                deps.append(dependency(orders[r][nxt[r] + 1], stages))
            if any(d is not None and d not in done for d in deps):
                continue
            start = max([free[r]] + [done[d] for d in deps if d is not None])
            end = start + COST[kind]
            done[("G" if kind in "IB" else kind, stage, mb)] = end
            free[r] = end
            nxt[r] += 1
            ops.append(Op(r, kind, mb, stage // p, int(start), int(end), stage))
            progressed = True
        if not progressed:  # pragma: no cover - torch's orders never deadlock (schedule_order's tests)
            raise RuntimeError(f"schedule {schedule} deadlocked at p={p} m={m} v={v}")
    return ops


# Box colours per action kind: (hue, saturation); the lightness says the chunk.
KIND_COLOURS = {"F": (212, 70), "B": (28, 85), "I": (0, 70), "W": (140, 55)}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input backward (I)", "W": "weight backward (W)"}


def schedule_svg(plan: PlanIR) -> str:
    p = plan.pipeline_size
    m, v = plan.microbatches, stages_per_rank(plan.schedule, plan.virtual)
    split = plan.schedule in SPLIT_BACKWARD
    ops = simulate(plan.schedule, p, m, v)
    span = max(o.end for o in ops)
    label_w, top, row_h = 110, 78, 40
    unit = max(6.0, min(40.0, 1100 / span))
    # wide enough for the three caption lines (about 7 px per character at these sizes)
    width = int(max(label_w + span * unit + 30, 1000 if split else 660))  # the split legend is longer
    height = top + p * (row_h + 8) + 70
    closed = bubble_fraction(plan.schedule, p, m, v)
    bubble = schedule_cost(plan.schedule, p, v, m).bubble if p > 1 else 0.0
    # The planner's bubble is this order's; the closed form is shown where it differs (interleaved).
    formula = f"(p - 1) / (m + p - 1){' / v' if v > 1 else ''}"
    if plan.schedule in CLOSED_FORM_SCHEDULES:
        caption = (f"bubble in torch's {plan.schedule} order (backward = 2 x forward): {bubble:.1%}"
                   + (f" = {formula}" if abs(bubble - closed) < 5e-4 else f"; the closed form {formula} gives {closed:.1%}"))
    else:  # no closed form holds over torch's order (planner/schedule.py IDLE_NOTES)
        caption = (f"bubble in torch's {plan.schedule} order (backward = 2 x forward"
                   + (", input backward = weight backward = forward" if split else "") + f"): {bubble:.1%}")
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>",
           f"<rect width='{width}' height='{height}' fill='white'/>",
           _text(10, 24, f"plan {plan.name}: schedule {plan.schedule}, {p} pipeline rank{'s' if p != 1 else ''}, "
                 f"{m} microbatches" + (f", {v} virtual stages per rank" if v > 1 else ""), 16, "start", "bold"),
           _text(10, 46, caption, 12, "start"),
           _text(10, 64, "blue: forward, orange: backward; the number is the microbatch"
                 + ("; lighter = later virtual stage" if v > 1 else "") + "; grey = idle (the bubble)", 11, "start", fill="#444")
           if not split else _legend(10, 64, v > 1)]
    for r in range(p):
        y = top + r * (row_h + 8)
        out.append(_text(label_w - 10, y + row_h / 2 + 4, f"{plan.roles.pipeline or 'rank'} {r}", 12, "end", "bold"))
        out.append(f"<rect x='{label_w}' y='{y}' width='{span * unit:.1f}' height='{row_h}' fill='#d9d9d9'/>")
    for o in ops:
        y = top + o.rank * (row_h + 8)
        x = label_w + o.start * unit
        w = (o.end - o.start) * unit
        light = 55 + (25 * o.chunk / max(1, v - 1) if v > 1 else 0)
        hue, sat = KIND_COLOURS[o.kind]
        fill = f"hsl({hue}, {sat}%, {light:.0f}%)"
        out.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{row_h}' fill='{fill}' stroke='white' stroke-width='1'/>")
        if w >= 12:
            out.append(_text(x + w / 2, y + row_h / 2 + 4, str(o.micro), 11 if w >= 16 else 8,
                             fill="white" if light < 65 else "#222", weight="bold"))
    ax_y = top + p * (row_h + 8) + 10
    out.append(f"<line x1='{label_w}' y1='{ax_y}' x2='{label_w + span * unit:.1f}' y2='{ax_y}' stroke='#333'/>")
    step = max(1, span // 12)
    for t in range(0, span + 1, step):
        x = label_w + t * unit
        out.append(f"<line x1='{x:.1f}' y1='{ax_y}' x2='{x:.1f}' y2='{ax_y + 5}' stroke='#333'/>")
        out.append(_text(x, ax_y + 18, str(t), 10))
    out.append(_text(label_w, ax_y + 36, "time, in forward-pass units of one (virtual) stage", 11, "start", fill="#444"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _legend(x: int, y: int, chunks: bool) -> str:
    """A swatch and a name per action kind of a split-backward schedule, then what the rest means."""
    parts = []
    for kind in ("F", "I", "W", "B"):
        hue, sat = KIND_COLOURS[kind]
        parts.append(f"<rect x='{x}' y='{y - 10}' width='12' height='12' fill='hsl({hue}, {sat}%, 55%)'/>")
        parts.append(_text(x + 16, y, KIND_NAMES[kind], 11, "start", fill="#444"))
        x += 16 + 7 * len(KIND_NAMES[kind]) + 12
    parts.append(f"<rect x='{x}' y='{y - 10}' width='12' height='12' fill='#d9d9d9'/>")
    parts.append(_text(x + 16, y, "idle (the bubble); the number is the microbatch"
                       + ("; lighter = later local stage" if chunks else ""), 11, "start", fill="#444"))
    return "\n".join(parts)


def simulated_idle(schedule: str, p: int, m: int, v: int) -> float:
    ops = simulate(schedule, p, m, v)
    span = max(o.end for o in ops)
    return 1 - sum(o.end - o.start for o in ops) / (span * p)
