"""`meshc export`: a checked plan as torch DTensor code or as transformers' `tp_plan` mapping.

Everything comes from the checked `PlanIR` (placements per leaf and block class, the loss, the ZeRO
stage and axes) and the module names transformers gives the model, which runtime/hf/weights.py already
knows (`hf_key_map`): nothing is re-derived from the spec. What the target cannot express is a
located diagnostic (E1201-E1206), never a silently different plan; what a `tp_plan` leaves to the
launcher (data parallelism) and the one layout it must change (gathered logits, as transformers has
no vocab-parallel loss) are warnings (W1201, W1202).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codegen.lower import _adamw_kwargs, docstring_text, literal, model_description
from meshllm_dsl.codes import E1201, E1202, E1203, E1204, E1205, E1206, W1201, W1202
from meshllm_dsl.diagnostics import Diagnostic, SpecError
from meshllm_dsl.families import BY_ARCHITECTURE, PACKS, exported_families
from meshllm_dsl.families.pack import FamilyPack
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import Declarations
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import Leaf, Placement, PlanIR, Repeat, Unit
from meshllm_dsl.primitives.linear import LINEAR

TARGETS = ("dtensor", "hf-tp-plan")

# transformers' class per checkpoint layout (runtime/hf/weights.py's `arch`) whose packs are proven for
# export: the first such pack's class, whose modules the names below are. Keyed by layout, not family:
# two families (gemma2, gemma3) share the gemma layout.
HF_CLASSES: dict[str, str] = {}
for _packs in exported_families().values():
    for _p in _packs:
        HF_CLASSES.setdefault(_p.checkpoint.layout, _p.architecture)


@attrs.frozen
class Entry:
    """One module's tensor-parallel style, in both targets' words."""

    module: str  # transformers' module path, `*` for every block ("model.layers.*.self_attn.q_proj")
    axis: str  # the mesh axis it is sharded over
    style: str  # the torch.distributed.tensor.parallel expression
    hf_style: str  # the style name in transformers' ALL_PARALLEL_STYLES
    why: str  # the plan's rule, for the generated comment


@attrs.frozen
class Export:
    """What both targets print, decided once."""

    plan: PlanIR
    arch: str
    blocks: str | None  # transformers' path of the block list ("model.layers")
    entries: tuple[Entry, ...]
    ties: tuple[tuple[str, str], ...]  # (module whose weight is re-tied, module that owns it)
    zero_axis: str | None  # fully_shard over this axis (ZeRO 2 / 3), else None
    loss_parallel: bool
    warnings: tuple[Diagnostic, ...]
    hf_class: str  # transformers' class of the checkpoint (the one with q / k norms, not LlamaForCausalLM, for them)


# ---------------------------------------------------------------- analysis


def _plan_decl(decls: Declarations | None, name: str) -> ast.PlanDecl | None:
    for decl in decls.user(ast.PlanDecl) if decls is not None else ():
        if decl.name.value == name:
            return decl  # type: ignore[no-any-return]
    return None


def _stmt_span(decl: ast.PlanDecl | None, kind: type, fallback: Span | None) -> Span | None:
    """Where a plan statement of `kind` is written (for the caret only; its meaning comes from the IR)."""
    for stmt in decl.body if decl is not None else ():
        if isinstance(stmt, kind):
            return stmt.span
    return fallback


def _setting_span(decl: ast.PlanDecl | None, key: str, fallback: Span | None) -> Span | None:
    for stmt in decl.body if decl is not None else ():
        if isinstance(stmt, ast.Setting) and stmt.name.value == key:
            return stmt.span
    return fallback


def _zero_span(decl: ast.PlanDecl | None, fallback: Span | None) -> Span | None:
    for stmt in decl.body if decl is not None else ():
        if isinstance(stmt, ast.OptimizerStmt) and stmt.zero is not None:
            return stmt.zero.span
    return fallback


def _seq_span(decl: ast.PlanDecl | None, fallback: Span | None) -> Span | None:
    for stmt in decl.body if decl is not None else ():
        if isinstance(stmt, ast.LayoutStmt):
            for entry in stmt.entries:
                if entry.dim.value == "seq":
                    return entry.span
    return fallback


def _param_names(item: Repeat | Unit, leaf: Leaf) -> list[str]:
    """Full parameter names of `leaf` as the generated program names them (block 0 for a repeat)."""
    prefix = (item.name, "0") if isinstance(item, Repeat) else ()
    return [".".join((*prefix, *leaf.path, t.name)) for t in leaf.params]


# (leaf kind, shard rule, what the leaf is) -> (torch's parallel style, transformers' tp_plan style).
# The head's column split gathers its logits (kept as DTensors under loss parallelism); a row split
# of the head has no style. A "gathered layer" is one of a sublayer whose model code needs every
# column of its projections on each rank (a fused qkv / gate_up it slices, a norm over the whole of
# q / k: `_gathered`): its column splits gather their outputs and its row split takes the replicated
# input and keeps its own columns, as transformers' own plans for those classes say
# (Phi3Config / Olmo2Config.base_model_tp_plan).
_STYLES: dict[tuple[str, str, str], tuple[str, str]] = {
    ("embedding", "vocab_parallel", "layer"): ("RowwiseParallel(input_layouts=Replicate())", "embedding_rowwise"),
    ("linear", "column", "layer"): ("ColwiseParallel()", "colwise"),
    ("linear", "column", "head"): ("ColwiseParallel(output_layouts=Replicate())", "colwise_gather_output"),
    ("linear", "column", "head, loss parallel"): ("ColwiseParallel(use_local_output=False)", "colwise_gather_output"),
    ("linear", "row", "layer"): ("RowwiseParallel()", "rowwise"),
    ("linear", "column", "gathered layer"): ("ColwiseParallel(output_layouts=Replicate())", "colwise_gather_output"),
    ("linear", "row", "gathered layer"): ("RowwiseParallel(input_layouts=Replicate())", "rowwise_split_input"),
}


# transformers' style for a replicated parameter whose gradient each rank computes only in part.
_PARTIAL_GRAD_STYLE = "replicated_with_grad_allreduce"


def _style(leaf: Leaf, p: Placement, role: str, target: str) -> tuple[str, str] | str:
    """(torch style, transformers style) for a sharded leaf in `role` (_STYLES), or why the target cannot say it."""
    if len(p.axes) != 1:
        return (f"it is split over {' x '.join(p.axes)} at once; a parallel style shards over one mesh "
                "dimension")
    style = _STYLES.get((leaf.kind, p.rule, role))
    if style is not None:
        return style
    what = "torch's parallel styles" if target == "dtensor" else "transformers' tp_plan styles"
    return f"`{p.rule}` on a {leaf.kind} layer has no counterpart in {what}"


@attrs.define
class _Findings:
    """The refusals (errors) and warnings one export collects before it raises or returns."""

    plan: PlanIR
    decl: ast.PlanDecl | None
    target: str
    pack: FamilyPack | None = None  # the architecture whose module names the export uses
    errors: list[Diagnostic] = attrs.field(factory=list)
    warnings: list[Diagnostic] = attrs.field(factory=list)

    @property
    def where(self) -> str:
        return {"dtensor": "DTensor", "hf-ep-plan": "transformers' expert parallelism"}.get(self.target,
                                                                                          "a transformers tp_plan")

    def refuse(self, code: str, message: str, span: Span | None, label: str, help: str) -> None:  # noqa: A002
        diag = Diagnostic(code, message, span or self.plan.span, label=label, help=help)
        if diag not in self.errors:  # the same module of two repeats (DeepSeek-V3's dense and moe blocks): once
            self.errors.append(diag)


def _exported_help() -> str:
    """"`a` (A1, A2, ...), `b` or `c`": the families export is proven for, from their packs."""
    named = [f"`{family}`" + (f" ({', '.join(p.title for p in packs)})" if len(packs) > 1 else "")
             for family, packs in exported_families().items()]
    return ", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else named[0]


def _checkpoint_layout(plan: PlanIR, desc: dict[str, Any], where: str) -> str:
    """The model's checkpoint layout (runtime/hf/weights.py's `arch`), refusing one export is not proven for."""
    from meshllm_dsl.runtime.hf.weights import WeightsError, model_arch

    try:
        arch = model_arch(desc)
    except WeightsError as err:
        raise SpecError([Diagnostic(
            E1204, f"model `{plan.model.name}` has no transformers module layout to export to",
            plan.model.span or plan.span, label="no Hugging Face model has these modules",
            note=str(err), help="export models of the `llama` (Llama, Mistral, Qwen2) or `gpt2` family",
        )]) from None
    # Exports are proven (tests/integration/test_export.py, test_export_families.py) for the packs marked
    # tp_export only: another layout would need its own module names and its own proof first.
    if arch not in HF_CLASSES:
        raise SpecError([Diagnostic(
            E1204, f"model `{plan.model.name}` (the {arch} checkpoint layout) is not exported to {where} yet",
            plan.model.span or plan.span, label="no tested export for this model",
            help=f"export models of the {_exported_help()} family; `meshc compile` and `meshc run` take this one",
        )])
    return arch


def _refuse_unproven_model(plan: PlanIR, desc: dict[str, Any], pack: FamilyPack | None, where: str) -> None:
    """Partial rotary outside a class whose config.json carries it (GLM-4.5's partial_rotary_factor), and
    mixture-of-experts layers in a class whose export is not proven."""
    from meshllm_dsl.runtime.model.description import partial_rotary

    partial = partial_rotary(desc)
    if partial is not None and (pack is None or not pack.checkpoint.partial_rotary):
        raise SpecError([Diagnostic(
            E1204, f"model `{plan.model.name}`: `{partial}` rotates part of each head (rotary_dim), which is not "
            f"exported to {where} yet", plan.model.span or plan.span, label="partial rotary",
            help="drop rotary_dim to export; `meshc compile` and `meshc run` take this model")])
    routes = any(primitives.of(u).routes_experts
                 for item in plan.model.items for u in (item.body if isinstance(item, Repeat) else (item,)))
    if routes and (pack is None or not pack.tp_export):
        raise SpecError([Diagnostic(
            E1204, f"model `{plan.model.name}` (mixture-of-experts layers) is not exported to {where} yet",
            plan.model.span or plan.span, label="no tested export for this model",
            help="its expert parallelism exports as transformers' `ep_plan` with `--to hf-ep-plan` ("
                 + ", ".join(p.title for p in PACKS if p.ep_export) + "); "
                 f"export models of the {_exported_help()} family; `meshc compile` and `meshc run` take this one",
        )])


def _refuse_unexported_features(found: _Findings) -> None:
    """Pipeline, sequence and context parallelism, recomputation, precision the targets cannot say."""
    plan, decl, where, refuse = found.plan, found.decl, found.where, found.refuse
    if plan.roles.pipeline is not None:
        refuse(E1201, f"{where} cannot express the pipeline over `{plan.roles.pipeline}`",
               _stmt_span(decl, ast.StagesStmt, plan.span), label="pipeline stages",
               help="export a plan without `stages` (tensor and data parallelism); torch.distributed.pipelining "
                    "splits a model into stages outside parallelize_module")
    if plan.roles.sequence:
        refuse(E1203, f"sequence parallelism over {' x '.join(plan.roles.sequence)} is not exported to {where}",
               _seq_span(decl, plan.span), label="Shard(seq) between sublayers",
               help="drop `seq -> ...` from the layout to export the tensor-parallel plan: a transformers model "
                    "computes its positions and mask from the activations' local shape, which Shard(seq) changes")
    if plan.roles.context:
        refuse(E1203, f"context parallelism over {' x '.join(plan.roles.context)} is not exported to {where}",
               _seq_span(decl, plan.span), label="every sequence split over the context axes",
               help="drop `seq -> ...` from the layout to export the plan; torch's context_parallel (ring "
                    "attention over DTensor) shards a transformers model's sequence outside parallelize_module")
    if plan.recompute != "none":
        refuse(E1206, f"`recompute = {plan.recompute}` is not exported to {where}",
               _setting_span(decl, "recompute", plan.span), label="activation recomputation",
               help="drop `recompute` for the export and wrap the blocks with torch.utils.checkpoint "
                    "(or `model.gradient_checkpointing_enable()`) yourself")
    if plan.float8 is not None:
        refuse(E1206, f"float8 matmuls (`matmul = {plan.float8.recipe}`) are not exported to {where}",
               _matmul_span(decl, plan.span), label="torchao float8 training",
               help="drop `matmul` for the export and convert the model yourself before parallelizing it: "
                    "torchao.float8.convert_to_float8_training (torchtitan's order: float8, then TP, then FSDP2)")
    if plan.compile != "none":
        refuse(E1206, f"`compile = {plan.compile}` is not exported to {where}",
               _setting_span(decl, "compile", plan.span), label="torch.compile per block",
               help="drop `compile` for the export and compile the model's blocks yourself "
                    "(`block.compile()` on each decoder layer, after parallelize_module)")
    if plan.document_mask:
        refuse(E1206, f"`pack = documents` is not exported to {where}",
               _setting_span(decl, "pack", plan.span), label="attention masked at document boundaries",
               help="drop `pack` (and `positions`) for the export and pass the documents' mask and position ids "
                    "with each batch yourself (transformers: packed sequences' position_ids)")
    _refuse_unexported_precision(found)


def _matmul_span(decl: ast.PlanDecl | None, default: Span | None) -> Span | None:
    """Where the plan asks for float8: the `matmul` setting, else a `precision PATH matmul` rule."""
    for stmt in decl.body if decl is not None else ():
        if isinstance(stmt, ast.PrecisionStmt):
            for s in stmt.settings:
                if s.name.value == "matmul":
                    return s.span
        if isinstance(stmt, ast.PrecisionRule):
            return stmt.span
    return default


def _refuse_unexported_precision(found: _Findings) -> None:
    """`precision` at ZeRO 0 / 1: master weights neither target holds that way."""
    plan, decl, where = found.plan, found.decl, found.where
    if plan.master_dtype is not None and plan.zero == 1:
        found.refuse(E1206, f"`precision` at ZeRO 1 (the distributed optimizer: FSDP2 reducing gradients once a step) "
                     f"is not exported to {where}", _stmt_span(decl, ast.PrecisionStmt, plan.span),
                     label="sharded master weights",
                     help="use `zero 2` for the export: fully_shard with reshard_after_forward=False and "
                          "MixedPrecisionPolicy holds the same state, and reduce-scatters every microbatch's gradients")
    elif plan.master_dtype is not None and plan.zero == 0:
        found.refuse(E1206, f"`precision` at ZeRO {plan.zero} (fp32 parameters under torch.autocast) is not exported "
                     f"to {where}", _stmt_span(decl, ast.PrecisionStmt, plan.span), label="mixed precision by autocast",
                     help=f"run the exported model under `torch.autocast(device, dtype=torch."
                          f"{'bfloat16' if plan.dtype == 'bf16' else 'float16'})` "
                          "yourself, or use `zero 2` / `zero 3` (fully_shard's MixedPrecisionPolicy)")


def _zero_axis(found: _Findings) -> str | None:
    """The axis fully_shard shards over (dtensor, ZeRO 2 / 3); refusals and warnings for the rest."""
    plan, decl, refuse = found.plan, found.decl, found.refuse
    batch, shard = plan.roles.batch, plan.roles.batch_shard
    if found.target != "dtensor":
        if batch:
            found.warnings.append(Diagnostic(
                W1202, f"a tp_plan holds tensor parallelism only: data parallelism over "
                f"{' x '.join(batch)} (ZeRO {plan.zero}) is left out", _zero_span(decl, plan.span),
                label="not in the tp_plan",
                help="give the data axes to transformers' DistributedConfig (dp / fsdp sizes) when loading"))
        return None
    if plan.zero == 1:
        refuse(E1202, "ZeRO 1 (optimizer states sharded, weights and gradients whole) has no counterpart "
               "in fully_shard", _zero_span(decl, plan.span), label="ZeRO stage 1",
               help="use `zero 2` (fully_shard with reshard_after_forward=False) or `zero 3` "
                    "(reshard_after_forward=True): FSDP2 shards gradients with the optimizer states")
    elif plan.zero in (2, 3) and len(shard) != 1:
        refuse(E1206, f"ZeRO {plan.zero} over {' x '.join(shard)}: the export shards over one "
               "mesh axis", _zero_span(decl, plan.span), label="several data axes",
               help="shard over one data axis (`zero 3 over data`)")
    elif plan.zero in (2, 3) and shard != batch:
        refuse(E1206, f"ZeRO {plan.zero} over {' x '.join(shard)} but the batch is split over "
               f"{' x '.join(batch)}: hybrid sharding is not exported",
               _zero_span(decl, plan.span), label="zero axes differ from the batch axes",
               help="shard over the batch axis itself")
    elif plan.zero in (2, 3):
        return shard[0]
    elif batch:
        refuse(E1206, f"data parallelism over {' x '.join(batch)} without ZeRO is not exported "
               "to DTensor", plan.span, label="gradients averaged over the data axes",
               help="add `zero 2` or `zero 3` to the optimizer (fully_shard averages the gradients), "
                    "or wrap the parallelized model in DistributedDataParallel yourself")
    return None


def _placements(plan: PlanIR, item: Repeat | Unit, leaf: Leaf) -> Iterator[tuple[str, Placement]]:
    """(block index, placement): `*` where every block of the repeat places the leaf alike (its classes
    differing elsewhere), else one per block of its class."""
    if isinstance(item, Repeat):
        classes = plan.classes_of(item.name)
        placed = [(cls, cls.placement(".".join(leaf.path))) for cls in classes]
        if len({(p.rule, p.axes, p.experts) for _, p in placed}) == 1:
            yield "*", placed[0][1]
            return
        for cls, p in placed:
            for idx in cls.indices:
                yield str(idx), p
    else:
        yield "", plan.placement(".".join(leaf.path))


def _unshardable(found: _Findings, leaf: Leaf, p: Placement, module: str, conv1d: bool) -> bool:
    """Refuse a sharded leaf whose transformers module cannot be sharded as the plan says; True if refused."""
    where = found.where
    if conv1d:
        found.refuse(E1204, f"`{'.'.join(leaf.path)}` is a transformers Conv1D ({module}), which "
                     f"{where} cannot shard", p.span, label=f"{p.rule}({', '.join(p.axes)}) on a Conv1D layer",
                     help="GPT-2 stores its projections as Conv1D ([in, out]): export GPT-2 plans with these "
                          "layers replicated (ZeRO 2 / 3 still shards them), or use `meshc compile`")
        return True
    return False


@attrs.define
class _Modules:
    """What the walk over the leaves builds: the entries, the ties and transformers' module paths."""

    entries: list[Entry] = attrs.field(factory=list)
    ties: list[tuple[str, str]] = attrs.field(factory=list)
    blocks: str | None = None  # transformers' path of the block list ("model.layers")
    top: dict[str, str] = attrs.field(factory=dict)  # our leaf path -> transformers module (top level), for ties
    # a fused module's path -> (our leaf, its placement) of every projection it holds, compared after the walk
    fused: dict[str, list[tuple[str, Placement]]] = attrs.field(factory=dict)
    tp_axes: dict[str, Span | None] = attrs.field(factory=dict)
    # Models of several repeats (DeepSeek-V3's dense blocks, then its moe ones) in one block list: a `*`
    # entry's path -> the repeats that wrote it and where; per repeat its layers and the module paths
    # (relative to a block) it has, so a `*` one repeat writes is checked against the others' layers
    star: dict[str, tuple[set[str], Span | None]] = attrs.field(factory=dict)
    layers: dict[str, range] = attrs.field(factory=dict)
    rels: dict[str, set[str]] = attrs.field(factory=dict)


def _gathered(found: _Findings, unit: Unit, module: str) -> tuple[str, str | None]:
    """(transformers' module, whether its sublayer is gathered) for one leaf's module: a projection the
    architecture stores fused (Phi-3's qkv_proj, gate_up_proj) is that fused module, whose output the
    model code slices by offsets of the whole width; a norm over the whole q / k projection (OLMo 2's
    qk_norm = full) needs every head's columns. Either way each rank needs the sublayer's whole
    projections, so transformers gathers them (and its own plans for these classes do so)."""
    parent, name = module.rsplit(".", 1) if "." in module else ("", module)
    fused = found.pack.fused_projections if found.pack is not None else {}
    sub = parent.rsplit(".", 1)[-1]
    if sub in fused and name in fused[sub][1]:
        return f"{parent}.{fused[sub][0]}", "fused"
    if sub in fused:
        return module, "fused"
    if dict(unit.attrs).get("qk_norm") == "full":
        return module, "qk_norm"
    return module, None


# Where a tensor-parallel style says more than one module's: transformers' own plans for these classes
# (DeepseekV3Config / GptOssConfig-like base_model_tp_plan) and torch's counterpart, if it has one.
_MLA_KV_A_STYLE = "mla_kv_a_proj"  # the latent's rotary key feeds every rank's heads: its gradient summed
_SINKS_STYLE = "colwise"  # a bare per-head parameter split as the heads are
_LOCAL_PARAMS_STYLE = "local_params"  # its owner's forward then runs on the local slice


# transformers' styles for the routed experts split by their ffn (Llama4Config.base_model_tp_plan's, for
# transformers 5's stacked experts module [experts, 2 x ffn, hidden] / [experts, hidden, ffn]): gate and up
# packed in one tensor whose halves each rank splits alike (`packed_colwise`: a strided shard of dim 1),
# down split by its input (`rowwise`: dim -1), and the module run on those local slices with its input's
# gradient and its output summed over the axis (`moe_tp_experts`).
_EXPERTS_TP = {"column": ("gate_up_proj", "packed_colwise"), "row": ("down_proj", "rowwise")}
_EXPERTS_TP_MODULE = "moe_tp_experts"


def _routed(found: _Findings, out: _Modules, unit: Unit, leaf: Leaf, hf_name: str, item: Repeat | Unit) -> bool:
    """A leaf of a mixture-of-experts layer's routed experts (per-expert names `{e}`, or GPT-OSS's stacked
    tensors `%`) or its routers: their entries (the experts split by ffn in a tp_plan) or refusals; True
    if the leaf is one of them (its entries are made here)."""
    if not primitives.of(unit).routes_experts:
        return False
    experts = "{e}" in hf_name or "%" in hf_name
    if not experts and leaf.path[-1] not in ("router", "shared_router"):
        return False  # a shared expert: a dense MLP of transformers' own (colwise / rowwise)
    title = found.pack.title if found.pack is not None else "this class"
    # GPT-OSS stores gate and up interleaved (and biased), which packed_colwise's halves do not split
    packed = found.pack is not None and found.pack.experts is not None and found.pack.experts.tensors is None
    name = ".".join(leaf.path)
    for idx, p in _placements(found.plan, item, leaf):
        if (p.sharded and experts and not p.experts and found.target == "hf-tp-plan" and packed and idx == "*"
                and len(p.axes) == 1 and p.rule in _EXPERTS_TP):
            _experts_tp(out, hf_name, name, p)
            continue
        if p.experts:
            found.refuse(E1205, f"{found.where} cannot express the placement of `{name}`: the experts split over "
                         f"{' x '.join(p.experts)} (expert parallelism)", p.span,
                         label=f"experts over {' x '.join(p.experts)}",
                         help="export the expert parallelism with `--to hf-ep-plan`, and the tensor parallelism of a "
                              "plan that keeps every expert on every rank here")
        elif p.sharded and experts:
            why = ("torch's parallel styles shard modules' 2-D weights, not transformers' stacked experts"
                   if found.target != "hf-tp-plan" else
                   f"transformers' {title} stores gate and up interleaved, which packed_colwise does not split"
                   if not packed else "a tp_plan splits every block's experts alike over one axis, by ffn")
            found.refuse(E1205, f"{found.where} cannot express the placement of `{name}`: the routed experts split "
                         f"by {p.rule}({', '.join(p.axes)}); {why}", p.span,
                         label=f"{p.rule}({', '.join(p.axes)}) on the routed experts",
                         help="keep the routed experts whole in the export (`shard blocks.*.mlp.{gate,up,down} "
                              "replicate`)" + ("" if found.target == "hf-tp-plan" or not packed else
                                               ", or export the plan with `--to hf-tp-plan` (`moe_tp_experts`)"))
        elif p.sharded:
            found.refuse(E1205, f"{found.where} cannot express the placement of `{name}`: a router split by "
                         f"{p.rule}({', '.join(p.axes)}); transformers' {title} scores every expert on every rank",
                         p.span, label=f"{p.rule}({', '.join(p.axes)}) on the router",
                         help=f"keep the router whole (`shard blocks.*.{name} replicate`)")
        else:
            continue
        break  # one refusal per leaf
    return True


def _experts_tp(out: _Modules, hf_name: str, name: str, p: Placement) -> None:
    """The entries of one routed experts' leaf split by ffn over one axis (every block alike): its stacked
    parameter's style and the experts module's."""
    from meshllm_dsl.interop.hf_ep import EXPERTS

    module = f"{'.'.join(hf_name.split('.')[:2])}.*.{EXPERTS}"  # "model.layers" + transformers 5's module
    param, style = _EXPERTS_TP[p.rule]
    why = f"{name}: {p.rule}({p.axes[0]})"
    out.tp_axes.setdefault(p.axes[0], p.span)
    for entry in (Entry(f"{module}.{param}", p.axes[0], "", style, why),
                  Entry(module, p.axes[0], "", _EXPERTS_TP_MODULE, f"{why} (the experts' sum over the axis)")):
        at = next((i for i, e in enumerate(out.entries) if e.module == entry.module), None)
        if at is None:
            out.entries.append(entry)
        elif why not in out.entries[at].why:
            out.entries[at] = attrs.evolve(out.entries[at], why=f"{out.entries[at].why}, {why}")


def _leaf_entries(found: _Findings, out: _Modules, item: Repeat | Unit, unit: Unit, leaf: Leaf,
                  hf_name: str, conv1d: bool, extra: dict[str, str]) -> None:
    """The entries (one per block class) of one leaf whose first parameter transformers calls `hf_name`
    (`extra`: its other parameters' transformers names by our name: `norm`, a per-head q / k norm's;
    `sinks`, GPT-OSS's attention sinks)."""
    plan = found.plan
    if _routed(found, out, unit, leaf, hf_name, item):
        return
    last = plan.model.items[-1]
    head_name = last.name if isinstance(last, Unit) and primitives.of(last) is LINEAR else None
    own, rel = hf_name.rsplit(".", 1)[0], ""
    module, gathered = _gathered(found, unit, own)
    first = 0  # transformers' layer number of the repeat's block 0 (DeepSeek-V3's blocks follow its dense ones)
    if isinstance(item, Repeat):
        parts = module.split(".")
        out.blocks = ".".join(parts[:2])  # "model.layers.0.self_attn.q_proj" -> "model.layers"
        first, rel = int(parts[2]), ".".join(parts[3:])
    else:
        out.top[leaf.path[-1]] = module
    is_head = leaf.path[-1] == head_name
    role = ("head, loss parallel" if is_head and plan.roles.loss_parallel else "head" if is_head
            else "gathered layer" if gathered else "layer")
    mla = found.pack is not None and found.pack.checkpoint.attention_kind == "mla"
    for idx, p in _placements(plan, item, leaf):
        layer = idx if idx in ("*", "") else str(first + int(idx))
        path = f"{out.blocks}.{layer}.{rel}" if isinstance(item, Repeat) else module

        def beside(hf: str, layer: str = layer) -> str:  # a sibling parameter's module in the same block
            return f"{out.blocks}.{layer}.{hf.split('.', 3)[3]}" if isinstance(item, Repeat) else hf

        if module != own:  # one projection of a fused module
            out.fused.setdefault(path, []).append((".".join(leaf.path), p))
        if not p.sharded or _unshardable(found, leaf, p, module, conv1d):
            continue
        if idx not in ("*", "") and found.target == "hf-tp-plan":
            found.refuse(E1205, f"{found.where} cannot express the placement of `{'.'.join(leaf.path)}` in block "
                         f"{idx} alone: transformers looks its rules up with every layer number replaced by `*`",
                         p.span, label=f"{p.rule}({', '.join(p.axes)}) in some blocks",
                         help="place every block of the repeat alike to export a tp_plan, or use `--to dtensor`, "
                              "which names each layer")
            continue
        if mla and leaf.path[-1] in ("q_a", "kv_a"):
            found.refuse(E1205, f"{found.where} cannot express the placement of `{'.'.join(leaf.path)}`: a latent "
                         "down-projection split; transformers' DeepSeek-V3 normalises and splits the whole latent",
                         p.span, label=f"{p.rule}({', '.join(p.axes)}) on a latent",
                         help="keep the latents whole (`shard blocks.*.attn.{q_a,kv_a} replicate`)")
            continue
        style = _style(leaf, p, role, found.target)
        if isinstance(style, str):
            found.refuse(E1205, f"{found.where} cannot express the placement of `{'.'.join(leaf.path)}`: {style}",
                         p.span, label=f"{p.rule}({', '.join(p.axes)})",
                         help="place it with `column`, `row` or `vocab_parallel` over one axis, or `replicate`")
            continue
        out.tp_axes.setdefault(p.axes[0], p.span)
        why = f"{'.'.join(leaf.path)}: {p.rule}({p.axes[0]})"
        same = next((i for i, e in enumerate(out.entries) if e.module == path), None)
        if same is not None and (out.entries[same].style, out.entries[same].axis) != (style[0], p.axes[0]):
            found.refuse(E1205, f"{found.where} cannot express the placement of `{'.'.join(leaf.path)}`: `{path}` is "
                         f"one rule for every layer, and {out.entries[same].why} shards it otherwise", p.span,
                         label=f"{p.rule}({', '.join(p.axes)})",
                         help="place the repeats' layers of one module alike")
            continue

        def put(entry: Entry, span: Span | None = p.span) -> None:
            """Add `entry`, or name `why` in the one already there (another projection of the same fused
            module, or the same module of another repeat); a `*` one is recorded for `_repeats_apart`."""
            at = next((i for i, e in enumerate(out.entries) if e.module == entry.module), None)
            if at is None:
                out.entries.append(entry)
            elif entry.why not in out.entries[at].why:
                out.entries[at] = attrs.evolve(out.entries[at], why=f"{out.entries[at].why}, {entry.why}")
            if isinstance(item, Repeat) and ".*." in entry.module:
                out.star.setdefault(entry.module, (set(), span))[0].add(item.name)

        put(Entry(path, p.axes[0], style[0], style[1], why))
        if "norm" in extra and not gathered and p.rule == "column":
            # Each rank normalises only its heads with the whole (replicated) per-head scale, so its
            # gradient is partial: summed over the axis, as Qwen3 / Gemma3Config.base_model_tp_plan do;
            # torch's SequenceParallel over the heads' dim of the norm's input does the same (the scale a
            # Replicate DTensor whose Partial gradient is reduced).
            heads = found.pack.head_norm_heads_dim if found.pack is not None else 2
            put(Entry(beside(extra["norm"]), p.axes[0], f"SequenceParallel(sequence_dim={heads}, use_local_output=True)",
                      _PARTIAL_GRAD_STYLE, f"{why} (its per-head norm)"))
        if "sinks" in extra and p.rule == "column":
            _sinks(found, put, p, why, beside(extra["sinks"]))
        if mla and leaf.path[-1] == "kv_b" and p.rule == "column":
            _mla_kv_a(found, put, p, why, beside(hf_name).rsplit(".", 2)[0])
        if leaf.path[-1] == head_name and plan.roles.loss_parallel and found.target == "hf-tp-plan":
            found.warnings.append(Diagnostic(
                W1201, f"`{head_name}`'s logits are gathered in the tp_plan: transformers has no "
                "vocab-parallel loss", p.span, label="exported as colwise_gather_output",
                help="the loss is the same; each rank then holds the full logits. `--to dtensor` keeps "
                     "them sharded (loss_parallel)"))
    if leaf.tie is not None and plan.placement(leaf.tie).sharded and leaf.tie in out.top:
        out.ties.append((module, out.top[leaf.tie]))


def _sinks(found: _Findings, put: Callable[[Entry], None], p: Placement, why: str, sinks: str) -> None:
    """GPT-OSS's attention sinks (one per head, a bare parameter of the attention) split as the heads are,
    the attention's forward on its local slice (transformers' `local_params`, as its plans for classes
    with sinks say); torch's parallel styles shard modules, not a bare parameter."""
    if found.target != "hf-tp-plan":
        found.refuse(E1205, f"{found.where} cannot express the heads split by {p.rule}({', '.join(p.axes)}) in "
                     "an attention with sinks (one per head, a bare parameter of the attention module, which "
                     "parallelize_module's styles do not shard)", p.span, label=f"{p.rule}({', '.join(p.axes)})",
                     help="export it with `--to hf-tp-plan` (transformers' `local_params`), or keep the attention "
                          "whole (`shard blocks.*.attn.{q,k,v,o} replicate`)")
        return
    put(Entry(sinks, p.axes[0], "", _SINKS_STYLE, f"{why} (its heads' sinks)"))
    put(Entry(sinks.rsplit(".", 1)[0], p.axes[0], "", _LOCAL_PARAMS_STYLE, f"{why} (the attention's forward on its sinks' slice)"))


def _mla_kv_a(found: _Findings, put: Callable[[Entry], None], p: Placement, why: str, attn: str) -> None:
    """DeepSeek-V3's kv latent (kv_a_proj_with_mqa, whole on every rank) ends in the rotary key, which
    every rank's heads read past the split kv_b_proj: its gradient is partial, summed over the axis by
    transformers' `mla_kv_a_proj`; torch's parallel styles have no counterpart."""
    kv_a = found.pack.checkpoint.attn[1]["kv_a"] if found.pack is not None else "kv_a_proj_with_mqa"
    if found.target != "hf-tp-plan":
        found.refuse(E1205, f"{found.where} cannot express the heads split by {p.rule}({', '.join(p.axes)}) in "
                     f"multi-head latent attention: the whole latent's rotary key ({kv_a}) feeds every rank's heads, "
                     "and no parallel style sums its gradient", p.span, label=f"{p.rule}({', '.join(p.axes)})",
                     help="export it with `--to hf-tp-plan` (transformers' `mla_kv_a_proj`), or keep the "
                          "attention whole (`shard blocks.*.attn.{q_b,kv_b,o} replicate`)")
        return
    put(Entry(f"{attn}.{kv_a}", p.axes[0], "", _MLA_KV_A_STYLE, f"{why} (the latent's rotary key)"))


def _fused_alike(found: _Findings, out: _Modules) -> None:
    """A fused module is one tensor sharded by one style: the projections it holds must be placed alike.
    The checker already refuses q / k / v or gate / up placed apart (E0402, as attention and the gated
    product combine them); this keeps the export from writing one style for parts it would not hold."""
    for path, parts in out.fused.items():
        first_leaf, first = parts[0]
        for leaf, p in parts[1:]:
            if (p.rule, p.axes) != (first.rule, first.axes):
                title = found.pack.title if found.pack is not None else "this"
                found.refuse(E1205, f"{found.where} cannot express the placement of `{leaf}`: {title}'s "
                             f"checkpoint holds {', '.join(f'`{n}`' for n, _ in parts)} in one tensor ({path}), "
                             f"sharded by one style, but `{leaf}` is {p.rule}({', '.join(p.axes)}) and "
                             f"`{first_leaf}` is {first.rule}({', '.join(first.axes)})",
                             p.span or first.span, label=f"{p.rule}({', '.join(p.axes)}) beside "
                             f"{first.rule}({', '.join(first.axes)}) in one fused tensor",
                             help="split the projections of one fused tensor alike (`heads` with `kv_heads`), or "
                                  "keep them all whole, or use `meshc compile`, which stores them apart")
                break


def _block_modules(out: _Modules, item: Repeat, hf_params: list[str]) -> None:
    """Record a repeat's layers and the modules (relative to a block) its leaf's parameters live in."""
    first = int(hf_params[0].split(".")[2])  # "model.layers.2.mlp.gate_proj.weight"
    out.layers[item.name] = range(first, first + item.count)
    rels = out.rels.setdefault(item.name, set())
    for name in hf_params:
        parts = name.split(".")[3:]
        rels.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))


