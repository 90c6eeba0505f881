"""How one-line messages show a value read from a JSON file (config.json, manifests, index files).

Standard library only: `meshc import-hf` (which never imports torch) and the runtime word a bad
value the same way.
"""

from __future__ import annotations

import json
from typing import Any


def describe(value: Any) -> str:
    """``value`` as JSON shows it, with its JSON type: for one-line messages."""
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
    text = json.dumps(value, default=str)
    text = text if len(text) <= 40 else text[:37] + "..."
    return "null" if value is None else f"{text} ({kind})"
