"""Context parallelism on packed documents: how evenly each `context_balance` spreads the attention
work of a row over the context ranks, and what deciding it costs the host per step.

Writes a corpus of DOCS documents of log-normal lengths (median MEDIAN tokens, cut below 4 seq) and
packs it with the runtime's Packer (the seeded order `meshc run --data` trains on).  Per step of
BATCH rows of SEQ and each number of context ranks:

* counted: each rank's query-key pairs under the document mask (runtime/parallel/context_layout.py
  ``rank_pairs``: what its attention core computes) and the busiest rank's over the mean, averaged
  over the steps (1.00: even; the step waits for the busiest);
* measured: the host time of ``layout`` for a step's rows (median over the steps), which the runtime
  runs before each step on the batch's document numbers.

    python bench/context_balance.py [--seq 8192] [--batch 16] [--ranks 2,4,8] [--steps 10] [--markdown]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import print_table
from packed_attention import _write_corpus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--median", type=int, default=300)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    from meshllm_dsl.runtime.data.packing import corpus_packer
    from meshllm_dsl.runtime.parallel import context_layout

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.tokens"
        _write_corpus(path, args.docs, args.median, 4 * args.seq, args.seed)
        packer = corpus_packer(path, seq=args.seq, seed=args.seed)
        steps = [packer.next_batch(args.batch).documents for _ in range(args.steps)]
    per_row = statistics.mean(float((d[:, 1:] != d[:, :-1]).sum(dim=1).add(1).double().mean()) for d in steps)
    print(f"{args.steps} steps of {args.batch} rows x {args.seq} tokens, {per_row:.1f} documents a row "
          f"(log-normal, median {args.median})")
    rows: list[list[object]] = [["ranks", "balance", "busiest / mean pairs", "worst step", "layout ms / step"]]
    for ranks in (int(r) for r in args.ranks.split(",")):
        for balance in context_layout.BALANCES:
            ratios, seconds = [], []
            for docs in steps:
                t = time.perf_counter()
                context_layout.layout(docs, ranks, balance)
                seconds.append(time.perf_counter() - t)
                # The step waits for the rank with the most pairs over all of its rows.
                pairs = context_layout.rank_pairs(docs, ranks, balance).sum(dim=0).double()
                ratios.append(float(pairs.max() / pairs.mean()))
            rows.append([ranks, balance, f"{statistics.mean(ratios):.3f}", f"{max(ratios):.3f}",
                         f"{statistics.median(seconds) * 1e3:.2f}"])
    print_table(rows, align="rl", markdown=args.markdown)


if __name__ == "__main__":
    main()
