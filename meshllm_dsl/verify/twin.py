"""Tiny twins: the same plan with every dim shrunk to the smallest size that keeps its structure.

The twin keeps the mesh, every rule, the schedule and the stage map's shape; it shrinks each dim to
the least common multiple of the mesh-axis products it is split over (times a small factor), keeps
the GQA ratio (up to 2), gives each stage one block per original block range and shrinks the batch
to data x microbatches. The twin is rebuilt as .mesh text and checked again, so a twin is always a
plan the checker accepts and its divisibility structure is the original's.
"""

from __future__ import annotations

import math

from meshllm_dsl import primitives
from meshllm_dsl.checker import CheckResult, check_text
from meshllm_dsl.front import ast
from meshllm_dsl.front.fmt import format_module
from meshllm_dsl.front.load import load
from meshllm_dsl.ir import PlanIR, Repeat

FACTOR = 2
HEAD_DIM = 8


def _split_products(plan: PlanIR) -> dict[str, int]:
    """Logical dim -> lcm of the mesh-axis products it is split over anywhere in the plan."""
    out: dict[str, int] = {}
    placements = list(plan.top_placements) + [pl for c in plan.block_classes for pl in c.placements]
    leaves = {".".join(leaf.path): leaf for _, _, leaf in plan.model.leaves()}
    for path, p in placements:
        leaf = leaves.get(path)
        if leaf is None or not p.sharded:
            continue
        n = plan.mesh.size(*p.axes)
        for name, _ in leaf.in_units if p.rule == "row" else leaf.out_units:
            out[name] = math.lcm(out.get(name, 1), n)
    return out


