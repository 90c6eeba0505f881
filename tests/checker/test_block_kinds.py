"""Models whose blocks are of several kinds (issue 38, item 2: DeepSeek-V3's and GLM-4.5's dense first
blocks): each kind is its own `repeat`, the repeats follow one another, their same-named layers are
distinct layers for the rules, `balanced` weighs each block's own work and the generated module has a
class per kind. Equivalence with the unsharded model: tests/integration/test_compiled_plans.py."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from meshllm_dsl import primitives
from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.checker.stages import _split_weighted
from meshllm_dsl.codegen.emit import render_plan
from meshllm_dsl.ir import Repeat

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_dense_moe.mesh"

MODEL = """
model m {
    vocab = 64
    hidden = 32
    embed = embedding(vocab, hidden)
    dense = repeat(DENSE) {
        n = rmsnorm(hidden)
        mlp = mlp(hidden, 256, act = swiglu)
    }
    blocks = repeat(SPARSE) {
        n = rmsnorm(hidden)
        mlp = moe(hidden, 16, 4, 2)
    }
    norm = rmsnorm(hidden)
    lm_head = linear(hidden, vocab)
}
"""


def _spec(plan: str, axes: str = "pipeline = 2", dense: int = 1, sparse: int = 3) -> str:
    model = MODEL.replace("DENSE", str(dense)).replace("SPARSE", str(sparse))
    return f"mesh g {{ axes {axes} }}\n{model}\nplan p on g for m {{\n    batch = 8\n    seq = 8\n{plan}\n}}\n"


def test_same_named_layers_of_two_repeats_are_placed_by_their_own_rules() -> None:
    # `dense.*.mlp.gate` and `blocks.*.mlp.gate` are two layers: a rule for one leaves the other unplaced.
    text = _spec("    shard dense.*.mlp.{gate,up} column(tensor)\n    shard dense.*.mlp.down row(tensor)",
                 axes="tensor = 2")
    result = check_text(text, "s.mesh")
    (e0501,) = [d for d in result.errors if d.code == "E0501"]
    assert e0501.note is not None
    assert "`blocks.{0-2}.mlp.gate`" in e0501.note and "dense" not in e0501.note
    ok = check_text(_spec("    shard dense.*.mlp.{gate,up} column(tensor)\n    shard dense.*.mlp.down row(tensor)\n"
                          "    shard blocks.*.mlp.{router,gate,up,down} replicate\n    shard {embed,lm_head} replicate",
                          axes="tensor = 2"), "s.mesh")
    assert ok.ok, ok.errors
    (plan,) = ok.plans.values()
    assert {c.repeat for c in plan.block_classes} == {"dense", "blocks"}
    assert plan.placement("dense.0.mlp.gate").rule == "column"
    assert plan.placement("blocks.2.mlp.gate").rule == "replicate"


def _stage_work(plan) -> list[int]:  # type: ignore[no-untyped-def]
    out = []
    for stage in plan.stages:
        work = 0
        for pc in stage.pieces:
            item = plan.model.item(pc.item)
            if isinstance(item, Repeat):
                work += (pc.stop - pc.start) * sum(primitives.of(u).flops_per_token(u, plan.seq) for u in item.body)
            else:
                work += primitives.of(item).flops_per_token(item, plan.seq)
        out.append(work)
    return out


@pytest.mark.parametrize(("dense", "sparse", "p"), [(1, 3, 2), (3, 5, 2), (2, 6, 4), (1, 1, 2)])
def test_balanced_weighs_each_kind_of_block_and_is_best_of_every_contiguous_split(dense: int, sparse: int, p: int) -> None:
    result = check_text(_spec("    microbatches = 4\n    stages over pipeline balanced", axes=f"pipeline = {p}",
                              dense=dense, sparse=sparse), "s.mesh")
    assert result.ok, result.errors
    (plan,) = result.plans.values()
    # Every block in exactly one stage, in order, a stage's range crossing from one repeat into the next.
    held = [(pc.item, i) for s in plan.stages for pc in s.pieces if pc.start is not None for i in range(pc.start, pc.stop)]
    assert held == [("dense", i) for i in range(dense)] + [("blocks", i) for i in range(sparse)]
    busiest = max(_stage_work(plan))
    # Brute force over every map of the blocks into p contiguous non-empty-where-needed runs.
    model = plan.model
    block_cost = {r.name: sum(primitives.of(u).flops_per_token(u, plan.seq) for u in r.body) for r in model.repeats}
    costs = [block_cost["dense"]] * dense + [block_cost["blocks"]] * sparse
    embed = primitives.of(model.items[0]).flops_per_token(model.items[0], plan.seq)
    tail = sum(primitives.of(u).flops_per_token(u, plan.seq) for u in model.items[-2:])
    best = None
    n = len(costs)
    for cuts in itertools.combinations(range(n + 1), p - 1):
        bounds = (0, *cuts, n)
        if any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            continue
        sizes = [bounds[k + 1] - bounds[k] for k in range(p)]
        if any(s == 0 for s in sizes[1:-1]):
            continue  # a middle stage holds nothing else: it needs a block
        work = [sum(costs[bounds[k]:bounds[k + 1]]) for k in range(p)]
        work[0] += embed
        work[-1] += tail
        best = max(work) if best is None else min(best, max(work))
    assert busiest == best


def test_split_weighted_is_optimal_on_random_costs() -> None:
    rng = random.Random(38)
    for _ in range(200):
        n, m = rng.randint(1, 9), rng.randint(1, 4)
        if n < m - 2:
            continue
        costs = [rng.randint(1, 50) for _ in range(n)]
        fixed = [rng.randint(0, 60) for _ in range(m)]
        least = [0 if (k == 0 or k == m - 1) else 1 for k in range(m)]
        if sum(least) > n:
            continue
        per = _split_weighted(costs, fixed, least)
        assert sum(per) == n and all(c >= lo for c, lo in zip(per, least))
        bounds = list(itertools.accumulate([0, *per]))
        got = max(fixed[k] + sum(costs[bounds[k]:bounds[k + 1]]) for k in range(m))
        best = None
        for cuts in itertools.combinations_with_replacement(range(n + 1), m - 1):
            b = (0, *cuts, n)
            sizes = [b[k + 1] - b[k] for k in range(m)]
            if any(s < lo for s, lo in zip(sizes, least)):
                continue
            load = max(fixed[k] + sum(costs[b[k]:b[k + 1]]) for k in range(m))
            best = load if best is None else min(best, load)
        assert got == best, (costs, fixed, per)


def test_generated_module_has_a_class_per_kind_and_stages_cross_repeats() -> None:
    result = check_file(EXAMPLE)
    assert result.ok, result.diagnostics
    (plan,) = result.plans.values()
    code = render_plan(plan, EXAMPLE.name, EXAMPLE.read_text())
    assert "class DenseBlock(nn.Module)" in code and "class Block(nn.Module)" in code
    assert [[(pc.item, pc.start, pc.stop) for pc in s.pieces] for s in plan.stages] == [
        [("embed", None, None), ("dense", 0, 1), ("blocks", 0, 1)],
        [("blocks", 1, 3), ("norm", None, None), ("lm_head", None, None)]]


def test_recompute_every_counts_within_each_repeat() -> None:
    result = check_text(_spec("    recompute = blocks every 2", axes="data = 1", dense=2, sparse=4), "s.mesh")
    assert result.ok, result.errors
    (plan,) = result.plans.values()
    code = render_plan(plan, "s.mesh", "")
    assert code.count("if (int(i) + 1) % 2 == 0:") == 2  # the dense loop and the moe loop
    too_many = check_text(_spec("    recompute = blocks every 5", axes="data = 1", dense=2, sparse=4), "s.mesh")
    assert [d.code for d in too_many.errors] == ["E0409"]


def test_twin_of_a_two_kind_model_keeps_its_blocks_and_stage_map() -> None:
    from meshllm_dsl.verify.twin import make_twin

    text = _spec("    microbatches = 2\n    stages over pipeline {\n        0: embed, dense, blocks[0:1]\n"
                 "        1: blocks[1:3], norm, lm_head\n    }")
    path = ROOT / "build" / "twin_block_kinds.mesh"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    result = check_text(text, str(path))
    twin_text, twin = make_twin(result, "p", str(path))
    assert twin.ok, twin.diagnostics
    assert "blocks[1:3]" in twin_text
