"""Entry point of a generated module under torchrun: ``rt.launch.main(PROGRAM)``.

Trains for ``--steps`` on deterministic synthetic tokens (or a text file read as bytes, or as text
with ``--tokenizer``) and prints progress on rank 0; with ``--infer`` decodes greedily with a KV
cache after ``--prompt TEXT`` / ``--prompt-ids 1,2,3``; with ``--eval`` reports the mean loss and
perplexity on ``--data``.  ``--weights DIR`` starts from a Hugging Face checkpoint and
``--export-hf DIR`` writes one at the end (``runtime/hf.py``).  A rank that fails prints
the cause and exits at once, so its peers' collectives fail quickly and torchrun stops the job.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .generate import greedy_generate
from .hf import WeightsError
from .program import Built, Program

__all__ = ["evaluate", "infer", "main", "parse_args", "synthetic_batch", "text_batch", "train"]


# How gloo / NCCL report that another rank went away.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL communicator was aborted",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train or decode a meshc-generated plan (run under torchrun)."
    )
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--seed", type=int, default=0, help="weights and synthetic data seed")
    p.add_argument("--data", type=Path, help="train on this file's bytes (token = byte mod vocab)")
    p.add_argument("--infer", action="store_true", help="greedy generation instead of training")
    p.add_argument("--tokens", type=int, default=16, help="tokens to generate with --infer")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a stuck collective fails"
    )
    p.add_argument("--save", type=Path, help="write a sharded checkpoint here at the end")
    p.add_argument("--load", type=Path, help="start from this sharded checkpoint (any layout)")
    p.add_argument(
        "--weights", type=Path, help="start from this Hugging Face model directory (safetensors)"
    )
    p.add_argument(
        "--export-hf", type=Path, help="write a Hugging Face model directory here at the end"
    )
    p.add_argument(
        "--tokenizer", type=Path, help="a Hugging Face tokenizer dir: --data is text, --prompt too"
    )
    p.add_argument("--prompt", help="with --infer: prompt text (needs --tokenizer)")
    p.add_argument("--prompt-ids", help="with --infer: prompt token ids, e.g. 1,2,3")
    p.add_argument(
        "--eval", action="store_true", help="mean loss and perplexity on --data, no training"
    )
    return p.parse_args(argv)


def synthetic_batch(
    vocab: int, batch: int, seq: int, seed: int, step: int
) -> tuple[Tensor, Tensor]:
    """Deterministic tokens and next-token targets for ``step``, identical on every rank.

    Windows of one fixed pseudo-random cycle of 64 tokens: uniform noise would leave nothing to
    learn (the loss would sit at ln(vocab)), while a cycle lets a user watch the loss fall.
    """
    cycle = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, 64, (batch, 1), generator=gen)
    ids = cycle[(starts + torch.arange(seq + 1)) % 64]
    return ids[:, :-1], ids[:, 1:]


def text_batch(
    data: Tensor, vocab: int, batch: int, seq: int, seed: int, step: int
) -> tuple[Tensor, Tensor]:
    """``batch`` windows of ``seq + 1`` bytes at deterministic offsets; ids are bytes mod vocab."""
    if data.numel() < seq + 2:
        raise ValueError(f"--data needs at least {seq + 2} bytes, got {data.numel()}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    ids = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]) % vocab
    return ids[:, :-1], ids[:, 1:]


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _progress(step: int, steps: int, loss: float, tok_s: float) -> None:
    width = 24
    done = width * step // steps
    bar = "#" * done + "." * (width - done)
    end = "\n" if step == steps else ""
    print(
        f"\r[{bar}] step {step}/{steps}  loss {loss:.4f}  {tok_s:,.0f} tok/s",
        end=end,
        file=sys.stderr,
        flush=True,
    )


def _corpus(built: Built, data: Path | None, tokenizer: Any = None) -> Tensor | None:
    """Token ids of ``data``: tokenized text with a tokenizer, else its bytes mod vocab."""
    if data is None:
        return None
    if tokenizer is None:
        return torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8).long()
    ids = tokenizer.corpus(data.read_text())
    vocab = _real_vocab(built)
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(f"--tokenizer produces id {int(ids.max())}, past the model's vocab {vocab}")
    return ids


def evaluate(built: Built, ids: Tensor, limit: int) -> float:
    """Mean token loss over up to ``limit`` held-out batches, without updating; rank 0 prints it."""
    from .layers import cross_entropy
    from .tokens import eval_batches

    p = built.program
    total, count = 0.0, 0
    for tokens, targets in eval_batches(ids, p.batch, p.seq, limit):
        logits = built.forward(tokens)
        logits = logits[..., : _real_vocab(built)]
        total += float(cross_entropy(logits, targets.to(logits.device))) * targets.numel()
        count += targets.numel()
    loss = total / count
    _summary(built, f"eval loss {loss:.4f}  perplexity {math.exp(loss):.3f}  ({count} tokens)")
    return loss


def _real_vocab(built: Built) -> int:
    """Rows of the vocab that are tokens (a padded vocab's embedding says how many)."""
    embed = next(x for x in built.program.model["layers"] if x["kind"] == "embedding")
    return int(embed.get("used") or built.program.vocab)


def train(
    built: Built, steps: int, seed: int, data: Path | None = None, corpus: Tensor | None = None
) -> float:
    """Train ``steps`` steps; rank 0 prints progress and a summary.  Returns the last loss."""
    p = built.program
    if corpus is None:
        corpus = _corpus(built, data)
    rank0 = _first(built)
    loss, start = float("nan"), time.perf_counter()
    for step in range(steps):
        if corpus is None:
            tokens, targets = synthetic_batch(_real_vocab(built), p.batch, p.seq, seed, step)
        else:
            tokens, targets = text_batch(corpus, _real_vocab(built), p.batch, p.seq, seed, step)
        loss = built.train_step(tokens, targets)
        if rank0:
            _progress(
                step + 1, steps, loss, (step + 1) * p.batch * p.seq / (time.perf_counter() - start)
            )
    elapsed = time.perf_counter() - start
    if steps == 0:
        _summary(built, "no training steps (--steps 0)")
        return loss
    _summary(
        built, f"loss {loss:.4f}  {steps * p.batch * p.seq / max(elapsed, 1e-9):,.0f} tokens/s"
    )
    return loss


def infer(
    built: Built, n_new: int, seed: int, prompt: Tensor | None = None, tokenizer: Any = None
) -> Tensor:
    """Decode ``n_new`` tokens greedily after ``prompt`` (default synthetic); rank 0 prints them."""
    p = built.program
    if prompt is None:
        prompt, _ = synthetic_batch(_real_vocab(built), 1, min(8, p.seq), seed, 0)
    start = time.perf_counter()
    out = greedy_generate(built, prompt, n_new)
    elapsed = time.perf_counter() - start
    if _first(built):
        new = out[0, prompt.shape[1] :].tolist()
        print(f"prompt    {prompt[0].tolist()}\ngenerated {new}", file=sys.stderr)
        if tokenizer is not None:
            print(tokenizer.decode(out[0].tolist()), flush=True)
    _summary(built, f"{n_new} tokens  {n_new / max(elapsed, 1e-9):,.1f} tokens/s")
    return out


def _first(built: Built) -> bool:
    return built.mesh.rank == built.mesh.ranks[0]


def _summary(built: Built, text: str) -> None:
    """The mesh's first rank prints ``text`` and every rank's peak memory (collective)."""
    peak = torch.tensor([_peak_memory_mib(built.device)], dtype=torch.float64, device=built.device)
    group = built.mesh.group(*built.mesh.names)
    peaks = [peak]
    if group is not None:
        peaks = [torch.zeros_like(peak) for _ in range(built.mesh.size())]
        # [1] per rank -> mesh-size x [1], in mesh rank order.
        dist.all_gather(peaks, peak, group=group)
    if _first(built):
        per_rank = " ".join(f"r{r}={v.item():.0f}" for r, v in zip(built.mesh.ranks, peaks))
        print(f"done: {text}  peak MiB per rank: {per_rank}", file=sys.stderr, flush=True)


def main(program: Program, argv: Sequence[str] | None = None) -> None:
    """Run ``program`` under torchrun (or any launcher that sets RANK / WORLD_SIZE / MASTER_*)."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    try:
        built = program.build(seed=args.seed, weights=args.weights)
        if args.load:
            from .checkpoint import load

            load(built, args.load)
        tokenizer = None
        if args.tokenizer:
            from .tokens import Tokenizer

            tokenizer = Tokenizer(args.tokenizer)
        corpus = _corpus(built, args.data, tokenizer)
        if args.infer:
            from .tokens import parse_ids

            prompt = None
            if args.prompt_ids is not None:
                prompt = parse_ids(args.prompt_ids, _real_vocab(built))
            elif args.prompt is not None:
                if tokenizer is None:
                    raise ValueError("--prompt TEXT needs --tokenizer DIR (or use --prompt-ids)")
                prompt = parse_ids(",".join(map(str, tokenizer.encode(args.prompt))), _real_vocab(built))
            infer(built, args.tokens, args.seed, prompt, tokenizer)
        elif args.eval:
            if corpus is None:
                raise ValueError("--eval needs --data FILE (held-out text)")
            evaluate(built, corpus, max(args.steps, 1))
        else:
            train(built, args.steps, args.seed, corpus=corpus)
        if args.save:
            from .checkpoint import save

            save(built, args.save)
        if args.export_hf:
            from .hf import export_hf

            export_hf(built, args.export_hf, source=args.weights)
    except BaseException as exc:  # noqa: BLE001 - every failure must end this process at once
        if any(mark in str(exc) for mark in _PEER_LOST):
            # A consequence, not a cause: keep the failing rank's traceback the one people read.
            print(
                f"\nrank {rank} stopped: a peer rank exited ({str(exc).splitlines()[0][:160]})",
                file=sys.stderr,
            )
        elif isinstance(exc, WeightsError):
            # The checkpoint, not the program, is wrong: the message names the tensor and file.
            print(f"rank {rank}: bad --weights: {exc}", file=sys.stderr)
        else:
            print(f"\nrank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        # No clean shutdown: destroy_process_group could wait on peers that are stuck waiting
        # for this rank.  Exiting closes the connections so their collectives fail promptly.
        os._exit(1)
    dist.destroy_process_group()
