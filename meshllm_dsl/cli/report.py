"""`meshc report FILE.jsonl`: charts of the metrics `meshc run --metrics` wrote (SVG, no dependency)."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_report(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli.main import UsageError, existing
    from meshllm_dsl.views.metrics_report import MetricsError, write_report

    path = Path(existing(args.file)[0])
    out = Path(args.out) if args.out else path.parent
    try:
        written = write_report(path, out)
    except MetricsError as err:
        raise UsageError(str(err)) from None
    for target in written:
        print(target)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    r = sub.add_parser("report", help="draw the loss and tokens/s per step of a `meshc run --metrics` file (SVG)")
    r.add_argument("file", metavar="FILE.jsonl", help="what `meshc run --metrics FILE.jsonl` wrote")
    r.add_argument("--out", metavar="DIR",
                   help="write FILE.loss.svg and FILE.tokens_per_s.svg here (default: beside FILE)")
    r.set_defaults(func=cmd_report)
