"""The pipeline stage map: every layer and block in exactly one stage, in order (E0601-E0605, E0608, E0609),
and the balance of parameters across stages (W0701)."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Sequence

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.checker.context import (
    PlanContext,
    _blocks_text,
    _human,
)
from meshllm_dsl.codes import (
    E0201,
    E0202,
    E0601,
    E0602,
    E0603,
    E0604,
    E0605,
    E0607,
    E0608,
    E0609,
    W0701,
)
from meshllm_dsl.diagnostics import Applicability, Label, insert, replace, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import (
    PLACEMENTS,
    SCHEDULES,
    BlockClass,
    Placement,
    Repeat,
    Stage,
    StagePiece,
    Unit,
    placement_of,
    stage_coord,
)


@attrs.define
class _MapWalk:
    """What checking a written stage map has seen so far, stage by stage and piece by piece."""

    order: dict[str, int]  # item -> its place in the model
    out_of_order: set[int]  # ids of the pieces outside a longest run in layer order
    seen_items: dict[str, ast.StageItem] = attrs.Factory(dict)
    last_item: dict[str, tuple[int, ast.StageItem]] = attrs.Factory(dict)  # item -> (stage, its latest occurrence)
    position: tuple[int, int] = (-1, 0)  # (item order, next block) the next piece must start at
    overlap_reported: bool = False
    bad_ranges: set[str] = attrs.Factory(set)
    unknown_names: bool = False

    @classmethod
    def of(cls, rules: StageRules, entries: Sequence[ast.StageEntry]) -> _MapWalk:
        order = {i.name: k for k, i in enumerate(rules.model.items)}
        # Pieces out of layer order: those outside a longest run in order, so one misplaced layer is one
        # error (not an error for every correct piece after it).
        listed = [it for e in entries for it in e.items if it.name.value in order]
        keep = _longest_ordered([(order[it.name.value], it.start or 0) for it in listed])
        return cls(order, {id(it) for i, it in enumerate(listed) if i not in keep})


class StageRules(PlanContext):
    # -- pipeline
    def stages(self, top: dict[str, Placement], classes: tuple[BlockClass, ...], seq: int = 128) -> tuple[tuple[Stage, ...], str | None, int]:
        stmts = [s for s in self.decl.body if isinstance(s, ast.StagesStmt)]
        model = self.model
        if not stmts:
            return (Stage(0, 0, tuple(StagePiece(i.name, 0 if isinstance(i, Repeat) else None, i.count if isinstance(i, Repeat) else None) for i in model.items), model.numel),), None, 1
        stmt = stmts[0]
        for extra in stmts[1:]:
            self.error(E0201, "`stages` is declared twice", extra.span, label="second declaration",
                       secondary=(Label(stmt.span, "first here"),), help="declare the stage map once")  # type: ignore[arg-type]
        axes = self.check_axes([stmt.axis], "stages")
        if axes is None:
            return (), None, 1
        axis = axes[0]
        p = self.mesh.size(axis)
        virtual = 1
        if stmt.virtual is not None:
            virtual = self.eval_int(stmt.virtual, {}, "virtual stages") or 1
        count = p * virtual
        placement = self.placement(stmt)
        if stmt.balanced:
            return self.balanced(stmt, axis, p, virtual, placement, seq), axis, virtual
        # Stage-map errors point at the map's header (`stages over AXIS`) or at the entry involved,
        # never at the whole multi-line map.
        header_end = stmt.virtual.span.end if stmt.virtual is not None and stmt.virtual.span else stmt.axis.span.end  # type: ignore[union-attr]
        header = stmt.span.source.span(stmt.span.start, header_end) if stmt.span else None
        errors_before = self.error_count()
        entries = self._numbered_entries(stmt)
        walk = _MapWalk.of(self, entries)
        stages = [self._stage(k, entry, walk, top, p, axis, placement) for k, entry in enumerate(entries)]
        self._coverage(stages, walk, entries, header)
        if len(stmt.entries) != count:
            self.error(E0604, f"{len(stmt.entries)} stages for a pipeline of {count}", header,
                       label=f"{len(stmt.entries)} stage{'s' if len(stmt.entries) != 1 else ''} listed, {count} needed",
                       secondary=self.axis_label(axis),
                       help=f"declare exactly {count} stages ({axis} size {p}" + (f" x {virtual} virtual" if virtual > 1 else "") + ")")
        if self.error_count() == errors_before:
            # Balance is only meaningful for a valid stage map.
            worst = max(range(len(stages)), key=lambda k: stages[k].numel, default=0)
            self.imbalance(stages, entries[worst].span if entries else stmt.span, axis)
        return tuple(stages), axis, virtual

    def placement(self, stmt: ast.StagesStmt) -> str:
        """How the stages sit on the pipeline ranks: the schedule's way (a V for `zbv` and `dualpipev`,
        a loop otherwise), which a written `placement` must agree with (E0607): torch's schedule classes
        send and receive by their own placement, so another one cannot run."""
        schedule = next((s for s in self.decl.body if isinstance(s, ast.ScheduleStmt)), None)
        name = schedule.name.value if schedule is not None and schedule.name.value in SCHEDULES else None
        wanted = placement_of(name) if name is not None else "loop"
        given = stmt.placement
        if given is None:
            return wanted
        if given.value not in PLACEMENTS:
            self.error(E0607, f"unknown placement `{given.value}`", given.span, label="not a placement",
                       **typo(given.span, given.value, PLACEMENTS))
            return wanted
        if given.value != wanted:
            shape = {"v": "a V (rank r holds stages r and 2p - 1 - r)", "loop": "a loop (stage i on rank i % p)"}
            secondary = (Label(schedule.name.span, f"places its stages in {shape[wanted].split(' (')[0]}"),) \
                if schedule is not None and schedule.name.span else ()
            if wanted == "v":
                help_ = f"write `placement v`, or drop `placement`: `{name}` places its stages itself"
            else:
                help_ = ("a V is what `schedule zbv` and `schedule dualpipev` run (with `virtual 2`); "
                         "for this schedule drop `placement v`")
            self.error(E0607, f"`{name or 'the default schedule'}` runs its stages in {shape[wanted]}, not {shape[given.value]}",
                       given.span, label=f"a {given.value if given.value == 'loop' else 'V'} placement",
                       secondary=secondary, help=help_)  # type: ignore[arg-type]
        return wanted

    def _numbered_entries(self, stmt: ast.StagesStmt) -> list[ast.StageEntry]:
        """The map's stages in the order to check them, after E0603 for stages numbered out of order."""
        entries = list(stmt.entries)
        order_of = {i.name: k for k, i in enumerate(self.model.items)}
        indices = [e.index.value for e in entries]
        if indices != list(range(len(entries))):
            if sorted(indices) == list(range(len(entries))):
                # Numbered 0..n-1 but listed out of order: one error, then check the map in stage order.
                k, bad = next((k, e) for k, e in enumerate(entries) if e.index.value != k)
                self.error(E0603, f"stage {bad.index.value} is listed where stage {k} belongs", bad.index.span,
                           label=f"expected stage {k}",
                           help=f"list the stages in order {', '.join(map(str, range(len(entries))))}: "
                           "activations flow from stage i to stage i + 1")
                # Follow the numbering unless the listing is the one in layer order (then the numbers are the typo).
                by_index = sorted(entries, key=lambda e: e.index.value)
                if not _layer_ordered(entries, order_of) and _layer_ordered(by_index, order_of):
                    entries = by_index
            else:
                for k, e in enumerate(entries):
                    if e.index.value != k:
                        self.error(E0603, f"stage {e.index.value} is out of order", e.index.span,
                                   label=f"expected stage {k}", help="number stages 0, 1, 2, ... in order")
        return entries

    def _stage(self, k: int, entry: ast.StageEntry, walk: _MapWalk, top: dict[str, Placement], p: int,
               axis: str, placement: str) -> Stage:
        """Stage `k` of the map: its pieces, each checked against the walk so far (E0202, E0601-E0603,
        E0605, E0609)."""
        pieces: list[StagePiece] = []
        for it in entry.items:
            piece = self._piece(k, it, walk)
            if piece is not None:
                pieces.append(piece)
        if not pieces and not entry.items:
            self.error(E0605, f"stage {k} holds no layers", entry.span, label="empty stage",
                       help=f"every stage needs at least one layer: move layers here or use fewer stages (and a smaller `{axis}` axis)")
        return Stage(k, stage_coord(k, p, placement), tuple(pieces), self.stage_numel(pieces, top))

    def _piece(self, k: int, it: ast.StageItem, walk: _MapWalk) -> StagePiece | None:
        """One item of stage `k` as a piece of it; None where it names no layer or a range that is none."""
        name = it.name.value
        item = self.model.item(name)
        if item is None:
            self.error(E0202, f"unknown layer `{name}` in the stage map", it.name.span, label="no such layer",
                       **typo(it.name.span, name, [i.name for i in self.model.items]))
            walk.unknown_names = True  # the layers "in no stage" are then most likely this one, misspelled
            return None
        if isinstance(item, Repeat):
            start, stop = (it.start, it.stop) if it.start is not None else (0, item.count)
            assert start is not None and stop is not None
            if not (0 <= start < stop <= item.count):
                walk.bad_ranges.add(name)  # coverage of this repeat is then unknown: no E0601 / E0602 guesses
                self.error(E0609, f"`{name}[{start}:{stop}]` is not a valid block range", it.span,
                           label=f"`{name}` has blocks 0 to {item.count - 1}",
                           help=f"use a range within [0:{item.count}] with start < stop",
                           suggestions=replace(it.span, f"{name}[{start}:{item.count}]", f"End at {item.count}")
                           if 0 <= start < item.count < stop else ())
                return None
        else:
            if it.start is not None:
                self.error(E0609, f"`{name}` is a single layer and cannot be sliced", it.span,
                           label="not a repeat", help=f"write `{name}` without a range",
                           suggestions=replace(it.span, name, f"Write `{name}`", Applicability.MACHINE_APPLICABLE))
                walk.seen_items.setdefault(name, it)  # it is in this stage, only mis-written
                return None
            start = stop = None  # type: ignore[assignment]
            if name in walk.seen_items:
                self.error(E0602, f"`{name}` is in two stages", it.span, label="again here",
                           secondary=(Label(walk.seen_items[name].span, "first here"),),  # type: ignore[arg-type]
                           help="every layer belongs to exactly one stage")
                return None
            walk.seen_items[name] = it
        self._placed(it, item, start, stop, walk)
        order, position = walk.order, walk.position
        if id(it) not in walk.out_of_order:
            walk.position = max(position, (order[name], stop if stop is not None else 0) if isinstance(item, Repeat) else (order[name] + 1, 0))
        walk.last_item[name] = (k, it)
        return StagePiece(name, start, stop)

    def _placed(self, it: ast.StageItem, item: Repeat | Unit, start: int, stop: int, walk: _MapWalk) -> None:
        """Where a valid piece falls against the walk so far: overlapping the previous range (E0602),
        out of layer order (E0603), or leaving blocks before it in no stage (E0601)."""
        name, order, position = it.name.value, walk.order, walk.position
        here = (order[name], start or 0)
        prev = walk.last_item.get(name)
        if (isinstance(item, Repeat) and prev is not None and position[0] == order[name]
                and start < position[1] and stop > (prev[1].start or 0)):
            self.error(E0602, f"blocks {_blocks_text(range(start, min(stop, position[1])))} of `{name}` are in two stages",
                       it.span, label=f"starts at {start}",
                       secondary=(Label(prev[1].span, f"stage {prev[0]} holds blocks up to {position[1] - 1}"),),  # type: ignore[arg-type]
                       help=f"start this range at {position[1]}: every block belongs to exactly one stage",
                       suggestions=replace(it.span, f"{name}[{position[1]}:{stop}]", f"Start at {position[1]}",
                                           Applicability.MACHINE_APPLICABLE))
            walk.overlap_reported = True
        elif id(it) in walk.out_of_order:
            self.error(E0603, f"`{it.name.value}{'' if start is None else f'[{start}:{stop}]'}` is out of order",
                       it.span, label="comes before an earlier stage's layers",
                       help="stages must hold the model's layers contiguously and in order")
        elif isinstance(item, Repeat) and here > position and position[0] == order[name]:
            self.error(E0601, f"blocks {position[1]} to {start - 1} of `{name}` are in no stage", it.span,
                       label=f"starts at {start}", help=f"start this range at {position[1]}",
                       suggestions=replace(it.span, f"{name}[{position[1]}:{stop}]", f"Start at {position[1]}"))
        elif isinstance(item, Repeat) and position[0] < order[name] and start != 0:
            self.error(E0601, f"blocks 0 to {start - 1} of `{name}` are in no stage", it.span,
                       label=f"starts at {start}", help=f"start the first range of `{name}` at 0")

    def _coverage(self, stages: list[Stage], walk: _MapWalk, entries: list[ast.StageEntry], header: Span | None) -> None:
        """Every layer and every block in some stage, once (E0601, E0602), where the walk left them out."""
        model = self.model
        for i, item in enumerate(model.items):
            if isinstance(item, Repeat) and item.name not in walk.bad_ranges:
                self._block_coverage(item, stages, walk, header)
            elif not isinstance(item, Repeat) and item.name not in walk.seen_items and not walk.unknown_names:
                last_item = walk.last_item
                before = next((last_item[n.name] for n in reversed(model.items[:i]) if n.name in last_item), None)
                after = next((last_item[n.name] for n in model.items[i + 1:] if n.name in last_item), None)
                if before is not None:
                    k, it = before
                    self.error(E0601, f"`{item.name}` is in no stage", it.span, label=f"`{item.name}` comes after this",
                               help=f"add `{item.name}` after `{it.span.text if it.span else it.name.value}` in stage {k}"
                               + (f", or first in stage {k + 1}" if k + 1 < len(entries) else ""),
                               suggestions=insert(it.span, True, f", {item.name}", f"Add `{item.name}` to this stage"))
                elif after is not None:
                    k, it = after
                    self.error(E0601, f"`{item.name}` is in no stage", it.span, label=f"`{item.name}` comes before this",
                               help=f"add `{item.name}` before `{it.span.text if it.span else it.name.value}` in stage {k}",
                               suggestions=insert(it.span, False, f"{item.name}, ", f"Add `{item.name}` to this stage"))
                else:
                    self.error(E0601, f"`{item.name}` is in no stage", header, label="stage map",
                               help=f"add `{item.name}` to the first stage")

    def _block_coverage(self, item: Repeat, stages: list[Stage], walk: _MapWalk, header: Span | None) -> None:
        """A repeat's blocks in two stages (E0602, unless the walk reported the overlap) or, past its
        last range, in none (E0601; gaps and a late first range the walk reported where they occur)."""
        counts = collections.Counter(
            b for s in stages for pc in s.pieces if pc.item == item.name for b in range(pc.start or 0, pc.stop or 0))
        dup = sorted(b for b, c in counts.items() if c > 1)
        if dup and not walk.overlap_reported:
            self.error(E0602, f"blocks {_blocks_text(dup)} of `{item.name}` are in two stages", header,
                       label="overlapping ranges", help="block ranges of consecutive stages must not overlap")
        end = max(counts, default=-1) + 1
        if end < item.count:
            where = walk.last_item.get(item.name)
            if where is None:
                self.error(E0601, f"`{item.name}` (blocks 0-{item.count - 1}) is in no stage", header,
                           label="stage map", help=f"add `{item.name}[a:b]` ranges covering `{item.name}[0:{item.count}]`")
            else:
                k, it = where
                first = it.start if it.start is not None else 0
                self.error(E0601, f"blocks {_blocks_text(range(end, item.count))} of `{item.name}` are in no stage",
                           it.span, label=f"the last range stops at block {end - 1}",
                           help=f"extend it to `{item.name}[{first}:{item.count}]`, or add `{item.name}[{end}:{item.count}]` to the next stage",
                           suggestions=replace(it.span, f"{item.name}[{first}:{item.count}]",
                                               f"Extend to `{item.name}[{first}:{item.count}]`"))

    def balanced(self, stmt: ast.StagesStmt, axis: str, p: int, virtual: int, placement: str,
                 seq: int = 128) -> tuple[Stage, ...]:
        """`balanced`: the repeat's blocks over the stages in order, as many to each as evens out the
        compute of the busiest rank, then of the busiest stage, weighing the layers before the blocks
        (on the first stage) and after them (on the last) by their flops as well: a 128k-vocabulary
        head costs several blocks (Megatron's `Et|(tt|)*30mL` layouts, torchtitan's fewer layers on
        the first and last stage). Without such layers every stage gets the same share."""
        count = p * virtual
        reps = self.model.repeats
        if not reps:
            self.error(E0608, "`balanced` needs a repeated block stack to split", stmt.span,
                       label="no repeat in this model", help="list the stages explicitly")
            return ()
        order = [i.name for i in self.model.items]
        ri, rj = order.index(reps[0].name), order.index(reps[-1].name)  # the repeats follow one another
        n_blocks = sum(r.count for r in reps)
        # The first and the last stage hold other layers too: they may go without a block.
        least = [0 if (k == 0 and ri > 0 or k == count - 1 and rj < len(order) - 1) else 1 for k in range(count)]
        if n_blocks < sum(least):
            spare = count - sum(least)  # stages that hold other layers
            most = max((d for d in range(1, p + 1) if d * virtual - min(spare, 2) <= n_blocks), default=1)
            self.error(E0608, f"{n_blocks} blocks cannot fill {count} stages", stmt.span,
                       label=f"{axis} = {p}" + (f" x virtual {virtual}" if virtual > 1 else ""),
                       secondary=self.axis_label(axis),
                       help=f"every stage that holds no other layer needs a block: use a `{axis}` of at most {most}"
                       + (f" with virtual {virtual}" if virtual > 1 else "") + ", or list the stages explicitly")
            return ()
        cost = {i.name: primitives.of(i).flops_per_token(i, seq) for i in self.model.items if isinstance(i, Unit)}
        fixed = [0] * count
        fixed[0] += sum(cost.get(n, 0) for n in order[:ri])
        fixed[-1] += sum(cost.get(n, 0) for n in order[rj + 1 :])
        coords = [stage_coord(k, p, placement) for k in range(count)]
        if len(reps) == 1:
            block = sum(primitives.of(u).flops_per_token(u, seq) for u in reps[0].body)
            per = _split_blocks(n_blocks, fixed, block, coords, least)
        else:  # blocks of different kinds (dense first blocks, then moe ones): each weighs its own work
            per = _split_weighted([sum(primitives.of(u).flops_per_token(u, seq) for u in r.body)
                                   for r in reps for _ in range(r.count)], fixed, least)
        # The model's blocks in order as (repeat, index in it).
        seq_blocks = [(r.name, i) for r in reps for i in range(r.count)]
        stages = []
        top_placeholder: dict[str, Placement] = {}
        first = 0
        for k in range(count):
            pieces = []
            if k == 0:
                pieces += [StagePiece(n) for n in order[:ri]]
            mine = seq_blocks[first : first + per[k]]
            for name in dict.fromkeys(n for n, _ in mine):  # one piece per repeat the range crosses
                held = [i for n, i in mine if n == name]
                pieces.append(StagePiece(name, held[0], held[-1] + 1))
            first += per[k]
            if k == count - 1:
                pieces += [StagePiece(n) for n in order[rj + 1 :]]
            stages.append(Stage(k, coords[k], tuple(pieces), self.stage_numel(pieces, top_placeholder)))
        # No W0701 here: the map evens out compute by construction, and the parameters an embedding
        # or a head add there are memory, which the planner weighs per rank (W0806).
        return tuple(stages)

    def stage_numel(self, pieces: Iterable[StagePiece], top: dict[str, Placement]) -> int:
        total = 0
        for pc in pieces:
            item = self.model.item(pc.item)
            if isinstance(item, Repeat):
                total += (pc.stop - pc.start) * item.numel_per_block  # type: ignore[operator]
            elif item is not None:
                total += item.numel
                for leaf in item.leaves:
                    if leaf.tie is not None:
                        tied = self.model.item(leaf.tie)
                        # A tied weight on another stage is held there too (a synchronised copy).
                        if tied is not None and all(q.item != leaf.tie for q in pieces):
                            total += tied.numel
        return total

    def imbalance(self, stages: Sequence[Stage], span: Span | None, axis: str) -> None:
        if len(stages) < 2:
            return
        sizes = [s.numel for s in stages]
        mean = sum(sizes) / len(sizes)
        worst = max(stages, key=lambda s: s.numel)
        if not (mean and worst.numel > 1.25 * mean):
            return
        listing = ", ".join(f"{_human(s.numel)}" for s in stages)
        best = self.best_split(stages)
        if best is not None and best[0] < worst.numel:
            load, counts = best
            lead = f"move blocks off stage {worst.index}"
            help_ = (f"{lead}; the best map of whole blocks holds at most {load / mean:.2f}x the mean: "
                     f"`stages over {axis} {{ {self.stage_map_text(counts)} }}`")
        elif best is not None:
            help_ = (f"no map of whole blocks does better on {len(stages)} stages: the layers outside the blocks "
                     "(embedding, head) outweigh them; use fewer pipeline stages, or a model with more blocks")
        else:
            help_ = (f"the slowest stage sets the pace of the pipeline: move blocks off stage {worst.index}, or "
                     "give the embedding / head stages fewer blocks")
        self.warn(W0701, f"stage {worst.index} holds {worst.numel / mean:.2f}x the mean parameter count",
                  span, label=f"parameters per stage: {listing}", help=help_,
                  note="the pipeline waits for its slowest stage")

    def best_split(self, stages: Sequence[Stage]) -> tuple[int, list[int]] | None:
        """The smallest largest-stage parameter count any map of whole blocks reaches (the layers
        before the repeat on the first stage, those after it on the last, as every valid map has
        them), and the blocks per stage that reach it; None where that model does not apply (no
        repeat, interleaved stages, layers outside the blocks split across stages)."""
        if len(self.model.repeats) != 1 or len({s.coord for s in stages}) != len(stages):
            return None  # (blocks of several kinds: no whole-block map is proposed)
        rep = self.model.repeats[0]
        order = [i.name for i in self.model.items]
        ri = order.index(rep.name)
        blocks = []
        for k, st in enumerate(stages):
            names = {pc.item for pc in st.pieces if pc.item != rep.name}
            if names != set(order[:ri] if k == 0 else ()) | set(order[ri + 1 :] if k == len(stages) - 1 else ()):
                return None
            blocks.append(sum((pc.stop or 0) - (pc.start or 0) for pc in st.pieces if pc.item == rep.name))
        b = rep.numel_per_block
        if not b:
            return None
        pre, post = stages[0].numel - blocks[0] * b, stages[-1].numel - blocks[-1] * b
        n, total = len(stages), rep.count
        low = (1 if pre == 0 else 0, 1, 1 if post == 0 else 0)  # every stage holds some layer (E0605)

        def caps(t: int) -> list[int] | None:
            c = [(t - pre) // b if t >= pre else -1, *([t // b] * (n - 2)), (t - post) // b if t >= post else -1]
            mins = [low[0], *([low[1]] * (n - 2)), low[2]]
            if any(x < m for x, m in zip(c, mins)) or sum(c) < total:
                return None
            return c

        lo, hi = 0, max(s.numel for s in stages)
        while lo < hi:  # the smallest load a split reaches
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if caps(mid) is not None else (mid + 1, hi)
        counts = caps(lo)
        if counts is None:
            return None
        extra = [pre, *([0] * (n - 2)), post]
        mins = [low[0], *([low[1]] * (n - 2)), low[2]]
        # Level the stages below that load too: the lowest level each stage can be cut down to while
        # the blocks still fit, then the few left over one at a time off the most loaded stage.
        def level(t: int) -> list[int]:
            return [min(c, max(m, (t - e) // b)) for c, m, e in zip(counts, mins, extra)]

        a, z = 0, lo
        while a < z:
            mid = (a + z) // 2
            a, z = (a, mid) if sum(level(mid)) >= total else (mid + 1, z)
        counts = level(a)
        for _ in range(sum(counts) - total):
            k = max((k for k in range(n) if counts[k] > mins[k]), key=lambda k: counts[k] * b + extra[k])
            counts[k] -= 1
        return max(c * b + e for c, e in zip(counts, extra)), counts

    def stage_map_text(self, counts: list[int]) -> str:
        rep = self.model.repeats[0]
        order = [i.name for i in self.model.items]
        ri = order.index(rep.name)
        parts, start = [], 0
        for k, c in enumerate(counts):
            names = list(order[:ri] if k == 0 else ())
            if c:
                names.append(f"{rep.name}[{start}:{start + c}]")
            names += order[ri + 1 :] if k == len(counts) - 1 else ()
            start += c
            parts.append(f"{k}: {', '.join(names)}")
        return "  ".join(parts)


def _layer_ordered(entries: Sequence[ast.StageEntry], order: dict[str, int]) -> bool:
    keys = [(order[e.items[0].name.value], e.items[0].start or 0) for e in entries if e.items and e.items[0].name.value in order]
    return keys == sorted(keys)


def _longest_ordered(keys: Sequence[tuple[int, int]]) -> set[int]:
    """Indices of a longest non-decreasing subsequence of `keys` (patience sorting, O(n log n))."""
    import bisect

    tails: list[tuple[int, int]] = []
    tail_index: list[int] = []
    parent = [-1] * len(keys)
    for i, key in enumerate(keys):
        j = bisect.bisect_right(tails, key)
        if j == len(tails):
            tails.append(key)
            tail_index.append(i)
        else:
            tails[j], tail_index[j] = key, i
        parent[i] = tail_index[j - 1] if j else -1
    out: set[int] = set()
    i = tail_index[-1] if tail_index else -1
    while i >= 0:
        out.add(i)
        i = parent[i]
    return out


def _split_weighted(costs: Sequence[int], fixed: Sequence[int], least: Sequence[int]) -> list[int]:
    """Blocks per stage for blocks of different work `costs` (in model order; each stage a contiguous
    run of them, at least `least[k]`): a split whose busiest stage (`fixed[k]`: its other layers'
    work) is least. Dynamic programming over (stages, blocks placed), O(stages x blocks^2): a greedy
    fill is not optimal once a stage must take a block. With interleaved stages a rank's work is the
    sum of its stages': evening the stages evens the ranks."""
    n, m = len(costs), len(fixed)
    prefix = list(itertools.accumulate(costs, initial=0))
    inf = float("inf")
    best: list[list[float]] = [[inf] * (n + 1) for _ in range(m + 1)]  # [k][i]: k stages hold blocks 0..i-1
    choice = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0
    for k in range(1, m + 1):
        for i in range(n + 1):
            for j in range(i - least[k - 1] + 1):
                if best[k - 1][j] == inf:
                    continue
                load = max(best[k - 1][j], fixed[k - 1] + prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i], choice[k][i] = load, j
    assert best[m][n] < inf  # the caller checked there are blocks enough for every stage
    per, i = [0] * m, n
    for k in range(m, 0, -1):
        j = choice[k][i]
        per[k - 1], i = i - j, j
    return per


def _split_blocks(blocks: int, fixed: Sequence[int], block: int, coords: Sequence[int], least: Sequence[int]) -> list[int]:
    """Blocks per stage (at least `least[k]`, `blocks` in all) that make the busiest rank's work least
    (a rank runs every stage placed on it: `coords`), then its busiest stage's; `fixed[k]`: the work
    of stage k's other layers, `block`: one block's. Greedy, one block at a time to the stage whose
    rank and then whose own work stays least (the earlier stage on a tie): optimal for the busiest
    rank, as every block weighs the same."""
    per = list(least)
    rank_work: dict[int, int] = {}
    for k, c in enumerate(coords):
        rank_work[c] = rank_work.get(c, 0) + fixed[k] + per[k] * block
    for _ in range(blocks - sum(per)):
        k = min(range(len(per)), key=lambda k: (rank_work[coords[k]] + block, fixed[k] + (per[k] + 1) * block, k))
        per[k] += 1
        rank_work[coords[k]] += block
    return per
