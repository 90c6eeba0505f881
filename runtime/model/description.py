"""Reading the MODEL description a generated module carries (codegen/lower.py writes it): its layers
unrolled, the token embedding, the position table and the moe layers, so the trainer, the launcher,
the router losses, the reference comparison and the checkpoint code read the model alike. (The
reference model's and the checkpoint layouts' own tables dispatch on the kind themselves.)"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

Layer = Mapping[str, Any]


def layers(model: Mapping[str, Any]) -> Iterator[Layer]:
    """Every layer of the model, blocks unrolled, in order."""
    return _unrolled(model["layers"])


def _unrolled(items: Sequence[Layer]) -> Iterator[Layer]:
    for spec in items:
        if spec["kind"] == "repeat":
            for _ in range(int(spec["count"])):
                yield from spec["body"]
        else:
            yield spec


def partial_rotary(model: Mapping[str, Any]) -> str | None:
    """The name of the first attention that rotates part of each head (`rotary_dim`, written only
    where it is not head_dim), else None: Hugging Face checkpoints of it are not mapped yet."""
    return next((str(spec["name"]) for spec in layers(model) if spec.get("rotary_dim")), None)


def token_embedding(model: Mapping[str, Any]) -> Layer:
    """The token embedding (`num` rows, `dim` wide; `used` rows are tokens when the table is padded)."""
    for spec in model["layers"]:
        if spec["kind"] == "embedding":
            return spec
    raise ValueError("model has no embedding layer")


def position_table(model: Mapping[str, Any]) -> Layer | None:
    """The learned position embedding; None for a model with rotary positions."""
    return next((spec for spec in model["layers"] if spec["kind"] == "positional"), None)


def moe_layers(model: Mapping[str, Any]) -> list[Layer]:
    """The mixture-of-experts sublayers, blocks unrolled."""
    return [spec for spec in layers(model) if spec["kind"] == "moe"]
