"""Files a spec can point meshc at, and bytes a spec can be made of.

Includes read only regular `.mesh` files under the size cap, found next to the including file, in
`-I` directories or in the standard library; nothing else is read, and no line of a file that is not
a spec is ever echoed. Line endings are one notion (\\n, \\r\\n, \\r), a BOM is skipped, and a file
that is not UTF-8 is one diagnostic in every command.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from meshllm_dsl.checker import check_file
from meshllm_dsl.cli.main import main
from meshllm_dsl.front.source import MAX_SPEC_BYTES

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "examples" / "tiny_llama.mesh").read_text()
SECRET = "AWS_SECRET_ACCESS_KEY=hunter2"


def meshc(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def codes(path: Path) -> list[str]:
    return [d.code for d in check_file(path).diagnostics]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secrets.env"
    path.write_text(f"{SECRET}\n")
    return path


def including(tmp_path: Path, target: str, name: str = "main.mesh") -> Path:
    path = tmp_path / name
    path.write_text(f'include "{target}"\n' + SPEC)
    return path


@pytest.mark.parametrize("target", ["{secret}", "../{secret_name}", "secrets.env", "/dev/zero", "/etc/passwd",
                                    "C:/Windows/x.mesh", "{abs_spec}"])
def test_includes_never_read_a_file_that_is_not_a_spec(tmp_path: Path, secret: Path, target: str) -> None:
    sub = tmp_path / "sub"
    sub.mkdir()
    (tmp_path / "abs.mesh").write_text(f"# {SECRET}\n")  # a spec, but named by an absolute path
    spec = including(sub if "../" in target else tmp_path,
                     target.format(secret=secret, secret_name=secret.name, abs_spec=tmp_path / "abs.mesh"))
    code, out, err = meshc("check", str(spec))
    assert code == 1 and "E0103" in err and "refused" in err
    assert SECRET not in out + err


def test_a_symlink_named_mesh_must_lead_to_a_spec(tmp_path: Path, secret: Path) -> None:
    (tmp_path / "shared.mesh").symlink_to(secret)
    code, _, err = meshc("check", str(including(tmp_path, "shared.mesh")))
    assert code == 1 and "E0103" in err and "not a .mesh file" in err and SECRET not in err


def test_a_symlink_loop_is_a_diagnostic(tmp_path: Path) -> None:
    (tmp_path / "loop.mesh").symlink_to(tmp_path / "loop.mesh")
    code, _, err = meshc("check", str(including(tmp_path, "loop.mesh")))
    assert code == 1 and ("E0104" in err or "E0103" in err) and "Traceback" not in err


def test_a_fifo_or_directory_named_mesh_is_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.mesh")  # reading it would block forever
    (tmp_path / "dir.mesh").mkdir()
    for name in ("pipe.mesh", "dir.mesh"):
        code, _, err = meshc("check", str(including(tmp_path, name)))
        assert code == 1 and "E0104" in err and ("not a regular file" in err or "Is a directory" in err)


def test_binary_and_oversized_specs_are_refused_without_echo(tmp_path: Path) -> None:
    binary = tmp_path / "blob.mesh"
    binary.write_bytes(b"mesh m {\x00\x01" + SECRET.encode() + b"\n")
    code, _, err = meshc("check", str(including(tmp_path, "blob.mesh")))
    assert code == 1 and "is a binary file" in err and SECRET not in err
    big = tmp_path / "big.mesh"
    with open(big, "wb") as f:
        f.truncate(MAX_SPEC_BYTES + 1)  # sparse: costs nothing on disk
    start = time.monotonic()
    code, _, err = meshc("check", str(including(tmp_path, "big.mesh")))
    assert code == 1 and "E0104" in err and "limited to" in err
    code, _, err = meshc("check", str(big))
    assert code == 1 and "E0104" in err and "limited to" in err
    assert time.monotonic() - start < 10


def test_include_path_flag(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    model_start = SPEC.index("model tiny_llama")
    plan_start = SPEC.index("plan train")
    (lib / "models.mesh").write_text(SPEC[model_start:plan_start])
    main_spec = tmp_path / "work" / "main.mesh"
    main_spec.parent.mkdir()
    main_spec.write_text('include "models.mesh"\n' + SPEC[:model_start] + SPEC[plan_start:])
    code, _, err = meshc("check", str(main_spec))
    assert code == 1 and "E0103" in err and "-I DIR" in err
    code, out, err = meshc("check", "-I", str(lib), str(main_spec))
    assert code == 0, err
    code, _, err = meshc("plan", "-I", str(lib), str(main_spec))
    assert code == 0, err
    code, _, err = meshc("check", "-I", str(tmp_path / "nope"), str(main_spec))
    assert code == 2 and "not a directory" in err


def test_relative_includes_going_up_still_work(tmp_path: Path) -> None:
    model_start, plan_start = SPEC.index("model tiny_llama"), SPEC.index("plan train")
    (tmp_path / "models.mesh").write_text(SPEC[model_start:plan_start])
    main_spec = tmp_path / "plans" / "main.mesh"
    main_spec.parent.mkdir()
    main_spec.write_text('include "../models.mesh"\n' + SPEC[:model_start] + SPEC[plan_start:])
    assert codes(main_spec) == []


def _with_bad_heads() -> str:
    # tiny_llama with a tensor axis that does not divide the heads: a real E0301 on a known line.
    text = SPEC.replace("heads = 4", "heads = 3")
    assert text != SPEC
    return text


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_line_endings_and_bom_are_one_notion(tmp_path: Path, newline: str, bom: bytes) -> None:
    reference = tmp_path / "lf.mesh"
    reference.write_bytes(_with_bad_heads().encode())
    variant = tmp_path / "variant.mesh"
    variant.write_bytes(bom + _with_bad_heads().replace("\n", newline).encode())
    ref = [(d.code, d.span.line, d.span.column) for d in check_file(reference).diagnostics if d.span]
    got = [(d.code, d.span.line, d.span.column) for d in check_file(variant).diagnostics if d.span]
    assert ref and got == ref
    assert meshc("check", str(variant))[0] == 1


def test_fmt_write_normalises_line_endings_atomically(tmp_path: Path) -> None:
    path = tmp_path / "crlf.mesh"
    path.write_bytes(b"\xef\xbb\xbf" + SPEC.replace("\n", "\r\n").encode())
    code, out, _ = meshc("fmt", "--check", str(path))
    assert code == 1 and "would reformat" in out
    path.chmod(0o640)
    assert meshc("fmt", "--write", str(path))[0] == 0
    assert path.read_bytes() == SPEC.encode()
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crlf.mesh"]


def test_not_utf8_is_one_diagnostic_in_every_command(tmp_path: Path) -> None:
    path = tmp_path / "latin1.mesh"
    data = SPEC.replace("# ", "# caf\u00e9 ", 1).encode("latin-1")
    path.write_bytes(data)
    for argv in (["check"], ["fmt"], ["fmt", "--write"], ["compile", "-o", str(tmp_path / "gen")], ["plan"],
                 ["explain"]):
        code, _, err = meshc(*argv, str(path))
        assert code == 1, (argv, err)
        assert "E0104" in err and "not valid UTF-8" in err and "Traceback" not in err
    assert path.read_bytes() == data  # fmt --write did not "fix" it into replacement characters
    assert not (tmp_path / "gen").exists()


def test_long_lines_and_long_spans_are_cut_around_the_caret(tmp_path: Path) -> None:
    # An error at column ~3,000: the snippet shows a window of the line with the caret under the value.
    text = SPEC.replace("microbatches = 2", "microbatches = " + " " * 3000 + "3")
    path = tmp_path / "wide.mesh"
    path.write_text(text)
    code, _, err = meshc("check", str(path))
    assert code == 1 and "3000" not in err
    lines = err.splitlines()
    assert max(len(x) for x in lines) < 200
    i = next(k for k, x in enumerate(lines) if x.rstrip().endswith("3") and "| ..." in x)
    source, marks = lines[i], lines[i + 1]
    assert source.startswith("21 | ...") and source.rstrip().endswith("3")
    start = source.index(" | ") + 3
    mark_col = next(k for k in range(start, len(marks)) if marks[k] in "^-")
    assert mark_col == len(source.rstrip()) - 1  # the mark sits under the 3



def test_a_span_over_many_lines_shows_its_first_and_last_lines() -> None:
    from meshllm_dsl.diagnostics import Diagnostic, render
    from meshllm_dsl.front.source import SourceFile

    source = SourceFile("x.mesh", "".join(f"line {k}\n" for k in range(1, 21)))
    start = source.text.index("line 2")
    end = source.text.index("line 18") + len("line 18")
    text = render(Diagnostic("E0308", "a long span", source.span(start, end), label="here"))
    shown = [x for x in text.splitlines() if "| line" in x]
    assert [x.split("| ")[1] for x in shown] == ["line 2", "line 3", "line 4", "line 5", "line 18"]
    assert " | ..." in text and "^^^^^^^ here" in text  # the label under the last line
