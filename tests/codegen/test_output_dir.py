"""`meshc compile -o DIR` never deletes or overwrites a file it did not generate.

Every kind of output path a user can give: missing, empty, an earlier meshc output (with a user's
own file beside it, with an edited generated file), a foreign non-empty directory, a file, the spec's
own directory, one that cannot be written; and a crash in the middle of an update.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshllm_dsl.cli.main import main
from meshllm_dsl.runtime.outputs import MANIFEST, OutputError, write_generated

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "examples" / "tiny_llama.mesh").read_text()


def meshc(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "model.mesh"
    path.write_text(SPEC)
    return path


def test_missing_directory_is_created_with_a_manifest(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "gen"
    code, stdout, err = meshc("compile", str(spec), "-o", str(out))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "__init__.py", "train.py"])
    manifest = json.loads((out / MANIFEST).read_text())
    assert set(manifest["files"]) == {"__init__.py", "train.py"} and "pending" not in manifest
    assert f"wrote {out / 'train.py'}" in stdout
    # No temporary sibling is left behind.
    assert sorted(p.name for p in out.parent.iterdir()) == ["gen"]


def test_empty_directory_is_used(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    out.mkdir()
    assert meshc("compile", str(spec), "-o", str(out))[0] == 0
    assert (out / "train.py").is_file()


def test_recompile_replaces_only_its_own_files(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    assert meshc("compile", str(spec), "-o", str(out))[0] == 0
    (out / "notes.txt").write_text("mine")
    (out / "__pycache__").mkdir()
    (out / "__pycache__" / "x.pyc").write_bytes(b"cache")
    spec.write_text(SPEC.replace("plan train ", "plan tuned "))
    code, _, err = meshc("compile", str(spec), "-o", str(out))
    assert code == 0, err
    names = sorted(p.name for p in out.iterdir())
    # train.py belonged to a plan that is gone and was unedited: removed. The user's files stay.
    assert names == sorted([MANIFEST, "__init__.py", "tuned.py", "notes.txt", "__pycache__"])
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "__pycache__" / "x.pyc").read_bytes() == b"cache"


def test_edited_generated_file_is_refused_then_forced(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    assert meshc("compile", str(spec), "-o", str(out))[0] == 0
    (out / "train.py").write_text("# my edits\n")
    before = snapshot(out)
    code, _, err = meshc("compile", str(spec), "-o", str(out))
    assert code == 2 and "was edited since meshc wrote it" in err and "--force" in err
    assert snapshot(out) == before
    code, _, err = meshc("compile", str(spec), "-o", str(out), "--force")
    assert code == 0, err
    assert (out / "train.py").read_text().startswith('"""Plan `train`')


