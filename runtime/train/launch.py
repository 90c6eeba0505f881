"""Entry point of a generated module under torchrun: ``rt.launch.main(PROGRAM)``.

Trains for ``--steps`` on deterministic synthetic tokens (or a text file read as bytes, or as text
with ``--tokenizer``) and prints progress on rank 0; with ``--infer`` decodes greedily with a KV
cache after ``--prompt TEXT`` / ``--prompt-ids 1,2,3``; with ``--eval`` reports the mean loss and
perplexity on ``--data``.  ``--weights DIR`` starts from a Hugging Face checkpoint and
``--export-hf DIR`` writes one at the end (``runtime/hf/weights.py``).  A rank that fails prints
the cause and exits at once, so its peers' collectives fail quickly and torchrun stops the job.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from meshllm_dsl.runtime.data.corpus import IGNORE, Batch
from meshllm_dsl.runtime.data.packing import Packer, corpus_packer
from meshllm_dsl.runtime.hf.weights import (
    EXTRA_POLICIES,
    ExportError,
    WeightsError,
    check_export_dir,
    check_weights,
    extras_note,
)
from meshllm_dsl.runtime.model import description
from meshllm_dsl.runtime.model.generate import greedy_generate
from meshllm_dsl.runtime.parallel.collectives import all_reduce_
from meshllm_dsl.runtime.parallel.mesh import set_group_timeout
from meshllm_dsl.runtime.train.checkpoint import (
    CheckpointError,
    check_save_root,
    start_lineage,
    verify,
)
from meshllm_dsl.runtime.train.checkpoint import load as load_checkpoint
from meshllm_dsl.runtime.train.checkpoint import save as save_checkpoint
from meshllm_dsl.runtime.train.profile_steps import (
    PROFILE_STEPS,
    PROFILE_STEPS_TEXT,
    TRACE_STEPS,
    TRACE_STEPS_TEXT,
)
from meshllm_dsl.runtime.train.program import Built, Program
from meshllm_dsl.runtime.train.tokens import DataError

__all__ = [
    "DEFAULT_TIMEOUT",
    "InputError",
    "check_inputs",
    "evaluate",
    "select_device",
    "infer",
    "main",
    "parse_args",
    "synthetic_batch",
    "text_batch",
    "train",
]


# How gloo / NCCL report that another rank went away.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL communicator was aborted",
)


# A collective that waits this long for a peer ends the job.  Five minutes covers a slow first
# step or a large checkpoint written by one rank while the others wait in the next collective;
# a stopped rank then costs at most that.  Short CPU runs may pass --timeout 30.
DEFAULT_TIMEOUT = 300.0
MAX_TIMEOUT = 1e7  # seconds (115 days); collectives take it in milliseconds
DEFAULT_KEEP = 3
HEARTBEAT_S = 1.0


class InputError(Exception):
    """A flag or input file is unusable; the message is one line naming it."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train or decode a meshc-generated plan (run under torchrun)."
    )
    p.add_argument("--steps", type=int, default=10, help="train up to this many steps in total (default 10)")
    p.add_argument("--seed", type=int, default=0, help="weights and data sampling seed")
    p.add_argument("--data", type=Path, help="train on this file: a token file's documents packed into rows "
                   "(docs/guides/data.md), else its bytes (token = byte mod vocab)")
    p.add_argument("--balance", action="store_true",
                   help="with a token-file --data: repack each step's documents so the data ranks' attention work evens out")
    p.add_argument("--infer", action="store_true", help="greedy generation instead of training")
    p.add_argument("--tokens", type=int, default=16, help="tokens to generate with --infer")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds a collective may wait for a peer before the job stops (default {DEFAULT_TIMEOUT:.0f})",
    )
    p.add_argument("--save", type=Path, help="checkpoint root: DIR/step-NNNNNN, DIR/latest")
    p.add_argument(
        "--save-every", type=int, default=0, metavar="N",
        help="also checkpoint every N steps (default: only at the end)",
    )
    p.add_argument(
        "--keep", type=int, default=DEFAULT_KEEP, metavar="K",
        help=f"keep the newest K checkpoints (default {DEFAULT_KEEP})",
    )
    p.add_argument(
        "--resume", metavar="DIR|latest",
        help="continue training from a checkpoint (a root, a step directory, or `latest` of --save)",
    )
    p.add_argument(
        "--save-over", action="store_true",
        help="let this run write into a --save root holding another run's checkpoints (never pruned; "
        "replaced only at the steps this run saves; `latest` then names this run's)",
    )
    p.add_argument("--load", type=Path, help="start from the weights of this checkpoint (any layout)")
    p.add_argument("--debug", action="store_true", help="full tracebacks on failures")
    p.add_argument(
        "--metrics", type=Path, metavar="FILE.jsonl",
        help="the mesh's first rank writes one JSON object per training step here (appends with --resume)",
    )
    p.add_argument(
        "--tensorboard", type=Path, metavar="DIR",
        help="the mesh's first rank also writes the per-step metrics as TensorBoard scalars here (needs tensorboard)",
    )
    p.add_argument(
        "--weights", type=Path, help="start from this Hugging Face model directory (safetensors)"
    )
    p.add_argument(
        "--export-hf", type=Path, help="write a Hugging Face model directory here at the end"
    )
    p.add_argument(
        "--weights-extra", choices=EXTRA_POLICIES, default="error",
        help="tensors of --weights the model has no place for: an error (default), or ignore them with a warning",
    )
    p.add_argument(
        "--tokenizer", type=Path, help="a Hugging Face tokenizer dir: --data is text, --prompt too"
    )
    p.add_argument("--prompt", help="with --infer: prompt text (needs --tokenizer)")
    p.add_argument("--prompt-ids", help="with --infer: prompt token ids, e.g. 1,2,3")
    p.add_argument(
        "--eval", action="store_true", help="mean loss and perplexity on --data, no training"
    )
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help=f"after training, {PROFILE_STEPS_TEXT}; each rank writes DIR/rankR.json",
    )
    p.add_argument(
        "--profile-trace",
        type=Path,
        metavar="DIR",
        help=f"after training (and --profile), {TRACE_STEPS_TEXT}; "
        "each rank writes a Chrome trace DIR/rankR.json",
    )
    p.add_argument(
        "--compile-fallback",
        action="store_true",
        help="with `compile = blocks`: run a block eagerly where torch.compile fails on it (default: stop)",
    )
    return p.parse_args(argv)


def resume_path(args: argparse.Namespace) -> Path | None:
    if args.resume is None:
        return None
    if args.resume == "latest":
        if args.save is None:
            raise InputError("--resume latest needs --save DIR (the root it is the latest of)")
        return Path(args.save)
    return Path(args.resume)


