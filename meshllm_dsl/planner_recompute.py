"""What `recompute = blocks | ops [every N]` keeps and reruns, per held unit, for the planner.

`blocks` (full recomputation) keeps only each recomputed block's input; `ops` (torchtitan's
selective op, runtime/remat.py `recompute_ops`) keeps that input and the outputs of the block's
matrix products and of its attention kernel (out and the fp32 log-sum-exp), and reruns the rest.
With `every N` only blocks N - 1, 2 N - 1, ... are recomputed; the others keep what they save.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm_dsl import primitives
from meshllm_dsl.ir import DTYPES

if TYPE_CHECKING:
    from meshllm_dsl.devices import DeviceProfile
    from meshllm_dsl.ir import PlanIR, Stage
    from meshllm_dsl.planner import HeldUnit

FP32 = 4
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


def kept_bytes(plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool = True) -> int:
    """Bytes one recomputed copy of the unit keeps beyond its block's input, per microbatch: none
    under `blocks`; under `ops` every matmul's output ([tokens, n] per product: a column layer's
    shard, a row layer's full partial sum) and the attention kernel's output and fp32 log-sum-exp."""
    if plan.recompute != "ops":
        return 0
    e = DTYPES[plan.dtype]
    work = primitives.of(hu.unit).work(plan, hu, tokens, seq, micro, flash_attention)
    out = sum(e * mm.m * mm.n * mm.count for mm in work.matmuls if not mm.core)
    core = [mm for mm in work.matmuls if mm.core]
    if core:
        pv = core[-1]  # p v: [seq, head_dim] per (sequence, head), the kernel's output
        out += e * pv.m * pv.n * pv.count + FP32 * pv.m * pv.count  # and one log-sum-exp per row
    return out


def rerun_seconds(plan: PlanIR, device: DeviceProfile, hu: HeldUnit, forward_s: float, tokens: int, seq: int,
                  micro: int, flash_attention: bool = True) -> float:
    """Backward's rerun of one recomputed copy: its whole forward (`blocks`), or its forward less
    the kept matrix products (`ops`: the norms, rotary and activations, memory traffic)."""
    if plan.recompute == "blocks":
        return forward_s
    from meshllm_dsl.planner import matmul_seconds  # the planner imports this module

    work = primitives.of(hu.unit).work(plan, hu, tokens, seq, micro, flash_attention)
    return max(0.0, forward_s - sum(matmul_seconds(device, mm, DTYPES[plan.dtype]) for mm in work.matmuls))


def recomputed_text(plan: PlanIR) -> str:
    """What the step report says backward recomputes."""
    what = {"blocks": "the blocks", "attention": "the attention core",
            "ops": "the blocks but their matmul and attention outputs"}[plan.recompute]
    n = plan.recompute_every
    return what if n == 1 else f"{what} (blocks {n - 1}, {2 * n - 1}, ...: every {n})"
