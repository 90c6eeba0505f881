"""What the bench scripts share: a spec compiled to a generated module, plans stepped in interleaved
rounds on the same ranks, and the table they print.

Imported as `_common` (the scripts run as `python bench/NAME.py`, so bench/ is first on sys.path,
also in the worker pool's ranks, which the fork server starts with the parent's sys.path).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def compile_spec(text: str, directory: str | Path, name: str) -> tuple[Any, str]:
    """(the checked plan, the path of its generated module `directory/name.py`) for a spec with
    one plan; a spec that does not check stops the bench with its messages."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.emit import render_plan

    result = check_text(text, f"{name}.mesh")
    assert result.ok, [d.message for d in result.errors]
    (plan,) = result.plans.values()
    path = Path(directory) / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", text))
    return plan, str(path)


def interleaved_steps(built: Mapping[str, Any], tokens: Any, targets: Any, rounds: int,
                      steps: int) -> dict[str, list[float]]:
    """Seconds of each training step of every plan in `built`, in rounds of `steps` steps of one
    plan after the other, so a swing of the shared cores falls on all plans alike. The ranks meet
    at a barrier before each step: one rank's step is then the job's, not its share of it."""
    import torch

    times: dict[str, list[float]] = {k: [] for k in built}
    for _ in range(rounds):
        for k, b in built.items():
            for _ in range(steps):
                torch.distributed.barrier()
                start = time.perf_counter()
                b.train_step(tokens, targets)
                times[k].append(time.perf_counter() - start)
    return times


def print_table(rows: Sequence[Sequence[object]], align: str = "l", indent: str = "  ",
                markdown: bool = False) -> None:
    """Rows (the first is the header) in columns as wide as their widest cell, aligned as `align`
    says column by column ("l" flush left, "r" flush right; columns past its end flush right, so
    the default puts the names left and the numbers right). `markdown`: a Markdown table (for
    pasting into README.md), else columns two spaces apart."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    sides = align.ljust(len(widths), "r")

    def line(r: Sequence[str]) -> str:
        parts = [c.ljust(w) if side == "l" else c.rjust(w) for c, w, side in zip(r, widths, sides)]
        return f"| {' | '.join(parts)} |" if markdown else (indent + "  ".join(parts)).rstrip()

    print(line(cells[0]))
    if markdown:
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print(line(r))
