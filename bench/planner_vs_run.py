"""The planner's step time and per-rank peak memory vs a measured run, for the example plans that run
on this machine, with the device measured by `meshc calibrate` (as many processes as the plan has).

For each example: `meshc calibrate --ranks N` -> devices.mesh, a copy of the example that includes it
and names it, `meshc run --steps 1 --profile JSON`, then per rank: predicted / measured for the step
time and for peak memory (weights + gradients + optimizer states + activations and temporaries).
Goals (issue 12): step time within 25%, peak memory within 5%.

    python bench/planner_vs_run.py [--only tiny_gpt2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"tiny_llama": 8, "tiny_gpt2": 4, "tiny_llama_fsdp": 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only")
    args = ap.parse_args()
    meshc = [sys.executable, "-m", "meshllm_dsl"]
    rows = [("plan", "rank", "step plan", "step run", "ratio", "peak plan", "peak run", "ratio")]
    with tempfile.TemporaryDirectory() as tmp:
        for name, ranks in EXAMPLES.items():
            if args.only and args.only != name:
                continue
            d = Path(tmp) / name
            d.mkdir()
            subprocess.run([*meshc, "calibrate", "--ranks", str(ranks), "-o", str(d / "devices.mesh")],
                           check=True, capture_output=True)
            text = (ROOT / "examples" / f"{name}.mesh").read_text()
            spec = d / f"{name}.mesh"
            spec.write_text('include "devices.mesh"\n' + text.replace("device = cpu", "device = calibrated"))
            out = d / "profile.json"
            subprocess.run([*meshc, "run", str(spec), "--steps", "1", "--profile", str(out)],
                           check=True, capture_output=True)
            data = json.loads(out.read_text())
            for r in data["ranks"]:
                t = r["time"]["step"]
                mem = r["memory"]
                keys = ("weights", "gradients", "optimizer", "activations + temporaries peak")
                planned = sum(mem[k]["planned"] for k in keys)
                measured = sum(mem[k]["measured"] for k in keys)
                rows.append((name, str(r["rank"]), f"{t['planned'] * 1e3:.1f} ms", f"{t['measured'] * 1e3:.1f} ms",
                             f"{t['planned'] / t['measured']:.2f}", f"{planned / 2**10:.0f} KiB",
                             f"{measured / 2**10:.0f} KiB", f"{planned / measured:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    main()
