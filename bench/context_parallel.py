"""Context parallelism on gloo ranks: activation memory per rank and K / V bytes, measured vs `meshc plan`.

The same Llama (4 layers, hidden 128, 8 heads, 2 kv heads, seq 64, batch 4) at context 1 and 4
(`layout { seq -> cp }`), and on tensor 2 x context 2 without and with sequence parallelism inside
(`seq -> tensor * cp`). Each plan is built on the worker pool and stepped once (warm-up), then:

  saved/mb   bytes autograd keeps for backward during one step, per microbatch, on rank 0 (the
             runtime's ``saved_bytes``; planner: activations per microbatch)
  kv/layer   bytes the K / V all-gathers hand back per attention layer and microbatch (k and v of
             the whole sequence, counted on the autograd Function's outputs; planner:
             kv_gather_bytes_per_layer)

    python bench/context_parallel.py
"""

from __future__ import annotations

import tempfile
from typing import Any

from _common import compile_spec, print_table

LLAMA = """
mesh m {{ axes {axes} }}
model l = llama {{ vocab = 512, hidden = 128, layers = 4, heads = 8, kv_heads = 2, ffn = 256, dtype = fp32 }}
plan p on m for l {{
    batch = 4
    seq = 64
    layout {{ {layout} }}
{rules}}}
"""
MEGATRON = """    shard blocks.*.attn.{q,k,v} column(tensor)
    shard blocks.*.attn.o row(tensor)
    shard blocks.*.mlp.{gate,up} column(tensor)
    shard blocks.*.mlp.down row(tensor)
    shard embed vocab_parallel(tensor)
    shard lm_head column(tensor)
"""
# (name, mesh axes, layout, rules): context 1 and 4, and tensor 2 x context 2 without and with
# Megatron sequence parallelism inside (`seq -> tensor * cp`).
PLANS = [
    ("cp1", "cp = 1", "seq -> cp", ""),
    ("cp4", "cp = 4", "seq -> cp", ""),
    ("tp2 cp2", "tensor = 2, cp = 2", "seq -> cp", MEGATRON),
    ("tp2 cp2 sp", "tensor = 2, cp = 2", "seq -> tensor * cp", MEGATRON),
]


def _job(ctx: Any, path: str) -> dict[str, int]:
    import torch

    from meshllm_dsl.runtime.parallel import context
    from meshllm_dsl.runtime.train.profile import saved_bytes
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, program.vocab, (program.batch, program.seq), generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    built.train_step(tokens, targets)  # warm-up: gradients, optimizer states exist
    gathered: list[int] = []
    real = context._GatherSeq

    class Counting:
        @staticmethod
        def apply(x: Any, group: Any) -> Any:
            out = real.apply(x, group)
            gathered.append(out.numel() * out.element_size())
            return out

    context._GatherSeq = Counting  # type: ignore[assignment,misc]
    try:
        with saved_bytes(exclude=built.parameters()) as saved:
            built.train_step(tokens, targets)
    finally:
        context._GatherSeq = real  # type: ignore[misc]
    return {"saved": saved["bytes"], "gathered": sum(gathered), "calls": len(gathered)}


def main() -> None:
    from meshllm_dsl.planner.analyze import analyze
    from meshllm_dsl.planner.formatting import fmt_bytes
    from meshllm_dsl.planner.formulas import kv_gather_bytes_per_layer
    from meshllm_dsl.runtime.jobs.pool import WorkerPool

    rows = [("plan", "plan saved/mb", "measured", "ratio", "plan kv/layer", "measured", "gathers")]
    with tempfile.TemporaryDirectory() as tmp, WorkerPool(world_size=4, timeout=300) as pool:
        for name, axes, layout, rules in PLANS:
            plan, path = compile_spec(LLAMA.format(axes=axes, layout=layout, rules=rules), tmp, name.replace(" ", "_"))
            got = pool.run(_job, plan.mesh.devices, path)[0]
            rc = analyze(plan).ranks[0]
            layers = plan.model.blocks
            kv_measured = got["gathered"] // max(1, layers)
            rows.append((name, fmt_bytes(rc.activation_bytes_per_microbatch), fmt_bytes(got["saved"]),
                         f"{rc.activation_bytes_per_microbatch / max(1, got['saved']):.2f}",
                         fmt_bytes(kv_gather_bytes_per_layer(plan)), fmt_bytes(kv_measured), str(got["calls"])))
    print_table(rows, align="r", indent="")


if __name__ == "__main__":
    main()
