"""Memory techniques a plan asks for: activation recomputation (E0409), sequence parallelism (E0410,
E0301 for seq), context parallelism (E0411, E0301 for seq)."""

from __future__ import annotations

import math

from meshllm_dsl import primitives
from meshllm_dsl.checker.context import (
    PlanContext,
)
from meshllm_dsl.codes import E0203, E0301, E0409, E0410, E0411
from meshllm_dsl.diagnostics import Label
from meshllm_dsl.front import ast
from meshllm_dsl.front.names import or_list
from meshllm_dsl.ir import Unit


class MemoryRules(PlanContext):
    def recompute(self, given: ast.Setting | None) -> tuple[str, int]:
        """`recompute = none | blocks | attention | ops [every N]`: which activations backward
        recomputes, and in which blocks (every N-th: blocks N - 1, 2 N - 1, ...)."""
        from meshllm_dsl.ir import RECOMPUTE

        if given is None:
            return "none", 1
        v = given.value
        if not (isinstance(v, ast.Name) and v.value in RECOMPUTE):
            self.error(E0203, "unknown recompute region", v.span, label="not a region",
                       help=f"use one of {or_list(RECOMPUTE)}: `blocks` recomputes each block of the repeat in "
                            "backward, `attention` only the attention core, `ops` all but the attention "
                            "outputs and every other matmul output (torchtitan's selective op)")
            return "none", 1
        region = v.value
        reps = self.model.repeats
        # `every N` counts within each repeat: its blocks N - 1, 2 N - 1, ...
        most = max((r.count for r in reps), default=0)
        every = self._recompute_every(given, region)
        if region in ("blocks", "ops") and not reps:
            self.error(E0409, f"`recompute = {region}` needs a repeated block stack", v.span,
                       label="no blocks to recompute", help=f"model `{self.model.name}` has no `repeat`: remove the setting")
        elif reps and every > most:
            assert given.every is not None
            self.error(E0409, f"`every {every}` recomputes none of the {most} blocks", given.every.span,
                       label=f"more than the {most} blocks",
                       help=f"recompute every block with `recompute = {region}`, or every n-th with n from 1 to {most}")
        elif region == "attention" and not any(primitives.of(u).recomputed_core for r in reps for u in r.body):
            self.error(E0409, "`recompute = attention` needs attention inside the repeated blocks", v.span,
                       label="no attention to recompute",
                       help=f"model `{self.model.name}` has no attention in a `repeat`: use `recompute = blocks` or remove the setting")
        return region, every

    def _recompute_every(self, given: ast.Setting, region: str) -> int:
        """`every N` of `recompute = blocks every N` (torchtitan's `ac_freq`): a whole number >= 1,
        only for the regions wrapped block by block."""
        if given.every is None:
            return 1
        if region not in ("blocks", "ops"):
            self.error(E0203, f"`every` does not apply to `recompute = {region}`", given.every.span,
                       label="only blocks and ops are recomputed block by block",
                       help="write `recompute = blocks every N` or `recompute = ops every N`, or drop `every`")
            return 1
        n = self.eval_int(given.every, {}, "`every`")
        return n if n is not None else 1

    def sequence_parallel(self, seq: int, seq_setting: ast.Setting | None) -> None:
        """`layout { seq -> T }`: Megatron sequence parallelism over the tensor axes T.

        The sublayers' fit (tensor-parallel over exactly T, E0410) is checked with the activation
        layouts (layouts.py); here: a model it applies to, and seq splitting over T (E0301).
        """
        entry = self.seq_entry
        if entry is None or not self.seq_axes:  # (context parallelism alone)
            return
        axes, text = self.seq_axes, " x ".join(self.seq_axes)
        if not any(primitives.of(u).sublayer for r in self.model.repeats for u in r.body):
            self.error(E0410, "sequence parallelism needs tensor-parallel blocks", entry.span,
                       label="no blocks to shard along the sequence",
                       help=f"model `{self.model.name}` has no attention or mlp in a `repeat`: remove `seq -> {' * '.join(axes)}`")
            return
        items = self.model.items
        for item in items[:-1]:
            if isinstance(item, Unit) and primitives.of(item) is primitives.linear.LINEAR:
                self.error(E0410, f"sequence parallelism does not support the top-level linear `{item.name}`",
                           entry.span, label="sequence parallelism asked for here",
                           secondary=(Label(item.span, "a linear between the blocks and the head"),) if item.span else (),
                           help=f"remove `seq -> {' * '.join(axes)}`")
        n = self.mesh.size(*axes)
        # (Inside context parallelism seq must split into 2 |C| chunks as well: context_parallel checks both.)
        if not self.context_axes:
            self._seq_splits(seq, seq_setting, n, axes, f"`seq` ({seq}) is not divisible by {text} ({n})",
                             f"{seq} tokens do not split over {n} devices", f"sequence parallelism over {text}",
                             f"sequence parallelism gives each of the {n} ranks of {text} an equal slice of every sequence")

    def _seq_splits(self, seq: int, seq_setting: ast.Setting | None, n: int, axes: tuple[str, ...], message: str,
                    label: str, what: str, why: str) -> None:
        """E0301 unless `seq` splits into `n` equal parts (`what` splits it over `axes`, `why` says
        how); the help offers the next multiples of `n`."""
        entry = self.seq_entry
        if entry is None or "seq" in self.bad_settings or seq % n == 0:
            return
        span = seq_setting.value.span if seq_setting is not None else entry.span
        ok = [k * n for k in range(max(1, seq // n), max(1, seq // n) + 3)]
        self.error(E0301, message, span, label=label,
                   secondary=(Label(entry.span, what),) + tuple(lab for a in axes for lab in self.axis_label(a)),
                   help=f"{why}: use seq = {or_list(ok)}")

    def context_parallel(self, seq: int, seq_setting: ast.Setting | None, pipeline_axis: str | None,
                         batch_axes: tuple[str, ...]) -> None:
        """`layout { seq -> C }` over axes C that split no weight: context parallelism (runtime/parallel/context.py).

        C has no other role (E0411), and seq divides into 2 |C| equal chunks for the head-tail balance
        (E0301), and under sequence parallelism over T each rank's s / |C| over T as well.
        """
        entry, axes = self.seq_entry, self.context_axes
        if entry is None or not axes:
            return
        text = " x ".join(axes)
        for a in axes:
            role = "the pipeline axis" if a == pipeline_axis else "a batch axis" if a in batch_axes else None
            if role is not None:
                self.error(E0411, f"axis `{a}` is {role}; the sequence cannot also be split over it", entry.span,
                           label=f"context parallelism over `{a}`", secondary=self.axis_label(a),
                           help="context parallelism needs a mesh axis of its own: add one (`axes data = 2, cp = 2`) "
                                f"and write `seq -> cp`, or remove `seq -> {' * '.join(axes)}`")
                return
        c = self.mesh.size(*axes)
        # Under sequence parallelism over T as well, each rank's s / C tokens split over T.
        t = self.mesh.size(*self.seq_axes) if self.seq_axes else 1
        n = math.lcm(2 * c, c * t)
        chunks = (f"each of the {c} ranks of {text} holds chunks i and {2 * c - 1} - i of {2 * c} equal ones "
                  "(the causal work balanced)")
        if t == 1:
            message, label = f"`seq` ({seq}) is not divisible by 2 x {text} (2 x {c} = {n})", f"{n} equal chunks"
        else:
            sp = " x ".join(self.seq_axes)
            message = f"`seq` ({seq}) is not divisible by {n} (2 x {text} chunks, each rank's s / {c} split over {sp} ({t}))"
            label = f"{n} equal parts"
            chunks += f" and sequence parallelism splits its s / {c} tokens over the {t} ranks of {sp}"
        what = f"context parallelism over {text}" + (f", sequence parallelism over {' x '.join(self.seq_axes)}" if t > 1 else "")
        self._seq_splits(seq, seq_setting, n, (*axes, *self.seq_axes), message,
                         f"{seq} tokens do not split into {label}", what, chunks)
