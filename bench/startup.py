"""Start-up costs as ratios to bare Python baselines (issue 12's goals), interleaved, medians.

  check    `meshc check examples/llama2_70b.mesh`      / `python -c "import lark"`        goal <= 1.3
  run      `meshc run examples/tiny_llama.mesh --steps 1` / torchrun of 8 processes that only
           `import torch.distributed`                                                   goal <= 2
  verify   `meshc verify examples/llama2_70b.mesh` (seconds; also / `python -c "import torch"`)
                                                                                        goal <= 10 s

Each round runs every command once, in turn, so a busy neighbour on this shared machine slows all
of them alike; the table prints medians over rounds.  Absolute seconds depend on the machine and on
its load; compare ratios.

    python bench/startup.py [--runs 3] [--only check,run,verify]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MESHC = [PY, "-m", "meshllm_dsl"]


def _time(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="check,run,verify")
    args = ap.parse_args()
    wanted = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare.py"
        bare.write_text("import torch.distributed\n")
        commands = {
            "import lark": [PY, "-c", "import lark"],
            "import torch": [PY, "-c", "import torch"],
            "torchrun 8 x import torch.distributed": [
                PY,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "8",
                str(bare),
            ],
        }
        if "check" in wanted:
            commands["meshc check llama2_70b"] = [*MESHC, "check", "examples/llama2_70b.mesh"]
        if "run" in wanted:
            commands["meshc run tiny_llama --steps 1"] = [
                *MESHC,
                "run",
                "examples/tiny_llama.mesh",
                "--steps",
                "1",
            ]
        if "verify" in wanted:
            commands["meshc verify llama2_70b"] = [*MESHC, "verify", "examples/llama2_70b.mesh"]
        times: dict[str, list[float]] = {k: [] for k in commands}
        env_note = f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
        for _ in range(args.runs):
            for name, cmd in commands.items():
                times[name].append(_time(cmd))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median of {args.runs} interleaved rounds ({env_note} at start)")
    for name, t in med.items():
        print(f"  {name:<42} {t:7.2f} s")
    print("ratios")
    if "check" in wanted:
        print(
            f"  check / import lark                        {med['meshc check llama2_70b'] / med['import lark']:7.2f}"
            "   (goal <= 1.3)"
        )
    if "run" in wanted:
        r = med["meshc run tiny_llama --steps 1"] / med["torchrun 8 x import torch.distributed"]
        print(f"  run 1 step / torchrun bare                 {r:7.2f}   (goal <= 2)")
    if "verify" in wanted:
        v = med["meshc verify llama2_70b"]
        print(
            f"  verify / import torch                      {v / med['import torch']:7.2f}"
            f"   ({v:.1f} s; goal <= 10 s)"
        )


if __name__ == "__main__":
    main()
