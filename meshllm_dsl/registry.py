"""What the compiler's registries share: records keyed by the members of a `Literal`, complete at import.

A layer kind (meshllm_dsl/primitives) and a collective op (meshllm_dsl/parallel/collectives.py) are each one
record named by a `Literal` member. Building the registry refuses a member without a record, a record
for a name the `Literal` lacks and a name recorded twice, so a new kind or op half added is an error
at import instead of a fallthrough later.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeVar, get_args

R = TypeVar("R")


def assert_never(value: NoReturn) -> NoReturn:
    """The end of an exhaustive dispatch over a Literal: a type checker proves it unreachable, and
    at run time it names the value nobody handled (typing.assert_never, from Python 3.11 on)."""
    raise AssertionError(f"unhandled value {value!r}")


def keyed(records: Iterable[R], name_of: Callable[[R], str], declared: Any, registry: str, noun: str) -> dict[str, R]:
    """``records`` by name, each member of the ``Literal`` ``declared`` exactly once (ValueError
    naming what is missing, undeclared or doubled, e.g. "collective registry: ... ops")."""
    records = list(records)
    names = [name_of(r) for r in records]
    members = set(get_args(declared))
    missing, unknown = members - set(names), set(names) - members
    twice = {n for n in names if names.count(n) > 1}
    if missing or unknown or twice:
        raise ValueError(f"{registry} registry: no record for {sorted(missing)}, records for undeclared {noun}s "
                         f"{sorted(unknown)}, records named twice {sorted(twice)}")
    return {name_of(r): r for r in records}
