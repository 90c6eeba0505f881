"""Identifier rules: every name in a spec may reach generated Python, so it must be a safe identifier."""

from __future__ import annotations

import difflib
import keyword
import sys
from collections.abc import Iterable

from meshllm_dsl.front.limits import MAX_NAME

# Public attributes of torch.nn.Module (`dir(nn.Module)` in torch 2.13; tests/front compare the
# list with the installed torch) plus `training`, and `smart_apply`, which transformers adds to
# nn.Module once one of its models initialises weights: a layer with one of these names would shadow them.
_NN_MODULE_ATTRS = frozenset(
    """add_module apply bfloat16 buffers call_super_init children compile cpu cuda double dump_patches
    eval extra_repr float forward get_buffer get_extra_state get_parameter get_submodule half ipu
    load_state_dict modules mtia named_buffers named_children named_modules named_parameters parameters
    register_backward_hook register_buffer register_forward_hook register_forward_pre_hook
    register_full_backward_hook register_full_backward_pre_hook register_load_state_dict_post_hook
    register_load_state_dict_pre_hook register_module register_parameter register_state_dict_post_hook
    register_state_dict_pre_hook requires_grad_ set_extra_state set_submodule share_memory state_dict to
    to_empty train type xpu zero_grad training T_destination smart_apply""".split()
)
# Names the generated modules bind themselves: module-level imports and constants, the `params`
# static method of every generated class, and process-group attributes, which are `g_AXES`.
_GENERATED_NAMES = frozenset("self torch nn rt F math mesh main params AXES MODEL PROGRAM make_loss".split())
GROUP_PREFIX = "g_"
# A plan becomes the file `PLAN.py`, whose directory is first on sys.path when it runs: a plan named
# after a module the generated code (or Python itself) imports would shadow that module.
_MODULE_NAMES = frozenset(sys.stdlib_module_names) | {"torch", "numpy", "meshllm_dsl", "safetensors", "typing_extensions"}


def identifier_problem(name: str, attribute: bool = False, module: bool = False) -> str | None:
    """Why `name` cannot be used in a spec, or None when it is fine.

    `attribute`: the name becomes an attribute of a generated nn.Module (layers), so it must not
    shadow what nn.Module or the generated module already define.
    `module`: the name becomes a Python module file (plans).
    """
    if not name.isidentifier() or not name.isascii():
        return "is not an identifier"
    if len(name) > MAX_NAME:
        return f"is longer than {MAX_NAME} characters"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return "is a Python keyword"
    if name.startswith("__") or name.endswith("__"):
        return "starts or ends with a double underscore"
    if attribute and (name in _NN_MODULE_ATTRS or name in _GENERATED_NAMES):
        return "is reserved by the generated code"
    if attribute and (name.startswith(GROUP_PREFIX) or name.startswith("_")):
        return (f"starts with `{GROUP_PREFIX}`, which generated code uses for process groups" if name.startswith(GROUP_PREFIX)
                else "starts with `_`, which torch.nn.Module uses for its own attributes")
    if module and (name in _MODULE_NAMES or name in _GENERATED_NAMES):
        return "is the name of a Python module, which the generated file would shadow"
    return None


def safe_variant(name: str, attribute: bool = False, module: bool = False, kind: str = "name") -> str:
    """A name close to `name` that passes identifier_problem with the same flags (for help lines)."""
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name).strip("_") or kind
    if cleaned[0].isdigit():
        cleaned = "n" + cleaned
    if cleaned.startswith(GROUP_PREFIX):
        cleaned = cleaned[len(GROUP_PREFIX):] or kind
    cleaned = cleaned[: MAX_NAME - len(kind) - 2]
    for candidate in (cleaned, f"{cleaned}_", f"{cleaned}_{kind}", f"my_{cleaned}"):
        if identifier_problem(candidate, attribute=attribute, module=module) is None:
            return candidate
    return kind + "1"


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate a misspelt `name` most likely meant (what `did_you_mean` proposes), if any."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return close[0] if close else None


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
