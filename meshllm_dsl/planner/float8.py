"""What `precision { matmul = fp8_* | mxfp8, all_gather = fp8 }` and `compile = blocks` change in the
time model: which copies of a linear layer run in which recipe (the plan's Float8Plan decides, as the
runtime converts exactly those), each product's roofline at the recipe's peak, the float8 casts as
memory traffic, and a compiled block's matmul efficiency and elementwise passes. The fitted constants
(COMPILED_MATMUL, COMPILED_ELEMENTWISE_PASSES, FLOAT8_MATMUL) and their sources are in
parallel/devices.py beside H100_MATMUL.

Below time.py and recompute.py, which both price products through `product_seconds`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from meshllm_dsl.ir import DTYPES, FP8_BYTES, Float8Plan, PlanIR
from meshllm_dsl.parallel.costs import HeldUnit, Matmul, matmul_seconds
from meshllm_dsl.parallel.devices import COMPILED_MATMUL, FLOAT8_MATMUL, DeviceProfile

TENSORWISE = "fp8_tensorwise"  # the only recipe whose weights FSDP2 may all-gather in float8


def _recipes(f8: Float8Plan) -> dict[str, str]:
    return f8.by_path


# Answers by path alone, shared by every Float8Plan with the same layers: `meshc suggest` checks
# thousands of layouts of one model, each plan with a Float8Plan of its own that is mostly equal.
_SHARED: dict[tuple[object, ...], dict[object, object]] = {}


def _memo(f8: Float8Plan) -> dict[object, object]:
    found = f8.memo.get("shared")
    if found is None:
        if len(_SHARED) > 256:
            _SHARED.clear()
        found = f8.memo["shared"] = _SHARED.setdefault((f8.layers, f8.gather), {})
    return found  # type: ignore[no-any-return]


def leaf_recipes(plan: PlanIR, hu: HeldUnit, leaf: str) -> tuple[tuple[str | None, int], ...]:
    """(recipe or None for the params dtype, copies) over the `hu.count` copies of linear `leaf` (its
    path in the unit, `attn.q`) that `hu` stands for: per-layer overrides may convert some blocks only."""
    if plan.float8 is None or not leaf:
        return ((None, hu.count),)
    recipes = _recipes(plan.float8)
    if not hu.prefix:
        return ((recipes.get(leaf), hu.count),)
    key = ("leaf_recipes", hu.prefix, hu.indices, hu.count, leaf)
    memo = _memo(plan.float8)
    found = memo.get(key)
    if found is None:
        repeat = hu.prefix.split(".", 1)[0]
        counts = Counter(recipes.get(f"{repeat}.{i}.{leaf}") for i in (hu.indices or range(hu.count)))
        found = memo[key] = tuple(counts.items())
    return found  # type: ignore[no-any-return]


def float8_peak(device: DeviceProfile, recipe: str | None) -> float | None:
    """The dense peak (TFLOP/s) a recipe's products run at on `device`; None where they run at the
    params dtype's: no recipe, no such tensor cores, or host-bound ranks (CPU), where torchao emulates
    float8 in the params dtype and is no faster."""
    if recipe is None or device.kernel_us is not None:
        return None
    return device.mx_tflops if recipe == "mxfp8" else device.fp8_tflops


def compiled(plan: PlanIR, device: DeviceProfile, hu: HeldUnit) -> bool:
    """`compile = blocks` compiles this unit: a block's (not the embedding's or the head's), on a device
    whose time the model prices (host-bound ranks' kernel counts under compile are not measured)."""
    return plan.compile == "blocks" and bool(hu.prefix) and device.kernel_us is None


def product_seconds(plan: PlanIR, device: DeviceProfile, hu: HeldUnit, mm: Matmul) -> float:
    """One copy's product `mm` (averaged over the copies `hu` stands for): the roofline at the params
    dtype's peak, or at its recipe's float8 peak with float8 operands; a compiled block's faster."""
    factor = COMPILED_MATMUL if compiled(plan, device, hu) else 1.0
    total = 0.0
    for recipe, copies in leaf_recipes(plan, hu, mm.leaf):
        peak = float8_peak(device, recipe)
        if peak is None:
            seconds = matmul_seconds(device, mm, DTYPES[plan.dtype], device.tflops * factor)
        else:
            seconds = matmul_seconds(device, mm, FP8_BYTES, peak * FLOAT8_MATMUL * factor)
        total += copies * seconds
    return total / max(1, hu.count)


def weight_gathered_in_float8(plan: PlanIR, recipe: str | None) -> bool:
    """FSDP2 hands the layer a float8 weight (`all_gather = fp8`): torchao casts it before the gather."""
    return plan.float8 is not None and plan.float8.gather and recipe == TENSORWISE


def _cast_elements(plan: PlanIR, mm: Matmul, recipe: str, rerun: bool) -> int:
    """Elements torchao's float8_linear casts for one product of a converted layer (m tokens, k in,
    n out): forward its input and weight; backward the output gradient twice (for the input's and the
    weight's gradient), the weight and the input again. A weight gathered in float8 is cast already.
    A recomputed forward (`rerun`) casts its input and weight again."""
    weight = 0 if weight_gathered_in_float8(plan, recipe) else mm.k * mm.n
    forward = mm.m * mm.k + weight
    return forward if rerun else 2 * forward + 2 * mm.m * mm.n


def cast_seconds(plan: PlanIR, device: DeviceProfile, hu: HeldUnit, mm: Matmul, rerun: bool = False) -> float:
    """One copy's float8 casts around product `mm` per microbatch (forward and backward, or a rerun
    forward's), averaged over the copies: each cast reads the high-precision tensor twice (its amax,
    then the scaled cast) and writes it in float8, through device memory. None where not converted,
    or on a device without `hbm` (CPU: the emulation's casts are in its kernels' host time)."""
    if not device.hbm_gbps:
        return 0.0
    w = DTYPES[plan.dtype]
    moved = sum(copies * _cast_elements(plan, mm, recipe, rerun) * (2 * w + FP8_BYTES)
                for recipe, copies in leaf_recipes(plan, hu, mm.leaf) if float8_peak(device, recipe) is not None)
    return moved / max(1, hu.count) / (device.hbm_gbps * 1e9)


def float8_weights(plan: PlanIR, hu: HeldUnit) -> tuple[int, int, int]:
    """The linear weights of `hu`'s copies FSDP2 all-gathers in float8 (`all_gather = fp8`), on one
    device before ZeRO: (elements over every copy, weight tensors over every copy, the fewest
    elements one copy has: what a gathered block holds at least in float8)."""
    if plan.float8 is None or not plan.float8.gather:
        return 0, 0, 0
    per_copy: Counter[int] = Counter()  # copy (block index, 0 at the top level) -> elements
    tensors = 0
    copies = (hu.indices or range(hu.count)) if hu.prefix else (0,)
    for leaf in hu.unit.leaves:
        weight = next((t for t in leaf.params if t.name == "weight"), None)
        if leaf.kind != "linear" or weight is None:
            continue
        numel = math.prod(plan.local_shape(weight, hu.placement(leaf)))
        for copy in _gathered_copies(plan, hu, ".".join(leaf.path), copies):
            per_copy[copy] += numel
            tensors += 1
    return sum(per_copy.values()), tensors, min((per_copy[c] for c in copies), default=0)


def _gathered_copies(plan: PlanIR, hu: HeldUnit, path: str, copies: Iterable[int]) -> tuple[int, ...]:
    """The copies (block indices) of linear `path` whose weight FSDP2 gathers in float8; by path
    alone, so kept with the plan's Float8Plan (every layout of one search shares it)."""
    assert plan.float8 is not None
    key = ("gathered", hu.prefix.split(".", 1)[0] if hu.prefix else "", hu.indices, hu.count, path)
    memo = _memo(plan.float8)
    found = memo.get(key)
    if found is None:
        recipes = _recipes(plan.float8)
        found = memo[key] = tuple(
            c for c in copies
            if weight_gathered_in_float8(plan, recipes.get(f"{hu.prefix.split('.', 1)[0]}.{c}.{path}" if hu.prefix else path)))
    return found  # type: ignore[no-any-return]


def float8_flops(plan: PlanIR) -> tuple[int, int]:
    """(matmul flops per token in a float8 recipe, all matmul flops per token) of the whole model's
    forward, unsharded (the attention core's products among the latter: they stay in the params dtype)."""
    from meshllm_dsl import primitives
    from meshllm_dsl.ir import Repeat

    recipes = _recipes(plan.float8) if plan.float8 is not None else {}
    converted = total = 0
    for item in plan.model.items:
        units = item.body if isinstance(item, Repeat) else (item,)
        for unit in units:
            work = primitives.of(unit).work(plan, HeldUnit(unit, "", 1, (), None), plan.seq, plan.seq, 1, True)
            for mm in work.matmuls:
                paths = ([f"{item.name}.{i}.{mm.leaf}" for i in range(item.count)] if isinstance(item, Repeat)
                         else [mm.leaf])
                total += mm.flops * len(paths)
                converted += mm.flops * sum(1 for p in paths if mm.leaf and p in recipes)
    return converted // plan.seq, total // plan.seq


def kept_in_params_dtype(plan: PlanIR) -> list[str]:
    """What of the model's matmuls stays in the params dtype under its Float8Plan, in words: the
    skipped layers (as templates, `blocks.*.attn.q`) and the attention core."""
    from meshllm_dsl import primitives

    if plan.float8 is None:
        return []
    kept = _folded([path for path, _ in plan.float8.skipped], plan)
    if any(primitives.of(unit).recomputed_core for _, unit, _ in plan.model.leaves()):
        kept.append("the attention core")
    return kept


def _folded(paths: list[str], plan: PlanIR) -> list[str]:
    """Leaf paths folded over the blocks: `blocks.0` for every linear of block 0, `blocks.*.attn.k` for
    one layer of every block, `blocks.{2,3}.mlp.up` for some."""
    reps = {r.name: r for r in plan.model.repeats}
    blocks: dict[str, dict[str, list[str]]] = {}  # repeat -> path in the block -> block indices
    top: list[str] = []
    for path in paths:
        parts = path.split(".")
        if parts[0] in reps and parts[1].isdigit():
            blocks.setdefault(parts[0], {}).setdefault(".".join(parts[2:]), []).append(parts[1])
        else:
            top.append(path)
    out: list[str] = []
    for name, in_blocks in blocks.items():
        rep = reps[name]
        linears = {".".join(leaf.path) for unit in rep.body for leaf in unit.leaves if leaf.kind == "linear"}
        by_set: dict[tuple[str, ...], list[str]] = {}
        for rest, indices in in_blocks.items():
            by_set.setdefault(tuple(indices), []).append(rest)
        for indices, rests in by_set.items():
            which = "*" if len(indices) == rep.count else indices[0] if len(indices) == 1 else "{" + ",".join(indices) + "}"
            out += [f"{rep.name}.{which}"] if set(rests) == linears else [f"{rep.name}.{which}.{r}" for r in rests]
    return out + top


def best_matmul_tflops(device: DeviceProfile) -> float:
    """The highest peak (TFLOP/s, before `mfu`) any product of any plan reaches on `device` in the
    time model: a compiled block's float8 (or MX) product, or a compiled one in the params dtype."""
    if device.kernel_us is not None:
        return device.tflops
    float8 = [FLOAT8_MATMUL * p for p in (device.fp8_tflops, device.mx_tflops) if p is not None]
    return COMPILED_MATMUL * max([device.tflops, *float8])
