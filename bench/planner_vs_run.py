"""The planner's step time and per-rank peak memory vs a measured run, for the example plans that run
on this machine, with the device measured by `meshc calibrate` (as many processes as the plan has).

For each example: `meshc calibrate --ranks N` -> devices.mesh, a copy of the example that includes it
and names it, `meshc run --steps 1 --profile JSON`, then per rank: predicted / measured for the step
time and for peak memory (weights + gradients + optimizer states + activations and temporaries).
Goals (issue 12): step time within 25%, peak memory within 5%.

On a machine other people share, the cores a job gets swing within seconds, and a calibration a
minute before a run can be off by that swing. So the examples run in interleaved rounds (each a
fresh calibration right before its run) and the table gives each rank's median over the rounds,
with the range of the step ratio.

    python bench/planner_vs_run.py [--only tiny_gpt2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import print_table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"tiny_llama": 8, "tiny_gpt2": 4, "tiny_llama_fsdp": 8}


def _round(meshc: list[str], tmp: Path, name: str, ranks: int, i: int) -> list[dict]:
    d = tmp / f"{name}.{i}"
    d.mkdir()
    subprocess.run([*meshc, "calibrate", "--ranks", str(ranks), "-o", str(d / "devices.mesh")],
                   check=True, capture_output=True)
    text = (ROOT / "examples" / f"{name}.mesh").read_text()
    spec = d / f"{name}.mesh"
    spec.write_text('include "devices.mesh"\n' + text.replace("device = cpu", "device = calibrated"))
    out = d / "profile.json"
    subprocess.run([*meshc, "run", str(spec), "--steps", "1", "--profile", str(out)],
                   check=True, capture_output=True)
    return json.loads(out.read_text())["ranks"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    meshc = [sys.executable, "-m", "meshllm_dsl"]
    names = [n for n in EXAMPLES if not args.only or args.only == n]
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name in names:
                runs[name].append(_round(meshc, Path(tmp), name, EXAMPLES[name], i))
    rows = [("plan", "rank", "step plan", "step run", "ratio", "range", "host CPU ratio", "peak plan", "peak run",
             "ratio")]
    keys = ("weights", "gradients", "optimizer", "activations + temporaries peak")
    for name in names:
        for r, per_rank in enumerate(zip(*runs[name])):
            planned = [x["time"]["step"]["planned"] for x in per_rank]
            measured = [x["time"]["step"]["measured"] for x in per_rank]
            ratios = [p / m for p, m in zip(planned, measured)]
            # What the model must get right before the cores are shared: one rank's host time.
            host = statistics.median(x["time"]["host CPU"]["planned"] / x["time"]["host CPU"]["measured"]
                                     for x in per_rank)
            mem = per_rank[-1]["memory"]
            peak_p = sum(mem[k]["planned"] for k in keys)
            peak_m = sum(mem[k]["measured"] for k in keys)
            rows.append((name, str(r), f"{statistics.median(planned) * 1e3:.1f} ms",
                         f"{statistics.median(measured) * 1e3:.1f} ms", f"{statistics.median(ratios):.2f}",
                         f"{min(ratios):.2f}-{max(ratios):.2f}", f"{host:.2f}", f"{peak_p / 2**10:.0f} KiB",
                         f"{peak_m / 2**10:.0f} KiB", f"{peak_p / peak_m:.2f}"))
    print_table(rows, align="ll", indent="")


if __name__ == "__main__":
    main()
