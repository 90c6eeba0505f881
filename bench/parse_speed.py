"""How fast `meshc check` reads a large spec: parse and check time per megabyte.

Builds a spec of about SIZE bytes from copies of examples/tiny_llama.mesh (each copy's mesh, model
and plan renamed, so every declaration is distinct and checked), then measures, in this process, the
CPU time of parsing it and of checking it, and `meshc check` end to end in a subprocess.

    python bench/parse_speed.py [--size 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from meshllm_dsl.checker import check_declarations
    from meshllm_dsl.load import load
    from meshllm_dsl.parser import parse

    text = build(args.size)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.mesh"
        path.write_text(text)
        parse("mesh warm { axes a = 1 }")  # load the grammar tables outside the timing
        best: dict[str, float] = {}
        for _ in range(args.runs):
            t = time.process_time()
            decls = load(path)
            t_parse = time.process_time() - t
            t = time.process_time()
            result = check_declarations(decls)
            t_check = time.process_time() - t
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-P", "-m", "meshllm_dsl", "check", str(path)], capture_output=True)
            t_cli = time.perf_counter() - t
            assert proc.returncode == 0 and result.ok, proc.stderr[-500:]
            for key, v in (("parse", t_parse), ("check", t_check), ("meshc check", t_cli)):
                best[key] = min(best.get(key, v), v)
    mb = len(text) / 1e6
    print(f"{len(text):,} bytes, {len(result.plans)} plans (best of {args.runs})")
    for key, v in best.items():
        unit = "wall" if key == "meshc check" else "CPU"
        print(f"  {key:12s} {v:6.2f} s {unit}  ({mb / v:.2f} MB/s)")


if __name__ == "__main__":
    main()
