"""Planner vs measured activation memory, per rank, for plans that run on this machine.

Each plan is compiled by meshc, built on a pool of gloo workers, stepped once (so gradients and
optimizer states exist), then stepped again while the runtime's ``LiveBytes`` counts every tensor
the step allocates (activations, the pipeline's buffers, temporaries) and ``saved_bytes`` counts
what autograd keeps for backward.  Printed next to `meshc plan`'s numbers:

  saved/mb   bytes saved for backward per microbatch (planner: activations per microbatch)
  held       saved x the microbatches in flight at the peak (planner: activations)
  peak       the step's peak of live bytes beyond weights / grads / optimizer states
             (planner: activations + its transient estimate)

    python bench/activation_memory.py [--only NAME]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from _common import compile_spec, print_table

ROOT = Path(__file__).resolve().parents[1]

LLAMA = """
mesh m {{ axes {axes} }}
model l = llama {{ vocab = 512, hidden = 128, layers = 4, heads = 8, kv_heads = 2, ffn = 256, dtype = fp32 }}
plan p on m for l {{
    batch = {batch}
    seq = 64
    microbatches = {m}
    recompute = {recompute}
    {rules}
}}
"""
TP_RULES = "layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }"

CASES: dict[str, str] = {
    "tiny_llama (d2 p2 t2, 1f1b)": (ROOT / "examples" / "tiny_llama.mesh").read_text(),
    "tiny_gpt2 (p2 t2, gpipe)": (ROOT / "examples" / "tiny_gpt2.mesh").read_text(),
    "llama single": LLAMA.format(axes="tensor = 1", batch=4, m=1, rules="", recompute="none"),
    "llama t2": LLAMA.format(axes="tensor = 2", batch=4, m=1, rules=TP_RULES, recompute="none"),
    "llama p2 t2 1f1b m4": LLAMA.format(
        axes="pipeline = 2, tensor = 2",
        batch=8,
        m=4,
        rules=TP_RULES + "\n    stages over pipeline balanced\n    schedule 1f1b",
        recompute="none",
    ),
    # Activation recomputation on and off (`recompute = blocks | attention`).
    **{
        f"llama t2 recompute {mode}": LLAMA.format(
            axes="tensor = 2", batch=4, m=1, rules=TP_RULES, recompute=mode
        )
        for mode in ("blocks", "attention")
    },
    **{
        f"llama p2 t2 1f1b m4 recompute {mode}": LLAMA.format(
            axes="pipeline = 2, tensor = 2",
            batch=8,
            m=4,
            rules=TP_RULES + "\n    stages over pipeline balanced\n    schedule 1f1b",
            recompute=mode,
        )
        for mode in ("blocks", "attention")
    },
    # Sequence parallelism (`layout { seq -> tensor }`): norms, block inputs and column inputs / t.
    "llama t2 seqpar": LLAMA.format(
        axes="tensor = 2", batch=4, m=1, rules=TP_RULES.replace(" }", ", seq -> tensor }"), recompute="none"
    ),
    "llama t2 seqpar recompute blocks": LLAMA.format(
        axes="tensor = 2", batch=4, m=1, rules=TP_RULES.replace(" }", ", seq -> tensor }"), recompute="blocks"
    ),
    "llama p2 t2 1f1b m4 seqpar": LLAMA.format(
        axes="pipeline = 2, tensor = 2",
        batch=8,
        m=4,
        rules=TP_RULES.replace(" }", ", seq -> tensor }") + "\n    stages over pipeline balanced\n    schedule 1f1b",
        recompute="none",
    ),
}


def _job(ctx: Any, path: str, m: int) -> dict[str, int]:
    import torch

    from meshllm_dsl.runtime.train.profile import LiveBytes, saved_bytes
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, program.vocab, (program.batch, program.seq), generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    built.train_step(tokens, targets)  # warm-up: gradients, optimizer states, schedules exist
    with saved_bytes(exclude=built.parameters()) as saved:
        built.train_step(tokens, targets)
    live = LiveBytes()
    with live:
        built.train_step(tokens, targets)
    return {"saved_per_mb": saved["bytes"] // m, "peak": live.peak, "peak_op": live.peak_op}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    args = ap.parse_args()

    from meshllm_dsl.planner.analyze import analyze
    from meshllm_dsl.planner.formatting import fmt_bytes
    from meshllm_dsl.runtime.jobs.pool import WorkerPool

    rows = []
    with tempfile.TemporaryDirectory() as tmp, WorkerPool(world_size=8, timeout=300) as pool:
        for i, (name, text) in enumerate(CASES.items()):
            if args.only and args.only not in name:
                continue
            plan, path = compile_spec(text, tmp, f"case{i}")
            measured = pool.run(_job, plan.mesh.devices, path, plan.microbatches)
            rep = analyze(plan)
            by_coord = {rc.coord: rc for rc in rep.ranks}
            for coord, rc in sorted(by_coord.items()):
                rank = rc.ranks[0]
                got = measured[rank]
                held = got["saved_per_mb"] * rc.in_flight // max(1, len(rc.stages))
                predicted_peak = rc.activation_bytes + rc.transient_bytes
                rows.append(
                    (
                        name,
                        f"pp {coord} (rank {rank})",
                        fmt_bytes(rc.activation_bytes_per_microbatch),
                        fmt_bytes(got["saved_per_mb"]),
                        f"{rc.activation_bytes_per_microbatch / max(1, got['saved_per_mb']):.2f}",
                        fmt_bytes(rc.activation_bytes),
                        fmt_bytes(held),
                        fmt_bytes(predicted_peak),
                        fmt_bytes(got["peak"]),
                        f"{predicted_peak / max(1, got['peak']):.2f}",
                        got["peak_op"],
                    )
                )
    header = (
        "plan",
        "rank",
        "plan saved/mb",
        "measured",
        "ratio",
        "plan held",
        "measured held",
        "plan peak",
        "measured peak",
        "ratio",
        "peak after",
    )
    print_table([header, *rows], align="ll", indent="")


if __name__ == "__main__":
    main()
