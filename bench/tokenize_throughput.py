"""How fast sources are tokenized into a corpus (runtime/data/prepare.py): tokens per second, and
per core, with one tokenizing process and with one per core, measured side by side.

Writes a JSONL source of DOCS synthetic English-like documents (words drawn Zipf-like from a fixed
list, so the run needs no download) and trains a byte-level BPE tokenizer on it, then encodes the
source into a token file with 1 process and with N, in interleaved rounds so that a swing of the
shared cores falls on both alike.  Each cell is the median round.  Start-up of the N processes
(spawned interpreters) is inside the time: it is what `meshc tokenize` pays.

(Named tokenize_throughput.py, not tokenize.py: a script's directory is first on sys.path, and a
bench/tokenize.py would stand in for the standard library's tokenize module, which inspect and
linecache import.)

    python bench/tokenize_throughput.py [--docs 20000] [--workers N] [--rounds 3] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import print_table

WORDS = ("the of and to a in that it was he for on are as with his they at be this from have or by "
         "one had not but what all were when we there can an your which their said if do will each "
         "about how up out them then she many some so these would other into has more her two like "
         "him see time could no make than first been its who now people my made over did down only "
         "way find use may water long little very after words called just where most know rabbit "
         "alice queen garden hatter turtle caterpillar mushroom curious wonder tea party croquet "
         "sister bank daisy chain pocket watch tunnel well shelves marmalade jar latitude longitude "
         "antipathies curtsey dinah bats cats heap sticks leaves passage lamps hall doors key table "
         "glass bottle poison telescope garden flowers fountains").split()


def _corpus(path: Path, docs: int, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(WORDS) + 1)
    p /= p.sum()
    with open(path, "w") as f:
        for _ in range(docs):
            sentences = []
            for _ in range(int(rng.integers(2, 12))):
                words = rng.choice(WORDS, size=int(rng.integers(5, 25)), p=p)
                sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ";"]))
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")


def _tokenizer(directory: Path, sample: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with open(sample) as f:
        tok.train_from_iterator((json.loads(line)["text"] for _, line in zip(range(2000), f)), trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    from meshllm_dsl.runtime.data.prepare import TokenFileWriter, encode_sources, encoder_spec
    from meshllm_dsl.runtime.data.sources import open_source
    from meshllm_dsl.runtime.train.tokens import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _corpus(d / "docs.jsonl", args.docs)
        _tokenizer(d / "tok", d / "docs.jsonl")
        tok = Tokenizer(d / "tok")
        spec = encoder_spec(tok, d / "tok")
        source = open_source(d / "docs.jsonl")
        counts = {1: [], args.workers: []}  # type: dict[int, list[float]]
        tokens = 0
        for _ in range(args.rounds):
            for workers in counts:
                writer = TokenFileWriter(d / f"out{workers}.tokens", tok.vocab)
                start = time.perf_counter()
                c = encode_sources([source], spec, writer, workers=workers, progress=False)
                writer.commit()
                counts[workers].append(time.perf_counter() - start)
                tokens = c.tokens
        mib = (d / "docs.jsonl").stat().st_size / 2**20
        same = (d / "out1.tokens").read_bytes() == (d / f"out{args.workers}.tokens").read_bytes()
    rows: list[list[object]] = [["processes", "seconds", "tokens/s", "tokens/s per core", "MiB/s"]]
    for workers, times in counts.items():
        t = statistics.median(times)
        rows.append([workers, f"{t:.2f}", f"{tokens / t:,.0f}", f"{tokens / t / workers:,.0f}", f"{mib / t:.1f}"])
    print(f"{args.docs:,} documents, {tokens:,} tokens ({mib:.1f} MiB of JSONL), median of {args.rounds} "
          f"rounds; the same corpus bytes for 1 and {args.workers} processes: {same}")
    print_table(rows, markdown=args.markdown)


if __name__ == "__main__":
    main()