def check_inputs(args: argparse.Namespace, model: Any = None, seq: int = 0) -> None:
    """Everything about the flags that can be known before any rank starts; ``InputError`` if not.

    ``meshc run`` calls it before launching, and every rank again (a module may be started by
    torchrun directly).  Only reads files.  With ``model`` (the plan's model description, as
    ``Program.model``) and ``seq``, also what depends on the model: token ids against its
    vocabulary, a prompt and ``--tokens`` against its learned positions.
    """
    if args.infer:
        if args.tokens < 1:
            raise InputError(f"--tokens must be at least 1, got {args.tokens}")
    elif args.steps < 0 or (args.steps == 0 and not (args.weights or args.load or args.export_hf)):
        # --steps 0 only loads (and with --export-hf converts) a checkpoint.
        raise InputError(f"--steps must be at least 1 (0 only with --weights / --load / --export-hf), got {args.steps}")
    if args.eval and args.data is None:
        raise InputError("--eval needs --data FILE (held-out text)")
    if args.prompt is not None and args.tokenizer is None:
        raise InputError("--prompt TEXT needs --tokenizer DIR (or use --prompt-ids)")
    for flag, path in (("--weights", args.weights), ("--tokenizer", args.tokenizer)):
        if path is not None and not Path(path).is_dir():
            raise InputError(f"{flag} {path}: no such directory")
    if not 0 < args.timeout <= MAX_TIMEOUT:  # nan and inf too: a timedelta of them raises on every rank
        raise InputError(f"--timeout must be positive seconds, at most {MAX_TIMEOUT:g}, got {args.timeout:g}")
    if not 0 <= args.seed < 2**32:  # seed * 1_000_003 + step seeds a torch.Generator (int64)
        raise InputError(f"--seed must be 0 to {2**32 - 1}, got {args.seed}")
    if args.save_every < 0:
        raise InputError(f"--save-every must be 0 (only at the end) or more, got {args.save_every}")
    if args.keep < 1:
        raise InputError(f"--keep must be at least 1, got {args.keep}")
    if args.profile is not None and (args.save or args.export_hf or args.infer or args.eval or args.steps == 0):
        # Measuring trains further: the weights saved or exported would not be the trained ones.
        raise InputError(f"--profile trains {PROFILE_STEPS_TEXT} after --steps: it does not combine "
                         "with --save, --export-hf, --infer, --eval or --steps 0")
    if args.profile_trace is not None:
        if args.save or args.export_hf or args.infer or args.eval or args.steps == 0:
            # As --profile: the traced steps train the model further.
            raise InputError(f"--profile-trace trains {TRACE_STEPS_TEXT} after --steps: it does not combine "
                             "with --save, --export-hf, --infer, --eval or --steps 0")
        if Path(args.profile_trace).exists() and not Path(args.profile_trace).is_dir():
            raise InputError(f"--profile-trace {args.profile_trace}: exists and is not a directory")
    if args.save_every and args.save is None:
        raise InputError("--save-every needs --save DIR")
    _check_metrics(args)
    if args.save_over and args.save is None:
        raise InputError("--save-over needs --save DIR (the root to start over in)")
    if args.resume is not None and args.load is not None:
        raise InputError("--resume and --load exclude each other (--resume restores the weights too)")
    if args.infer and (args.resume is not None or args.save is not None):
        raise InputError("--infer takes --load CHECKPOINT, not --resume / --save")
    if args.data is not None and not args.infer:
        sources = data_sources(args.data)
        for data, _ in sources:
            if not data.is_file():
                raise InputError(f"--data {data}: no such file")
            if data.stat().st_size == 0:
                raise InputError(f"--data {data}: the file is empty")
        if len(sources) > 1 and not is_corpus(args.data):
            raise InputError(f"--data {args.data}: several sources mix only as token files (with `meshc run "
                             "--tokenizer DIR` every source is tokenized into one first)")
        if len(sources) > 1 and args.eval:
            raise InputError("--eval takes one held-out --data file, not a weighted mix")
    if args.balance and (args.infer or args.eval or not is_corpus(args.data)):
        # Only packed rows have documents whose lengths say the attention work.
        raise InputError("--balance repacks the documents of a token-file --data for the data ranks: "
                         "it needs one, and training (not --infer / --eval)")
    if model is not None and (args.weights or args.export_hf):
        from meshllm_dsl.runtime.hf.weights import maps_partial_rotary
        from meshllm_dsl.runtime.model.description import partial_rotary

        partial = partial_rotary(model)
        # config.json's partial_rotary_factor is read and written by the layouts that map it (GLM-4.5) only
        if partial is not None and not maps_partial_rotary(model):
            flag = "--weights" if args.weights else "--export-hf"
            raise InputError(f"{flag}: `{partial}` rotates part of each head (rotary_dim), which Hugging Face "
                             f"checkpoints are not mapped for yet; run without {flag}")
    try:
        _check_text_inputs(args)
        if model is not None:
            _check_model_inputs(args, model, seq)
    except DataError as err:
        raise InputError(str(err)) from None
    try:
        if args.save is not None:
            check_save_root(args.save, resume_path(args), args.save_over)
        if args.export_hf is not None:
            check_export_dir(args.export_hf, args.weights)
        for flag, path in (("--resume", resume_path(args)), ("--load", args.load)):
            if path is not None:
                try:
                    verify(path, checksums=False)
                except CheckpointError as err:
                    raise InputError(f"{flag}: {err}") from None
    except (CheckpointError, ExportError) as err:
        raise InputError(str(err)) from None


def _check_metrics(args: argparse.Namespace) -> None:
    """--metrics: a new file in an existing directory, or (with --resume) one to append to;
    --tensorboard: a directory (or none yet), and the package installed."""
    board = getattr(args, "tensorboard", None)
    if board is not None:
        if args.infer or args.eval:
            raise InputError("--tensorboard records training steps: it does not combine with --infer or --eval")
        if Path(board).exists() and not Path(board).is_dir():
            raise InputError(f"--tensorboard {board}: exists and is not a directory")
        try:
            import torch.utils.tensorboard  # noqa: F401 - only whether it imports
        except ImportError:
            raise InputError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    path = getattr(args, "metrics", None)
    if path is None:
        return
    path = Path(path)
    if args.infer or args.eval:
        raise InputError("--metrics records training steps: it does not combine with --infer or --eval")
    if path.is_dir():
        raise InputError(f"--metrics {path}: is a directory (expected a .jsonl file)")
    if not path.parent.is_dir():
        raise InputError(f"--metrics {path}: no such directory {path.parent}")
    if path.exists() and args.resume is None:
        raise InputError(f"--metrics {path}: the file exists (pass --resume to append to it, or name a new file)")


def _check_text_inputs(args: argparse.Namespace) -> None:
    """Token files whole, text UTF-8 where a tokenizer reads it, the tokenizer loadable, prompts
    well-formed; ``DataError`` if not."""
    try:
        _check_text_files(args)
    except OSError as err:
        raise DataError(f"{err.filename or args.data}: cannot read it ({err.strerror or err})") from None


def _check_text_files(args: argparse.Namespace) -> None:
    from meshllm_dsl.runtime.train.tokens import (
        check_prompt_text,
        check_utf8_file,
        load_tokenizer,
        parse_id_list,
        token_file_header,
    )

    if args.data is not None and not args.infer:
        for data, _ in data_sources(args.data):
            if token_file_header(data) is None and args.tokenizer is not None:
                check_utf8_file(data)
    if args.tokenizer is not None:
        load_tokenizer(Path(args.tokenizer))
    if args.prompt is not None:
        check_prompt_text(args.prompt)
    if args.prompt_ids is not None:
        parse_id_list(args.prompt_ids)


