"""Step time of an 8-rank expert-parallel Mixtral (`experts -> data`) against the same model and
batches data-parallel only (every rank holds all experts), on gloo ranks.

Both plans run in the same 8 processes, alternating rounds of steps; prints a table of the median
step, the parameters each rank holds, and the planner's estimate for the same plans on the `cpu`
profile. Expert parallelism moves every (token, choice) row to its expert's rank and back
(4 all-to-alls per moe layer and step) but all-reduces only the dense gradients and runs each
expert on 8x the tokens.

    python bench/moe_expert_parallel.py [--rounds 3] [--steps 3] [--ranks 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

from _common import compile_spec, interleaved_steps, print_table

SPEC = """
mesh m {{ axes data = {ranks}
    device = cpu
}}
model mx = mixtral {{ vocab = 512, hidden = 128, layers = 4, heads = 4, kv_heads = 2, ffn = 256, experts = 8,
                     top_k = 2, dtype = fp32 }}
plan p on m for mx {{
    batch = {batch}
    seq = 64
    layout {{ batch -> data{experts} }}
}}
"""


def _job(ctx: Any, paths: dict[str, str], ranks: int, batch: int, rounds: int, steps: int) -> dict[str, Any]:
    import torch

    from meshllm_dsl.verify.equivalence import load_generated

    built = {k: load_generated(p).PROGRAM.build(ctx.mesh((("data", ranks),)), seed=0) for k, p in paths.items()}
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (batch, 64), generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    losses = {k: b.train_step(tokens, targets) for k, b in built.items()}  # warm-up, and the same loss
    times = interleaved_steps(built, tokens, targets, rounds, steps)
    held = {k: sum(q.numel() for q in b.parameters()) for k, b in built.items()}
    return {"times": times, "held": held, "loss": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    args = ap.parse_args()

    from meshllm_dsl.planner import analyze as planner
    from meshllm_dsl.runtime.jobs.pool import WorkerPool

    batch = 2 * args.ranks
    estimates = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for key, experts in (("data only", ""), ("experts -> data", ", experts -> data")):
            text = SPEC.format(ranks=args.ranks, batch=batch, experts=experts)
            plan, paths[key] = compile_spec(text, tmp, key.replace(" ", "_").replace(">", ""))
            estimates[key] = planner.analyze(plan).step.total_s
        with WorkerPool(world_size=args.ranks, timeout=900.0) as pool:
            out = pool.run(_job, args.ranks, paths, args.ranks, batch, args.rounds, args.steps)[0]
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    base = med["data only"]
    print(f"mixtral 4 layers x 8 experts (top 2), hidden 128, ffn 256; batch {batch} x seq 64 on {args.ranks} gloo ranks")
    print_table([("plan", "median step", "vs data only", "params / rank", "planned (cpu)", "first loss"),
                 *((k, f"{v * 1e3:.1f} ms", f"{v / base:.2f}x", f"{out['held'][k]:,}", f"{estimates[k] * 1e3:.1f} ms",
                    f"{out['loss'][k]:.6f}") for k, v in med.items())])

if __name__ == "__main__":
    main()