def _repeats_apart(found: _Findings, out: _Modules) -> None:
    """A `*` entry names the module in every layer of the block list, but only its repeats wrote it: where
    another repeat's blocks have that module (unsharded, or sharded otherwise) a tp_plan cannot say it
    (transformers looks rules up with every layer number replaced by `*`); DTensor names the layers."""
    told: set[tuple[str, ...]] = set()  # one refusal per pair of repeats placed apart
    for path, (repeats, span) in out.star.items():
        rel = path.split(".*.", 1)[1]
        others = sorted(r for r, rels in out.rels.items() if r not in repeats and rel in rels)
        if not others:
            continue
        if found.target == "hf-tp-plan":
            if (*sorted(repeats), "|", *others) in told:
                continue
            told.add((*sorted(repeats), "|", *others))
            found.refuse(E1205, f"{found.where} cannot express `{path}` sharded in the blocks of "
                         f"{', '.join(sorted(repeats))} but not in those of {', '.join(others)}: transformers looks "
                         "its rules up with every layer number replaced by `*`", span,
                         label="sharded in some repeats' blocks", help="place the module alike in every repeat "
                         "to export a tp_plan, or use `--to dtensor`, which names each layer")
            continue
        i = next(i for i, e in enumerate(out.entries) if e.module == path)
        entry = out.entries.pop(i)
        layers = sorted(n for r in repeats for n in out.layers[r])
        out.entries[i:i] = [attrs.evolve(entry, module=path.replace(".*.", f".{n}.", 1)) for n in layers]


