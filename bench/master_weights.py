"""bf16 training with and without fp32 master weights, against an fp32 run of the same plan.

One small Llama on 2 gloo ranks (data 2, ZeRO-3 by FSDP2), the same initial weights and batches,
trained for --steps AdamW steps three ways:

  fp32          every dtype fp32 (the reference)
  bf16          `dtype = bf16`: weights, gradients and AdamW moments in bf16 (updates smaller than
                half a bf16 ulp of a weight round away)
  bf16+master   `precision { params = bf16, master = fp32, reduce = fp32 }`: bf16 compute, fp32
                master weights and moments, gradients reduced in fp32 (FSDP2 MixedPrecisionPolicy)

Printed: the loss of each run at a few steps and the mean / last |loss - fp32 loss| over the steps,
for each learning rate (the smaller it is, the more of bf16's updates round away).

    python bench/master_weights.py [--steps 60] [--lr 1e-3 1e-4]
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

from _common import compile_spec, print_table

SPEC = """
mesh m {{ axes data = 2 }}
model l = llama {{ vocab = 256, hidden = 128, layers = 4, heads = 8, kv_heads = 4, ffn = 256, dtype = {dtype} }}
plan p on m for l {{
    batch = 8
    seq = 64
    layout {{ batch -> data }}
    {precision}
    optimizer adamw {{ zero 3
        lr = {lr} }}
}}
"""

RUNS = {
    "fp32": ("fp32", ""),
    "bf16": ("bf16", ""),
    "bf16+master": ("bf16", "precision { params = bf16, master = fp32, reduce = fp32 }"),
}


def _train(ctx: Any, path: str, steps: int) -> list[float]:
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    return [built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, s)) for s in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-3, 1e-4])
    args = ap.parse_args()

    from meshllm_dsl.runtime.jobs.pool import WorkerPool

    with WorkerPool(world_size=2, timeout=900.0) as pool, tempfile.TemporaryDirectory() as tmp:
        for lr in args.lr:
            losses: dict[str, list[float]] = {}
            for name, (dtype, precision) in RUNS.items():
                text = SPEC.format(dtype=dtype, precision=precision, lr=lr)
                path = compile_spec(text, tmp, f"{name.replace('+', '_')}_{lr}")[1]
                losses[name] = pool.run(_train, 2, path, args.steps)[0]
            ref = losses["fp32"]
            marks = sorted({0, 9, args.steps // 2, args.steps - 1})
            print(f"\nlr {lr:g}, {args.steps} steps (llama hidden 128 x 4 layers, data 2, ZeRO-3)")
            gaps = {name: [abs(a - b) for a, b in zip(ls, ref)] for name, ls in losses.items()}
            mean = {name: sum(g) / len(g) for name, g in gaps.items()}
            rows: list[tuple[str, ...]] = [("run", *(f"loss@{s}" for s in marks), "mean gap", "last gap", "ratio")]
            for name, ls in losses.items():
                ratio = "" if name == "fp32" else f"{mean[name] / max(mean['bf16+master'], 1e-12):.1f}"
                rows.append((name, *(f"{ls[s]:.4f}" for s in marks), f"{mean[name]:.4f}", f"{gaps[name][-1]:.4f}", ratio))
            print_table(rows, indent="")
            print("ratio: mean gap to fp32 / that of bf16+master")


if __name__ == "__main__":
    main()
