"""`meshc`: the command line. Exit codes: 0 ok, 1 errors in a spec, 2 usage or internal error."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from meshllm_dsl.diagnostics import Diagnostic, SpecError, render_all, to_json

EXIT_OK, EXIT_SPEC, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


class _Terminated(BaseException):
    """SIGTERM as an exception (a BaseException, like KeyboardInterrupt) so cleanup runs."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def existing(*paths: str) -> list[str]:
    """The paths, or a usage error naming those that are not files."""
    import os
    import stat

    missing, others = [], []
    for p in paths:
        try:
            if not stat.S_ISREG(os.stat(p).st_mode):
                others.append(p)
        except FileNotFoundError:
            missing.append(p)
        except OSError as err:
            raise UsageError(f"cannot read {p}: {err.strerror or err}") from None
    if missing:
        raise UsageError(f"no such file: {', '.join(missing)}")
    if others:
        raise UsageError(f"not a regular file: {', '.join(others)}")
    return list(paths)


def select_plans(plans: Mapping[str, object], path: str, name: str | None) -> list[str]:
    """Names of the plans a command acts on: `name`, or every plan the file itself declares (the
    plans of files it includes only when it declares none: `meshc plan train.mesh` must not plan,
    nor `run` pick, the plan of the model file it includes)."""
    if name is not None and name not in plans:
        raise UsageError(f"{path} has no plan `{name}`; plans: {', '.join(sorted(plans)) or 'none'}")
    if not plans:
        raise UsageError(f"{path} declares no plan")
    if name is not None:
        return [name]
    here = os.path.realpath(path)
    own = [n for n, plan in plans.items()
           if (span := getattr(plan, "span", None)) is None or os.path.realpath(span.file) == here]
    return sorted(own or plans)


def cmd_check(args: argparse.Namespace) -> int:
    from meshllm_dsl.checker import check_file

    diags: list[Diagnostic] = []
    for path in existing(*args.files):
        diags.extend(check_file(path).diagnostics)
    if args.format == "json":
        print(to_json(diags))
    else:
        text = render_all(diags)
        if text:
            print(text, end="", file=sys.stderr if any(d.is_error for d in diags) else sys.stdout)
        if not any(d.is_error for d in diags):
            n = len(args.files)
            print(f"ok: {n} file{'s' if n != 1 else ''} checked")
    failed = any(d.is_error for d in diags) or (args.deny_warnings and diags)
    return EXIT_SPEC if failed else EXIT_OK


def cmd_fmt(args: argparse.Namespace) -> int:
    from meshllm_dsl.front.fmt import format_text
    from meshllm_dsl.front.load import read_spec
    from meshllm_dsl.runtime.outputs import write_file_atomic

    status = EXIT_OK
    for path in existing(*args.files):
        try:
            source = read_spec(path)
            formatted = format_text(source.text, path)
        except SpecError as err:
            print(render_all(err.diagnostics), end="", file=sys.stderr)
            status = EXIT_SPEC
            continue
        # Compared with the bytes on disk: CRLF line endings or a BOM are a reformat too.
        unchanged = formatted.encode() == Path(path).read_bytes()
        if args.check:
            if not unchanged:
                print(f"would reformat {path}")
                status = EXIT_SPEC
        elif args.write:
            if not unchanged:
                write_file_atomic(Path(path), formatted.encode())
                print(f"reformatted {path}")
        else:
            sys.stdout.write(formatted)
    return status


def cmd_explain_error(args: argparse.Namespace) -> int:
    from meshllm_dsl.codes import CODES, explain

    text = explain(args.code)
    if text is None:
        raise UsageError(f"unknown code {args.code!r}; codes: {', '.join(CODES)}")
    print(text, end="")
    return EXIT_OK


