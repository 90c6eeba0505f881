"""`meshc export --to hf-ep-plan`: a checked mixture-of-experts plan as transformers' expert parallelism.

The file is the arguments of transformers' `DistributedConfig` as JSON (`DistributedConfig(**json)`):
`ep_plan` in transformers' styles (`grouped_gemm` on the stacked experts' parameters, each rank holding
experts / ep_size of them; `ep_dispatch_experts` on the experts module, whose tokens travel to their
experts' ranks and back by all-to-all), and the sizes that lay transformers' mesh out as the plan's:
`ep_size` the experts' axis, `fsdp_size` the ZeRO 3 axes, `dp_replicate_size` the other batch axes
(HSDP), `tp_size` 1. transformers' layout is fixed where the plan's is free, so everything else is a
located refusal (E1204-E1206), never a silently different plan:

- transformers shards the dense parameters with FSDP2 (resharding after forward) over ranks that hold
  the experts' (`ep_size` divides `fsdp_size * tp_size`), its expert groups the fastest-varying of them,
  inside replicas: the plan's ZeRO 3 over axes that end with the experts' one, after the other batch axes;
- its experts are not tensor-parallel and its expert groups hold the tensor-parallel ranks (`ep_size` a
  multiple of `tp_size`), so a plan that splits the experts over data beside any tensor parallelism has
  no counterpart;
- it routes dropless and adds no router z-loss: a `capacity` or `z_loss_coef` has none either;
- its `fsdp_mixed_precision` is one fixed policy (bf16 parameters, fp32 reductions): `precision` is not
  proven against it yet.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codegen.lower import model_description
from meshllm_dsl.codes import E1204, E1205, E1206
from meshllm_dsl.diagnostics import Diagnostic, SpecError
from meshllm_dsl.families import BY_ARCHITECTURE, PACKS
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import Declarations
from meshllm_dsl.interop.export import (
    _Findings,
    _placements,
    _plan_decl,
    _refuse_unexported_features,
    _stmt_span,
    _zero_span,
)
from meshllm_dsl.ir import Placement, PlanIR, Repeat, Unit

TARGET = "hf-ep-plan"  # meshc export's --to beside export.TARGETS

# transformers 5's experts module (MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts, DeepseekV3NaiveMoe,
# Glm4MoeNaiveMoe, GptOssExperts) holds every expert
# stacked in two parameters ([experts, 2 * ffn, hidden] and [experts, hidden, ffn]): `grouped_gemm`
# splits their dim 0. The checkpoint's per-expert tensors (experts.{e}.gate_proj ...) are converted into
# them on loading, so these names are the module's, not the checkpoint's (hf_key_map).
STACKED = ("gate_up_proj", "down_proj")
# GPT-OSS's experts module (GptOssExperts) holds their biases stacked beside them ([experts, 2 * ffn] and
# [experts, hidden]), split with them (GptOssConfig.base_model_ep_plan).
STACKED_BIASES = ("gate_up_proj_bias", "down_proj_bias")
# Where transformers 5 keeps that module in a block, for all these classes: a Mixtral checkpoint's
# `block_sparse_moe.experts.{e}.w1` is renamed on loading (its conversion mapping), so the checkpoint's
# names (hf_key_map) give only the block list's path.
EXPERTS = "mlp.experts"
# How the experts module's tokens reach the ranks holding their experts: all-to-all, as meshllm's runtime
# dispatches them (transformers' `auto` picks it too where the expert group holds several batches).
IMPLEMENTATION = "all_to_all"


@attrs.frozen
class EpExport:
    """What the file says, decided once."""

    plan: PlanIR
    hf_class: str
    axis: str  # the mesh axis the experts are split over
    ep_size: int  # its size
    dp_replicate_size: int  # the batch axes ZeRO does not shard over (HSDP's replicas)
    fsdp_size: int  # the ZeRO 3 axes
    ep_plan: tuple[tuple[str, str], ...]  # (module or parameter, transformers style)


def _ep_classes() -> str:
    return ", ".join(p.title for p in PACKS if p.ep_export)


def _hf_class(plan: PlanIR, desc: dict[str, Any]) -> str:
    """transformers' class of the model (its config.json's), refusing a model without routed experts or
    one whose class expert parallelism is not proven for."""
    import torch

    from meshllm_dsl.runtime.hf.weights import WeightsError, hf_config

    where = plan.model.span or plan.span
    units = [u for item in plan.model.items for u in (item.body if isinstance(item, Repeat) else (item,))]
    if not any(primitives.of(u).routes_experts for u in units):
        raise SpecError([Diagnostic(
            E1204, f"model `{plan.model.name}` has no mixture-of-experts layer for transformers' expert parallelism",
            where, label="no experts to split", help="export its tensor parallelism with `--to hf-tp-plan`")])
    try:
        hf_class = str(hf_config(model_description(plan), torch.float32)["architectures"][0])
    except WeightsError as err:
        raise SpecError([Diagnostic(
            E1204, f"model `{plan.model.name}` has no transformers class to export to", where,
            label="no Hugging Face model has these modules", note=str(err),
            help=f"export models of a family expert parallelism is proven for: {_ep_classes()}")]) from None
    pack = BY_ARCHITECTURE.get(hf_class)
    if pack is None or not pack.ep_export:
        raise SpecError([Diagnostic(
            E1204, f"model `{plan.model.name}` ({hf_class}) is not exported to transformers' expert parallelism yet",
            where, label="no tested export for this class",
            help=f"export models of a family expert parallelism is proven for: {_ep_classes()}")])
    return hf_class


# The moe layer's routing settings transformers' classes have no counterpart for (its experts take every
# routed token; its router loss is the load-balancing one alone), with the help each refusal gives.
_UNEXPORTED_ROUTING = {
    "capacity": ("each expert dropping the tokens past its capacity",
                 "transformers routes dropless: set `capacity = 0` in the model to export it"),
    "z_loss_coef": ("the router's z-loss added to the training loss",
                    "transformers' Mixtral / Qwen-MoE add the load-balancing loss only: drop `z_loss_coef` to export"),
}


def _routing(found: _Findings, units: list[Unit]) -> None:
    """Routing settings that transformers' models do not compute: refused once each."""
    for key, (what, help_) in _UNEXPORTED_ROUTING.items():
        unit = next((u for u in units if primitives.of(u).routes_experts and dict(u.attrs).get(key)), None)
        if unit is not None:
            found.refuse(E1206, f"`{key} = {dict(unit.attrs)[key]:g}` ({what}) is not exported to {found.where}",
                         unit.span or found.plan.model.span, label=what, help=help_)