def _modules(found: _Findings, desc: dict[str, Any]) -> _Modules:
    """Every leaf's tensor-parallel entries under transformers' module names (hf_key_map)."""
    from meshllm_dsl.runtime.hf.weights import hf_key_map

    out = _Modules()
    for item, unit, leaf in found.plan.model.leaves():
        # A tied head owns no parameter; transformers still has its module (lm_head), sharded like the
        # weight it shares and re-tied after parallelize_module replaced the owner's parameter.
        names = _param_names(item, leaf) or ([".".join((*leaf.path, "weight"))] if leaf.tie else [])
        if names:
            keys = hf_key_map(desc, names)
            # a per-head q / k norm is a parameter of the projection's leaf (its `norm`), its own module there;
            # GPT-OSS's sinks a bare parameter of the attention
            extra = {t.name: keys[n][0].rsplit(".", 1)[0] if t.name == "norm" else keys[n][0]
                     for n, t in zip(names, leaf.params) if t.name in ("norm", "sinks")}
            _leaf_entries(found, out, item, unit, leaf, *keys[names[0]], extra)
            if isinstance(item, Repeat):
                _block_modules(out, item, [keys[n][0] for n in names])
    _fused_alike(found, out)
    _repeats_apart(found, out)
    if found.target == "hf-tp-plan" and len(out.tp_axes) > 1:
        second = list(out.tp_axes)[1]
        found.refuse(E1205, f"a tp_plan shards over one mesh axis, but this plan shards over {' and '.join(out.tp_axes)}",
                     out.tp_axes[second], label=f"sharded over `{second}`",
                     help=f"shard every layer over one axis (`{next(iter(out.tp_axes))}`) to export a tp_plan")
    return out


