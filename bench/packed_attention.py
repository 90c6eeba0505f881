"""Packed documents with a document mask (`pack = documents`) against the same rows attended
causally across documents: the attention work per step, counted, and the attention's measured time.

Writes a corpus of DOCS documents of mixed lengths (log-normal, median MEDIAN tokens, cut at 4 seq:
many short ones and a few that span rows) and packs it with the runtime's Packer (the seeded order
`meshc run --data` trains on).  Per step of BATCH rows of SEQ:

* counted: the attention core's query-key pairs and flops (q k^T and p v, 2 flops per pair and
  head dim each, forward; backward twice that) under the document mask (a query sees its own
  document's earlier keys: L (L + 1) / 2 pairs per document of L tokens) and full causal (s (s + 1)
  / 2 per row), and the planner's count (`meshc plan --data`: over all keys of a query's document,
  sum of L^2, against seq^2 a row; the same ratio up to the causal halves' diagonal);
* measured: torch's scaled_dot_product_attention forward + backward on CPU, with the explicit
  boolean block-causal mask the runtime builds on CPU (runtime/model/documents.py same_document)
  and with is_causal=True, in interleaved rounds (median), and their ratio.  SDPA's CPU kernels do
  not skip a masked-out block, so the measured ratio says what the mask costs there, not what the
  counted work saves; flash / flex kernels on a GPU skip the blocks between documents.

    python bench/packed_attention.py [--seq 1024] [--batch 4] [--heads 8] [--head-dim 64]
                                     [--steps 20] [--rounds 3] [--markdown]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import print_table

EOS, VOCAB = 0, 1000


def _write_corpus(path: Path, docs: int, median: int, longest: int, seed: int) -> None:
    """A token file of ``docs`` documents of log-normal lengths (each ended by EOS) with its document index."""
    from meshllm_dsl.runtime.data.corpus import write_sidecars
    from meshllm_dsl.runtime.train.tokens import TOKEN_MAGIC

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.2, size=docs).astype(np.int64), 1, longest - 1)
    ids = np.concatenate([np.append(rng.integers(1, VOCAB, size=n), EOS) for n in lengths])
    with open(path, "wb") as f:
        f.write(TOKEN_MAGIC + np.array([2, VOCAB], dtype="<u4").tobytes())
        ids.astype("<u2").tofile(f)
    write_sidecars(path, np.concatenate([[0], np.cumsum(lengths + 1)]), None)


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--median", type=int, default=120, help="median document length in tokens")
    ap.add_argument("--steps", type=int, default=20, help="steps of the packed order counted")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of each attention (median)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from meshllm_dsl.runtime.data.corpus import open_corpus
    from meshllm_dsl.runtime.data.packing import Packer
    from meshllm_dsl.runtime.model.documents import Packing, same_document

    s, b, h, d = args.seq, args.batch, args.heads, args.head_dim
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mixed.tok"
        _write_corpus(path, args.docs, args.median, 4 * s, seed=0)
        packer = Packer([(open_corpus(path), 1.0)], seq=s, seed=0)
        batches = [packer.next_batch(b) for _ in range(args.steps)]

    causal_pairs = masked_pairs = squares = 0
    documents = 0
    for batch in batches:
        for row in batch.documents:
            lengths = torch.bincount(row).to(torch.int64)
            documents += len(lengths)
            masked_pairs += int((lengths * (lengths + 1) // 2).sum())
            squares += int((lengths * lengths).sum())
            causal_pairs += s * (s + 1) // 2
    per_step = 1.0 / args.steps
    flops_per_pair = 3 * 2 * 2 * d * h  # q k^T and p v, forward and backward (twice), every head

    # Timed: the first step's rows, one attention layer's core, forward and backward.
    docs = batches[0].documents
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = same_document(causal, Packing(docs, docs, None))  # [b, 1, s, s]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, generator=gen)

    def masked() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(grad)

    def full() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    masked(), full()  # warm-up
    t_masked, t_causal = [], []
    for _ in range(args.rounds):  # interleaved: a swing of the shared cores falls on both
        t_masked.append(_seconds(masked))
        t_causal.append(_seconds(full))
    tm, tc = statistics.median(t_masked), statistics.median(t_causal)

    rows: list[list[object]] = [["per step", "document mask", "full causal", "ratio"]]
    rows.append(["query-key pairs", f"{masked_pairs * per_step:,.0f}", f"{causal_pairs * per_step:,.0f}",
                 f"{masked_pairs / causal_pairs:.3f}"])
    rows.append(["attention flops (fwd + bwd, one layer)", f"{masked_pairs * per_step * flops_per_pair:.3e}",
                 f"{causal_pairs * per_step * flops_per_pair:.3e}", f"{masked_pairs / causal_pairs:.3f}"])
    rows.append(["planner's count (sum L^2 vs seq^2)", f"{squares * per_step:,.0f}", f"{s * s * b:,}",
                 f"{squares / (s * s * b * args.steps):.3f}"])
    rows.append(["SDPA fwd + bwd on CPU, step 1 (s)", f"{tm:.3f}", f"{tc:.3f}", f"{tm / tc:.2f}"])
    print(f"{args.steps} steps of {b} rows x seq {s} packed from {args.docs:,} documents (median {args.median} "
          f"tokens), {documents / (args.steps * b):.1f} documents a row; {h} heads x {d}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print_table(rows, markdown=args.markdown)


if __name__ == "__main__":
    main()
