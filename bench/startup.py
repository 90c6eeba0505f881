"""Start-up costs as ratios to bare Python baselines (issue 12's goals), interleaved, medians.

  check    `meshc check examples/llama2_70b.mesh`      / `python -c "import lark"`        goal <= 1.3
  run      `meshc run examples/tiny_llama.mesh --steps 1` / torchrun of 8 processes that only
           `import torch.distributed`                                                   goal <= 2
  verify   `meshc verify examples/llama2_70b.mesh` (seconds; also / `python -c "import torch"`)
                                                                                        goal <= 10 s

Each round runs every command once, in turn, so a busy neighbour on this shared machine slows all
of them alike; the table prints medians over rounds, of wall time and of CPU time (user + system of
the command and its children: less disturbed by a loaded machine).  Absolute seconds depend on the
machine and on its load; compare ratios.  With --against DIR (a checkout of another commit), `meshc
check` of that tree runs in the same rounds, for a before / after ratio.

By default modules are compiled as the environment says: a checkout run with PYTHONDONTWRITEBYTECODE
(as on the shared machines) compiles every meshllm_dsl module from source at each start, while Lark
and the standard library come precompiled.  --compiled measures what an installed meshllm starts in
(pip writes bytecode at install): every command reads bytecode from a private PYTHONPYCACHEPREFIX,
written by one warm-up run of each command.

    python bench/startup.py [--runs 3] [--only check,run,verify] [--against DIR] [--compiled]
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

from _common import print_table

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MESHC = [PY, "-m", "meshllm_dsl"]


def _time(cmd: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of one run."""
    before = os.times()
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    took = time.perf_counter() - start
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return took, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="check,run,verify")
    ap.add_argument("--against", type=Path, help="another checkout whose `meshc check` runs alongside")
    ap.add_argument("--compiled", action="store_true", help="with bytecode for every module, as installed")
    args = ap.parse_args()
    wanted = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare.py"
        bare.write_text("import torch.distributed\n")
        # Only the baselines the wanted ratios need (torchrun of 8 processes alone takes ~20 s).
        commands = {"import lark": [PY, "-c", "import lark"]}
        if "verify" in wanted:
            commands["import torch"] = [PY, "-c", "import torch"]
        if "run" in wanted:
            commands["torchrun 8 x import torch.distributed"] = [
                PY,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "8",
                str(bare),
            ]
        envs: dict[str, dict[str, str]] = {}
        cwds: dict[str, Path] = {}
        if "check" in wanted:
            commands["meshc check llama2_70b"] = [*MESHC, "check", "examples/llama2_70b.mesh"]
            if args.against is not None:  # run from that tree: `-m` puts the working directory first
                against = args.against.resolve()
                commands["meshc check llama2_70b (against)"] = commands["meshc check llama2_70b"]
                envs["meshc check llama2_70b (against)"] = {**os.environ, "PYTHONPATH": str(against)}
                cwds["meshc check llama2_70b (against)"] = against
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
        if args.compiled:
            cache = {"PYTHONPYCACHEPREFIX": str(Path(tmp) / "pycache")}
            for name in commands:
                env = {k: v for k, v in envs.get(name, os.environ).items() if k != "PYTHONDONTWRITEBYTECODE"}
                envs[name] = {**env, **cache}
                _time(commands[name], cwds.get(name, ROOT), envs[name])  # writes the bytecode
        times: dict[str, list[float]] = {k: [] for k in commands}
        cpus: dict[str, list[float]] = {k: [] for k in commands}
        env_note = f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
        for _ in range(args.runs):
            for name, cmd in commands.items():
                wall, cpu = _time(cmd, cwds.get(name, ROOT), envs.get(name))
                times[name].append(wall)
                cpus[name].append(cpu)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpus.items()}
    mode = "all bytecode precompiled" if args.compiled else (
        "meshllm_dsl compiled from source at each start" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "bytecode as found")
    print(f"median of {args.runs} interleaved rounds ({env_note} at start; {mode})")
    print_table([("", "wall", "CPU"), *((name, f"{t:.2f} s", f"{cpu_med[name]:.2f} s") for name, t in med.items())])

    def ratio(a: str, b: str, note: str = "") -> tuple[str, str, str]:
        return f"{med[a] / med[b]:.2f}", f"{cpu_med[a] / max(cpu_med[b], 1e-9):.2f}", note

    ratios = [("ratios", "wall", "CPU", "")]
    if "check" in wanted:
        c, lark = "meshc check llama2_70b", "import lark"
        ratios.append(("check / import lark", *ratio(c, lark, "(goal <= 1.3)")))
        if args.against is not None:
            a = "meshc check llama2_70b (against)"
            ratios.append(("check (against) / import lark", *ratio(a, lark)))
            ratios.append(("check / check (against)", *ratio(c, a)))
    if "run" in wanted:
        r = med["meshc run tiny_llama --steps 1"] / med["torchrun 8 x import torch.distributed"]
        ratios.append(("run 1 step / torchrun bare", f"{r:.2f}", "", "(goal <= 2)"))
    if "verify" in wanted:
        v = med["meshc verify llama2_70b"]
        ratios.append(("verify / import torch", f"{v / med['import torch']:.2f}", "", f"({v:.1f} s; goal <= 10 s)"))
    if len(ratios) > 1:
        print_table(ratios, align="lrrl", indent="")

if __name__ == "__main__":
    main()
