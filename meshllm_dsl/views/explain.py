"""`meshc explain`: where every rank sits and what it holds, read off the checked plan (ir.PlanIR).

Three views: rank -> mesh coordinates -> pipeline stage, layers and shard index; the process group of
every axis (MeshIR.groups, the same groups the runtime builds with init_device_mesh); and per layer
the global and local shape of each parameter, its activation layouts and the collectives it issues.
Layouts are placements in DTensor's terms (parallel/dtensor.py), printed as torch prints a DTensor's, one
per axis of the mesh a stage's DTensors live on (the mesh without its pipeline axis).
"""

from __future__ import annotations

from typing import Any

from meshllm_dsl import primitives
from meshllm_dsl.front.names import ranges
from meshllm_dsl.ir import (
    Collective,
    Placement,
    PlanIR,
    Repeat,
    Unit,
    UnitFlow,
    param_dims,
    placement_of,
)
from meshllm_dsl.parallel.collectives import spec
from meshllm_dsl.parallel.dtensor import Layout, activation_dims, dtensor_placements, dtensor_text
from meshllm_dsl.parallel.layouts import seq_partial_grad
from meshllm_dsl.parallel.placements import activation_layout, fsdp_axes, spmd_mesh
from meshllm_dsl.planner.formatting import table_text
from meshllm_dsl.planner.units import stage_label


def shard_axes(plan: PlanIR) -> tuple[str, ...]:
    """Mesh axes any parameter is split over, in mesh order."""
    used = {a for _, p in plan.top_placements for a in p.axes}
    used |= {a for cls in plan.block_classes for _, p in cls.placements for a in p.axes}
    return tuple(a.name for a in plan.mesh.axes if a.name in used)


