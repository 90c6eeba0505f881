"""`meshc tokenize`: text -> a token file that every rank memory-maps (runtime/train/tokens.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_tokenize(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.runtime.outputs import OutputError, check_new_file

    text, out = Path(args.text), Path(args.output)
    if not text.is_file():
        raise UsageError(f"no such file: {text}")
    if not Path(args.tokenizer).is_dir() and not Path(args.tokenizer).is_file():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such directory")
    check_new_file(out, "token file", args.force)
    from meshllm_dsl.runtime.train.tokens import Tokenizer, write_token_file

    try:
        tokenizer = Tokenizer(args.tokenizer)
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        count = write_token_file(text, tokenizer, out)
    except UnicodeDecodeError as err:
        raise UsageError(f"{text} is not UTF-8 text (byte offset {err.start})") from None
    except OSError as err:
        raise OutputError(f"cannot write {out}: {err.strerror or err}") from None
    eos = "" if tokenizer.eos is None else f", documents ended by id {tokenizer.eos}"
    print(f"wrote {out}: {count:,} tokens (vocabulary {tokenizer.vocab:,}{eos})", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    t = sub.add_parser("tokenize", help="text -> a token file for `meshc run --data` (memory-mapped by every rank)")
    t.add_argument("text", metavar="TEXTFILE", help="UTF-8 text; documents separated by blank lines")
    t.add_argument("--tokenizer", required=True, metavar="DIR", help="a Hugging Face tokenizer (tokenizer.json)")
    t.add_argument("-o", "--output", required=True, metavar="FILE", help="the token file to write")
    t.add_argument("--force", action="store_true", help="replace FILE if it exists")
    t.set_defaults(func=cmd_tokenize)