# --infer without a prompt decodes after this many synthetic tokens (fewer if seq is shorter).
SYNTHETIC_PROMPT = 8


def model_vocab(model: Any) -> int:
    """Token ids the model has: a padded vocabulary's embedding says how many rows are tokens."""
    embed = description.token_embedding(model)
    return int(embed.get("used") or embed["num"])


def model_positions(model: Any) -> int | None:
    """Positions a model with learned position embeddings has rows for; None for rotary (any)."""
    table = description.position_table(model)
    return None if table is None else int(table["num"])


def _check_model_inputs(args: argparse.Namespace, model: Any, seq: int) -> None:
    from meshllm_dsl.runtime.train.tokens import (
        check_token_ids,
        load_tokenizer,
        parse_ids,
        token_file_count,
    )

    vocab = model_vocab(model)
    if args.data is not None and not args.infer:
        for data, _ in data_sources(args.data):
            check_token_ids(data, vocab)  # one pass over the memory map
            count = token_file_count(data)
            if count is not None and seq and not args.eval and count < seq + 2:
                raise DataError(f"--data {data}: {count} token ids, training at seq {seq} needs at least {seq + 2}")
    if not args.infer:
        return
    if args.prompt_ids is not None:
        length, what = parse_ids(args.prompt_ids, vocab).shape[1], "--prompt-ids"
    elif args.prompt is not None:
        ids = load_tokenizer(Path(args.tokenizer)).encode(args.prompt)
        if not ids:
            raise DataError("--prompt: the tokenizer makes no tokens of it (expected some text)")
        if max(ids) >= vocab:
            raise DataError(f"--prompt: the tokenizer makes id {max(ids)}, past the model's vocabulary of {vocab}")
        length, what = len(ids), "--prompt"
    else:
        length, what = min(SYNTHETIC_PROMPT, seq or SYNTHETIC_PROMPT), "the synthetic prompt"
    positions = model_positions(model)
    # Decoding feeds the prompt, then each new token but the last: length + tokens - 1 positions.
    if positions is not None and length + args.tokens - 1 > positions:
        if length > positions:
            raise DataError(f"{what}: {length} tokens, past the model's {positions} learned positions")
        raise DataError(f"--tokens {args.tokens}: after {what} of {length} tokens the model's {positions} learned "
                        f"positions allow at most {positions - length + 1}")


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
    data: Any, vocab: int, batch: int, seq: int, seed: int, step: int
) -> tuple[Tensor, Tensor]:
    """``batch`` windows of ``seq + 1`` ids at deterministic offsets, mod vocab (for bytes).

    ``data`` is any 1-D sequence of ids: a memory map of a token file or of a text file's bytes,
    so only the windows are read.
    A function of (seed, step) only, so the data position of a run is its step.
    """
    n = len(data)
    if n < seq + 2:
        raise InputError(f"--data needs at least {seq + 2} bytes for seq {seq}, got {n}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, n - seq - 1, (batch,), generator=gen)
    ids = torch.stack(
        # A copy of just the window, widened to int64 (the map is read-only, uint8 / 16 / 32).
        [torch.from_numpy(np.array(data[s : s + seq + 1], dtype=np.int64)) for s in starts.tolist()]
    ) % vocab
    return ids[:, :-1], ids[:, 1:]


def open_data(path: Path) -> Any:
    """``--data`` as a read-only memory map (rank memory stays O(batch)): the ids of a token file
    (`meshc tokenize`), else the file's bytes."""
    from meshllm_dsl.runtime.train.tokens import open_token_file, token_file_vocab

    if token_file_vocab(path) is not None:
        return open_token_file(path)
    return np.memmap(path, dtype=np.uint8, mode="r")


def data_identity(path: Path | None) -> dict[str, Any] | None:
    """What a checkpoint records about ``--data`` to notice a different file on resume."""
    if path is None:
        return None
    st = Path(path).stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    return {"path": str(path), "bytes": st.st_size, "sha256_first_mib": head}


def data_sources(data: Path | None) -> list[tuple[Path, float]]:
    """``--data``'s files with their weights: the one file it names, or each of a weighted list of
    token files (``a.tok:0.7,b.tok:0.3``, runtime/data/sources.py's spec) that `meshc run` tokenized."""
    if data is None:
        return []
    if Path(data).exists():
        return [(Path(data), 1.0)]
    from meshllm_dsl.runtime.data.sources import parse_data_spec

    try:
        return parse_data_spec(str(data))
    except DataError as err:
        raise InputError(str(err)) from None


def is_corpus(path: Path | None) -> bool:
    """Whether ``--data`` is a corpus (token files: their documents known from a ``.docs`` sidecar,
    else each one document), which training reads as packed batches (runtime/data/packing.py)."""
    from meshllm_dsl.runtime.train.tokens import token_file_vocab

    sources = data_sources(path)
    return bool(sources) and all(p.is_file() and token_file_vocab(p) is not None for p, _ in sources)


def packed_identity(built: Built, data: Path, seed: int, balance: bool) -> dict[str, Any]:
    """What a checkpoint records about a packed ``--data``: the corpus, seq, batch, seed and
    balancing its data cursor is valid for (a resume with any other is refused)."""
    return _packer(built, data, seed, balance).identity(built.program.batch)


def _packer(built: Built, data: Path, seed: int, balance: bool, cursor: dict[str, Any] | None = None) -> Packer:
    """The packer of a corpus ``data`` for ``built``'s rows, from ``cursor``; with ``balance``, each
    step's rows ordered so that its data ranks' attention work evens out."""
    return corpus_packer(data_sources(data), built.program.seq, seed, cursor, balance=built.dp if balance else 0)


def _step_on(built: Built, batch: Batch) -> float:
    """One training step on ``batch``: with its documents and positions where it has them (packed
    from a corpus) and the program masks attention at document boundaries, else tokens and targets
    alone."""
    if batch.documents is not None and getattr(built.program, "document_mask", False):
        return built.train_step(batch.tokens, batch.targets, documents=batch.documents,  # type: ignore[call-arg]
                                positions=batch.positions)
    return built.train_step(batch.tokens, batch.targets)


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _progress(step: int, steps: int, loss: float, tok_s: float) -> None:
    """The progress bar, redrawn in place (a terminal only: see ``_ProgressLog``)."""
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


# `meshc run` tells the ranks whether its own stderr (where rank 0's output ends up, through a
# pipe) is a terminal: "1" draws the bar, "0" prints plain lines.  Unset (torchrun started by
# hand): whether this rank's stderr is a terminal.
TTY_ENV = "MESHLLM_TTY"
# Plain lines every this many steps instead of the default (about 20 lines a run).
LOG_EVERY_ENV = "MESHLLM_LOG_EVERY"
PLAIN_LINES = 20


def progress_on_terminal() -> bool:
    said = os.environ.get(TTY_ENV)
    if said is not None:
        return said == "1"
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def log_every(steps: int) -> int:
    """Plain progress lines every this many of ``steps`` steps: about 20 lines a run."""
    forced = os.environ.get(LOG_EVERY_ENV, "")
    if forced.isdigit() and int(forced) > 0:
        return int(forced)
    return max(1, math.ceil(steps / PLAIN_LINES))


class _ProgressLog:
    """Rank 0's progress: the bar on a terminal; elsewhere (a log file, a pipe) one plain line for
    the first step, every ``log_every`` steps and the last, with no carriage returns."""

    def __init__(self, start: int, steps: int, tty: bool | None = None) -> None:
        self.start, self.steps = start, steps
        self.tty = progress_on_terminal() if tty is None else tty
        self.every = log_every(steps - start)
        self.t0 = time.perf_counter()

    def step(self, done: int, loss: float, tok_s: float) -> None:
        if self.tty:
            _progress(done, self.steps, loss, tok_s)
            return
        ran = done - self.start
        if ran == 1 or ran % self.every == 0 or done == self.steps:
            elapsed = time.perf_counter() - self.t0
            print(f"step {done}/{self.steps}  loss {loss:.4f}  {tok_s:,.0f} tok/s  ({elapsed:,.0f} s)",
                  file=sys.stderr, flush=True)


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class Metrics:
    """``--metrics FILE.jsonl``: one JSON object per step, written by the mesh's first rank, a whole
    line at a time and flushed (a killed run leaves whole lines).  Every rank must take part in
    ``record``: it gathers each rank's peak memory and, without ``clip``, the gradient norm."""

    def __init__(self, built: Built, path: Path | None, tensorboard: Path | None = None) -> None:
        self.built = built
        self.first = _first(built)
        self.kind = "cuda_max_allocated" if built.device.type == "cuda" else "cpu_max_rss"
        self.moe = any(name.endswith(".router.weight") for i in built.stage_ids for name in built.specs[i])
        self.file = open(path, "a", encoding="utf-8") if self.first and path is not None else None  # noqa: SIM115 - closed by close()
        self.board: Any = None
        if self.first and tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(log_dir=str(tensorboard))

    def routing(self) -> Any:
        """Around a step: counts each moe layer's (token, choice) pairs per expert on this rank."""
        from meshllm_dsl.runtime.moe import routing as moe_routing

        return moe_routing.recording(active=self.moe, keep_logits=False)

    def record(self, step: int, loss: float, tok_s: float, log: Any = None) -> None:
        built = self.built
        group = built.mesh.group(*built.mesh.names)
        norm = built.grad_norm
        if "clip" not in built.program.optimizer:
            from meshllm_dsl.runtime.parallel.collectives import all_reduce_sum

            total = built.grad_norm_sq().reshape(1)
            if group is not None:
                total = all_reduce_sum(total, group)  # [1]: each rank's share, summed over the mesh
            norm = float(total[0].sqrt())
        peak = torch.tensor([_peak_memory_bytes(built.device)], dtype=torch.float64, device=built.device)
        peaks = [peak]
        if group is not None:
            peaks = [torch.zeros_like(peak) for _ in range(built.mesh.size())]
            dist.all_gather(peaks, peak, group=group)  # [1] per rank -> mesh size x [1], mesh rank order
        if self.file is None and self.board is None:
            return
        row: dict[str, Any] = {
            "step": step,
            "loss": _finite(loss),
            "tokens_per_s": tok_s,
            "lr": float(built.optimizer.param_groups[0]["lr"]),
            "grad_norm": _finite(norm),
            "peak_memory_bytes": {str(r): int(v.item()) for r, v in zip(built.mesh.ranks, peaks)},
            "peak_memory_kind": self.kind,
        }
        if self.moe and log is not None:
            from meshllm_dsl.runtime.train.profile import _routing

            row["expert_load"] = {"rank": built.mesh.rank, "layers": [
                {"layer": r["layer"], "tokens_per_expert": r["tokens_per_expert"], "dropped": r["dropped"]}
                for r in _routing(built, log)
            ]}
        if self.board is not None:
            for key in ("loss", "tokens_per_s", "lr", "grad_norm"):
                if row[key] is not None:
                    self.board.add_scalar(key, row[key], step)
            self.board.add_scalar("peak_memory_bytes_max", max(row["peak_memory_bytes"].values()), step)
            self.board.flush()
        if self.file is not None:
            import json

            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.board is not None:
            self.board.close()
            self.board = None


class Progress:
    """Where each rank is, in the job's store, so a rank that times out can name the one that
    stopped.  Under torchrun the store lives in the agent, so it outlives any worker."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        try:
            self.store: Any = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError):
            self.store = None
        self.mark("start")
        self._set(f"meshllm/pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
        # A rank blocked in a collective still beats (the wait releases the GIL); a stopped or
        # hung-in-C process does not: that tells a timed-out rank which peer to blame.
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="meshllm-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        while self.store is not None and not self._stopped.is_set():
            self._set(f"meshllm/beat/{self.rank}", f"{time.time():.3f}")
            self._stopped.wait(HEARTBEAT_S)

    def stop(self) -> None:
        """End the heartbeat: no store call may be in flight when the process exits."""
        self._stopped.set()
        self._thread.join(timeout=5)

    def _set(self, key: str, value: str) -> None:
        if self.store is not None:
            try:
                self.store.set(key, value)
            except Exception:  # noqa: BLE001 - progress is advisory; never fail a step over it
                self.store = None

    def mark(self, where: str) -> None:
        self._set(f"meshllm/at/{self.rank}", f"{time.time():.3f} {where}")

    def read(self, key: str) -> str | None:
        if self.store is None:
            return None
        try:
            if not self.store.check([key]):
                return None
            return bytes(self.store.get(key)).decode()
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            return None


class PlanMismatch(Exception):
    """The nodes of a multi-node job run different plans, code or flags; one line, same on every node."""


# Flags that may differ between nodes: --profile and --profile-trace name a directory of each
# node's own.
_NODE_LOCAL_FLAGS = ("profile", "profile_trace")


def plan_digest() -> str:
    """What every node must run identically: the generated module (which records the sha256 of its
    .mesh source) and this runtime's code."""
    h = hashlib.sha256()
    main = getattr(sys.modules.get("__main__"), "__file__", None) or sys.argv[0]
    runtime = Path(__file__).parents[1]
    for path in [Path(main), *sorted(runtime.rglob("*.py"))]:
        h.update((path.name if path == Path(main) else path.relative_to(runtime).as_posix()).encode() + b"\0")
        with contextlib.suppress(OSError):
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _flags_text(args: argparse.Namespace) -> dict[str, str]:
    return {k: str(v) for k, v in sorted(vars(args).items()) if k not in _NODE_LOCAL_FLAGS}


def _axis_groups(axes: Sequence[tuple[str, int]], name: str) -> list[list[int]]:
    """Ranks that differ only along axis ``name`` (rank order: the last axis varies fastest)."""
    sizes = [int(n) for _, n in axes]
    i = [a for a, _ in axes].index(name)
    stride = math.prod(sizes[i + 1 :])
    world = math.prod(sizes)
    starts = [r for r in range(world) if (r // stride) % sizes[i] == 0]
    return [[r + k * stride for k in range(sizes[i])] for r in starts]


def node_warnings(axes: Sequence[tuple[str, int]], hosts: int, nodes: Sequence[str]) -> list[str]:
    """One line per mesh axis whose groups the spec keeps inside a host (``hosts``, ranks
    node-major) but that the job's ranks put on more than one node (``nodes[rank]``)."""
    world = math.prod(int(n) for _, n in axes)
    if hosts <= 1 or len(nodes) != world or world % hosts:
        return []
    per_host = world // hosts
    out = []
    for name, _ in axes:
        groups = _axis_groups(axes, name)
        if any(len({r // per_host for r in g}) > 1 for g in groups):
            continue  # the spec itself spreads this axis over hosts (the planner says "network")
        split = [g for g in groups if len({nodes[r] for r in g}) > 1]
        if split:
            g = split[0]
            on = ", ".join(sorted({nodes[r] for r in g}))
            more = f" (and {len(split) - 1} more group{'s' * (len(split) > 2)})" if len(split) > 1 else ""
            out.append(f"warning: the `{name}` group {g}{more} spans nodes {on}, though the spec (hosts = {hosts}) "
                       "keeps it in one host: its collectives cross the network")
    return out


def check_same_plan(args: argparse.Namespace, rank: int, world: int, timeout: timedelta) -> list[str]:
    """Every rank of a multi-node job publishes its node, plan digest and flags in the job's store
    and compares them with everyone's before any rank builds its part: two nodes started from
    different .mesh files (or meshc versions, or flags) would otherwise deadlock or silently
    train something else.  Raises ``PlanMismatch`` on every rank alike; returns each rank's node."""
    import json

    store = dist.distributed_c10d._get_default_store()
    node = os.environ.get("GROUP_RANK", "0")
    mine = {"node": node, "plan": plan_digest(), "flags": _flags_text(args)}
    store.set(f"meshllm/same/{rank}", json.dumps(mine))
    keys = [f"meshllm/same/{r}" for r in range(world)]
    store.wait(keys, timeout)
    everyone = [json.loads(bytes(store.get(k)).decode()) for k in keys]
    # Read by all before anyone leaves: the store lives in one node's agent, which exits with it.
    store.set(f"meshllm/same-read/{rank}", "1")
    store.wait([f"meshllm/same-read/{r}" for r in range(world)], timeout)
    first = everyone[0]
    for other in everyone[1:]:
        if other["plan"] != first["plan"]:
            raise PlanMismatch(
                f"node {first['node']} and node {other['node']} run different plans (spec or generated "
                f"code {first['plan']} vs {other['plan']}): start every node from the same .mesh file "
                "with the same meshc"
            )
        if other["flags"] != first["flags"]:
            diff = [k for k in first["flags"] if first["flags"][k] != other["flags"].get(k)]
            shown = ", ".join(
                f"--{k.replace('_', '-')} {first['flags'][k]} vs {other['flags'].get(k)}" for k in diff[:3]
            )
            raise PlanMismatch(
                f"node {first['node']} and node {other['node']} were started with different flags "
                f"({shown}): every node runs the same command"
            )
    return [str(e["node"]) for e in everyone]


class Preempted(Exception):
    """A SIGTERM arrived; the step finished and a checkpoint was written."""


class Preemption:
    """SIGTERM (what schedulers send before a kill) as a request to checkpoint and stop.

    Ranks receive the signal at different moments, so after every step they agree on it with one
    all-reduce of a flag ([1], MAX over the mesh): all of them then save the same step.
    """

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, built: Built) -> bool:
        flag = torch.tensor([float(self.requested)], device=built.device)
        group = built.mesh.group(*built.mesh.names) if built.mesh.size() > 1 else None
        if group is not None:
            # [1]: 1.0 on ranks that saw SIGTERM, MAX over the whole mesh.
            all_reduce_(flag, group, dist.ReduceOp.MAX)
        return bool(flag.item())


def _corpus(built: Built, data: Path | None, tokenizer: Any = None) -> Tensor | None:
    """Token ids of ``data``: tokenized text with a tokenizer, else its bytes mod vocab."""
    if data is None:
        return None
    from meshllm_dsl.runtime.train.tokens import open_token_file, token_file_vocab

    if token_file_vocab(data) is not None:  # already ids (read whole: --eval walks all of it)
        return torch.from_numpy(np.asarray(open_token_file(data), dtype=np.int64))
    if tokenizer is None:  # bytes mod vocab, as training reads them (a vocab under 256 has no row for some)
        return torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8).long() % _real_vocab(built)
    try:
        ids = tokenizer.corpus(data.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(f"--data {data}: not UTF-8 text (byte {err.start:,}); with --tokenizer it is read as text") from None
    vocab = _real_vocab(built)
    if ids.numel() and int(ids.max()) >= vocab:
        raise DataError(f"--data {data}: the tokenizer makes id {int(ids.max())}, past the model's vocabulary of {vocab}")
    return ids


def evaluate(built: Built, ids: Tensor, limit: int) -> float:
    """Mean token loss over up to ``limit`` held-out batches, without updating; rank 0 prints it."""
    from meshllm_dsl.runtime.model.layers import cross_entropy
    from meshllm_dsl.runtime.train.tokens import eval_batches

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


def evaluate_packed(built: Built, data: Path, limit: int) -> float:
    """Mean loss over the targets (not ``IGNORE``) of up to ``limit`` held-out batches of the corpus
    ``data`` packed in file order, one pass; rank 0 prints it."""
    from meshllm_dsl.runtime.model.layers import cross_entropy

    p = built.program
    packer = corpus_packer(data, p.seq, seed=0, shuffle=False)
    corpus = packer.sources[0][0]
    batches = min(limit, len(corpus.ids) // (p.batch * (p.seq + 1)))
    if batches < 1:
        raise DataError(f"--eval needs at least {p.batch * (p.seq + 1)} ids for one batch of {p.batch} "
                        f"x {p.seq}, {data} has {len(corpus.ids)}")
    total, count = 0.0, 0
    for _ in range(batches):
        batch = packer.next_batch(p.batch)
        if getattr(p, "document_mask", False):
            logits = built.forward(batch.tokens, documents=batch.documents,  # type: ignore[call-arg]
                                   positions=batch.positions)
        else:
            logits = built.forward(batch.tokens)
        logits = logits[..., : _real_vocab(built)]
        targets = batch.targets.to(logits.device)
        trained = int((targets != IGNORE).sum())
        if trained:  # cross_entropy's mean skips IGNORE targets
            total += float(cross_entropy(logits, targets)) * trained
            count += trained
    if count == 0:
        raise DataError(f"--eval {data}: the loss mask leaves no target in {batches} batches")
    loss = total / count
    _summary(built, f"eval loss {loss:.4f}  perplexity {math.exp(loss):.3f}  ({count} tokens)")
    return loss


def _real_vocab(built: Built) -> int:
    """Rows of the vocab that are tokens (a padded vocab's embedding says how many)."""
    return model_vocab(built.program.model)


def train(
    built: Built,
    steps: int,
    seed: int,
    data: Path | None = None,
    corpus: Any = None,
    *,
    start: int = 0,
    save: Path | None = None,
    save_every: int = 0,
    keep: int = DEFAULT_KEEP,
    progress: Progress | None = None,
    preempt: Preemption | None = None,
    metrics: Path | None = None,
    tensorboard: Path | None = None,
    cursor: dict[str, Any] | None = None,
    balance: bool = False,
) -> float:
    """Train from step ``start`` up to ``steps``; rank 0 prints progress and a summary.

    With ``save``, checkpoints every ``save_every`` steps and after the last step, and, when
    ``preempt`` saw a SIGTERM on any rank, after the current step before raising ``Preempted``.
    A corpus ``data`` (a token file) is read as packed batches from its seeded document order,
    starting at ``cursor`` (a resumed checkpoint's data cursor, saved with every checkpoint);
    otherwise the batch of step ``k`` depends only on (seed, k).  Either way a resumed run sees the
    batches it would have seen.  ``corpus`` (token ids) replaces reading ``data`` as bytes.
    Returns the last loss.
    """
    p = built.program
    packer = None
    if corpus is None and is_corpus(data):
        assert data is not None
        packer = _packer(built, data, seed, balance, cursor)
        identity: dict[str, Any] | None = packer.identity(p.batch)
    else:
        if corpus is None and data:
            corpus = open_data(data)
        identity = data_identity(data)
    rank0 = _first(built)
    t0 = time.perf_counter()
    shown = _ProgressLog(start, steps) if rank0 else None
    recorder = Metrics(built, metrics, tensorboard) if metrics is not None or tensorboard is not None else None
    try:
        loss = _train_steps(built, steps, seed, corpus, start, save, save_every, keep, progress, preempt,
                            identity, shown, recorder, packer)
    finally:
        if recorder is not None:
            recorder.close()
    elapsed = time.perf_counter() - t0
    trained = steps - start
    _summary(
        built, f"loss {loss:.4f}  {trained * p.batch * p.seq / max(elapsed, 1e-9):,.0f} tokens/s"
    )
    return loss


def _train_steps(built: Built, steps: int, seed: int, corpus: Any, start: int, save: Path | None,
                 save_every: int, keep: int, progress: Progress | None, preempt: Preemption | None,
                 identity: dict[str, Any] | None, shown: _ProgressLog | None, recorder: Metrics | None,
                 packer: Packer | None = None) -> float:
    """The steps of ``train``; the last loss."""
    p = built.program
    loss, t0 = float("nan"), time.perf_counter()
    for step in range(start, steps):
        if progress:
            progress.mark(f"step {step + 1}")
        if packer is not None:
            batch = packer.next_batch(p.batch)
        elif corpus is None:
            batch = Batch(*synthetic_batch(_real_vocab(built), p.batch, p.seq, seed, step))
        else:
            batch = Batch(*text_batch(corpus, _real_vocab(built), p.batch, p.seq, seed, step))
        t_step = time.perf_counter()
        if recorder is not None:
            with recorder.routing() as log:
                loss = _step_on(built, batch)
        else:
            log, loss = None, _step_on(built, batch)
        done = step + 1
        now = time.perf_counter()
        if recorder is not None:
            recorder.record(done, loss, p.batch * p.seq / max(now - t_step, 1e-9), log)
        if shown is not None:
            shown.step(done, loss, (done - start) * p.batch * p.seq / max(now - t0, 1e-9))
        stop = preempt is not None and preempt.agreed(built)
        if save is not None and (
            stop or done == steps or (save_every and done % save_every == 0)
        ):
            if progress:
                progress.mark(f"saving step {done}")
            state = {"step": done, "seed": seed, "data": identity, "loss": loss}
            if packer is not None:  # where the data is after this step: a resume continues there
                state["packer"] = packer.cursor.to_dict()
            path = save_checkpoint(built, save, step=done, state=state, keep=keep)
            if stop:
                raise Preempted(f"stopped by SIGTERM after step {done}; saved {path}")
    return loss


def infer(
    built: Built, n_new: int, seed: int, prompt: Tensor | None = None, tokenizer: Any = None
) -> Tensor:
    """Decode ``n_new`` tokens greedily after ``prompt`` (default synthetic); rank 0 prints them."""
    p = built.program
    if prompt is None:
        prompt, _ = synthetic_batch(_real_vocab(built), 1, min(SYNTHETIC_PROMPT, p.seq), seed, 0)
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


def _resume(built: Built, args: argparse.Namespace) -> tuple[int, int, dict[str, Any] | None]:
    """Restore the whole training state; the step to start from, the data seed and the data cursor
    (where a packed corpus's order was; None for other data).  A packed run resumed on other data,
    or on a plan of another seq or batch, is refused: its cursor would not mean the same batches."""
    path = resume_path(args)
    assert path is not None
    manifest = load_checkpoint(built, path, optimizer=True)
    state = manifest.get("state", {})
    step, seed = int(state.get("step", manifest["step"])), int(state.get("seed", args.seed))
    saved = state.get("data")
    packed = (isinstance(saved, dict) and "corpora" in saved) or is_corpus(args.data)
    now = packed_identity(built, args.data, seed, args.balance) if is_corpus(args.data) else data_identity(args.data)
    if packed and saved != now:
        raise InputError(f"--resume: {manifest['path']} was trained on {_data_said(saved)}, not on "
                         f"{_data_said(now)}; resume on the same data and plan (or start over with --load)")
    if _first(built):
        note = f"resumed from {manifest['path']} at step {step}"
        if seed != args.seed:
            note += f" (data seed {seed} from the checkpoint, not --seed {args.seed})"
        if saved != now and (saved or now):
            note += "; warning: --data is not the file the checkpoint was trained on"
        print(note, file=sys.stderr, flush=True)
    return step, seed, state.get("packer") if packed else None


def _data_said(identity: Any) -> str:
    """A checkpoint's data identity in a few words, for the refusal of a resume on other data."""
    if not isinstance(identity, dict):
        return "synthetic data"
    if "corpora" not in identity:
        return f"{identity.get('path')} (read as bytes)"
    corpora = ", ".join(f"{c['path']} ({c['documents']:,} documents, {c['ids']:,} ids, sha256 {c['sha256']})"
                        for c in identity["corpora"])
    return f"{corpora} packed at seq {identity['seq']}, batch {identity['batch']}, seed {identity['seed']}"


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _has_latest(root: Path) -> bool:
    return (Path(root) / "latest").is_file()


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _stopped_ranks(progress: Progress, world: int) -> str:
    """The ranks whose heartbeat stopped: what a timed-out rank was waiting for."""
    now = time.time()
    silent: dict[int, float] = {}
    for r in range(world):
        beat = progress.read(f"meshllm/beat/{r}")
        if beat is None or now - float(beat) > 3 * HEARTBEAT_S + 1:
            silent[r] = now - float(beat) if beat else float("inf")
    if not silent:
        return ""
    r = min(silent)
    where = (progress.read(f"meshllm/at/{r}") or "? unknown").partition(" ")[2]
    names = ", ".join(str(b) for b in sorted(silent))
    quiet = f"silent for {silent[r]:.0f} s" if silent[r] != float("inf") else "never started"
    return f"rank{'s' * (len(silent) > 1)} {names} stopped responding ({quiet}; last at {where})"


def _alive(pid: int) -> bool:
    try:  # a killed process stays a zombie until torchrun reaps it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _gone_ranks(progress: Progress, world: int) -> list[int]:
    """Ranks on this host whose process no longer exists."""
    out = []
    for r in range(world):
        got = progress.read(f"meshllm/pid/{r}")
        if got:
            host, _, pid = got.partition(" ")
            if host == socket.gethostname() and not _alive(int(pid)):
                out.append(r)
    return out


# How long a rank that lost a peer looks for the cause: a killed process closes its connections
# before the kernel marks it a zombie, so for a moment it still looks alive (seen under load: "a peer
# rank exited" instead of naming the killed rank).
GONE_WAIT_S = 2.0


def _lost_peer(progress: Progress | None, world: int, wait: float = GONE_WAIT_S) -> tuple[str | None, list[int]]:
    """Why a peer went away: the failure a rank recorded, or the ranks on this host whose process
    is gone; looked for again for up to ``wait`` seconds while neither is known yet."""
    if progress is None:
        return None, []
    deadline = time.monotonic() + wait
    while True:
        failed = progress.read("meshllm/failed")
        gone = [] if failed else _gone_ranks(progress, world)
        if failed or gone or time.monotonic() >= deadline:
            return failed, gone
        time.sleep(0.05)


def _kill_stuck(progress: Progress, text: str) -> None:
    """SIGKILL peers on this host that stopped (a SIGSTOPped rank ignores torchrun's SIGTERM for
    its 30 s grace period); the registered pid is theirs, written by the rank at start."""
    if not text.startswith("rank"):
        return
    ranks = text.split(" stopped")[0].split(" ", 1)[1]
    for r in (int(x) for x in ranks.split(", ")):
        got = progress.read(f"meshllm/pid/{r}")
        if got:
            host, _, pid = got.partition(" ")
            if host == socket.gethostname():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)


def _say(line: str) -> None:
    """One report line in a single write, on a line of its own: ranks write concurrently and the
    first rank's progress bar leaves its line open."""
    sys.stderr.flush()
    os.write(2, f"\n{line}\n".encode())


def _report(exc: BaseException, rank: int, world: int, first: bool, debug: bool, progress: Progress | None) -> None:
    """One line per failure: the cause on the rank that failed (or on the first rank when every
    rank agrees on it), ``stopped because ...`` on the others.  Tracebacks only with ``debug``."""
    # Wrappers such as pipelining's "[Stage 0] failed to run forward" say where, not why: judge
    # and report by the innermost exception of the chain.
    # `raise X from None` means X says it all: stop there, as Python's own traceback does.
    chain = [exc]
    while len(chain) < 20:
        last = chain[-1]
        inner = last.__cause__ if last.__cause__ is not None else (
            None if last.__suppress_context__ else last.__context__)
        if inner is None:
            break
        chain.append(inner)
    text = "\n".join(str(e) for e in chain)
    if isinstance(exc, Preempted):
        if first:
            _say(str(exc))
    elif isinstance(exc, KeyboardInterrupt):
        if first:
            _say("stopped: interrupted")
    elif isinstance(exc, PlanMismatch):
        # Raised alike on every rank of every node: each node's meshc says it once.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            _say(f"error: {exc}")
    elif isinstance(exc, (InputError, DataError, CheckpointError, WeightsError)):
        # Raised alike on every rank (inputs; checkpoint and --weights checks read the same files
        # everywhere before any rank reads a tensor): say it once.
        if first:
            _say(f"error: {'bad --weights: ' if isinstance(exc, WeightsError) else ''}{exc}")
    elif any(mark in text for mark in _PEER_LOST):
        failed, gone = _lost_peer(progress, world)
        if failed:
            why = f"rank {failed}"
        elif gone:
            why = f"rank {', '.join(map(str, gone))} exited without a word (killed?)"
        else:
            why = "a peer rank exited"
        _say(f"rank {rank} stopped: {why}")
    elif "timed out" in text.lower() or "timeout" in text.lower():
        stuck = _stopped_ranks(progress, world) if progress else ""
        detail = f": {stuck}" if stuck else f" ({_cause(chain[-1])})"
        mine, first_report = f"{rank} timed out{detail}", True
        if progress is not None and progress.store is not None:
            # Before killing the stuck rank, so the others blame it and not "a peer exited"; and
            # only the first rank to time out says it as an error.
            with contextlib.suppress(Exception):
                got = bytes(progress.store.compare_set("meshllm/failed", "", mine)).decode()
                first_report = got == mine
        if first_report:
            _say(f"error: rank {rank} timed out waiting for a collective{detail}")
        else:
            _say(f"rank {rank} stopped: timed out too{detail}")
        if progress:
            _kill_stuck(progress, stuck)
    else:
        cause = f"{rank} failed: {_cause(chain[-1])}"
        if progress is not None and progress.store is not None:
            with contextlib.suppress(Exception):
                progress.store.compare_set("meshllm/failed", "", cause)
        _say(f"error: rank {cause}")
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()


def select_device() -> bool:
    """This process's device: GPU ``LOCAL_RANK`` of its node when CUDA is present (NCCL then), else
    the CPU (gloo).  ``MESHLLM_DEVICE=cpu`` keeps a CPU plan on the CPU of a GPU machine (`meshc
    run` sets it for a spec whose device is `cpu`).  True for CUDA; ``InputError`` when the node
    runs more processes than it has GPUs (NCCL refuses two ranks on one GPU, much later)."""
    if os.environ.get("MESHLLM_DEVICE", "").lower() == "cpu" or not torch.cuda.is_available():
        return False
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        raise InputError(
            f"local rank {local} has no GPU: this node has {count}, so it can run at most {count} "
            "processes (MESHLLM_DEVICE=cpu runs on the CPU instead)"
        )
    torch.cuda.set_device(local)
    return True


def main(program: Program, argv: Sequence[str] | None = None) -> None:
    """Run ``program`` under torchrun (or any launcher that sets RANK / WORLD_SIZE / MASTER_*)."""
    from meshllm_dsl.runtime.train import startup

    startup.report("up")
    args, auto_resume = _checked_args(program, argv)
    cuda = _device_or_exit()
    timeout = timedelta(seconds=args.timeout)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    first, progress = rank == 0, None
    try:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        set_group_timeout(timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        startup.report("joined")
        if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            _check_nodes(program, args, rank, world, timeout)
        progress = Progress(rank)
        built = program.build(seed=args.seed, weights=args.weights, device=None if cuda else torch.device("cpu"))
        first = _first(built)
        if first and built.float8_layers:
            recipes = " and ".join(dict.fromkeys(program.float8.values()))
            _say(f"float8: {len(built.float8_layers)} linear layers on this rank train in {recipes}"
                 + (" (torchao, emulated: no CUDA)" if not cuda else " (torchao)")
                 + (", all-gathered in float8" if program.float8_gather else ""))
        startup.report("built")
        start, seed, cursor = _starting_step(built, args, auto_resume, first)
        tokenizer, corpus = _text_inputs(built, args)
        _run_mode(program, built, args, start, seed, tokenizer, corpus, progress, first, cursor)
        if args.export_hf:
            from meshllm_dsl.runtime.hf.weights import export_hf

            written = export_hf(built, args.export_hf, source=args.weights)
            if written is not None:
                _say(written)
        progress.mark("done")
    except Preempted as exc:
        _report(exc, rank, world, first, args.debug, progress)
        sys.stderr.flush()
        os._exit(143)  # 128 + SIGTERM: stopped on request, resumable
    except BaseException as exc:  # noqa: BLE001 - every failure must end this process at once
        _report(exc, rank, world, first, args.debug, progress)
        # No clean shutdown: destroy_process_group could wait on peers that are stuck waiting
        # for this rank.  Exiting closes the connections so their collectives fail promptly.
        os._exit(1)
    progress.stop()
    # Done, and everything written is fsynced: leave without tearing the process group and the
    # interpreter down. A finished rank aborted now and then in that teardown ("terminate called
    # without an active exception", exit -6, seen twice on a loaded 2-core machine, once after a
    # torchrun restart), failing a job that had completed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _checked_args(program: Program, argv: Sequence[str] | None) -> tuple[argparse.Namespace, bool]:
    """The command line, checked against the program (and --weights against its config) before any
    rank joins: exit 2 on a bad one. Also whether torchrun restarted the job, which then resumes."""
    args = parse_args(argv)
    auto_resume = args.resume is None and _restarted() and args.save is not None and _has_latest(args.save)
    if auto_resume:
        args.resume = "latest"  # torchrun restarted the job: go on from the last checkpoint
    if args.compile_fallback:
        from meshllm_dsl.runtime.train.compile import FALLBACK_ENV

        os.environ[FALLBACK_ENV] = "eager"
    if program.float8:
        from meshllm_dsl.runtime.train.float8 import Float8Unavailable, torchao_version

        try:  # before any rank joins: one line, exit 2, not a failure in every rank's build
            torchao_version()
        except Float8Unavailable as err:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
    try:
        check_inputs(args, program.model, program.seq)
    except InputError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.weights is not None:
        try:  # config, index and tensor headers against the program, before any rank reads a tensor
            ignored = check_weights(args.weights, program, args.weights_extra)
        except WeightsError as err:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: bad --weights: {err}", file=sys.stderr)
            sys.exit(2)
        if ignored and os.environ.get("RANK", "0") == "0":
            print(f"warning: {extras_note(args.weights, ignored)}", file=sys.stderr)
    return args, auto_resume


def _device_or_exit() -> bool:
    """select_device, or exit 2 where this rank has no GPU (said once, by the first such rank)."""
    try:
        return select_device()
    except InputError as err:
        if os.environ.get("LOCAL_RANK", "0") == str(torch.cuda.device_count()):  # the first without a GPU
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _check_nodes(program: Program, args: argparse.Namespace, rank: int, world: int, timeout: timedelta) -> None:
    """Every node runs the same plan; rank 0 warns about what the nodes it sees do not match."""
    nodes = check_same_plan(args, rank, world, timeout)
    if rank == 0:
        for line in node_warnings(program.axes, getattr(program, "hosts", 1), nodes):
            _say(line)


def _starting_step(built: Built, args: argparse.Namespace, auto_resume: bool,
                   first: bool) -> tuple[int, int, dict[str, Any] | None]:
    """The step, seed and data cursor the run starts from: a resumed checkpoint's, else 0, --seed and
    None (after loading --load's weights)."""
    start, seed, cursor = 0, args.seed, None
    if args.resume is not None:
        start, seed, cursor = _resume(built, args)
    elif args.load:
        loaded = load_checkpoint(built, args.load)
        if first:
            saved = " x ".join(f"{name} {size}" for name, size in loaded["layout"]["axes"]) or "1 rank"
            _say(f"loaded the weights of {loaded['path']} (step {loaded['step']}, saved on {saved})")
    if args.save_over and not auto_resume:
        start_lineage(built)  # --save-over starts a lineage of its own, even from --resume
    return start, seed, cursor


def _text_inputs(built: Built, args: argparse.Namespace) -> tuple[Any, Any]:
    """The tokenizer (--tokenizer) and the tokenized corpus of a text --data; None where not given.
    Text with a tokenizer is tokenized here; a token file or raw bytes are memory-mapped."""
    tokenizer = None
    if args.tokenizer:
        from meshllm_dsl.runtime.train.tokens import load_tokenizer

        tokenizer = load_tokenizer(Path(args.tokenizer))
    from meshllm_dsl.runtime.train.tokens import token_file_vocab

    text = args.data is not None and not is_corpus(args.data) and token_file_vocab(args.data) is None
    corpus = _corpus(built, args.data, tokenizer) if tokenizer is not None and text else None
    return tokenizer, corpus


def _run_mode(program: Program, built: Built, args: argparse.Namespace, start: int, seed: int, tokenizer: Any,
              corpus: Any, progress: Progress, first: bool, cursor: dict[str, Any] | None = None) -> None:
    """What the command line asks of the built program: generate, evaluate, or train from `start`
    (and, on a packed corpus, from the data cursor `cursor`)."""
    if args.infer:
        from meshllm_dsl.runtime.train.tokens import parse_ids

        prompt = None
        if args.prompt_ids is not None:
            prompt = parse_ids(args.prompt_ids, _real_vocab(built))
        elif args.prompt is not None:
            prompt = parse_ids(",".join(map(str, tokenizer.encode(args.prompt))), _real_vocab(built))
        infer(built, args.tokens, args.seed, prompt, tokenizer)
    elif args.eval:
        if is_corpus(args.data):
            evaluate_packed(built, args.data, max(args.steps, 1))
        else:
            evaluate(built, _corpus(built, args.data, tokenizer), max(args.steps, 1))
    elif args.steps == 0:
        _summary(built, "no training steps (--steps 0)")
    elif start >= args.steps:
        if first:
            print(f"nothing to do: the checkpoint is at step {start}, --steps is {args.steps}",
                  file=sys.stderr)
    else:
        _train_and_profile(program, built, args, start, seed, corpus, progress, first, cursor)


def _train_and_profile(program: Program, built: Built, args: argparse.Namespace, start: int, seed: int,
                       corpus: Any, progress: Progress, first: bool, cursor: dict[str, Any] | None = None) -> None:
    """Train steps `start` to --steps, then profile (--profile) or trace (--profile-trace) a few more."""
    if args.data is not None and not is_corpus(args.data) and len(open_data(args.data)) < program.seq + 2:
        raise InputError(
            f"--data {args.data}: needs at least {program.seq + 2} bytes for seq "
            f"{program.seq}, has {len(open_data(args.data))}"
        )
    preempt = Preemption() if args.save is not None else None
    train(built, args.steps, seed, args.data, corpus, start=start, save=args.save,
          save_every=args.save_every, keep=args.keep, progress=progress,
          preempt=preempt, metrics=args.metrics, tensorboard=args.tensorboard, cursor=cursor,
          balance=args.balance)
    if args.profile:
        from meshllm_dsl.runtime.train.profile import profile_train

        p = program
        batches = [synthetic_batch(_real_vocab(built), p.batch, p.seq, args.seed, i) for i in range(PROFILE_STEPS)]
        profile_train(built, batches, args.profile)
    if args.profile_trace:
        from meshllm_dsl.runtime.train.profile import trace_train

        p = program
        batches = [synthetic_batch(_real_vocab(built), p.batch, p.seq, args.seed, i) for i in range(TRACE_STEPS)]
        trace_train(built, batches, args.profile_trace)
        if first:
            print(f"Chrome traces of one step: {args.profile_trace}/rank*.json "
                  "(chrome://tracing or ui.perfetto.dev)", file=sys.stderr)