def rank_rows(plan: PlanIR) -> list[dict[str, Any]]:
    """One entry per global rank: coordinates, stages (with layers) and shard / replica indices."""
    mesh = plan.mesh
    sharding = shard_axes(plan)
    rows = []
    for rank in range(mesh.devices):
        coords = mesh.coords(rank)
        coord = coords[plan.roles.pipeline] if plan.roles.pipeline else 0
        stages = [s for s in plan.stages if s.coord == coord] if plan.roles.pipeline else list(plan.stages)
        shard = 0
        for a in sharding:
            shard = shard * mesh.size(a) + coords[a]
        replica = 0
        for a in plan.roles.batch:
            replica = replica * mesh.size(a) + coords[a]
        where = {}
        if mesh.hosts > 1:
            # torchrun numbers ranks node-major: node n holds ranks n*P .. n*P+P-1 (P per host).
            where = {"node": rank // mesh.devices_per_host, "local_rank": rank % mesh.devices_per_host}
        rows.append({
            "rank": rank, **where, "coords": coords, "stages": [s.index for s in stages],
            "layers": "; ".join(stage_label(plan, s) for s in stages),
            "shard": shard, "shards": mesh.size(*sharding) if sharding else 1,
            "replica": replica, "replicas": plan.data_size,
        })
    return rows


def _rule(p: Placement) -> str:
    return f"{p.rule}({', '.join(p.axes)})" if p.sharded else "replicate"


def _collective(c: Collective) -> str:
    s = spec(c.op)
    return f"{c.op}({', '.join(c.axes)}) at {c.where}: {s.forward} forward, {s.backward} backward"


def _activation(plan: PlanIR, layout: Layout) -> dict[str, Any]:
    """An activation boundary: its placements as DTensor prints them, and which dims they split."""
    whole = activation_layout(plan, layout)
    return {"placements": list(dtensor_placements(whole, spmd_mesh(plan), activation_dims(whole.feature()))),
            "layout": str(whole)}


def _boundaries(plan: PlanIR, flow: UnitFlow) -> list[dict[str, Any]]:
    """The unit's input, the layout after each of its leaves, and its output."""
    return [{"at": at, **_activation(plan, layout)}
            for at, layout in (("input", flow.input), *flow.inside, ("output", flow.output))]


def _unit_entries(plan: PlanIR, unit: Unit, placement: dict[str, Placement], flow: UnitFlow | None) -> dict[str, Any]:
    params: list[dict[str, Any]] = []
    mesh, fsdp = spmd_mesh(plan), fsdp_axes(plan)
    for leaf in unit.leaves:
        key = ".".join(leaf.path)
        p = placement.get(key, Placement("replicate"))
        if leaf.tie is not None:
            params.append({"name": "weight" if leaf.name == unit.name else f"{leaf.name}.weight", "tied_to": leaf.tie, "rule": _rule(p), "global": None, "local": None})
        for t in leaf.params:
            dim = p.tensor_dim(t)
            laid = p.layout(t, fsdp)
            entry = {"name": f"{leaf.name}.{t.name}" if leaf.name != unit.name else t.name,
                     "global": list(t.shape), "local": list(plan.local_shape(t, p)), "rule": _rule(p),
                     "split_dim": dim, "placements": list(dtensor_placements(laid, mesh, param_dims(t))),
                     "layout": str(laid)}
            summed = seq_partial_grad(plan, unit, leaf, t)
            if summed:
                # Sequence parallelism: each rank's gradient covers its slice of the sequence only.
                entry["grad_summed_over"] = list(summed)
                entry["rule"] += f"; gradient summed over {' x '.join(summed)}"
            if p.expert_dim(t) is not None:
                entry["rule"] += f"; experts over {' x '.join(p.experts)}"
            params.append(entry)
    collectives = [_collective(c) for c in flow.collectives] if flow else []
    # Then those the unit issues itself (expert parallelism's dispatch and combine), from its record.
    collectives += [_collective(c) for c in primitives.of(unit).unit_collectives(unit, placement)]
    return {
        "name": unit.name, "kind": unit.kind, "params": params,
        "input": str(flow.input) if flow else None, "output": str(flow.output) if flow else None,
        "activations": _boundaries(plan, flow) if flow else [],
        "collectives": collectives,
    }


def layer_entries(plan: PlanIR) -> list[dict[str, Any]]:
    """Per top-level unit, and per block class of the repeat, its units with shapes, layouts, collectives."""
    top = dict(plan.top_placements)
    flows = dict(plan.top_flows)
    out: list[dict[str, Any]] = []
    for item in plan.model.items:
        if isinstance(item, Repeat):
            for cls in plan.classes_of(item.name):
                out.append({
                    "blocks": f"{item.name} {ranges(list(cls.indices))}",
                    "units": [_unit_entries(plan, u, dict(cls.placements), dict(cls.flows).get(u.name)) for u in item.body],
                })
        else:
            out.append({"blocks": None, "units": [_unit_entries(plan, item, top, flows.get(item.name))]})
    return out


def explain_json(plan: PlanIR) -> dict[str, Any]:
    return {
        "plan": plan.name,
        "mesh": {"name": plan.mesh.name, "axes": {a.name: a.size for a in plan.mesh.axes}, "hosts": plan.mesh.hosts},
        "stages": [{"index": s.index, "pipeline_coord": s.coord, "layers": stage_label(plan, s), "params": s.numel}
                   for s in plan.stages],
        "placement": placement_of(plan.schedule) if plan.roles.pipeline else None,
        "ranks": rank_rows(plan),
        "groups": {a.name: plan.mesh.groups(a.name) for a in plan.mesh.axes},
        "dtensor_mesh": [a for a, _ in spmd_mesh(plan)],
        "layers": layer_entries(plan),
        "loss": f"vocab_parallel({', '.join(plan.roles.loss)})" if plan.roles.loss_parallel else "cross_entropy",
        "float8": None if plan.float8 is None else {
            "recipe": plan.float8.recipe, "layers": dict(plan.float8.layers), "kept": dict(plan.float8.skipped),
            "all_gather": "fp8" if plan.float8.gather else plan.dtype},
        "compile": plan.compile,
        "document_mask": plan.document_mask,
        "restart_positions": plan.restart_positions,
        "context_balance": plan.context_balance,
    }


def float8_lines(plan: PlanIR) -> list[str]:
    """Which linear layers train in float8 and which stay in the params dtype (and why), folded
    over the blocks: `blocks.*.attn.q` for a layer converted in every block."""
    if plan.float8 is None:
        return []
    lines = ["", f"float8 matmuls (torchao){', all-gathered in float8 by FSDP2' if plan.float8.gather else ''}"]
    by_recipe: dict[str, list[str]] = {}
    for pattern, recipe in plan.float8.patterns(plan.model).items():
        by_recipe.setdefault(recipe, []).append(pattern)
    for recipe, paths in by_recipe.items():
        lines.append(f"  {recipe}: {', '.join(paths)}")
    kept: dict[str, list[str]] = {}
    for path, why in plan.float8.skipped:
        kept.setdefault(why, []).append(path)
    for why, paths in kept.items():
        shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        lines.append(f"  in {plan.dtype}: {shown}: {why}")
    return lines


def _shape(s: list[int] | None) -> str:
    return "(" + ", ".join(str(x) for x in s) + ("," if s is not None and len(s) == 1 else "") + ")" if s is not None else "-"


def explain_text(plan: PlanIR) -> str:
    mesh = plan.mesh
    axes = " x ".join(f"{a.name} {a.size}" for a in mesh.axes)
    lines = [
        f"plan {plan.name}: {plan.model.name} on {mesh.name} ({mesh.devices} devices: {axes}"
        + (f", {mesh.hosts} hosts of {mesh.devices_per_host}" if mesh.hosts > 1 else "") + ")",
        "  rank order: the last axis varies fastest",
        "",
        "stages",
    ]
    stage_rows = [[str(s.index), str(s.coord), stage_label(plan, s), f"{s.numel:,}"] for s in plan.stages]
    lines += ["  " + x for x in table_text(["stage", plan.roles.pipeline or "pipeline", "layers", "parameters"], stage_rows,
                                       right={1, 3})]
    if plan.roles.pipeline and placement_of(plan.schedule) == "v":
        # Only where it is not the familiar loop: a V puts the first and the last stage on one rank.
        p = plan.pipeline_size
        lines.append(f"  placement: a V for `{plan.schedule}`: {plan.roles.pipeline} r holds stages r and {2 * p - 1} - r")
    lines += float8_lines(plan)
    if plan.compile == "blocks":
        lines += ["", "compile: each block with torch.compile (after float8, before FSDP2: torchtitan's order)"]
    lines += ["", "ranks"]
    sharding = shard_axes(plan)
    nodes = ["node", "local"] if mesh.hosts > 1 else []
    header = ["rank", *nodes, *(a.name for a in mesh.axes), "stage", "layers", "shard", "replica"]
    rows = []
    for r in rank_rows(plan):
        rows.append([str(r["rank"]), *([str(r["node"]), str(r["local_rank"])] if nodes else []),
                     *(str(r["coords"][a.name]) for a in mesh.axes),
                     ",".join(str(s) for s in r["stages"]), r["layers"],
                     f"{r['shard']}/{r['shards']}" + (f" over {' x '.join(sharding)}" if sharding else ""),
                     f"{r['replica']}/{r['replicas']}"])
    lines += ["  " + x for x in table_text(header, rows, right=set(range(len(mesh.axes) + len(nodes) + 1)))]
    lines += ["", "process groups (ranks that differ only along the axis)"]
    width = max(len(a.name) for a in mesh.axes)
    for a in mesh.axes:
        groups = mesh.groups(a.name)
        where = ("  (across nodes)" if mesh.crosses_hosts(a.name) else "  (in host)") if mesh.hosts > 1 else ""
        lines.append(f"  {a.name.ljust(width)}  " + " ".join("[" + ", ".join(map(str, g)) + "]" for g in groups) + where)
    stage_mesh = ", ".join(a for a, _ in spmd_mesh(plan))
    # A mesh of only a pipeline axis leaves DTensor no axis: every tensor is whole on its stage.
    placed = bool(stage_mesh)
    where = (f"placements as DTensor's over ({stage_mesh}){', the mesh of one stage' if plan.roles.pipeline else ''}"
             if placed else "every tensor whole on its stage")
    lines += ["", f"layers (global shape -> local shape on one device; {where})"]
    if plan.context_size > 1:
        n = plan.context_size
        lines.append(f"  (Shard(seq) over {' x '.join(plan.roles.context)} is balanced head-tail, not DTensor's contiguous "
                     f"split: rank i holds chunks i and {2 * n - 1} - i of {2 * n}; attention all-gathers k and v over it)")
    for entry in layer_entries(plan):
        indent = "  "
        if entry["blocks"] is not None:
            lines.append(f"  {entry['blocks']} (every block alike)")
            indent = "    "
        for u in entry["units"]:
            lines.append(f"{indent}{u['name']} ({u['kind']})")
            arows = [[a["at"], dtensor_text(a["placements"]), f"# {a['layout']}"] for a in u["activations"] if placed]
            lines += [indent + "  " + x for x in table_text(["at", "placements", "layout"], arows, right=set())[1:]]
            prows = []
            for p in u["params"]:
                if p.get("tied_to"):
                    prows.append([p["name"], f"tied to {p['tied_to']}", "", p["rule"], "", ""])
                else:
                    prows.append([p["name"], _shape(p["global"]), _shape(p["local"]), p["rule"],
                                  *((dtensor_text(p["placements"]), f"# {p['layout']}") if placed else ("", ""))])
            lines += [indent + "  " + x for x in table_text(["param", "global", "local", "rule", "placements", "layout"],
                                                        prows, right=set())[1:]]
            for c in u["collectives"]:
                lines.append(f"{indent}  collective: {c}")
    lines += ["", f"loss: {'vocab-parallel cross entropy over ' + ' x '.join(plan.roles.loss) if plan.roles.loss_parallel else 'cross entropy on full logits'}"]
    return "\n".join(lines) + "\n"