def _layout(found: _Findings, desc: dict[str, Any]) -> tuple[str | None, list[tuple[str, str]]]:
    """(the experts' axis, the ep_plan's entries): every placement checked against what transformers'
    expert parallelism holds."""
    from meshllm_dsl.runtime.hf.weights import hf_key_map

    plan = found.plan
    axes: dict[tuple[str, ...], Any] = {}
    entries: list[tuple[str, str]] = []
    whole: list[str] = []  # blocks whose experts stay whole on every rank
    tensor: tuple[str, Placement] | None = None  # the first layer split by tensor parallelism
    for item, unit, leaf in plan.model.leaves():
        name = ".".join(leaf.path)
        experts_module = primitives.of(unit).routes_experts and leaf.path[-1] == "gate" and isinstance(item, Repeat)
        for idx, p in _placements(plan, item, leaf):
            if p.sharded and tensor is None:  # tensor parallelism (the experts' own ffn split too)
                tensor = name, p
            if experts_module and not p.experts:
                whole.append(idx)
            if not p.experts:
                continue
            axes.setdefault(p.experts, p.span)
            if not experts_module or entries:
                continue
            # the block list as the checkpoint names it ("model.layers"), then transformers 5's experts module;
            # `*` for every block: transformers keeps its class's own `layers.*` rules beside any per-block
            # override, so blocks placed apart are refused below rather than written per block
            key = hf_key_map(desc, [".".join((item.name, "0", *leaf.path, leaf.params[0].name))])
            path = f"{'.'.join(next(iter(key.values()))[0].split('.')[:2])}.*.{EXPERTS}"
            biased = found.pack is not None and found.pack.experts is not None and found.pack.experts.biased
            entries += [(f"{path}.{param}", "grouped_gemm") for param in STACKED + (STACKED_BIASES if biased else ())]
            entries.append((path, "ep_dispatch_experts"))
    if not axes:
        found.refuse(E1206, f"plan `{plan.name}` keeps every expert on every rank: {found.where} has nothing to split",
                     plan.span, label="no `experts -> AXIS` in the layout",
                     help="split the experts over the batch axis (`layout { batch -> data, experts -> data }`), "
                          "or export the tensor parallelism with `--to hf-tp-plan`")
        return None, []
    if tensor is not None:  # no counterpart beside expert parallelism
        name, p = tensor
        found.refuse(E1205, f"{found.where} cannot express the placement of `{name}`: "
                     f"{'the experts split by ' if p.experts else ''}{p.rule}({', '.join(p.axes)}) beside the experts "
                     f"split over {' x '.join(next(iter(axes)))}; transformers' experts are not tensor-parallel and "
                     "its expert groups hold the tensor-parallel ranks", p.span, label=f"{p.rule}({', '.join(p.axes)})",
                     help="keep every layer whole (drop the tensor rules from the layout) to export the "
                          "expert parallelism, or export the tensor parallelism alone with `--to hf-tp-plan`")
        return None, []
    if whole:
        found.refuse(E1205, f"{found.where} splits the experts of every block, but this plan keeps block "
                     f"{', '.join(whole)}'s whole", next(iter(axes.values())), label="the experts of some blocks split",
                     help="split the experts of every moe block alike (`experts -> AXIS` in the layout); "
                          "transformers merges its class's `layers.*` ep_plan into any per-block one")
        return None, []
    if len(axes) > 1 or len(next(iter(axes))) != 1:
        split, span = next((a, s) for a, s in axes.items() if len(a) != 1 or a != next(iter(axes)))
        found.refuse(E1205, f"{found.where} splits every layer's experts over one group of ranks, but this plan "
                     f"splits them over {' and '.join(' x '.join(a) for a in axes)}", span,
                     label=f"experts over {' x '.join(split)}",
                     help="split every moe layer's experts over one axis (`experts -> data`)")
        return None, []
    return next(iter(axes))[0], entries