def twin_values(plan: PlanIR) -> dict[str, int]:
    """New values for the model's dims (by their names in the model / family)."""
    split = _split_products(plan)
    model = plan.model
    values = dict(model.values)
    attn = next((u for item in model.items for u in (item.body if isinstance(item, Repeat) else (item,))
                 if primitives.of(u).caches_kv), None)  # the unit with (kv) heads
    twin: dict[str, int] = {}
    if attn is not None and attn.kind == "mla":
        # Latent attention: heads split as the plan splits them, small latents and head dims (even rope)
        twin["heads"] = FACTOR * split.get("heads", 1)
        twin["hidden"] = 16 * split.get("hidden", 1)
        twin.update(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
        if attn.attr("q_lora_rank"):
            twin["q_lora_rank"] = 8
    elif attn is not None:
        a = dict(attn.attrs)
        ratio = min(int(a["heads"]) // int(a["kv_heads"]), 2)  # type: ignore[call-overload]
        kv = split.get("kv_heads", 1) * 1
        heads = math.lcm(kv * ratio, split.get("heads", 1))
        if heads % kv or (heads // kv) > ratio * 2:
            kv = heads // ratio if heads % ratio == 0 else heads
        twin["heads"], twin["kv_heads"] = heads, kv
        twin["head_dim"] = HEAD_DIM
        twin["hidden"] = heads * HEAD_DIM
    else:
        twin["hidden"] = 16 * split.get("hidden", 1)
    twin["ffn"] = FACTOR * 8 * split.get("ffn", 1)
    twin["vocab"] = 16 * split.get("vocab", 1)
    twin["positions"] = 32
    if "vocab_used" in values and values["vocab_used"] != values.get("vocab"):
        twin["vocab_used"] = twin["vocab"] - 1  # keep a padded (masked) row in the twin
    reps = model.repeats
    if len(reps) == 1:  # (several repeats keep their counts: `layers` would not say which it sets)
        rep = reps[0]
        stages = max(1, len(plan.stages))
        per_stage = max(1, min(2, rep.count // stages))
        if plan.recompute_every > 1:
            # `recompute = ... every N` needs N blocks for one to be recomputed (and N - 1 not).
            per_stage = max(per_stage, min(rep.count // stages, -(-plan.recompute_every // stages)))
        twin["layers"] = stages * per_stage
    return {k: v for k, v in twin.items() if k in values}


def _rotary(plan: PlanIR) -> tuple[int, int] | None:
    """(rotary_dim, the twin's): the twin's heads are HEAD_DIM wide (twin_values), a partial rotary
    shrunk with them and kept partial and even; None where nothing reads it (no attention, mla)."""
    attn = next((u for item in plan.model.items for u in (item.body if isinstance(item, Repeat) else (item,))
                 if primitives.of(u).caches_kv), None)
    if attn is None or attn.kind == "mla":
        return None  # mla reads no per-frequency lists
    a = dict(attn.attrs)
    hd = int(a["head_dim"])  # type: ignore[call-overload]
    rot = int(a.get("rotary_dim") or hd)  # type: ignore[call-overload]
    return rot, HEAD_DIM if rot == hd else max(2, HEAD_DIM * rot // hd // 2 * 2)


def _twin_value(name: str, value: ast.Value, rotary: tuple[int, int] | None) -> ast.Value:
    """A setting's twin value: a partial rotary_dim shrunk with the heads, a per-frequency list cut to it."""
    if name == "rotary_dim" and rotary is not None and isinstance(value, ast.IntLit) and value.value == rotary[0]:
        return ast.IntLit(rotary[1], value.span)
    return _per_frequency(value, rotary)


def _per_frequency(value: ast.Value, rotary: tuple[int, int] | None) -> ast.Value:
    """A list with one number per rotary frequency (longrope's factors, rotary_dim / 2 of them) cut
    to the twin's rotary_dim / 2: evenly spaced picks, the first and the last kept."""
    if not isinstance(value, ast.ListLit) or rotary is None or len(value.items) != rotary[0] // 2 \
            or len(value.items) <= rotary[1] // 2:
        return value
    n, m = len(value.items), rotary[1] // 2
    if m == 1:
        return ast.ListLit((value.items[0],))
    return ast.ListLit(tuple(value.items[round(i * (n - 1) / (m - 1))] for i in range(m)))


def _twin_body(body: tuple[ast.LayerStmt, ...], rotary: tuple[int, int] | None) -> tuple[ast.LayerStmt, ...]:
    out: list[ast.LayerStmt] = []
    for stmt in body:
        if isinstance(stmt, ast.RepeatDecl):
            out.append(ast.RepeatDecl(stmt.name, stmt.count, _twin_body(stmt.body, rotary), stmt.span))
        else:
            c = stmt.call
            kwargs = tuple(ast.Setting(k.name, _twin_value(k.name.value, k.value, rotary), k.span) for k in c.kwargs)
            out.append(ast.LayerDecl(stmt.name, ast.Call(c.func, c.args, kwargs, c.span), stmt.span))
    return tuple(out)


def make_twin(result: CheckResult, plan_name: str, path: str,
              microbatches: int | None = None) -> tuple[str, CheckResult]:
    """The twin of `plan_name` in the file at `path` as .mesh text, and its check result.

    ``microbatches``: the twin's instead of the plan's (`meshc verify --microbatches`: fewer make
    a faster check of a big twin, whose time goes into the pipeline schedule's many small steps)."""
    plan = result.plans[plan_name]
    values = twin_values(plan)
    rotary = _rotary(plan)  # the twin's head_dim is HEAD_DIM (twin_values)
    decls = load(path)
    items: list[ast.Item] = []
    per_stage = values.get("layers", 0) // max(1, len(plan.stages))
    for item in [*decls.items]:
        if isinstance(item, ast.ModelDecl) and item.name.value == plan.model.name:
            given = {s.name.value for s in item.settings}
            settings = [ast.Setting(s.name, ast.IntLit(values[s.name.value])) if s.name.value in values
                        else ast.Setting(s.name, _twin_value(s.name.value, s.value, rotary), s.span, s.every)
                        for s in item.settings]
            settings += [ast.Setting(ast.Name(k), ast.IntLit(v)) for k, v in values.items() if k not in given]
            items.append(ast.ModelDecl(item.name, item.family, tuple(settings), _twin_body(item.body, rotary),
                                       item.span))
        elif isinstance(item, ast.PlanDecl) and item.name.value == plan_name:
            items.append(_twin_plan(item, plan, per_stage, microbatches))
        elif isinstance(item, (ast.ModelDecl, ast.PlanDecl)):
            continue
        else:
            items.append(item)
    text = format_module(ast.Module(tuple(items)))
    return text, check_text(text, f"{path} (tiny twin)")


def _twin_seq(plan: PlanIR) -> int:
    """8 tokens, or a multiple that splits over the sequence-parallel axes and into the 2 x |C|
    balanced chunks of the context axes C."""
    return math.lcm(8, plan.sequence_size, 2 * plan.context_size)


def _twin_plan(decl: ast.PlanDecl, plan: PlanIR, per_stage: int, microbatches: int | None = None) -> ast.PlanDecl:
    body: list[ast.PlanStmt] = []
    data = plan.data_size
    micro = plan.microbatches if microbatches is None else microbatches
    for s in decl.body:
        if isinstance(s, ast.Setting) and s.name.value == "batch":
            body.append(ast.Setting(s.name, ast.IntLit(data * micro)))
        elif isinstance(s, ast.Setting) and s.name.value == "microbatches" and microbatches is not None:
            body.append(ast.Setting(s.name, ast.IntLit(micro)))
        elif isinstance(s, ast.Setting) and s.name.value == "seq":
            body.append(ast.Setting(s.name, ast.IntLit(_twin_seq(plan))))
        elif isinstance(s, ast.ShardStmt) and any(seg.kind == "index" for seg in s.path.segments):
            body.append(s)  # per-block rules keep their block index (checked again on the twin)
        elif isinstance(s, ast.StagesStmt) and not s.balanced and per_stage:
            # (per_stage 0: the twin keeps the blocks, where `layers` does not set them, so the map too)
            entries = []
            block = 0
            for e in s.entries:
                items = []
                for it in e.items:
                    if it.start is not None:
                        items.append(ast.StageItem(it.name, block, block + per_stage))
                        block += per_stage
                    else:
                        items.append(it)
                entries.append(ast.StageEntry(e.index, tuple(items)))
            body.append(ast.StagesStmt(s.axis, s.virtual, False, tuple(entries)))
        else:
            body.append(s)
    if not any(isinstance(s, ast.Setting) and s.name.value == "seq" for s in body):
        body.append(ast.Setting(ast.Name("seq"), ast.IntLit(_twin_seq(plan))))
    if not any(isinstance(s, ast.Setting) and s.name.value == "batch" for s in body):
        body.append(ast.Setting(ast.Name("batch"), ast.IntLit(data * micro)))
    if microbatches is not None and not any(isinstance(s, ast.Setting) and s.name.value == "microbatches" for s in body):
        body.append(ast.Setting(ast.Name("microbatches"), ast.IntLit(micro)))
    return ast.PlanDecl(decl.name, decl.mesh, decl.model, tuple(body))
