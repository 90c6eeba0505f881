"""W0701 says what the best stage map of whole blocks reaches (issue 26, item 8): a map of as many
blocks on every stage gets the map that does better, and a map that is already the best is told so.
Checked against every map. `balanced` (issue 39) evens out compute instead, and gets no W0701."""

from __future__ import annotations

import itertools
import re

import pytest

from meshllm_dsl.checker import check_text

SPEC = """\
mesh line {{
    axes pipeline = {p}
}}
model m = gpt2 {{
    vocab = 50304
    hidden = 768
    layers = {layers}
    heads = 12
}}
plan pipe on line for m {{
    batch = 8
    microbatches = 4
    {stages}
}}
"""


def _w0701(text: str):  # type: ignore[no-untyped-def]
    result = check_text(text, "s.mesh")
    assert result.ok, result.errors
    return next((d for d in result.diagnostics if d.code == "W0701"), None), result


def _map(counts: tuple[int, ...]) -> str:
    parts, start = [], 0
    for k, c in enumerate(counts):
        names = ["embed", "pos"] if k == 0 else []
        names += [f"blocks[{start}:{start + c}]"] if c else []
        names += ["norm", "lm_head"] if k == len(counts) - 1 else []
        start += c
        parts.append(f"{k}: {', '.join(names)}")
    return "stages over pipeline { " + "  ".join(parts) + " }"


@pytest.mark.parametrize(("p", "layers"), [(4, 4), (3, 6), (4, 8)])
def test_the_suggested_map_is_the_best_of_every_map(p: int, layers: int) -> None:
    warning, _ = _w0701(SPEC.format(p=p, layers=layers, stages=_map((layers // p,) * p)))
    assert warning is not None
    suggested = re.search(r"`(stages over pipeline \{.*\})`", warning.help or "")
    assert suggested, warning.help
    _, result = _w0701(SPEC.format(p=p, layers=layers, stages=suggested.group(1)))
    best = max(s.numel for s in result.plans["pipe"].stages)
    # every map of whole blocks (the first and last stage may hold no block: they hold the embedding / head)
    for cut in itertools.product(range(layers + 1), repeat=p - 1):
        counts = (cut[0], *(b - a for a, b in zip(cut, cut[1:])), layers - cut[-1])
        if any(c < 0 for c in counts) or any(c == 0 for c in counts[1:-1]):
            continue
        _, other = _w0701(SPEC.format(p=p, layers=layers, stages=_map(counts)))
        assert best <= max(s.numel for s in other.plans["pipe"].stages), counts
    again, _ = _w0701(SPEC.format(p=p, layers=layers, stages=suggested.group(1)))
    if again is not None:  # the best map may still be imbalanced: then it says no map does better
        assert (again.help or "").startswith("no map of whole blocks does better")


def test_a_map_that_is_already_the_best_says_so() -> None:
    warning, _ = _w0701(SPEC.format(p=4, layers=4, stages=_map((0, 2, 2, 0))))
    assert warning is not None and "no map of whole blocks does better on 4 stages" in (warning.help or "")


def test_balanced_evens_out_compute_and_gets_no_parameter_warning() -> None:
    """GPT-2's 50k-vocabulary head costs 2 x 768 x 50304 flops per token, about five blocks: `balanced`
    gives its stage no block (12 blocks over 3 stages: 6, 6 and the head), where equal counts would
    make that stage the slowest."""
    warning, result = _w0701(SPEC.format(p=3, layers=12, stages="stages over pipeline balanced"))
    assert warning is None
    pieces = [[(pc.item, pc.start, pc.stop) for pc in s.pieces] for s in result.plans["pipe"].stages]
    assert pieces == [[("embed", None, None), ("pos", None, None), ("blocks", 0, 6)], [("blocks", 6, 12)],
                      [("norm", None, None), ("lm_head", None, None)]]