def _data(found: _Findings, axis: str) -> tuple[int, int] | None:
    """(dp_replicate_size, fsdp_size): transformers' dense layout, FSDP2 resharding after forward over
    the ZeRO 3 axes (its expert groups the fastest-varying of them) inside replicas over the other batch
    axes (HSDP), both in the mesh's rank order; None after refusing another layout."""
    plan, decl = found.plan, found.decl
    names = [a.name for a in plan.mesh.axes]
    batch = sorted(plan.roles.batch, key=names.index)
    shard = sorted(plan.roles.batch_shard, key=names.index)
    if plan.zero != 3 or axis not in shard:
        what = f"ZeRO {plan.zero}" + (f" over {' x '.join(shard)}" if plan.zero else "")
        found.refuse(E1206, f"{what} is not exported to {found.where}: transformers shards the dense parameters "
                     f"with FSDP2 over ranks that hold the experts' (`{axis}`) and reshards them after forward "
                     "(ZeRO 3)", _zero_span(decl, plan.span), label="the dense parameters' data parallelism",
                     help=f"use `optimizer adamw {{ zero 3 }}` (or `zero 3 over ... {axis}`) to export the plan")
        return None
    replicate = [a for a in batch if a not in shard]
    if shard[-1] != axis or replicate and names.index(replicate[-1]) > names.index(shard[0]):
        order = f"`{axis}` last" + (f", after {' x '.join(replicate)}" if replicate else "")
        found.refuse(E1205, f"{found.where} lays its ranks out as (replicas, FSDP ranks, expert ranks fastest), but "
                     f"this mesh orders the batch axes {' x '.join(batch)} with ZeRO over {' x '.join(shard)} and the "
                     f"experts over `{axis}`", _stmt_span(decl, ast.LayoutStmt, plan.span), label="the batch and experts' axes",
                     help=f"order the mesh's axes with {order} (the last axis varies fastest)")
        return None
    sizes = dict((a.name, a.size) for a in plan.mesh.axes)
    return math.prod(sizes[a] for a in replicate), math.prod(sizes[a] for a in shard)


def analyze(plan: PlanIR, decls: Declarations | None) -> EpExport:
    """Decide the export of `plan` to transformers' expert parallelism, or raise SpecError with every refusal."""
    desc = model_description(plan)
    found = _Findings(plan, _plan_decl(decls, plan.name), TARGET)
    units = [u for item in plan.model.items for u in (item.body if isinstance(item, Repeat) else (item,))]
    _routing(found, units)
    if found.errors:  # before the class: transformers' config has no field for these, so none would be named
        raise SpecError(found.errors)
    hf_class = _hf_class(plan, desc)
    found.pack = BY_ARCHITECTURE[hf_class]
    _refuse_unexported_features(found)
    if plan.master_dtype is not None and plan.zero == 3:  # ZeRO 0 / 1 are refused above, and ZeRO 2 below
        # transformers' fsdp_mixed_precision is one fixed policy (bf16 parameters, fp32 reductions) over
        # whatever dtype the model is loaded in: not proven against the plan's precision yet
        found.refuse(E1206, f"`precision` (master weights in {plan.master_dtype}, parameters in {plan.dtype}) is not "
                     f"exported to {found.where}", _stmt_span(found.decl, ast.PrecisionStmt, plan.span),
                     label="mixed precision under FSDP2",
                     help="drop `precision` for the export; load the model in its master dtype and set "
                          "DistributedConfig's fsdp_mixed_precision yourself (bf16 parameters, fp32 reductions)")
    axis, entries = _layout(found, desc)
    data = _data(found, axis) if axis is not None else None
    if found.errors or axis is None or data is None:
        raise SpecError(found.errors)
    size = next(a.size for a in plan.mesh.axes if a.name == axis)
    return EpExport(plan, hf_class, axis, size, *data, tuple(entries))


def render(exp: EpExport) -> str:
    """`DistributedConfig`'s arguments: the mesh sizes, then the ep_plan."""
    config: dict[str, Any] = {"tp_size": 1}
    if exp.dp_replicate_size > 1:
        config["dp_replicate_size"] = exp.dp_replicate_size
    config |= {"fsdp_size": exp.fsdp_size, "ep_size": exp.ep_size, "ep_implementation": IMPLEMENTATION,
               "ep_plan": dict(exp.ep_plan)}
    return json.dumps(config, indent=2) + "\n"


def export_ep_plan(plan: PlanIR, decls: Declarations | None) -> tuple[str, tuple[Diagnostic, ...]]:
    """(file text, warnings) of `plan` as transformers' DistributedConfig arguments; SpecError with every refusal."""
    return render(analyze(plan, decls)), ()


__all__ = ["EXPERTS", "IMPLEMENTATION", "STACKED", "TARGET", "EpExport", "analyze", "export_ep_plan", "render"]
