"""Float8 matmuls and compiled blocks: tokens/s of one plan four ways, side by side in one run.

  bf16            bf16 parameters and matmuls, eager
  compiled        + `compile = blocks` (torch.compile per block)
  fp8             + `matmul = fp8_tensorwise` (torchao), eager
  compiled+fp8    both

Each run is `meshc run --steps N --metrics FILE`; the table gives the median tokens/s of the second
half of the steps (compilation and warm-up excluded), its ratio to the bf16 run, and the last loss.
On a CUDA machine (one GPU) the model is a 4-block Llama of hidden 2048 at seq 2048, where the
matmuls dominate; without CUDA a tiny one on one CPU rank, where torchao emulates float8 (slower:
the casts are extra work and the matmuls stay in bf16) and compiling takes minutes.

    python bench/float8.py [--steps 30] [--only bf16,fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import print_table

SPEC = """
mesh one {{
    axes data = 1
    device = {device}
}}
model m = llama {{ vocab = {vocab}, hidden = {hidden}, layers = 4, heads = {heads}, kv_heads = {kv}, ffn = {ffn}, dtype = bf16 }}
plan p on one for m {{
    batch = {batch}
    seq = {seq}
    {compile}
    layout {{ batch -> data }}
    {matmul}
    optimizer adamw {{ lr = 0.0003 }}
}}
"""

RUNS = {"bf16": (False, ""), "compiled": (True, ""), "fp8": (False, "fp8_tensorwise"),
        "compiled+fp8": (True, "fp8_tensorwise")}


def _shape(cuda: bool) -> dict[str, object]:
    if cuda:
        return {"device": "h200", "vocab": 32000, "hidden": 2048, "heads": 16, "kv": 8, "ffn": 8192, "batch": 4,
                "seq": 2048}
    return {"device": "cpu", "vocab": 256, "hidden": 256, "heads": 4, "kv": 2, "ffn": 512, "batch": 4, "seq": 128}


def run(name: str, steps: int, cuda: bool, work: Path) -> tuple[float, float]:
    compile_blocks, matmul = RUNS[name]
    spec = work / f"{name.replace('+', '_')}.mesh"
    spec.write_text(SPEC.format(**_shape(cuda), compile="compile = blocks" if compile_blocks else "",
                                matmul=f"precision {{ matmul = {matmul} }}" if matmul else ""))
    metrics = work / f"{spec.stem}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "meshllm_dsl", "run", str(spec), "--steps", str(steps),
                           "--metrics", str(metrics), "--timeout", "900"],
                          env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    late = [r["tokens_per_s"] for r in rows[len(rows) // 2:]]
    return statistics.median(late), float(rows[-1]["loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", default=",".join(RUNS), help="comma-separated runs (default: all four)")
    args = p.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    names = [n for n in args.only.split(",") if n]
    results: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            results[name] = run(name, args.steps, cuda, Path(d))
    base = results.get("bf16", next(iter(results.values())))[0]
    where = torch.cuda.get_device_name() if cuda else "CPU, one rank (float8 emulated)"
    print(f"{where}, torch {torch.__version__}, {args.steps} steps; tokens/s: median of the second half")
    print_table([("run", "tokens/s", "vs bf16", "last loss"),
                 *((n, f"{t:,.0f}", f"{t / base:.2f}x", f"{loss:.4f}") for n, (t, loss) in results.items())],
                align="lrrr")


if __name__ == "__main__":
    main()
