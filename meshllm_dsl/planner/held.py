"""What a pipeline stage holds: its units, each with the blocks it stands for and their placements.

Below the analysis (rank.py, report.py) and moe.py, which all walk it.
"""

from __future__ import annotations

from collections.abc import Iterator

from meshllm_dsl.front.names import ranges
from meshllm_dsl.ir import REPLICATE, PlanIR, Repeat, Stage, Unit
from meshllm_dsl.parallel.costs import HeldUnit


def held_units(plan: PlanIR, stage: Stage) -> Iterator[HeldUnit]:
    model = plan.model
    top = dict(plan.top_placements)
    flows = dict(plan.top_flows)
    last_item = model.items[-1].name
    names_here = {pc.item for pc in stage.pieces}
    for pc in stage.pieces:
        item = model.item(pc.item)
        if isinstance(item, Repeat):
            blocks = set(range(pc.start or 0, pc.stop if pc.stop is not None else item.count))
            for cls in plan.classes_of(item.name):
                mine = sorted(blocks & set(cls.indices))
                if not mine:
                    continue
                prefix = f"{item.name}.{ranges(mine)}."
                for unit in item.body:
                    yield HeldUnit(unit, prefix, len(mine), cls.placements, dict(cls.flows).get(unit.name),
                                   indices=tuple(mine))
        elif isinstance(item, Unit):
            placements = tuple((".".join(leaf.path), top.get(".".join(leaf.path), REPLICATE)) for leaf in item.leaves)
            yield HeldUnit(item, "", 1, placements, flows.get(item.name), last=item.name == last_item)
            for leaf in item.leaves:
                tied = model.item(leaf.tie) if leaf.tie else None
                # A head tied to an embedding on another stage holds a synchronised copy of it there.
                if isinstance(tied, Unit) and tied.name not in names_here:
                    tp = tuple((".".join(lf.path), top.get(".".join(lf.path), REPLICATE)) for lf in tied.leaves)
                    yield HeldUnit(tied, "", 1, tp, None, tied_copy=True)
