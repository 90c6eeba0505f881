"""Which layers a `shard` path pattern names: a function of the pattern and the model alone, so the
language server asks it directly (hover, completion) without building a checker."""

from __future__ import annotations

from collections.abc import Sequence

from meshllm_dsl.checker.context import _seg_matches
from meshllm_dsl.front import ast
from meshllm_dsl.ir import Leaf, ModelIR, Repeat

Matches = list[tuple[Leaf, frozenset[int] | None]]


def match_layer_path(pattern: ast.Path | Sequence[ast.PathSegment], model: ModelIR) -> Matches:
    """Every leaf of the layers `pattern` names as a whole (`blocks.*.mlp`: each leaf of `mlp`), as
    `match_path` gives them: for the rules that place a layer (`expert(D)`), not one of its weights."""
    return match_path(pattern, model, layer=True)


def match_path(pattern: ast.Path | Sequence[ast.PathSegment], model: ModelIR, layer: bool = False) -> Matches:
    """Every leaf `pattern` matches, with the blocks it covers for leaves inside the repeat (None:
    every block, or a top-level leaf). A block index past the repeat matches nothing. ``layer``:
    match the leaf's layer (its path less its own name) instead."""
    segs = tuple(pattern.segments if isinstance(pattern, ast.Path) else pattern)
    hits: Matches = []
    for item, _unit, leaf in model.leaves():
        path = leaf.path[:-1] if layer else leaf.path
        if not path:
            continue
        if isinstance(item, Repeat):
            if len(segs) != len(path) + 2 or not _seg_matches(segs[0], item.name):
                continue
            idx = segs[1]
            if idx.kind == "star":
                blocks = None
            elif idx.kind == "index":
                if idx.index >= item.count:
                    continue
                blocks = frozenset([idx.index])
            else:
                continue
            if all(_seg_matches(s, n) for s, n in zip(segs[2:], path)):
                hits.append((leaf, blocks))
        elif len(segs) == len(path) and all(_seg_matches(s, n) for s, n in zip(segs, path)):
            hits.append((leaf, None))
    return hits
