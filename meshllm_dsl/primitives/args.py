"""A layer kind's arguments as a spec writes them (`attention(hidden, heads, kv_heads = 8)`): the
resolver binds a call against its kind's table (resolve.ModelResolver), the LSP completes from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class Arg:
    name: str
    kind: str  # dim | float | floats (a list of positive numbers) | bool | choice | layer
    default: Callable[[dict[str, Any]], Any] | None = None
    choices: tuple[str, ...] = ()
    minimum: int = 1  # the least a `dim` takes (0 where 0 means "off", as attention's window)
    # `floats`: the length a non-empty list must have, from the other bound arguments, and why
    # (longrope's factors: one per rotary frequency, head_dim / 2); empty means "not given".
    length: Callable[[dict[str, Any]], int] | None = None
    length_why: str = ""


def const(v: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda _bound: v
