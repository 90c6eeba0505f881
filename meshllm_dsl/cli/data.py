"""`meshc tokenize`: sources -> a token file with its document index (and loss mask) that every rank
memory-maps (runtime/data/corpus.py); `meshc data-stats`: how many documents and tokens a source
holds and how long its documents are."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _sources(paths: list[str]) -> list[Any]:
    from meshllm_dsl.runtime.data.sources import open_source

    return [open_source(p) for p in paths]


def _encoder(tokenizer: str | None, sources: list[Any]) -> tuple[Any, Any]:
    """(the Tokenizer, its EncoderSpec), or (None, None) when every source is a token file."""
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.runtime.data.prepare import encoder_spec
    from meshllm_dsl.runtime.train.tokens import Tokenizer

    if tokenizer is None:
        needs = [s for s in sources if s.kind != "tokens"]
        if needs:
            raise UsageError(f"{needs[0].path} is a {needs[0].kind} source: pass --tokenizer DIR to tokenize it")
        return None, None
    if not Path(tokenizer).exists():
        raise UsageError(f"--tokenizer {tokenizer}: no such directory")
    tok = Tokenizer(tokenizer)
    return tok, encoder_spec(tok, Path(tokenizer))


def _skipped(counts: Any) -> None:
    if counts.bad or counts.empty:
        first = f" (first: {counts.first_bad})" if counts.first_bad else ""
        print(f"skipped {counts.bad:,} bad and {counts.empty:,} empty records{first}", file=sys.stderr)


def cmd_tokenize(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.runtime.outputs import OutputError, check_new_file

    out = Path(args.output)
    sources = _sources(args.sources)
    check_new_file(out, "token file", args.force)
    if any(out.resolve() == f.resolve() for s in sources for f in s.files):
        raise OutputError(f"-o {out} is one of the inputs; name another token file")
    tokenizer, spec = _encoder(args.tokenizer, sources)
    from meshllm_dsl.runtime.data.prepare import TokenFileWriter, encode_sources
    from meshllm_dsl.runtime.train.tokens import DataError, token_file_vocab

    token_vocabs = {s.path: token_file_vocab(s.path) or 1 for s in sources if s.kind == "tokens"}
    vocab = tokenizer.vocab if tokenizer is not None else max(token_vocabs.values())
    for path, v in token_vocabs.items():
        if tokenizer is not None and v != vocab:  # ids of another tokenizer would mean other words
            raise UsageError(f"{path} was tokenized for a vocabulary of {v:,}; --tokenizer {args.tokenizer} "
                             f"has {vocab:,}: a corpus is one tokenizer's ids")
    try:
        writer = TokenFileWriter(out, vocab)
    except OSError as err:
        raise OutputError(f"cannot write {out}: {err.strerror or err}") from None
    try:
        counts = encode_sources(sources, spec, writer, text_field=args.text_field, skip_bad=args.skip_bad,
                                workers=args.workers)
        writer.commit()
    except DataError as err:
        writer.abort()
        raise UsageError(str(err)) from None
    except OSError as err:
        writer.abort()
        raise OutputError(f"cannot write {out}: {err.strerror or err}") from None
    except BaseException:
        writer.abort()
        raise
    _skipped(counts)
    eos = "" if spec is None or spec.eos is None else f", documents ended by id {spec.eos}"
    mask = f", loss on {counts.loss_tokens:,}" if counts.loss_tokens != counts.tokens else ""
    print(f"wrote {out}: {counts.tokens:,} tokens in {counts.documents:,} documents{mask} "
          f"(vocabulary {vocab:,}{eos})", file=sys.stderr)
    return 0


def _token_file_counts(source: Any) -> Any:
    """A token file's counts from its document index and loss mask, without reading its ids."""
    from meshllm_dsl.runtime.data.corpus import open_corpus
    from meshllm_dsl.runtime.data.prepare import Counts

    corpus = open_corpus(source.path)
    import numpy as np

    counts = Counts(documents=corpus.documents, tokens=len(corpus.ids))
    counts.loss_tokens = counts.tokens if corpus.loss_mask is None else int(corpus.loss_mask.sum(dtype=np.int64))
    counts.add_lengths(corpus.lengths())
    return counts


def format_stats(counts: Any, described: list[str]) -> str:
    """data-stats' report: totals, then the length histogram with a bar per bucket."""
    lines = [f"source     {d}" for d in described]
    lines.append(f"documents  {counts.documents:,}")
    loss = f" (loss on {counts.loss_tokens:,})" if counts.loss_tokens != counts.tokens else ""
    lines.append(f"tokens     {counts.tokens:,}{loss}")
    first = f"; first: {counts.first_bad}" if counts.first_bad else ""
    lines.append(f"skipped    {counts.bad:,} bad, {counts.empty:,} empty{first}")
    if counts.histogram:
        lines.append("length (tokens, end-of-text included)  documents")
        top = max(counts.histogram.values())
        lo_k, hi_k = min(counts.histogram), max(counts.histogram)
        for k in range(lo_k, hi_k + 1):
            n = counts.histogram.get(k, 0)
            span = f"{2 ** k:,}..{2 ** (k + 1) - 1:,}"
            bar = "#" * (0 if n == 0 else max(1, round(40 * n / top)))
            lines.append(f"  {span:>20}  {n:>10,}  {bar}")
    return "\n".join(lines)


