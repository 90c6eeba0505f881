"""What `pip install .` ships: every package of the source tree is listed in pyproject.toml.

An editable install finds a package missing from the list anyway (it sits under a listed one), so
only a wheel would lose it: this catches that before a user does."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, where = set(config["packages"]), config["package-dir"]
    found = set()
    for name, folder in where.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((name, *init.parent.relative_to(ROOT / folder).parts)))
    assert found == listed
