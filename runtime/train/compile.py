"""`compile = blocks` in a plan: torch.compile each block of the repeat, as torchtitan compiles per
transformer block (torchtitan/models/llama3/infra/parallelize.py ``apply_compile``).

Each block's forward is compiled in place (the module, its parameter names and FSDP2's hooks stay
as they are: FSDP2 gathers outside the compiled region, torchtitan's order). A block is compiled
with ``fullgraph=True`` where Dynamo traces it whole; a block it must break (a collective or a
custom autograd Function it cannot trace) is compiled in pieces instead. A compilation that fails
outright stops the run with the block's name; it falls back to running that block eagerly only if
the user asked (``--compile-fallback`` or MESHLLM_COMPILE_FALLBACK=eager), and says so once, and
only when the whole-graph compile failed (nothing of the block has run then).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

FALLBACK_ENV = "MESHLLM_COMPILE_FALLBACK"


class BlockCompileError(RuntimeError):
    """torch.compile could not compile a block: which one, and why."""


def fallback_asked() -> bool:
    return os.environ.get(FALLBACK_ENV, "") == "eager"


def compile_blocks(blocks: Mapping[str, nn.Module], names: Mapping[str, str], fallback: bool | None = None) -> int:
    """Compile every block of ``blocks`` (a stage's ModuleDict) in place; ``names`` gives each key the
    block's name in the model (`blocks.7`) for messages. The number of blocks compiled."""
    fallback = fallback_asked() if fallback is None else fallback
    # Dynamo traces through functools.lru_cache and warns that it does: the cached functions the blocks
    # call (rope's inverse frequencies, model/rope.py) are pure in their arguments, so the trace
    # computes what the cache holds.
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`", category=UserWarning)
    for key, block in blocks.items():
        block.forward = _CompiledForward(block.forward, names.get(key, key), fallback)  # type: ignore[method-assign]
    return len(blocks)


def _dynamo_errors() -> tuple[type[BaseException], ...]:
    import torch._dynamo.exc as exc

    return (exc.TorchDynamoException,)


class _CompiledForward:
    """A block's forward under torch.compile: whole-graph first, in pieces where Dynamo must break
    the graph, the eager forward only when asked and compilation fails."""

    def __init__(self, eager: Callable[..., Any], name: str, fallback: bool) -> None:
        self.eager, self.name, self.fallback = eager, name, fallback
        self.fullgraph = True
        self.compiled: Callable[..., Any] = torch.compile(eager, fullgraph=True)
        self.failed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except _dynamo_errors() as e:
            if self.fullgraph and _graph_break(e):
                # The block cannot be one graph: compile it in pieces (Dynamo splits at the break).
                self.fullgraph = False
                self.compiled = torch.compile(self.eager, fullgraph=False)
                return self(*args, **kwargs)
            if not (self.fallback and self.fullgraph):
                # In pieces, an earlier piece (and its collectives) may have run: rerunning the block
                # eagerly would repeat them on this rank alone, so only a whole-graph failure falls back.
                hint = "" if self.fallback else " (run with --compile-fallback to run such blocks eagerly)"
                raise BlockCompileError(f"torch.compile failed on {self.name}: {_first_line(e)}{hint}") from e
            print(f"warning: torch.compile failed on {self.name}, which runs eagerly: {_first_line(e)}",
                  file=sys.stderr, flush=True)
            self.failed = True
            return self.eager(*args, **kwargs)


def _graph_break(e: BaseException) -> bool:
    import torch._dynamo.exc as exc

    return isinstance(e, exc.Unsupported)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
