"""Writing what meshc generates without ever losing a user's file.

In the runtime (torch-free, standard library only) because `--export-hf` writes by the same rule
as `meshc compile -o`, and the runtime never imports the compiler.

`meshc compile -o DIR` owns exactly the files it wrote there, recorded in `DIR/.meshc-manifest.json`
with their hashes. It creates a missing directory whole (a temporary sibling renamed into place),
writes into an empty one, and in a directory it wrote before replaces only its own files, each
atomically (temporary file, fsync, rename). It refuses, before writing anything: a path that is a
file, a non-empty directory without a manifest, a file of the same name that it did not write or
that was edited since, and any input spec. `--force` lifts the refusals about foreign or edited
files of the names it writes; it never deletes anything it did not generate.

The manifest is written first with the hashes about to be written (`pending`) and again at the end,
so after a crash at any point every file of ours matches the manifest, and the next run goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

MANIFEST = ".meshc-manifest.json"
_GENERATOR = "meshc"


class OutputError(Exception):
    """The output path cannot be written without destroying something; nothing was written."""


def check_new_file(path: Path, what: str, force: bool = False) -> None:
    """Refuse, before any work, to write the single file ``path`` (`-o FILE`) over something the
    user did not ask to replace: a directory always, an existing file without ``force``."""
    if path.is_dir():
        raise OutputError(f"{path} is a directory; -o names the {what} to write")
    if (path.exists() or path.is_symlink()) and not force:
        raise OutputError(f"{path} exists; pass --force to replace it")
    if not path.parent.is_dir():
        raise OutputError(f"cannot write {path}: no directory {path.parent}")


def write_output(path: Path, data: bytes) -> None:
    """write_file_atomic for a file the user named: a failure is an OutputError naming it."""
    try:
        write_file_atomic(path, data)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a crash leaves the old file or the new one, never a mix.

    An existing file keeps its permission bits; a new one gets the usual 0o666 less the umask.
    """
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; not every file system lets a directory be opened for it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_bytes(files: Mapping[str, str], pending: Mapping[str, str]) -> bytes:
    doc: dict[str, object] = {"generator": _GENERATOR, "version": 1, "files": dict(sorted(files.items()))}
    if pending:
        doc["pending"] = dict(sorted(pending.items()))
    return (json.dumps(doc, indent=2) + "\n").encode()


def read_manifest(out: Path) -> tuple[dict[str, str], dict[str, str]] | None:
    """(files, pending): name -> hash of meshc's own files; None when `out` is not meshc's."""
    try:
        doc = json.loads((out / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("generator") != _GENERATOR:
        return None
    parts: list[dict[str, str]] = []
    for key in ("files", "pending"):
        entries = doc.get(key, {})
        if not isinstance(entries, dict):
            return None
        parts.append({n: h for n, h in entries.items() if isinstance(h, str) and _plain_name(n)})
    return parts[0], parts[1]


def _plain_name(name: str) -> bool:
    """A manifest may only ever name a file directly inside the directory (it is read from disk)."""
    return bool(name) and name not in (".", "..", MANIFEST) and "/" not in name and "\\" not in name


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def write_generated(
    files: Mapping[str, str],
    out_dir: str | Path,
    *,
    force: bool = False,
    protect: Iterable[str | Path] = (),
    prune: bool = True,
) -> list[Path]:
    """Write `files` (name -> text) into `out_dir` under the rules above; the paths written.

    `protect` are files that must never be replaced (the input specs). `prune` removes files of an
    earlier run that this run no longer generates (a plan deleted from the spec), if unedited.
    Raises OutputError, having written nothing, when the directory cannot be written safely.
    """
    out = Path(out_dir)
    assert all(_plain_name(n) for n in files), "generated file names are plain names"
    data = {name: text.encode() for name, text in files.items()}
    digests = {name: _sha256(b) for name, b in data.items()}
    try:
        if out.is_symlink() and not out.exists():
            raise OutputError(f"`{out}` is a dangling symbolic link")
        if out.exists() and not out.is_dir():
            raise OutputError(f"`{out}` is a file, not a directory; meshc writes a package directory there")
        for spec in protect:
            for name in data:
                if _same_file(out / name, Path(spec)):
                    raise OutputError(f"writing `{out / name}` would overwrite the input spec `{spec}`")
        if not out.exists():
            return _write_fresh(out, data, digests)
        return _write_into(out, data, digests, force=force, prune=prune)
    except OSError as err:
        raise OutputError(f"cannot write `{err.filename or out}`: {err.strerror or err}") from None


def _write_fresh(out: Path, data: Mapping[str, bytes], digests: Mapping[str, str]) -> list[Path]:
    """A new directory appears whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, b in data.items():
            (tmp / name).write_bytes(b)
        (tmp / MANIFEST).write_bytes(manifest_bytes(digests, {}))
        tmp.chmod(0o777 & ~_umask())
        os.rename(tmp, out)  # not replace: a directory that appeared meanwhile is not ours to take
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(out.parent)
    return [out / name for name in data]


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _write_into(
    out: Path, data: Mapping[str, bytes], digests: Mapping[str, str], *, force: bool, prune: bool
) -> list[Path]:
    manifest = read_manifest(out)
    if manifest is None and any(out.iterdir()) and not force:
        raise OutputError(
            f"`{out}` is not empty and was not written by meshc (it has no {MANIFEST}); refusing to write into it."
            " Choose a new or empty directory, or pass --force to add meshc's files to it (nothing else is touched)"
        )
    owned, pending = manifest or ({}, {})

    def untouched(name: str) -> bool:
        return _sha256((out / name).read_bytes()) in (owned.get(name), pending.get(name))

    conflicts: list[str] = []
    for name in data:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            raise OutputError(f"`{target}` is a directory; meshc would write a file of that name")
        if not target.exists() and not target.is_symlink():
            continue
        if target.is_symlink() or not target.is_file():
            conflicts.append(f"`{target}` is not a regular file meshc wrote")
        elif name not in owned and name not in pending:
            conflicts.append(f"`{target}` exists and was not written by meshc")
        elif not untouched(name):
            conflicts.append(f"`{target}` was edited since meshc wrote it")
    if conflicts and not force:
        more = f" (and {len(conflicts) - 3} more)" if len(conflicts) > 3 else ""
        raise OutputError("; ".join(conflicts[:3]) + more + ". Nothing was written; pass --force to replace them")

    on_disk = {n: h for n, h in owned.items() if (out / n).is_file()}
    stale = [n for n in on_disk if n not in data] if prune else []
    # The old hashes stay in the manifest until every file is replaced, next to the new ones as
    # `pending`: a crash in between leaves a directory the next run still recognises as its own.
    write_file_atomic(out / MANIFEST, manifest_bytes(on_disk, digests))
    for name, b in data.items():
        write_file_atomic(out / name, b)
    for name in stale:
        if untouched(name):  # an edited file of a plan that is gone stays: its edits are the user's
            (out / name).unlink()
    kept = {n: h for n, h in on_disk.items() if n not in data and n not in stale}  # other plans (--plan)
    write_file_atomic(out / MANIFEST, manifest_bytes({**kept, **digests}, {}))
    return [out / name for name in data]
