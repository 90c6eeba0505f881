"""Typed reads of a Hugging Face config.json object, shared by every family pack.

Standard library only (and the runtime's torch-free `json_values`): the packs are read by
`meshc import-hf`, which never imports torch, and by the runtime, which never imports the compiler.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from meshllm_dsl.runtime.json_values import describe


class ImportError_(Exception):
    """The directory describes a model meshllm cannot reproduce exactly (exit 1)."""


class ConfigError(Exception):
    """config.json is not a description of a model at all: unreadable, not a JSON object, a field
    missing or of the wrong type or range (an input error: exit 2)."""


NO_DEFAULT: Any = object()


@attrs.frozen
class Limits:
    """The largest integer a field may hold, and the most blocks a model may have (the spec's own
    bounds, handed in by the compiler so that the packs import nothing of it)."""

    max_int: int
    max_blocks: int


# One model setting: (setting, value, the config.json fields it comes from).
Setting = tuple[str, Any, str]


class ConfigFields:
    """Typed reads of one JSON object of config.json: each raises ConfigError naming the file, the
    field and what was expected.  ``null`` is the default, as transformers reads a config; a
    field without a default is required.  Integers are JSON integers (64.0 is refused: transformers
    keeps it a float, and torch refuses a float size), booleans JSON booleans (never the string
    "false", which is truthy), numbers finite."""

    def __init__(self, doc: dict[str, Any], where: str, limits: Limits, prefix: str = "") -> None:
        self.doc, self.where, self.limits, self.prefix = doc, where, limits, prefix

    def with_doc(self, doc: dict[str, Any]) -> ConfigFields:
        """The same reads over another object of the same file (a config read as another architecture's)."""
        return ConfigFields(doc, self.where, self.limits, self.prefix)

    def error(self, field: str, expected: str) -> ConfigError:
        if self.doc.get(field) is None:
            return ConfigError(f"{self.where}: no `{self.prefix}{field}`; expected {expected}")
        return ConfigError(f"{self.where}: `{self.prefix}{field}` is {describe(self.doc[field])}; expected {expected}")

    def refuse(self, field: str, why: str) -> ImportError_:
        """A well-formed value the families cannot honour (exit 1), naming the field."""
        return ImportError_(f"{self.where}: `{field}` = {self.doc.get(field)!r} {why}")

    def _get(self, field: str, default: Any, expected: str) -> Any:
        value = self.doc.get(field)
        if value is None and default is NO_DEFAULT:
            raise self.error(field, expected)
        return value

    def int(self, field: str, default: Any = NO_DEFAULT, maximum: int | None = None) -> Any:
        maximum = self.limits.max_int if maximum is None else maximum
        expected = f"a positive integer (at most {maximum:,})"
        value = self._get(field, default, expected)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
            raise self.error(field, expected)
        return value

    def blocks(self, field: str) -> Any:
        """A required count of blocks (layers), bounded as a spec's `repeat` is."""
        return self.int(field, maximum=self.limits.max_blocks)

    def number(self, field: str, default: Any = NO_DEFAULT) -> Any:
        value = self._get(field, default, "a positive number")
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise self.error(field, "a positive number")
        return float(value)

    def flag(self, field: str, default: bool) -> bool:
        value = self.doc.get(field)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, "true or false")
        return value

    def text(self, field: str, default: Any = NO_DEFAULT, expected: str = "a string") -> Any:
        value = self._get(field, default, expected)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(field, expected)
        return value

    def obj(self, field: str) -> ConfigFields | None:
        value = self.doc.get(field)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(field, "an object (or null)")
        return ConfigFields(value, self.where, self.limits, f"{self.prefix}{field}.")

    def off(self, field: str, why: str) -> None:
        """A number that must be absent, null or 0: anything else changes the maths (exit 1)."""
        value = self.doc.get(field)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(field, "a number (or null)")
        if value:
            raise ImportError_(f"{self.where}: `{self.prefix}{field}` = {value!r} {why}")