def cmd_lsp(args: argparse.Namespace) -> int:
    from meshllm_dsl.lsp import main as lsp_main

    return lsp_main()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshc",
        description="Check and compile .mesh specs: how a large language model is split over devices.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    c = sub.add_parser("check", help="parse and check specs; print every diagnostic")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--format", choices=("text", "json"), default="text")
    c.add_argument("--deny-warnings", action="store_true", help="exit 1 on warnings too")
    c.set_defaults(func=cmd_check)

    f = sub.add_parser("fmt", help="print specs in canonical format")
    f.add_argument("files", nargs="+", metavar="FILE")
    g = f.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="only report files that would change (exit 1)")
    g.add_argument("--write", "-w", action="store_true", help="rewrite files in place")
    f.set_defaults(func=cmd_fmt)

    e = sub.add_parser("explain-error", help="explain a diagnostic code, e.g. E0301")
    e.add_argument("code")
    e.set_defaults(func=cmd_explain_error)

    ls = sub.add_parser("lsp", help="run the language server for editors (stdio; needs the [lsp] extra)")
    ls.add_argument("--stdio", action="store_true", help="accepted for editors that pass it; stdio is the only transport")
    ls.set_defaults(func=cmd_lsp)

    for register in _EXTENSIONS:
        register(sub)
    for command in sub.choices.values():  # every command that reads specs resolves includes alike
        if any(a.dest in ("file", "files") for a in command._actions):
            command.add_argument("-I", dest="include_dirs", action="append", default=[], metavar="DIR",
                                 help="also look for included .mesh files in DIR (after the including file's directory)")
    return p


# Later stages (compile, run, verify, plan, explain) register their subcommands here, so the
# front end's commands never import torch.
_EXTENSIONS: list[Callable[[argparse._SubParsersAction], None]] = []  # type: ignore[type-arg]


def _load_extensions() -> None:
    import importlib

    for name in ("meshllm_dsl.cli.compile", "meshllm_dsl.cli.plan", "meshllm_dsl.interop.import_hf", "meshllm_dsl.interop.import_engines",
                 "meshllm_dsl.planner.calibrate",
                 "meshllm_dsl.cli.data", "meshllm_dsl.cli.export", "meshllm_dsl.cli.report"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        if module.register not in _EXTENSIONS:  # main() may run many times in one process (tests, API)
            _EXTENSIONS.append(module.register)


# The commands defined here: `meshc check` and the rest of the front end start without importing the
# later stages (start-up is most of a small check: issue 12). Any other first argument (another
# command, `--help`, a typo) loads them all, so help and usage errors list every command.
_FRONT_END = ("check", "fmt", "explain-error", "lsp")


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if not args_in or args_in[0] not in _FRONT_END:
        _load_extensions()
    parser = build_parser()
    try:
        args = parser.parse_args(args_in)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if argv is None and args.command in ("check", "fmt"):
        # This process runs one command and exits: the cyclic GC would only walk the AST and the
        # checked plans again and again (15-20% of checking a 1 MB spec), and the front end makes
        # no cycles worth collecting. Not when called from Python (tests, tools), nor for `lsp`.
        import gc

        gc.disable()
    import signal
    import threading

    from meshllm_dsl.front.load import INCLUDE_DIRS

    dirs = getattr(args, "include_dirs", [])
    missing = [d for d in dirs if not Path(d).is_dir()]
    if missing:
        print(f"meshc: error: -I {missing[0]}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    token = INCLUDE_DIRS.set(tuple(Path(d) for d in dirs))
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return int(args.func(args))
    except _Terminated:
        return 143
    except UsageError as err:
        print(f"meshc: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except SpecError as err:
        print(render_all(err.diagnostics), end="", file=sys.stderr)
        return EXIT_SPEC
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as err:  # noqa: BLE001 - the contract: internal errors exit 2 with a report, not a raw traceback
        # OutputError: an output path that cannot be written without destroying something. Only a
        # command that imported meshllm_dsl.runtime.outputs can raise it; the others need not import it.
        outputs = sys.modules.get("meshllm_dsl.runtime.outputs")
        if outputs is not None and isinstance(err, outputs.OutputError):
            print(f"meshc: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        # DataError: training data that cannot be used (a bad record at file:line, a broken token
        # file), one line naming it; only the commands that read data import where it lives.
        tokens = sys.modules.get("meshllm_dsl.runtime.train.tokens")
        if tokens is not None and isinstance(err, tokens.DataError):
            print(f"meshc: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        import traceback

        print("meshc: internal error (please report it with the spec that caused it):", file=sys.stderr)
        print(traceback.format_exc(limit=-3), file=sys.stderr)
        return EXIT_USAGE
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        INCLUDE_DIRS.reset(token)



if __name__ == "__main__":
    sys.exit(main())
