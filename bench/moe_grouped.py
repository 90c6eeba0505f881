"""Grouped expert matmuls against the per-expert loop: forward + backward tokens/s of one moe
layer's experts, side by side in one run.

  grouped   one ``torch._grouped_mm`` per projection (runtime/moe/grouped.py), what
            ``experts_swiglu`` runs where the probe and the layouts allow
  loop      ``F.linear`` per expert (the same function with the grouped path switched off)

The layer: 64 experts, top-8 routing (``moe.route``, renormalised), StackedLinear weights, tokens
[T, hidden] in one batch; each repetition is a forward, a backward of <out, fixed cotangent> and
nothing else (router excluded). Repetitions alternate between the two paths, so a swing of the
shared cores falls on both alike; the table gives the median time, tokens/s, the ratio to the
loop, and how far the grouped output is from the loop's.

    python bench/moe_grouped.py [--tokens 4096] [--hidden 512] [--ffn 256] [--reps 5] [--dtypes fp32]

bf16 / fp16 (``--dtypes fp32,bf16``) are worth timing where the CPU or GPU has bf16 matmuls; on an
AVX2 CPU torch converts them and both paths crawl.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from typing import Any
from unittest import mock

from _common import print_table

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _layer(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, dtype: Any) -> dict[str, Any]:
    import torch

    from meshllm_dsl.runtime.moe import experts as moe

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(experts, hidden, generator=gen) / hidden**0.5
    weights, idx, _ = moe.route(x, router, top_k, True, True)
    gate, up = moe.StackedLinear(experts, hidden, ffn), moe.StackedLinear(experts, hidden, ffn)
    down = moe.StackedLinear(experts, ffn, hidden)
    params = [m.weight.detach().to(dtype).requires_grad_(True) for m in (gate, up, down)]
    return {"x": x.to(dtype).requires_grad_(True), "idx": idx, "weights": weights.requires_grad_(True),
            "params": params, "cot": torch.randn(tokens, hidden, generator=gen).to(dtype)}


def _step(layer: dict[str, Any]) -> Any:
    from meshllm_dsl.runtime.moe import experts as moe

    for t in (layer["x"], layer["weights"], *layer["params"]):
        t.grad = None
    out = moe.moe_experts(layer["x"], layer["idx"], layer["weights"], *layer["params"])
    (out * layer["cot"]).sum().backward()
    return out.detach()


def _timed(layer: dict[str, Any], loop: bool) -> tuple[float, Any]:
    from meshllm_dsl.runtime.moe import experts as moe

    with mock.patch.object(moe, "grouped_runs", return_value=False) if loop else nullcontext():
        start = time.perf_counter()
        out = _step(layer)
        return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32", help=f"comma-separated, of {', '.join(DTYPES)}")
    args = ap.parse_args()

    import torch

    from meshllm_dsl.runtime.moe import experts as moe
    from meshllm_dsl.runtime.moe import grouped

    rows: list[tuple[object, ...]] = [("dtype", "path", "median fwd+bwd", "tokens/s", "vs loop", "max |grouped - loop|")]
    for name in args.dtypes.split(","):
        dtype = getattr(torch, DTYPES[name])
        layer = _layer(args.tokens, args.hidden, args.ffn, args.experts, args.top_k, dtype)
        gate, up, down = (p.transpose(0, 1) for p in layer["params"])
        assert grouped.grouped_runs(layer["x"], gate, up, down), f"{name}: the grouped path would not run"
        assert moe.grouped_runs is grouped.grouped_runs
        times: dict[str, list[float]] = {"grouped": [], "loop": []}
        outs: dict[str, Any] = {}
        for loop in (False, True):  # warm-up: the probe, the allocator, the thread pool
            _timed(layer, loop)
        for _ in range(args.reps):
            for path in times:
                took, outs[path] = _timed(layer, path == "loop")
                times[path].append(took)
        med = {k: statistics.median(v) for k, v in times.items()}
        diff = (outs["grouped"].float() - outs["loop"].float()).abs().max().item()
        for path, t in med.items():
            rows.append((name, path, f"{t * 1e3:.0f} ms", f"{args.tokens / t:,.0f}", f"{med['loop'] / t:.2f}x",
                         f"{diff:.2e}" if path == "grouped" else ""))
    print(f"moe experts: {args.experts} experts, top {args.top_k}, hidden {args.hidden}, ffn {args.ffn}, "
          f"{args.tokens} tokens; {args.reps} interleaved repetitions, median; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print_table(rows)


if __name__ == "__main__":
    main()