def test_edited_file_of_a_removed_plan_is_kept(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    assert meshc("compile", str(spec), "-o", str(out))[0] == 0
    (out / "train.py").write_text("# my edits\n")
    spec.write_text(SPEC.replace("plan train ", "plan tuned "))
    assert meshc("compile", str(spec), "-o", str(out))[0] == 0
    assert (out / "train.py").read_text() == "# my edits\n"
    assert "train.py" not in json.loads((out / MANIFEST).read_text())["files"]  # the user's now


def test_foreign_directory_is_refused_and_untouched(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "project"
    out.mkdir()
    (out / "train.py").write_text("print('my training script')\n")
    (out / "data.bin").write_bytes(b"\x00" * 10)
    before = snapshot(out)
    code, _, err = meshc("compile", str(spec), "-o", str(out))
    assert code == 2 and "was not written by meshc" in err and "Traceback" not in err
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.mesh", "project"]


def test_force_into_a_foreign_directory_deletes_nothing(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "project"
    out.mkdir()
    (out / "data.bin").write_bytes(b"data")
    code, _, err = meshc("compile", str(spec), "-o", str(out), "--force")
    assert code == 0, err
    assert (out / "data.bin").read_bytes() == b"data"
    assert (out / "train.py").is_file() and (out / MANIFEST).is_file()


def test_output_that_is_a_file_is_refused(spec: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.py"
    target.write_text("precious\n")
    for extra in ([], ["--force"]):
        code, _, err = meshc("compile", str(spec), "-o", str(target), *extra)
        assert code == 2 and "is a file, not a directory" in err
    assert target.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.mesh", "out.py"]  # no hidden .old copy


def test_spec_directory_is_refused(spec: Path, tmp_path: Path) -> None:
    code, _, err = meshc("compile", str(spec), "-o", str(tmp_path))
    assert code == 2 and "not written by meshc" in err
    assert spec.read_text() == SPEC
    # Even forced, the spec stays: meshc only adds its own files next to it.
    assert meshc("compile", str(spec), "-o", str(tmp_path), "--force")[0] == 0
    assert spec.read_text() == SPEC


def test_input_spec_is_never_overwritten(tmp_path: Path) -> None:
    # A spec whose name is one meshc generates (contrived, but the guard must hold even with --force).
    out = tmp_path / "gen"
    out.mkdir()
    spec = out / "train.py"
    spec.write_text(SPEC)
    code, _, err = meshc("compile", str(spec), "-o", str(out), "--force")
    assert code == 2 and "would overwrite the input spec" in err
    assert spec.read_text() == SPEC


def test_unwritable_output(spec: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = meshc("compile", str(spec), "-o", str(blocker / "gen"))
    assert code == 2 and "cannot write" in err and "Traceback" not in err
    assert blocker.read_text() == "x"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to drop to nobody")
def test_read_only_directory_as_an_unprivileged_user() -> None:
    # Root ignores permission bits, so the unwritable case runs as `nobody` (in a directory that
    # nobody can reach: pytest's own tmp_path is private to root).
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="meshc-ro-"))
    tmp_path.chmod(0o755)
    spec = tmp_path / "model.mesh"
    spec.write_text(SPEC)
    spec.chmod(0o644)
    out = tmp_path / "ro"
    out.mkdir(mode=0o555)
    out.chmod(0o555)
    code = (
        "import sys; from meshllm_dsl.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code,
         "compile", str(spec), "-o", str(out)],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "HOME": "/tmp"},
    )
    if "Permission denied" in proc.stderr and "python" in proc.stderr.lower() and proc.returncode != 2:
        pytest.skip(f"nobody cannot run this interpreter here: {proc.stderr[:200]}")
    try:
        assert proc.returncode == 2, proc.stderr
        assert "cannot write" in proc.stderr and "Permission denied" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert list(out.iterdir()) == []
    finally:
        shutil.rmtree(tmp_path)


def test_plan_flag_keeps_other_plans(tmp_path: Path) -> None:
    spec = tmp_path / "two.mesh"
    spec.write_text(SPEC + "\n" + SPEC[SPEC.index("plan train "):].replace("plan train ", "plan other "))
    out = tmp_path / "gen"
    assert meshc("compile", str(spec), "-o", str(out))[0] == 0
    assert meshc("compile", str(spec), "-o", str(out), "--plan", "other")[0] == 0
    assert (out / "train.py").is_file() and (out / "other.py").is_file()
    assert set(json.loads((out / MANIFEST).read_text())["files"]) == {"__init__.py", "train.py", "other.py"}


def test_crash_during_an_update_leaves_a_directory_the_next_run_owns(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "gen"
    write_generated({"a.py": "A = 1\n", "b.py": "B = 1\n"}, out)
    import meshllm_dsl.runtime.outputs as outputs

    real = outputs.write_file_atomic
    calls = []

    def crash_after_first_file(path: Path, data: bytes) -> None:
        calls.append(path.name)
        if len(calls) == 3:  # manifest (pending), a.py, then "crash" before b.py
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(outputs, "write_file_atomic", crash_after_first_file)
    with pytest.raises(KeyboardInterrupt):
        write_generated({"a.py": "A = 2\n", "b.py": "B = 2\n"}, out)
    monkeypatch.setattr(outputs, "write_file_atomic", real)
    assert (out / "a.py").read_text() == "A = 2\n" and (out / "b.py").read_text() == "B = 1\n"
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "a.py", "b.py"])  # no temp files
    write_generated({"a.py": "A = 3\n", "b.py": "B = 3\n"}, out)  # recognised as meshc's own: no refusal
    assert (out / "b.py").read_text() == "B = 3\n"


def test_a_manifest_cannot_name_files_outside_the_directory(tmp_path: Path) -> None:
    victim = tmp_path / "victim.py"
    victim.write_text("keep\n")
    out = tmp_path / "gen"
    write_generated({"a.py": "A = 1\n"}, out)
    digest = json.loads((out / MANIFEST).read_text())["files"]["a.py"]
    (out / MANIFEST).write_text(json.dumps({"generator": "meshc", "version": 1,
                                            "files": {"../victim.py": digest, "a.py": digest}}))
    write_generated({"b.py": "B = 1\n"}, out)
    assert victim.read_text() == "keep\n"


def test_api_compile_refuses_like_the_cli(spec: Path, tmp_path: Path) -> None:
    import meshllm_dsl

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("k")
    with pytest.raises(OutputError):
        meshllm_dsl.compile(str(spec), str(tmp_path / "other"))
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["keep.txt"]


HOSTILE_NAMES = ['a"""b.mesh', "a\\N{x}.mesh", "a\\x41.mesh", "quote'and\".mesh", "new\nline.mesh",
                 "uni\u00e9\u2603.mesh", "{{ x }}{% if %}.mesh", "back\\.mesh", "tab\t.mesh", "end\\"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_file_names_stay_inside_docstrings(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(SPEC)
    out = tmp_path / "gen"
    code, _, err = meshc("compile", str(path), "-o", str(out))
    assert code == 0, err
    for generated in ("__init__.py", "train.py"):
        text = (out / generated).read_text()
        assert text.isascii()
        tree = ast.parse(text)  # valid Python
        doc = ast.get_docstring(tree, clean=False)
        assert doc is not None and str(path) in doc, doc
        # Nothing but the docstring comes before the imports: no statement leaked out of it.
        assert isinstance(tree.body[0], ast.Expr)
        assert all(not isinstance(node, ast.Expr) for node in tree.body[1:2])
