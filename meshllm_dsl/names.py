"""Identifier rules: every name in a spec may reach generated Python, so it must be a safe identifier."""

from __future__ import annotations

import difflib
import keyword
from collections.abc import Iterable

# Attribute names of torch.nn.Module and names the generated modules bind themselves: a layer or
# axis with one of these names would shadow them.
_GENERATED_RESERVED = frozenset(
    """self torch nn rt F math forward training parameters buffers modules children state_dict
    load_state_dict to cpu cuda eval train apply register_buffer register_parameter zero_grad
    named_parameters named_modules half float double type mesh main""".split()
)


def identifier_problem(name: str, attribute: bool = False) -> str | None:
    """Why `name` cannot be used in a spec, or None when it is fine.

    `attribute`: the name becomes an attribute of a generated nn.Module (layers), so it must not
    shadow what nn.Module or the generated module already define.
    """
    if not name.isidentifier() or not name.isascii():
        return "is not an identifier"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return "is a Python keyword"
    if name.startswith("__") or name.endswith("__"):
        return "starts or ends with a double underscore"
    if attribute and name in _GENERATED_RESERVED:
        return "is reserved by the generated code"
    return None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    options = sorted(set(candidates))
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    listing = ", ".join(f"`{c}`" for c in options[:12]) + (", ..." if len(options) > 12 else "")
    if close:
        return f"did you mean `{close[0]}`? known: {listing}" if listing else f"did you mean `{close[0]}`?"
    return f"known: {listing}" if listing else "nothing of that kind is declared"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def ranges(indices: Iterable[int], sep: str = ",") -> str:
    """Integers as runs: [0, 1, 2, 5] -> "0-2,5" (for block and rank lists)."""
    runs: list[list[int]] = []
    for x in sorted(set(indices)):
        if runs and runs[-1][1] == x - 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def or_list(items: Iterable[object]) -> str:
    xs = [str(x) for x in items]
    if len(xs) > 12:
        xs = xs[:6] + ["..."] + xs[-3:]
    if len(xs) <= 1:
        return "".join(xs)
    return ", ".join(xs[:-1]) + " or " + xs[-1]