def analyze(plan: PlanIR, decls: Declarations | None, target: str, weights: str | None = None) -> Export:
    """Decide the export of `plan` to `target`, or raise SpecError with every refusal found. `weights`:
    a checkpoint directory whose config.json names the class (else the model's own config.json's)."""
    assert target in TARGETS, target
    found = _Findings(plan, _plan_decl(decls, plan.name), target)
    desc = model_description(plan)
    arch = _checkpoint_layout(plan, desc, found.where)
    hf_class = _hf_class(plan, desc, arch, weights, found.where)
    found.pack = BY_ARCHITECTURE.get(hf_class)
    _refuse_unproven_model(plan, desc, found.pack, found.where)
    _refuse_unexported_features(found)
    zero_axis = _zero_axis(found)
    out = _modules(found, desc)
    if found.errors:
        raise SpecError(found.errors)
    return Export(plan, arch, out.blocks, tuple(out.entries), tuple(out.ties), zero_axis, plan.roles.loss_parallel,
                  tuple(found.warnings), hf_class)


def _hf_class(plan: PlanIR, desc: dict[str, Any], arch: str, weights: str | None, where: str) -> str:
    """The class whose modules the export names: the one `weights`' config.json names, checked against
    the model as `meshc run --weights` checks it (one llama-family model is Llama or Phi-3, whose
    fused qkv_proj / gate_up_proj only its checkpoint tells), else the class the model's own
    config.json names (runtime/hf/weights.py hf_config, what `--export-hf` writes): the llama layout
    alone is several architectures (a window, q, k, v biases, q / k norms: the packs' fields), and
    loading one with q / k norms as LlamaForCausalLM would drop its norms."""
    import torch

    from meshllm_dsl.runtime.hf.weights import WeightsError, check_config, hf_config, read_config

    if weights is not None:
        try:
            cfg = read_config(Path(weights))
            check_config(desc, cfg, str(Path(weights) / "config.json"))
        except WeightsError as err:
            raise SpecError([Diagnostic(
                E1204, f"model `{plan.model.name}` is not the model of {weights}", plan.model.span or plan.span,
                label="checked against its config.json", note=str(err),
                help="name the checkpoint this model was imported from (`meshc import-hf`), or leave out --weights",
            )]) from None
        pack = BY_ARCHITECTURE.get(str((cfg.get("architectures") or [""])[0]))
        if pack is None or not pack.tp_export or pack.checkpoint.layout != arch:
            raise SpecError([Diagnostic(
                E1204, f"{weights}'s class ({(cfg.get('architectures') or ['none'])[0]}) is not exported to {where} yet",
                plan.model.span or plan.span, label="no tested export for this class",
                help=f"export models of the {_exported_help()} family",
            )])
        return pack.architecture
    try:
        return str(hf_config(desc, torch.float32)["architectures"][0])
    except WeightsError:  # no config.json of its own (checked by the caller where it matters)
        return HF_CLASSES[arch]


