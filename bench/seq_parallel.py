"""Sequence parallelism on and off: step time and the collectives it issues, measured side by side.

The same Llama-shaped plan (tensor parallel 2 on gloo) compiled twice by meshc, without and with
`seq -> tensor`. Both are built in the same worker processes from the same seed; they alternate
rounds of training steps, and the table prints median step times, the collectives of one step
(calls and bytes handed to torch.distributed, from `runtime/train/profile.py`'s CollectiveLog) and the
ratios SP / TP. On CPU gloo the reduce-scatter is not native (DESIGN.md): this measures what SP
costs there, not what it costs on NCCL.

    python bench/seq_parallel.py [--rounds 5] [--steps 3] [--hidden 256] [--seq 256]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from _common import compile_spec, print_table

SPEC = """
mesh m {{ axes tensor = 2 }}
model l = llama {{ vocab = 1024, hidden = {hidden}, layers = 4, heads = 8, kv_heads = 4, ffn = {ffn}, dtype = fp32 }}
plan p on m for l {{
    batch = 4
    seq = {seq}
    layout {{ heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor{sp} }}
}}
"""


def _job(ctx: Any, paths: dict[str, str], rounds: int, steps: int) -> dict[str, Any]:
    import torch

    from meshllm_dsl.runtime.train.profile import CollectiveLog
    from meshllm_dsl.verify.equivalence import load_generated

    built, losses = {}, {}
    for name, path in paths.items():
        program = load_generated(path).PROGRAM
        built[name] = program.build(ctx.mesh(program.axes), seed=0)
    program = load_generated(paths["tp"]).PROGRAM
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, program.vocab, (program.batch, program.seq), generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    comms: dict[str, list[tuple[str, str, int, int, float]]] = {}
    for name, b in built.items():
        losses[name] = b.train_step(tokens, targets)  # warm-up, and the same first loss both ways
        with CollectiveLog(b.mesh) as log:
            b.train_step(tokens, targets)
        comms[name] = [(axes, op, int(c), int(b), t) for (axes, op), (c, b, t, _cpu) in sorted(log.stats.items())]
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(rounds):
        for name, b in built.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                b.train_step(tokens, targets)
            times[name].append((time.perf_counter() - t0) / steps)
    return {"losses": losses, "times": times, "comms": comms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()

    from meshllm_dsl.runtime.jobs.pool import WorkerPool

    paths = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sp in (("tp", ""), ("sp", ", seq -> tensor")):
            text = SPEC.format(hidden=args.hidden, ffn=4 * args.hidden, seq=args.seq, sp=sp)
            paths[name] = compile_spec(text, tmp, f"bench_{name}")[1]
        with WorkerPool(world_size=2) as pool:
            out = pool.run(_job, 2, paths, args.rounds, args.steps)[0]
    print(f"llama hidden {args.hidden}, 4 layers, batch 4 x seq {args.seq}, tensor 2 on gloo; "
          f"step-0 loss tp {out['losses']['tp']:.6f} sp {out['losses']['sp']:.6f}")
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    print_table([("", "tensor parallel", "+ sequence parallel", "ratio"),
                 ("step (median)", f"{med['tp'] * 1e3:.1f} ms", f"{med['sp'] * 1e3:.1f} ms", f"{med['sp'] / med['tp']:.2f}")],
                indent="")
    for name in ("tp", "sp"):
        total = sum(t for *_, t in out["comms"][name])
        print(f"collectives of one step, {name} (rank 0; bytes = the first tensor argument): {total * 1e3:.1f} ms")
        print_table([("op", "over", "calls", "MiB", "time"),
                     *((op, axes, calls, f"{nbytes / 2**20:.2f}", f"{t * 1e3:.1f} ms")
                       for axes, op, calls, nbytes, t in out["comms"][name])], align="ll", indent="    ")

if __name__ == "__main__":
    main()
