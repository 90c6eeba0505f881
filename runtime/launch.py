"""Entry point of a generated module under torchrun: ``rt.launch.main(PROGRAM)``.

Trains for ``--steps`` on deterministic synthetic tokens (or a text file read as bytes) and prints
progress on rank 0, or with ``--infer`` decodes greedily with a KV cache.  A rank that fails prints
the cause and exits at once, so its peers' collectives fail quickly and torchrun stops the job.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from .generate import greedy_generate
from .program import Built, Program

__all__ = ["infer", "main", "parse_args", "synthetic_batch", "text_batch", "train"]


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
        "--profile",
        type=Path,
        metavar="DIR",
        help="after training, time and measure 1 + 3 more steps; each rank writes DIR/rankR.json",
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


def train(built: Built, steps: int, seed: int, data: Path | None = None) -> float:
    """Train ``steps`` steps; rank 0 prints progress and a summary.  Returns the last loss."""
    p = built.program
    corpus = (
        torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8).long() if data else None
    )
    rank0 = _first(built)
    loss, start = float("nan"), time.perf_counter()
    for step in range(steps):
        if corpus is None:
            tokens, targets = synthetic_batch(p.vocab, p.batch, p.seq, seed, step)
        else:
            tokens, targets = text_batch(corpus, p.vocab, p.batch, p.seq, seed, step)
        loss = built.train_step(tokens, targets)
        if rank0:
            _progress(
                step + 1, steps, loss, (step + 1) * p.batch * p.seq / (time.perf_counter() - start)
            )
    elapsed = time.perf_counter() - start
    _summary(
        built, f"loss {loss:.4f}  {steps * p.batch * p.seq / max(elapsed, 1e-9):,.0f} tokens/s"
    )
    return loss


def infer(built: Built, n_new: int, seed: int) -> Tensor:
    """Decode ``n_new`` tokens greedily after a synthetic prompt; rank 0 prints the ids."""
    p = built.program
    prompt, _ = synthetic_batch(p.vocab, 1, min(8, p.seq), seed, 0)
    start = time.perf_counter()
    out = greedy_generate(built, prompt, n_new)
    elapsed = time.perf_counter() - start
    if _first(built):
        print(
            f"prompt    {prompt[0].tolist()}\ngenerated {out[0, prompt.shape[1] :].tolist()}",
            file=sys.stderr,
        )
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
        built = program.build(seed=args.seed)
        if args.load:
            from .checkpoint import load

            load(built, args.load)
        if args.infer:
            infer(built, args.tokens, args.seed)
        else:
            train(built, args.steps, args.seed, args.data)
            if args.profile:
                from .profile import profile_train

                p = program
                batches = [synthetic_batch(p.vocab, p.batch, p.seq, args.seed, i) for i in range(4)]
                profile_train(built, batches, args.profile)
        if args.save:
            from .checkpoint import save

            save(built, args.save)
    except BaseException as exc:  # noqa: BLE001 - every failure must end this process at once
        if any(mark in str(exc) for mark in _PEER_LOST):
            # A consequence, not a cause: keep the failing rank's traceback the one people read.
            print(
                f"\nrank {rank} stopped: a peer rank exited ({str(exc).splitlines()[0][:160]})",
                file=sys.stderr,
            )
        else:
            print(f"\nrank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        # No clean shutdown: destroy_process_group could wait on peers that are stuck waiting
        # for this rank.  Exiting closes the connections so their collectives fail promptly.
        os._exit(1)
    dist.destroy_process_group()