# ---------------------------------------------------------------- printing


def _digest(source_text: str) -> str:
    return hashlib.sha256(source_text.encode()).hexdigest()[:16]


def render_tp_plan(exp: Export) -> str:
    """transformers' `tp_plan`: module name (`*` for every layer) -> style, as `model.tp_plan` keys it."""
    return json.dumps({e.module: e.hf_style for e in exp.entries}, indent=2) + "\n"


def render_dtensor(exp: Export, source_path: str, source_text: str) -> str:
    from meshllm_dsl.codegen.emit import environment

    plan = exp.plan
    mesh = plan.mesh
    names = tuple(a.name for a in mesh.axes)
    sizes = tuple(a.size for a in mesh.axes)
    tp = sorted({e.axis for e in exp.entries}, key=names.index)
    header = [
        f"Plan `{plan.name}` of {docstring_text(source_path)} (sha256 {_digest(source_text)}), exported by meshc "
        "for torch DTensor. Do not edit.",
        "",
        f"Mesh `{mesh.name}`: {' x '.join(f'{a.name} {a.size}' for a in mesh.axes)} = {mesh.devices} ranks"
        " (rank order: last axis varies fastest).",
        f"Model `{plan.model.name}`: {plan.model.numel:,} parameters, as transformers' {exp.hf_class} "
        "names its modules.",
        f"Tensor parallel over: {' x '.join(tp) or 'none'} (parallelize_module). Data parallel over: "
        f"{' x '.join(plan.roles.batch) or 'none'}; ZeRO stage {plan.zero}"
        + (" (fully_shard)." if exp.zero_axis else "."),
        "Loss: " + ("vocab-parallel cross-entropy (loss_parallel): the logits stay sharded."
                    if exp.loss_parallel else "cross-entropy on replicated logits."),
    ]
    groups = []
    for axis in tp:
        lines = [f"{e.module!r}: {e.style},  # {e.why}" for e in exp.entries if e.axis == axis]
        groups.append({"axis": repr(axis), "lines": lines})
    fsdp: list[str] = []
    if exp.zero_axis is not None:
        reshard = plan.zero == 3
        mp = ""
        if plan.master_dtype is not None:
            from meshllm_dsl.codegen.lower import TORCH_DTYPES

            mp = (f", mp_policy=MixedPrecisionPolicy(param_dtype={TORCH_DTYPES[plan.dtype]}, "
                  f"reduce_dtype={TORCH_DTYPES[plan.reduce_dtype or plan.dtype]})")
        if exp.blocks is not None:
            fsdp.append(f"for block in model.get_submodule({exp.blocks!r}):")
            fsdp.append(f"    fully_shard(block, mesh=mesh[{exp.zero_axis!r}], reshard_after_forward={reshard}{mp})")
        fsdp.append(f"fully_shard(model, mesh=mesh[{exp.zero_axis!r}], reshard_after_forward={reshard}{mp})")
    ties = [f"model.get_submodule({a!r}).weight = model.get_submodule({b!r}).weight" for a, b in exp.ties]
    styles = sorted({e.style.split("(")[0] for e in exp.entries})
    parallel_imports = [*styles, *(["loss_parallel"] if exp.loss_parallel else []),
                        *(["parallelize_module"] if exp.entries else [])]
    ctx = {
        "header": header,
        "axes": literal(tuple(zip(names, sizes))),
        "names": literal(names),
        "sizes": literal(sizes),
        "hf_class": exp.hf_class,
        "layers": plan.model.blocks,
        "blocks": repr(exp.blocks) if exp.blocks else None,
        "batch": plan.batch,
        "seq": plan.seq,
        "microbatches": plan.microbatches,
        "optimizer": literal(_adamw_kwargs(plan)),
        "groups": groups,
        "ties": ties,
        "fsdp": fsdp,
        "mixed_precision": bool(fsdp) and plan.master_dtype is not None,
        "replicate": any("Replicate()" in e.style for e in exp.entries),
        "parallel_imports": ", ".join(parallel_imports),
        "loss_parallel": exp.loss_parallel,
    }
    text = environment().get_template("dtensor.py.j2").render(**ctx)
    compile(text, f"<exported {plan.name}>", "exec")  # always valid Python: a failure is a meshc bug
    return text


def export_plan(plan: PlanIR, decls: Declarations | None, target: str, source_path: str,
                source_text: str, weights: str | None = None) -> tuple[str, tuple[Diagnostic, ...]]:
    """(file text, warnings) of `plan` exported to `target` (as the class of `weights`' config.json
    when given); SpecError with every refusal."""
    if target not in TARGETS:  # --to torchtitan writes two files: interop/torchtitan.py's export_torchtitan
        raise ValueError(f"export_plan writes {' or '.join(TARGETS)}, not {target}")
    exp = analyze(plan, decls, target, weights)
    text = render_dtensor(exp, source_path, source_text) if target == "dtensor" else render_tp_plan(exp)
    return text, exp.warnings


__all__ = ["TARGETS", "Entry", "Export", "analyze", "export_plan"]
