"""The plan checker is an ordered tuple of pure passes over a frozen context: the order is visible
and fixed, each pass computes the same result from the same context, nothing mutates the context,
and `match_path` answers without a checker."""

from __future__ import annotations

import attrs
import pytest
from helpers import ERRORS, EXAMPLES

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.checker.passes import CLEAN_ONLY, PASSES, PassContext, PassResult, run_passes
from meshllm_dsl.checker.paths import match_path
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import load

SPECS = [EXAMPLES / "llama2_70b.mesh", EXAMPLES / "gpt2_small.mesh", EXAMPLES / "tiny_llama_fsdp.mesh",
         ERRORS / "E0601_stages_do_not_cover_layers.mesh", ERRORS / "E0502_misspelt_path.mesh",
         ERRORS / "E0606_too_few_microbatches_1f1b.mesh"]


def _contexts(path):  # type: ignore[no-untyped-def]
    """The first pass's context for each plan of a spec that resolves."""
    result = check_file(path)
    decls = load(path)
    for item in decls.user(ast.PlanDecl):
        mesh, model = result.meshes.get(item.mesh.value), result.models.get(item.model.value)
        if mesh is not None and model is not None:
            yield PassContext(item, mesh, model)


def test_the_passes_run_in_this_order() -> None:
    assert [p.__name__ for p in PASSES] == [
        "settings", "recompute", "placements", "loss", "stages", "moe_routing", "schedule", "batch", "sequence_parallel",
        "context_parallel", "optimizer", "precision", "matmul", "packing", "expert_zero", "axis_roles", "pitfalls"]


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_each_pass_is_a_pure_function_of_its_context(path) -> None:  # type: ignore[no-untyped-def]
    contexts = list(_contexts(path))
    assert contexts
    for ctx in contexts:
        for p in PASSES:
            first, second = p(ctx), p(ctx)
            assert isinstance(first, PassResult)
            assert first == second, p.__name__
            ctx = ctx.then(p.__name__, first)
        assert [name for name, _ in ctx.results] == [p.__name__ for p in PASSES]


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_the_passes_give_the_checker_diagnostics_in_order(path) -> None:  # type: ignore[no-untyped-def]
    result = check_file(path)
    ours = [d for ctx in _contexts(path) for _, r in run_passes(ctx).results for d in r.diagnostics]
    assert [d for d in result.diagnostics if d in ours] == ours


def test_the_context_and_results_are_frozen() -> None:
    ctx = next(_contexts(EXAMPLES / "llama2_70b.mesh"))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ctx.results = ()  # type: ignore[misc]
    done = run_passes(ctx)
    assert ctx.results == ()  # running the passes made a new context
    _name, placements = done.results[2]
    with pytest.raises(TypeError):
        placements.values["top"] = {}  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        placements.diagnostics = ()  # type: ignore[misc]
    assert done["schedule"] == "1f1b" and not done.failed
    with pytest.raises(KeyError, match="no pass before"):
        ctx["schedule"]


def test_the_driver_runs_no_clean_only_pass_after_an_error() -> None:
    """`pitfalls` judges the placements of a clean plan only: after an error the driver skips it."""
    # too few microbatches (E0606), and the ffn split over an axis of size 1 (a W0705 on a clean plan)
    text = (ERRORS / "E0606_too_few_microbatches_1f1b.mesh").read_text()
    text = text.replace("axes pipeline = 3", "axes pipeline = 3, tensor = 1").replace(
        "    schedule 1f1b\n", "    schedule 1f1b\n    layout { ffn -> tensor }\n")
    result = check_text(text, "x.mesh")
    [decl] = load("x.mesh", text).user(ast.PlanDecl)
    ctx = PassContext(decl, result.meshes["line3"], result.models["twelve"])
    before = run_passes(ctx, PASSES[:-1])
    assert before.failed and PASSES[-1] in CLEAN_ONLY
    assert [d.code for d in PASSES[-1](before).diagnostics] == ["W0705"]  # what running it would say
    assert dict(run_passes(ctx).results)["pitfalls"] == PassResult()
    assert "W0705" not in [d.code for d in result.diagnostics]


def test_match_path_needs_no_checker() -> None:
    result = check_file(EXAMPLES / "llama2_70b.mesh")
    [model] = result.models.values()
    [decl] = load(EXAMPLES / "llama2_70b.mesh").user(ast.PlanDecl)
    rule = next(s for s in decl.body if isinstance(s, ast.ShardStmt) and str(s.path) == "blocks.*.attn.{q,k,v}")
    hits = match_path(rule.path, model)
    assert sorted(".".join(leaf.path) for leaf, _ in hits) == ["attn.k", "attn.q", "attn.v"]
    assert all(blocks is None for _, blocks in hits)
    assert match_path(rule.path.segments, model) == hits
    segs = rule.path.segments
    assert {b for _, b in match_path((segs[0], ast.PathSegment("index", (), 3), *segs[2:]), model)} == {frozenset([3])}
    assert match_path((segs[0], ast.PathSegment("index", (), 80), *segs[2:]), model) == []  # 80 blocks: 0-79
