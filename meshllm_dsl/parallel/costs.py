"""What a unit costs on one device under its placements: the toolkit the layer kinds' cost methods
(meshllm_dsl/primitives, `saved_bytes`, `backward_bytes`, `work`) and the planner share.

A held unit (HeldUnit: a unit a stage holds, with its leaves' placements), its shard sizes, the
matrix products its linear layers run (Matmul, Work) and each product's roofline on a device. The
planner (meshllm_dsl/planner/memory.py, comm.py, time.py: analyze.py's STEPS) adds up what the kinds charge; nothing here knows a layer
kind, so the kinds' modules import this one and never the planner.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

from meshllm_dsl.ir import DTYPES, REPLICATE, Leaf, Placement, PlanIR, Unit, UnitFlow

if TYPE_CHECKING:
    from meshllm_dsl.parallel.devices import DeviceProfile

FP32 = 4  # bytes of an fp32 element: master weights, moments, softmax statistics

# Fraction of peak dense flops the matmuls reach *before* communication and the bubble, which this
# model charges separately. Megatron-LM reports 50-60% of peak for large GEMM-bound transformer layers
# on A100 / H100 once communication is subtracted; end-to-end MFUs of 40-50% include the overheads we
# add back. 0.5 is the middle of that range.
MFU = 0.5

# A matmul's output is computed in tiles of TILE x TILE (cuBLAS / CUTLASS's usual 128 x 128 for
# large bf16 / fp16 products), one wave of them per `sms` at a time: a product with too few
# tiles leaves SMs idle in its last wave (NVIDIA's "wave quantization", Matrix Multiplication
# Background User's Guide). The efficiency that grows with the size of the product.
TILE = 128


@attrs.frozen
class Matmul:
    """One matrix product a unit's forward runs on one device: [m, k] x [k, n], `count` times (once
    per head and sequence for the attention core). Its backward runs two of the same size (the
    input's gradient and the weight's, or for the core the gradients of both operands)."""

    m: int
    n: int
    k: int
    count: int = 1
    core: bool = False  # the attention core (q k^T, p v): what `recompute = attention` runs again
    # Elements read and written per product where they are not its operands and result (a fused
    # attention kernel keeps its s x s scores on chip: q, k, v and the output only); None: m k + k n + m n.
    io: int | None = None
    leaf: str = ""  # a linear layer's leaf path in its unit (`attn.q`): what a float8 recipe converts

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count

    @property
    def elements(self) -> int:
        """Elements it moves to and from memory, all `count` products."""
        one = self.io if self.io is not None else self.m * self.k + self.k * self.n + self.m * self.n
        return one * self.count


@attrs.frozen
class Work:
    """What a unit's forward does on one device per microbatch, for the planner's time model
    (planner.unit_forward_seconds): its matrix products, and the bytes of table rows it reads
    without one (an embedding lookup is memory traffic, not a matmul)."""

    matmuls: tuple[Matmul, ...] = ()
    lookup_bytes: int = 0


@attrs.frozen
class HeldUnit:
    """A unit (or `count` identical blocks' copies of it) that a stage holds, with its placements."""

    unit: Unit
    prefix: str  # "blocks.0-3." for repeated units, "" at the top level
    count: int  # blocks of this block class in the stage (1 for top-level units)
    placements: tuple[tuple[str, Placement], ...]  # leaf path -> placement
    flow: UnitFlow | None
    tied_copy: bool = False  # the tied weight of a head, held here because the embedding is elsewhere
    last: bool = False  # the model's output layer (logits feed the loss)
    indices: tuple[int, ...] = ()  # the blocks of the repeat these copies are (per-block settings: a window)

    def placement(self, leaf: Leaf) -> Placement:
        return dict(self.placements).get(".".join(leaf.path), REPLICATE)



def axes_size(plan: PlanIR, p: Placement) -> int:
    return plan.mesh.size(*p.axes) if p.sharded else 1



def seq_size(plan: PlanIR) -> int:
    """How many ways sequence parallelism splits the residual stream (1 without it)."""
    return plan.sequence_size



def local_heads(plan: PlanIR, hu: HeldUnit) -> int:
    leaves = {leaf.name: leaf for leaf in hu.unit.leaves}
    q = leaves.get("qkv", leaves.get("q"))
    assert q is not None
    return int(hu.unit.attr("heads")) // axes_size(plan, hu.placement(q))  # type: ignore[arg-type]



def attention_core_bytes(plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int,
                         flash_attention: bool = True) -> int:
    """What the attention core itself saves beyond q, k, v and its output, per microbatch: the fp32
    log-sum-exp of a fused kernel, or the softmax probabilities (a s^2 b) without one. This is what
    selective recomputation (`recompute = attention`) stops keeping: the core's inputs q, k, v stay
    (the checkpoint holds them for the rerun) and its output is the o projection's saved input."""
    hq = local_heads(plan, hu)
    # (tokens = micro x s, or micro x s / c of the queries under context parallelism: their rows of
    # the scores meet all s keys.)
    if dict(hu.unit.attrs).get("softcap"):
        # Soft-capped logits run as plain autograd, never a fused kernel: per head the
        # tanh output, the fp32 softmax and the probabilities, s x s each.
        return (2 * DTYPES[plan.dtype] + FP32) * tokens * hq * seq
    if flash_attention:
        return FP32 * tokens * hq
    return DTYPES[plan.dtype] * tokens * hq * seq



def linear_matmuls(plan: PlanIR, hu: HeldUnit, tokens: int) -> tuple[Matmul, ...]:
    """[tokens, in] x [in, out] for each linear layer of the unit, in this device's shard of it (a
    tied head's from the table it multiplies by, split as the head's placement says). Sequence
    parallelism gathers the sequence before a column layer and after a row layer's product, so
    each runs over all the microbatch's tokens."""
    out = []
    for leaf in hu.unit.leaves:
        if leaf.kind != "linear":
            continue
        p = hu.placement(leaf)
        weight = next((t for t in leaf.params if t.name == "weight"), None)
        if weight is not None:
            rows, cols = plan.local_shape(weight, p)
        else:
            rows, cols = int(hu.unit.attr("out")), int(hu.unit.attr("in"))  # type: ignore[arg-type]
            if p.sharded and p.rule in ("column", "vocab_parallel"):
                rows //= axes_size(plan, p)
            elif p.sharded and p.rule == "row":
                cols //= axes_size(plan, p)
        out.append(Matmul(tokens, rows, cols, leaf=".".join(leaf.path)))
    return tuple(out)



def matmul_seconds(device: DeviceProfile, mm: Matmul, dtype_bytes: int, peak_tflops: float | None = None) -> float:
    """The roofline of one product: the slower of its flops at the device's matmul rate (peak x
    `mfu`, less the SMs its last wave of tiles leaves idle) and its operands and result through
    memory (`hbm`). Large products are compute-bound; thin ones (few tokens, a narrow shard) and
    an unfused attention's scores are bound by memory. `peak_tflops`: another peak than `tflops`
    (a float8 recipe's, a compiled block's; planner/float8.py)."""
    rate = (peak_tflops if peak_tflops is not None else device.tflops) * 1e12 * (device.mfu or MFU)
    if device.sms:
        tiles = mm.count * -(-mm.m // TILE) * -(-mm.n // TILE)
        waves = -(-tiles // device.sms)
        rate *= tiles / (waves * device.sms)
    seconds = mm.flops / rate
    if device.hbm_gbps:
        seconds = max(seconds, dtype_bytes * mm.elements / (device.hbm_gbps * 1e9))
    return seconds



# ---------------------------------------------------------------- experts (planner/moe.py models the rest)


def routed_pairs(tokens: int, top_k: int, experts: int, capacity: float) -> int:
    """(token, choice) pairs one forward of `tokens` tokens computes when routing is balanced:
    every pair (dropless, or a capacity factor >= 1), else each expert at its capacity."""
    pairs = tokens * top_k
    if not capacity:
        return pairs
    return min(pairs, experts * math.ceil(capacity * tokens * top_k / experts))



def expert_token_split(plan: PlanIR, hu: HeldUnit) -> tuple[str, ...]:
    """The tensor axes a moe unit's experts split over: each of their ranks routes 1 / |axes| of the
    tokens, which it splits off the whole ones and all-gathers the outputs of (runtime/moe/dispatch.py
    ExpertsParallel.experts)."""
    leaf = next((lf for lf in hu.unit.leaves if lf.name == "gate"), None)
    if leaf is None or not plan.roles.expert_token_split:
        return ()
    return tuple(a for a in hu.placement(leaf).experts if a in plan.roles.expert_token_split)


def routed_tokens(plan: PlanIR, hu: HeldUnit, tokens: int) -> int:
    """The tokens a rank routes of its `tokens`: 1 / |T| of them with the experts over tensor axes T."""
    split = expert_token_split(plan, hu)
    return tokens // plan.mesh.size(*split) if split else tokens


def expert_degree(plan: PlanIR, hu: HeldUnit) -> int:
    """Ranks the layer's experts are split over (`experts -> AXIS`: its stacked weights' experts dim)."""
    leaf = next(lf for lf in hu.unit.leaves if lf.name == "gate")
    return int(hu.unit.attr("experts")) // plan.local_shape(leaf.params[0], hu.placement(leaf))[1]  # type: ignore[arg-type]

