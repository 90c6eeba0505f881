"""How fast `meshc check` reads a large spec: parse and check CPU time per megabyte (issue 10's goal:
a 1 MB spec checked in under 2 CPU-s end to end).

Builds a spec of about SIZE bytes from copies of examples/tiny_llama.mesh (each copy's mesh, model
and plan renamed, so every declaration is distinct and checked), then measures the CPU time of
parsing it and of checking it in this process, and of `meshc check` end to end in a subprocess
(user + system time of the child: wall time on this shared machine says more about the neighbours).

With --against DIR (a checkout of another commit, e.g. `git worktree add /tmp/base HEAD~5`), the
same measurements run on that tree's meshllm_dsl too, interleaved round by round, and the table
gains a column of ratios this tree / DIR.

    python bench/parse_speed.py [--size 1000000] [--runs 3] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import print_table

ROOT = Path(__file__).resolve().parents[1]

# Runs in a subprocess with the tree under test first on sys.path: parse and check times, in-process.
_IN_PROCESS = """
import json, sys, time
from meshllm_dsl.checker import check_declarations
from meshllm_dsl.front.load import load
from meshllm_dsl.front.parser import parse
parse("mesh warm { axes a = 1 }")  # load the grammar tables outside the timing
t = time.process_time(); decls = load(sys.argv[1]); t_parse = time.process_time() - t
t = time.process_time(); result = check_declarations(decls); t_check = time.process_time() - t
assert result.ok, result.errors[:3]
print(json.dumps({"parse": t_parse, "check": t_check, "plans": len(result.plans)}))
"""


def build(size: int) -> str:
    template = (ROOT / "examples" / "tiny_llama.mesh").read_text()
    names = re.compile(r"\b(cpu8|tiny_llama|train)\b")
    parts: list[str] = []
    total = 0
    while total < size:
        i = len(parts)
        part = names.sub(lambda m, i=i: f"{m.group(1)}{i}", template)
        parts.append(part)
        total += len(part)
    return "".join(parts)


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def measure(tree: Path, path: Path) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _IN_PROCESS, str(path)], env=_env(tree), cwd=tree,
                          capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    before = os.times()
    cli = subprocess.run([sys.executable, "-m", "meshllm_dsl", "check", str(path)], env=_env(tree), cwd=tree,
                         capture_output=True, text=True)
    after = os.times()
    assert cli.returncode == 0, cli.stderr[-500:]
    out["meshc check"] = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--against", type=Path, help="another checkout to measure side by side")
    args = ap.parse_args()
    trees = {"this": ROOT}
    if args.against is not None:
        trees["against"] = args.against.resolve()
    text = build(args.size)
    keys = ("parse", "check", "meshc check")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.mesh"
        path.write_text(text)
        best: dict[str, dict[str, float]] = {t: {} for t in trees}
        plans = 0
        for _ in range(args.runs):
            for name, tree in trees.items():
                got = measure(tree, path)
                plans = int(got["plans"])
                for key in keys:
                    best[name][key] = min(best[name].get(key, got[key]), got[key])
    mb = len(text) / 1e6
    print(f"{len(text):,} bytes, {plans} plans; CPU seconds, best of {args.runs}"
          f"{' interleaved rounds' if len(trees) > 1 else ''} ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    header = ["", "this", "MB/s"] + (["against", "MB/s", "this/against"] if len(trees) > 1 else [])
    rows = []
    for key in keys:
        v = best["this"][key]
        row = [key, f"{v:.2f}", f"{mb / v:.2f}"]
        if len(trees) > 1:
            w = best["against"][key]
            row += [f"{w:.2f}", f"{mb / w:.2f}", f"{v / w:.2f}"]
        rows.append(row)
    print_table([header, *rows])
    print("goal: meshc check of 1 MB under 2 CPU-s")


if __name__ == "__main__":
    main()
