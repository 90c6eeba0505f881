"""The per-user cache of the parser's tables (meshllm_dsl.front.parse_tables): what is cached is what Lark
builds, and a missing, stale, corrupt or unwritable cache never changes what is parsed."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from meshllm_dsl.front import parse_tables

SPEC = "mesh m { axes a = 2 }\n"


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MESHLLM_NO_CACHE", raising=False)
    return tmp_path / "meshllm"


def _cache_file(folder: Path) -> Path:
    return folder / parse_tables.cache_name(parse_tables.grammar_text(), parse_tables.lark_version())


def _fresh() -> parse_tables.Tables:
    return parse_tables.build_tables(parse_tables.grammar_text(), parse_tables.lark_version())


def test_first_load_writes_the_cache_and_the_second_reads_it(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tables = parse_tables.load_tables()
    path = _cache_file(cache_home)
    assert path.is_file() and oct(cache_home.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in cache_home.iterdir()] == [path.name]  # no temporary file left behind

    def no_build(*args: object) -> None:
        raise AssertionError("built again although the cache is fresh")

    monkeypatch.setattr(parse_tables, "build_tables", no_build)
    assert parse_tables.load_tables() == tables


def _without_lark(tables: parse_tables.Tables) -> parse_tables.Tables:
    # Lark's own serialized parser is not byte-for-byte reproducible (test_properties.py checks that
    # it parses as the tables do); the tables are.
    return {k: v for k, v in tables.items() if k != "lark"}


def test_cached_tables_are_what_lark_builds(cache_home: Path) -> None:
    parse_tables.load_tables()
    with open(_cache_file(cache_home), "rb") as f:
        assert _without_lark(marshal.load(f)) == _without_lark(_fresh())


@pytest.mark.parametrize("content", [b"", b"\x00garbage", marshal.dumps([1, 2, 3])], ids=["empty", "garbage", "not-tables"])
def test_corrupt_cache_is_rebuilt(cache_home: Path, content: bytes) -> None:
    cache_home.mkdir(mode=0o700)
    path = _cache_file(cache_home)
    path.write_bytes(content)
    assert _without_lark(parse_tables.load_tables()) == _without_lark(_fresh())
    assert _without_lark(marshal.loads(path.read_bytes())) == _without_lark(_fresh())  # and rewritten


def test_truncated_cache_is_rebuilt(cache_home: Path) -> None:
    parse_tables.load_tables()
    path = _cache_file(cache_home)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert _without_lark(parse_tables.load_tables()) == _without_lark(_fresh())


def test_stale_cache_for_another_grammar_is_rebuilt(cache_home: Path) -> None:
    # Same file name (as after a checksum collision), tables of another grammar inside.
    stale = dict(_fresh(), grammar=b"start: NAME\n", actions=[])
    cache_home.mkdir(mode=0o700)
    _cache_file(cache_home).write_bytes(marshal.dumps(stale))
    assert _without_lark(parse_tables.load_tables()) == _without_lark(_fresh())


def test_cache_name_follows_grammar_lark_and_python() -> None:
    text = parse_tables.grammar_text()
    names = {
        parse_tables.cache_name(text, "1.3.1"),
        parse_tables.cache_name(text + b"\n// changed", "1.3.1"),
        parse_tables.cache_name(text, "1.3.2"),
    }
    assert len(names) == 3
    assert all(f"py{sys.version_info[0]}{sys.version_info[1]}" in n for n in names)


def test_lark_version_is_read_without_importing_lark() -> None:
    import lark

    assert parse_tables.lark_version() == lark.__version__


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_cache_dir_parses_without_a_cache(cache_home: Path) -> None:
    cache_home.mkdir(mode=0o700)
    cache_home.chmod(0o500)
    try:
        assert _without_lark(parse_tables.load_tables()) == _without_lark(_fresh())
        assert list(cache_home.iterdir()) == []
    finally:
        cache_home.chmod(0o700)


def test_unwritable_cache_dir_parses_without_a_cache(cache_home: Path) -> None:
    # Writing fails (here: the temporary file cannot be created; as root a read-only mode would not stop it).
    cache_home.mkdir(mode=0o700)
    assert parse_tables.write_atomic(str(cache_home / "missing-dir" / "x.marshal"), b"data") is False
    assert not (cache_home / "missing-dir").exists()


def test_shared_or_foreign_cache_dir_is_not_trusted(cache_home: Path) -> None:
    cache_home.mkdir(mode=0o777)
    cache_home.chmod(0o777)  # group / world writable: someone else could plant a file
    assert parse_tables.cache_dir() is None
    assert _without_lark(parse_tables.load_tables()) == _without_lark(_fresh())
    assert list(cache_home.iterdir()) == []


def test_no_cache_env(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_NO_CACHE", "1")
    assert _without_lark(parse_tables.load_tables()) == _without_lark(_fresh())
    assert not cache_home.exists()


def _meshc_check(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "s.mesh"
    spec.write_text(SPEC)
    code = (
        "import sys; from meshllm_dsl.cli.main import main; rc = main(['check', sys.argv[1]]);"
        "print('lark imported' if 'lark' in sys.modules else 'no lark');"
        "print('later stages imported' if 'meshllm_dsl.cli.compile' in sys.modules else 'front end only'); sys.exit(rc)"
    )
    full = {k: v for k, v in os.environ.items() if k != "MESHLLM_NO_CACHE"}
    return subprocess.run([sys.executable, "-c", code, str(spec)], cwd=ROOT, env={**full, **env},
                          capture_output=True, text=True, timeout=120)


def test_meshc_check_with_a_warm_cache_imports_neither_lark_nor_later_stages(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = _meshc_check(tmp_path, env)
    assert first.returncode == 0, first.stderr
    assert "ok: 1 file checked" in first.stdout and "lark imported" in first.stdout  # built the tables
    second = _meshc_check(tmp_path, env)
    assert second.returncode == 0, second.stderr
    assert second.stdout == "ok: 1 file checked\nno lark\nfront end only\n"


def test_no_usable_cache_dir_parses_without_a_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cache home is a file: no directory can be made there (a read-only home behaves alike).
    (tmp_path / "home").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MESHLLM_NO_CACHE", raising=False)
    assert parse_tables.cache_dir() is None
    assert _without_lark(parse_tables.load_tables()) == _without_lark(_fresh())
