"""What `recompute = blocks | ops [every N]` keeps and reruns, per held unit, for the planner.

`blocks` (full recomputation) keeps only each recomputed block's input; `ops` (torchtitan's
selective op, runtime/train/remat.py `recompute_ops`, whose docstring cites torchtitan's policy) keeps
that input, the attention kernel's outputs (out and the fp32 log-sum-exp) and the outputs of the
block's odd matrix products in forward order (in a Llama block q, v, gate and down), and reruns
the rest, the even products (k, o, up) included. With `every N` only blocks N - 1, 2 N - 1, ...
are recomputed; the others keep what they save.

The products are counted from each unit's `work` (its linear layers in forward order, as the
generated code calls them), a `Matmul` of `count` products as that many in a row: exact for dense
blocks (tests/planner/test_recompute_granularity_memory.py matches gloo ranks to the byte). Routed
experts are approximate: `work` gives all experts' gate, up and down products as one each, while
the runtime runs gate, up, down expert after expert, so which of them the policy keeps alternates
from one expert to the next.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.ir import DTYPES, Repeat
from meshllm_dsl.parallel.costs import FP32
from meshllm_dsl.planner.float8 import cast_seconds, product_seconds

if TYPE_CHECKING:
    from meshllm_dsl.ir import PlanIR, Stage
    from meshllm_dsl.parallel.costs import HeldUnit, Matmul
    from meshllm_dsl.parallel.devices import DeviceProfile

BLOCKWISE = ("blocks", "ops")  # the modes that wrap whole blocks (and so take `every N`)


def is_recomputed(plan: PlanIR, block: int) -> bool:
    """Whether block `block` of the repeat runs under `rt.recompute` / `rt.recompute_ops`."""
    return plan.recompute in BLOCKWISE and (block + 1) % plan.recompute_every == 0


def recomputed_copies(plan: PlanIR, hu: HeldUnit) -> int:
    """How many of the `hu.count` blocks a held block unit stands for are recomputed (0 at the top
    level, and for `none` / `attention`)."""
    if not hu.prefix or plan.recompute not in BLOCKWISE:
        return 0
    return sum(is_recomputed(plan, i) for i in hu.indices) if hu.indices else hu.count


def recomputed_in(plan: PlanIR, stage: Stage) -> int:
    """Recomputed blocks a stage holds: each keeps its input for the rerun."""
    return sum(is_recomputed(plan, i) for pc in stage.pieces if pc.start is not None and pc.stop is not None
               for i in range(pc.start, pc.stop))


def _products(plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> list[Matmul]:
    """The unit's linear products (not the attention core's) one by one, in forward order."""
    work = primitives.of(hu.unit).work(plan, hu, tokens, seq, micro, flash_attention)
    return [attrs.evolve(mm, count=1) for mm in work.matmuls if not mm.core for _ in range(mm.count)]


def _products_before(plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> int:
    """How many products the block runs before this unit's: the policy counts them over the whole
    checkpointed block (attention and MLP together), not per sublayer."""
    item = plan.model.item(hu.prefix.split(".", 1)[0])
    assert isinstance(item, Repeat), hu.prefix
    before = 0
    for unit in item.body:
        if unit.name == hu.unit.name:
            return before
        before += len(_products(plan, attrs.evolve(hu, unit=unit), tokens, seq, micro, flash_attention))
    raise AssertionError(f"{hu.unit.name} is not in {item.name}")


def kept_products(plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int,
                  flash_attention: bool = True) -> list[Matmul]:
    """The products of one recomputed copy of the unit whose outputs `ops` keeps: the odd ones of
    its block, counted from 1 (torchtitan's `mm_count % 2`: the even ones are recomputed)."""
    first = _products_before(plan, hu, tokens, seq, micro, flash_attention) + 1
    products = _products(plan, hu, tokens, seq, micro, flash_attention)
    return [mm for i, mm in enumerate(products, start=first) if i % 2 == 1]


def kept_bytes(plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool = True) -> int:
    """Bytes one recomputed copy of the unit keeps beyond its block's input, per microbatch: none
    under `blocks`; under `ops` the outputs of its kept products ([tokens, n] each: a column
    layer's shard, a row layer's full partial sum) and the attention kernel's output and fp32
    log-sum-exp."""
    if plan.recompute != "ops":
        return 0
    e = DTYPES[plan.dtype]
    out = sum(e * mm.m * mm.n for mm in kept_products(plan, hu, tokens, seq, micro, flash_attention))
    work = primitives.of(hu.unit).work(plan, hu, tokens, seq, micro, flash_attention)
    core = [mm for mm in work.matmuls if mm.core]
    if core:
        pv = core[-1]  # p v: [seq, head_dim] per (sequence, head), the kernel's output
        out += e * pv.m * pv.n * pv.count + FP32 * pv.m * pv.count  # and one log-sum-exp per row
    return out


def rerun_seconds(plan: PlanIR, device: DeviceProfile, hu: HeldUnit, forward_s: float, tokens: int, seq: int,
                  micro: int, flash_attention: bool = True) -> float:
    """Backward's rerun of one recomputed copy: its whole forward (`blocks`), or its forward less
    the attention kernel and the kept products (`ops`: the recomputed products, norms, rotary and
    activations); with the float8 casts of the products it reruns."""
    products = _products(plan, hu, tokens, seq, micro, flash_attention)
    if plan.recompute == "blocks":
        return forward_s + sum(cast_seconds(plan, device, hu, mm, rerun=True) for mm in products)
    work = primitives.of(hu.unit).work(plan, hu, tokens, seq, micro, flash_attention)
    kept = kept_products(plan, hu, tokens, seq, micro, flash_attention)
    skipped = (sum(product_seconds(plan, device, hu, mm) for mm in work.matmuls if mm.core)
               + sum(product_seconds(plan, device, hu, mm) for mm in kept))
    kept_leaves = {mm.leaf for mm in kept}
    casts = sum(cast_seconds(plan, device, hu, mm, rerun=True) for mm in products if mm.leaf not in kept_leaves)
    return max(0.0, forward_s - skipped) + casts


def core_rerun_seconds(plan: PlanIR, device: DeviceProfile, hu: HeldUnit, core_s: float, tokens: int, seq: int,
                       micro: int, flash_attention: bool = True) -> tuple[float, int]:
    """Backward's rerun of one copy's recomputed core (`recompute = attention`): the core, and the
    products its region reruns with it (the kind's `core_reruns`: mla's kv_b over the latents, the
    whole sequence's under context parallelism) with their float8 casts; (seconds, their products)."""
    leaves = primitives.of(hu.unit).core_reruns
    work = primitives.of(hu.unit).work(plan, hu, tokens, seq, micro, flash_attention)
    products = [mm for mm in work.matmuls if not mm.core and mm.leaf.rsplit(".", 1)[-1] in leaves]
    seconds = sum(product_seconds(plan, device, hu, mm) + cast_seconds(plan, device, hu, mm, rerun=True)
                  for mm in products)
    return core_s + seconds, sum(mm.count for mm in products)


def recomputed_text(plan: PlanIR) -> str:
    """What the step report says backward recomputes."""
    what = {"blocks": "the blocks", "attention": "the attention core",
            "ops": "the blocks but their attention and every other matmul output"}[plan.recompute]
    reruns = sorted({leaf for _, unit, _ in plan.model.leaves() for leaf in primitives.of(unit).core_reruns})
    if plan.recompute == "attention" and reruns:
        # the products its region reruns before the core (mla's kv_b: the region starts from the latents)
        what += " and " + ", ".join(f"`{leaf}`" for leaf in reruns) + " before it"
    n = plan.recompute_every
    return what if n == 1 else f"{what} (blocks {n - 1}, {2 * n - 1}, ...: every {n})"