def cmd_data_stats(args: argparse.Namespace) -> int:
    from meshllm_dsl.runtime.data.prepare import Counts, encode_sources

    sources = _sources(args.sources)
    if all(s.kind == "tokens" for s in sources) and args.tokenizer is None:
        total = Counts()
        for s in sources:
            c = _token_file_counts(s)
            total.documents += c.documents
            total.tokens += c.tokens
            total.loss_tokens += c.loss_tokens
            for k, n in c.histogram.items():
                total.histogram[k] = total.histogram.get(k, 0) + n
        counts = total
    else:
        _, spec = _encoder(args.tokenizer, sources)
        counts = encode_sources(sources, spec, None, text_field=args.text_field, skip_bad=args.skip_bad,
                                workers=args.workers)
    print(format_stats(counts, [s.describe() for s in sources]))
    if args.plan is not None:
        corpora = data_corpora([(p, 1.0) for p in args.sources], args.tokenizer, args)
        source = " + ".join(s.describe() for s in sources)
        from meshllm_dsl.cli.plan import data_report

        return data_report(args.plan, args.plan_name, corpora, source, args)
    return 0


def data_corpora(spec: str | list[tuple[str, float]], tokenizer: str | None, args: argparse.Namespace) -> list[Any]:
    """The corpora of ``spec`` with their weights, tokenized into ``--data-cache`` as `meshc run` does."""
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.runtime.data.prepare import prepare_corpora

    if tokenizer is not None and not Path(tokenizer).exists():
        raise UsageError(f"--tokenizer {tokenizer}: no such directory")
    return prepare_corpora(spec, tokenizer, args.data_cache, text_field=args.text_field, skip_bad=args.skip_bad)


def measure_data(corpora: list[Any], plan: Any, *, seed: int, steps: int, balance: bool) -> Any:
    """The data ranks' rows over the first ``steps`` global batches of ``plan`` in the seeded order
    (runtime/data/packing.py's Packer, as `meshc run --data` packs them; with ``balance`` repacked
    for the ranks as `meshc run --balance` repacks them): a planner/data.py DataProfile."""
    import numpy as np

    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.planner.data import Row, data_profile
    from meshllm_dsl.runtime.data.packing import Packer
    from meshllm_dsl.runtime.train.tokens import DataError

    ranks = plan.data_size
    try:
        packer = Packer(list(corpora), seq=plan.seq, seed=seed, balance=ranks if balance else 0)
        taken = []
        for _ in range(steps):
            # Tokens are row[:-1], targets row[1:] (Packer.next_batch): the documents of the tokens.
            taken.append([Row(tuple(int(n) for n in np.bincount(docs[:-1])), int(train[1:].sum()))
                          for _ids, docs, _pos, train in packer.step_rows(plan.batch)])
    except DataError as err:
        raise UsageError(f"plan `{plan.name}`: {err}") from None
    # Under the document mask a context rank's share of a row depends on its documents: split the rows
    # as the runtime does (without it a causal row's head-tail halves are even: nothing to measure).
    split = plan.document_mask and plan.context_size > 1
    return data_profile(taken, seq=plan.seq, ranks=ranks, masked=plan.document_mask, balanced=balance,
                        contexts=plan.context_size, context_balance=plan.context_balance,
                        context_pairs=_context_pairs(taken, plan.context_size) if split else None)


def _context_pairs(taken: list[list[Any]], contexts: int) -> dict[str, list[list[list[int]]]]:
    """Under each `context_balance`, the causal pairs each of ``contexts`` context ranks' queries see
    in each row of each step (``[step][row][c]``), as the runtime splits the rows
    (runtime/parallel/context_layout.py, from the rows' document numbers: 0, 1, ... along the row,
    as Packer.next_row numbers them, each as long as the Row's length)."""
    import torch

    from meshllm_dsl.runtime.parallel.context_layout import BALANCES, rank_pairs

    numbers = [torch.stack([torch.repeat_interleave(torch.arange(len(row.lengths)), torch.tensor(row.lengths))
                            for row in rows]) for rows in taken]
    return {b: [rank_pairs(docs, contexts, b).tolist() for docs in numbers] for b in BALANCES}


