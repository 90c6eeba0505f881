"""`meshc run --profile`: what the ranks measured, next to what `meshc plan` predicted.

The runtime (``meshllm_dsl.runtime.train.profile.profile_train``) writes one JSON file per rank; this
module reads them with the checked plan, runs the planner on it and prints, per rank, memory by
category and time by kind (compute, collectives per mesh axis, pipeline waits), each with the
ratio planned / measured.  No torch here: the parent `meshc` process only reads files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshllm_dsl.ir import PlanIR
from meshllm_dsl.parallel.devices import uncalibrated
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.formatting import fmt_bytes, fmt_seconds
from meshllm_dsl.planner.records import PlanReport

# Said where the times are planned with the built-in `cpu` profile's defaults (another machine's).
UNCALIBRATED = ("note: the cpu profile is not calibrated for this machine: run `meshc calibrate --device cpu -o devices.mesh` "
                "and `include \"devices.mesh\"` in the spec (its `device cpu` replaces the built-in defaults, "
                "host times measured on another machine)")


def read_ranks(directory: str | Path) -> list[dict[str, Any]]:
    files = sorted(Path(directory).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def _ratio(planned: float, measured: float) -> str:
    return f"{planned / measured:.2f}" if measured else "-"


def compare(plan: PlanIR, ranks: list[dict[str, Any]], rep: PlanReport | None = None) -> dict[str, Any]:
    """Planned and measured figures per rank (JSON-ready)."""
    rep = rep or analyze(plan)
    by_coord = {rc.coord: rc for rc in rep.ranks}
    out = []
    for r in ranks:
        coord = r["coords"].get(plan.roles.pipeline, 0) if plan.roles.pipeline else 0
        rc = by_coord[coord]
        mem = r["memory"]
        planned_comm: dict[str, dict[str, float]] = {}
        for c in rc.comms:
            if c.kind == "pipeline":
                continue  # compared with the measured waits below, which include the bubble
            e = planned_comm.setdefault(c.axis, {"bytes": 0.0, "seconds": 0.0})
            e["bytes"] += c.payload_bytes
            e["seconds"] += c.seconds
        measured_comm: dict[str, dict[str, float]] = {}
        for c in r["collectives"]:
            if c["op"].endswith("(wait)"):
                continue
            e = measured_comm.setdefault(c["axes"], {"bytes": 0.0, "seconds": 0.0, "calls": 0.0, "cpu_s": 0.0})
            for k in ("bytes", "seconds", "calls", "cpu_s"):
                e[k] += c.get(k, 0.0)
        pipe_planned = rc.comm_seconds(("pipeline",)) + (rep.step.bubble_s if plan.pipeline_size > 1 else 0.0)
        out.append({
            "rank": r["rank"], "coords": r["coords"], "stages": r["stages"],
            "memory": {
                "weights": {"planned": rc.weight_bytes, "measured": mem["weights"]},
                "gradients": {"planned": rc.grad_bytes, "measured": mem["gradients"]},
                "optimizer": {"planned": rc.optimizer_bytes, "measured": mem["optimizer"]},
                "activations per microbatch": {"planned": rc.activation_bytes_per_microbatch,
                                               "measured": mem["activations_per_microbatch"]},
                # With ZeRO 2 / 3 the parameters FSDP2 gathers for compute are temporaries too, and
                # pipelined, the unsharded gradients it accumulates between microbatches.
                "activations + temporaries peak": {"planned": rc.activation_bytes + rc.transient_bytes
                                                   + rc.gather_buffer_bytes + rc.grad_accum_bytes,
                                                   "measured": mem["activations_and_temporaries_peak"]},
            },
            "time": {
                "step": {"planned": rep.step.total_s, "measured": r["step_s"]},
                "compute": {"planned": rc.compute_s, "measured": r["compute_s"]},
                "pipeline wait (bubble + send / recv)": {"planned": pipe_planned, "measured": r["pipeline_wait_s"]},
                # CPU seconds of the rank's process (all threads) vs the planner's host time at the
                # device's rates alone; ranks time-sharing cores each run slower than alone.
                "host CPU": {"planned": rc.host_s, "measured": r.get("cpu_s", 0.0)},
            },
            "kernels": {"planned": rc.kernels, "measured": r.get("kernels", 0)},
            "collectives": {
                axes: {"planned": planned_comm.get(axes, {"bytes": 0, "seconds": 0.0}), "measured": measured_comm.get(axes)}
                for axes in sorted(set(planned_comm) | set(measured_comm))
            },
            "routing": r.get("routing", []),
        })
    return {"plan": plan.name, "device": rep.device.name, "calibrated": not uncalibrated(rep.device), "ranks": out}


def report_text(data: dict[str, Any]) -> str:
    lines = [f"profile of plan `{data['plan']}` (planner device profile `{data['device']}`); ratio = planned / measured"]
    if not data.get("calibrated", True):
        lines.append(UNCALIBRATED)
    for r in data["ranks"]:
        where = ", ".join(f"{a} {i}" for a, i in r["coords"].items())
        lines.append(f"\nrank {r['rank']} ({where}; stages {', '.join(map(str, r['stages']))})")
        rows = [("memory", "planned", "measured", "ratio")]
        for k, v in r["memory"].items():
            rows.append((k, fmt_bytes(v["planned"]), fmt_bytes(v["measured"]), _ratio(v["planned"], v["measured"])))
        for k, v in r["time"].items():
            rows.append((k, fmt_seconds(v["planned"]), fmt_seconds(v["measured"]), _ratio(v["planned"], v["measured"])))
        k = r["kernels"]
        rows.append(("kernels per step", f"{k['planned']:,}", f"{k['measured']:,}", _ratio(k["planned"], k["measured"])))
        for axes, v in r["collectives"].items():
            m = v["measured"] or {"bytes": 0, "seconds": 0.0, "calls": 0}
            p = v["planned"]
            rows.append((f"collectives over {axes} ({m['calls']:.0f} calls)", f"{fmt_bytes(p['bytes'])} {fmt_seconds(p['seconds'])}",
                         f"{fmt_bytes(m['bytes'])} {fmt_seconds(m['seconds'])}", _ratio(p["seconds"], m["seconds"])))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            lines.append("  " + row[0].ljust(widths[0]) + "".join("  " + c.rjust(w) for c, w in zip(row[1:], widths[1:])))
        lines += routing_lines(r.get("routing", []))
    return "\n".join(lines) + "\n"


def routing_lines(layers: list[dict[str, Any]]) -> list[str]:
    """Tokens per expert per moe layer (one step on this rank), with the measured max / mean load
    and the busiest expert's share: the `skew = F` a plan can be given to check the next run."""
    if not layers:
        return []
    lines = ["  moe routing (tokens per expert, one step; busiest share = a plan's `skew`)"]
    width = max(len(x["layer"]) for x in layers)
    for x in layers:
        drop = f", {x['dropped']:,} dropped" if x["dropped"] else ""
        lines.append(f"    {x['layer'].ljust(width)}  [{', '.join(f'{c:,}' for c in x['tokens_per_expert'])}]  "
                     f"max / mean {x['max_over_mean']:.2f}, busiest share {x['busiest_share']:.3f}{drop}")
    return lines