def _processes(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of processes, 1 or more")
    return int(text)


def _source_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the JSONL / Parquet / dataset field holding each document: a string, or a chat "
                        "(a list of {role, content}) rendered with the tokenizer's chat template (default: text)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip records that are not usable (not JSON, no field, not UTF-8) and count them")
    p.add_argument("--workers", type=_processes, default=None, metavar="N",
                   help="tokenizing processes (default: one per core)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    t = sub.add_parser("tokenize", help="text, JSONL, Parquet or a saved dataset -> a token file for "
                                        "`meshc run --data` (memory-mapped by every rank)")
    t.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="a text file (documents at blank lines), a .jsonl or .parquet file or directory "
                        "of them, a `datasets` save_to_disk directory, or a token file; several are "
                        "written one after the other")
    t.add_argument("--tokenizer", metavar="DIR", help="a Hugging Face tokenizer (tokenizer.json)")
    t.add_argument("-o", "--output", required=True, metavar="FILE", help="the token file to write "
                   "(and FILE.docs, its document index; FILE.lossmask for chats)")
    t.add_argument("--force", action="store_true", help="replace FILE if it exists")
    _source_options(t)
    t.set_defaults(func=cmd_tokenize)

    s = sub.add_parser("data-stats", help="documents, tokens, skipped records and document lengths of "
                                          "a data source")
    s.add_argument("sources", nargs="+", metavar="SOURCE", help="as for `meshc tokenize`")
    s.add_argument("--tokenizer", metavar="DIR",
                   help="a Hugging Face tokenizer (not needed for a token file)")
    _source_options(s)
    s.add_argument("--plan", metavar="FILE.mesh",
                   help="also each data rank's share of tokens and attention work over the plan's first steps "
                        "(its seq, global batch and data ranks), and what they cost its step")
    s.add_argument("--plan-name", metavar="P", help="with --plan: only this plan (default: every plan in the file)")
    add_data_plan_flags(s)
    s.set_defaults(func=cmd_data_stats)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of steps, 1 or more")
    return int(text)


def add_data_plan_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say which rows a plan's data ranks take (`data-stats --plan`, `plan --data`)."""
    p.add_argument("--seed", type=int, default=0, help="the packing order's seed, as `meshc run --seed` (default 0)")
    p.add_argument("--steps", type=_positive, default=20, metavar="N",
                   help="measure the first N steps of the seeded order (default 20)")
    p.add_argument("--balance", action="store_true",
                   help="with each step's documents repacked for the data ranks as `meshc run --balance` repacks them")
    p.add_argument("--data-cache", default="meshllm-data-cache", metavar="DIR",
                   help="where tokenized sources are kept, named by content hash (default ./meshllm-data-cache)")



def _needs_tokenizing(spec: str) -> bool:
    """Whether `meshc run --data SPEC` names sources the ranks cannot read as they are: anything but
    one file (a token file, text read through --tokenizer in memory, or bytes)."""
    if Path(spec).is_file():
        return Path(spec).suffix in (".jsonl", ".parquet")
    return True


def run_data(args: argparse.Namespace, documents: bool = False) -> str | None:
    """The ``--data`` the ranks of `meshc run` read: a data spec's sources tokenized here, once, into
    cached corpora (runtime/data/prepare.py; the ranks then read token files), or ``--data`` itself
    when it is one file they read (a token file, a text file, bytes).  With ``documents`` (the plan
    masks them) a text file with ``--tokenizer`` is tokenized into its documents too."""
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.runtime.train.tokens import DataError, token_file_header

    spec = args.data
    field = getattr(args, "text_field", "text")
    if spec is not None and not args.infer and not Path(spec).exists():
        from meshllm_dsl.runtime.data.sources import parse_data_spec

        missing = [path for path, _ in parse_data_spec(spec) if not path.exists()]
        if missing:
            raise UsageError(f"--data {missing[0]}: no such file or directory")
    try:
        text = spec is not None and Path(spec).is_file() and token_file_header(spec) is None
    except DataError:
        text = False  # a broken token file: the launcher's checks name what is wrong with it
    wanted = documents and text and args.tokenizer is not None
    if spec is None or args.infer or not (_needs_tokenizing(spec) or field != "text" or wanted):
        return spec
    if args.tokenizer is None:
        raise UsageError(f"--data {spec}: these sources are tokenized before training; pass --tokenizer DIR")
    if args.eval and "," in spec:
        raise UsageError("--eval takes one held-out --data source, not a weighted mix")
    corpora = data_corpora(spec, args.tokenizer, args)
    return ",".join(f"{c.path.resolve()}:{w:g}" if len(corpora) > 1 else str(c.path.resolve()) for c, w in corpora)


def add_run_data_flags(r: argparse.ArgumentParser) -> None:
    """`meshc run`'s flags for the sources it tokenizes before training."""
    r.add_argument("--text-field", default="text", metavar="NAME",
                   help="the JSONL / Parquet / dataset field of each document: a string, or a chat's `messages` "
                        "(the loss on the assistant's tokens)")
    r.add_argument("--skip-bad", action="store_true", help="skip and count unusable records instead of stopping at the first")
    r.add_argument("--data-cache", default="meshllm-data-cache", metavar="DIR",
                   help="where tokenized sources are kept, named by content hash (default ./meshllm-data-cache)")
