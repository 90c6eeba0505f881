"""Hover text: what `meshc explain` and `meshc plan` would say about the thing under the cursor."""

from __future__ import annotations

from meshllm_dsl.front import ast
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import DTYPES, MeshIR, PlanIR, Repeat, Unit
from meshllm_dsl.lsp.document import Document, Occ, _include_target, shard_matches

GB, GIB = 1e9, 2**30

RULE_DOCS = {
    "column": "column-parallel: splits the output features (weight dim 0) over the axes; its output is sharded",
    "row": "row-parallel: splits the input features (weight dim 1); its output is a partial sum, all-reduced",
    "vocab_parallel": "vocab-parallel: splits the vocabulary rows of an embedding or head over the axes",
    "replicate": "replicated: every device holds the whole parameter",
    "expert": "expert-parallel: splits a moe layer's experts over the (batch) axes, as `layout { experts -> AXES }`; "
              "tokens travel to their experts' ranks by all-to-all",
    "cross_entropy": "plain cross-entropy on full logits",
}
SCHEDULE_DOCS = {
    "gpipe": "GPipe: all forwards, then all backwards; bubble (p - 1) / (m + p - 1)",
    "1f1b": "1F1B: one forward one backward; same bubble as GPipe, fewer activations in flight; needs microbatches >= stages",
    "interleaved_1f1b": "interleaved 1F1B: `virtual` stages per rank; bubble divided by v",
    "looped_bfs": "looped BFS: `virtual` stages per rank, breadth first (every microbatch through a rank's first stage, "
                  "then its next); full backwards, not zero bubble",
    "interleaved_zb": "interleaved zero bubble (ZB1P): backward split into input (I) and weight (W) gradients, W fills "
                      "the bubble: (p - 1)(F + B - 2W); microbatches in whole rounds of m // p",
    "zbv": "ZB-V: `virtual 2` stages per rank in a V (rank r holds stages r and 2p - 1 - r), backward split into I and W",
    "dualpipev": "DualPipeV (DeepSeek-V3): `virtual 2` in a V, a forward overlapped with a backward; bubble "
                 "(p - 1)(F&B + B - 3W); 2x parameters per rank; microbatches >= stages",
}
# The moe families' routing settings (runtime/moe/routing.py) and the planner's `skew`.
PARAM_DOCS = {
    "aux_loss_coef": "adds this x transformers' load-balancing loss (over every moe layer's router logits of a "
                     "forward) to the training loss; 0: none",
    "z_loss_coef": "adds this x ST-MoE's router z-loss (per layer mean logsumexp(logits)^2, summed) to the training "
                   "loss; 0: none",
    "seq_aux_loss": "adds this (alpha) x DeepSeek-V3's sequence-wise balance loss (per sequence and layer, "
                    "sum_i f_i P_i over the normalised affinities, averaged over sequences) to the training loss; 0: none",
    "capacity": "capacity factor: each expert takes at most ceil(capacity x tokens x top_k / experts) (token, choice) "
                "pairs of a forward, kept by token position; 0: dropless",
    "scoring": "softmax (default) or sigmoid: DeepSeek-V3's router, sigmoid scores chosen with the correction bias "
               "`router.e_score_correction_bias` (a buffer, not a parameter)",
    "groups": "sigmoid scoring: the experts in this many groups, a token choosing only in its topk_groups best groups "
              "(a group scored by its two best experts); 1: no group limit",
    "topk_groups": "sigmoid scoring with groups: the groups each token keeps; default all of them",
    "routed_scaling": "multiplies the chosen experts' weights (routed_scaling_factor); 1: none",
    "balance_rate": "sigmoid scoring: after each optimizer step the correction bias moves by this rate toward balance, "
                    "from the expert loads over every rank (auxiliary-loss-free); 0: the bias stays",
    "shared_experts": "DeepSeek's shared experts: one ungated SwiGLU of width shared_ffn (N x ffn) every token passes "
                      "through; 0: none",
}
SETTING_DOCS = {
    "skew": "planner only: the busiest expert of each moe layer receives this share of its routed (token, "
            "choice) pairs, 1 / experts to 1 / top_k; "
            "`meshc plan` gives each expert-parallel rank's memory and step under it (W0807); "
            "`meshc run --profile` measures it",
    "pack": "`documents`: rows pack several documents and a token attends only to its own document's earlier tokens "
            "(block-causal attention; flex_attention's block mask on CUDA); `none` (default): across documents",
    "positions": "`restart`: rotary and learned positions start at 0 at each document (with `pack = documents`); "
                 "`continue` (default): the row's positions",
    "context_balance": "how a packed row's tokens spread over the context ranks (with `pack = documents`): "
                       "`headtail` (default) cuts the row into 2 n chunks, rank i takes i and 2 n - 1 - i; "
                       "`per_document` does so within each document; `ptrr` deals blocks by their attention work",
}


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{x:,}" for x in s) + "]"


def _groups(mesh: MeshIR, axis: str) -> str:
    gs = mesh.groups(axis)
    shown = " ".join("[" + ", ".join(map(str, g)) + "]" for g in gs[:8])
    return shown + (f" ... ({len(gs)} groups)" if len(gs) > 8 else "")


def hover(a: Document, offset: int) -> tuple[str, Span] | None:
    hits = a.index.at(a.path, offset)
    # On a shard rule's path, the rule's matches say more than the first segment's layer.
    plan = a.plan_decl_at(offset)
    if plan is not None:
        for s in plan.body:
            if isinstance(s, ast.ShardStmt) and s.path.span is not None and s.path.span.start <= offset <= s.path.span.end:
                text = _shard(a, plan, s)
                if text:
                    return text, s.path.span
            if isinstance(s, ast.LayoutStmt):
                for e in s.entries:
                    if e.dim.value == "seq" and e.span is not None and e.span.start <= offset <= e.span.end:
                        return _seq_entry(a, plan.name.value), e.span
    if not hits:
        return None
    occ = hits[0]
    text = _occ(a, occ)
    return (text, occ.span) if text else None


def _occ(a: Document, occ: Occ) -> str | None:
    kind, *rest = occ.key
    res = a.sem_result
    if kind == "mesh":
        mesh = res.meshes.get(rest[0])
        if mesh is None:
            return f"mesh `{rest[0]}`"
        axes = " x ".join(f"{x.name} {x.size}" for x in mesh.axes)
        host = f", {mesh.hosts} hosts of {mesh.devices_per_host}" if mesh.hosts > 1 else ""
        return f"**mesh `{mesh.name}`**: {mesh.devices} devices ({axes}{host}), device {mesh.device or 'not given'}\n\nrank order: the last axis varies fastest"
    if kind == "axis":
        mesh = res.meshes.get(rest[0])
        if mesh is None or mesh.axis(rest[1]) is None:
            return f"axis `{rest[1]}` of mesh `{rest[0]}`"
        ax = mesh.axis(rest[1])
        assert ax is not None
        cross = " (crosses hosts)" if mesh.hosts > 1 and mesh.crosses_hosts(ax.name) else ""
        return (f"**axis `{ax.name}`** of mesh `{mesh.name}`: size {ax.size}, rank stride {mesh.stride(ax.name)}{cross}\n\n"
                f"process groups: {_groups(mesh, ax.name)}")
    if kind == "model":
        model = res.models.get(rest[0])
        if model is None:
            return f"model `{rest[0]}` (does not resolve; see its diagnostics)"
        w = DTYPES.get(model.dtype, 2)
        from meshllm_dsl.planner.formatting import fmt_count

        lines = [f"**model `{model.name}`**: {model.numel:,} parameters ({fmt_count(model.numel)})",
                 f"{model.dtype} weights: {model.numel * w / GB:.2f} GB = {model.numel * w / GIB:.2f} GiB"]
        for rep in model.repeats:
            lines.append(f"{rep.count} x `{rep.name}` of {rep.numel_per_block:,} parameters each")
        return "\n\n".join(lines)
    if kind == "plan":
        return _plan(a, rest[0])
    if kind == "family":
        fam = a.index.families.get(rest[0])
        if fam is None:
            return f"family `{rest[0]}` (not declared)"
        from meshllm_dsl.front.fmt import format_expr

        params = ", ".join(p.name.value + (f" = {format_expr(p.default)}" if p.default is not None else "") for p in fam.params)
        return f"**family `{fam.name.value}`**`({params})`"
    if kind == "param":
        fam = a.index.families.get(rest[0])
        text = f"parameter `{rest[1]}` of family `{rest[0]}`"
        if fam is not None:
            p = next((p for p in fam.params if p.name.value == rest[1]), None)
            if p is not None and p.default is not None:
                from meshllm_dsl.front.fmt import format_expr

                text += f" (default `{format_expr(p.default)}`)"
        if rest[1] in PARAM_DOCS:
            text += f"\n\n{PARAM_DOCS[rest[1]]}"
        ctx = occ.context
        model_name = ctx.name.value if isinstance(ctx, ast.ModelDecl) else ctx.model.value if isinstance(ctx, ast.PlanDecl) else None
        model = res.models.get(model_name) if model_name else None
        if model is not None and model.value(rest[1]) is not None:
            text += f"\n\nin model `{model.name}`: `{rest[1]} = {_value(model.value(rest[1]))}`"
        return text
    if kind == "dim":
        model = res.models.get(rest[0])
        value = model.value(rest[1]) if model is not None else None
        return f"dim `{rest[1]}` of model `{rest[0]}`" + (f" = {_value(value)}" if value is not None else "")
    if kind == "layer":
        return _layer(a, occ)
    if kind == "device":
        from meshllm_dsl.parallel.devices import PROFILES

        prof = PROFILES.get(rest[0])
        if prof is None:
            return f"device `{rest[0]}`"
        return f"**device `{prof.name}`**: {prof.memory_bytes / GIB:.0f} GiB" + (f", {prof.tflops} TFLOP/s" if getattr(prof, "tflops", None) else "")
    if kind == "rule":
        return RULE_DOCS.get(rest[0], f"`{rest[0]}` is not a rule")
    if kind == "schedule":
        return SCHEDULE_DOCS.get(rest[0], f"`{rest[0]}` is not a schedule")
    if kind == "file":

        target = _include_target(a.path, rest[0])
        return f"include `{target}`" if target else f"`{rest[0]}` not found"
    if kind == "primitive":
        return f"primitive `{rest[0]}`"
    if kind == "setting" and rest[0] == "plan" and rest[1] in SETTING_DOCS:
        return f"plan setting `{rest[1]}`: {SETTING_DOCS[rest[1]]}"
    return None


def _layer(a: Document, occ: Occ) -> str | None:
    owner, path = occ.key[1], occ.key[2]
    ctx = occ.context
    model_name = None
    if isinstance(ctx, ast.ModelDecl):
        model_name = ctx.name.value
    elif isinstance(ctx, ast.PlanDecl):
        model_name = ctx.model.value
    model = a.sem_result.models.get(model_name) if model_name else None
    if model is None:
        return f"layer `{path}` of {owner.replace(':', ' `')}`"
    head, *tail = path.split(".")
    item = model.item(head)
    if item is None:
        return f"layer `{path}`"
    if isinstance(item, Repeat):
        if not tail:
            return f"**`{item.name}`**: repeat of {item.count} blocks, {item.numel_per_block:,} parameters each ({item.count * item.numel_per_block:,} in all)"
        unit = next((u for u in item.body if u.name == tail[0]), None)
        return _unit(unit, f"{item.name}.*.{tail[0]}") if unit else None
    return _unit(item, item.name)


def _value(v: object) -> str:
    """A model's value as the language writes it: a list (longrope's factors) in brackets, its
    first items only when long."""
    if not isinstance(v, tuple):
        return str(v)
    shown = ", ".join(repr(x) for x in v[:6])
    return f"[{shown}, ...] ({len(v)} numbers)" if len(v) > 6 else f"[{shown}]"


def _unit(unit: Unit | None, name: str) -> str | None:
    if unit is None:
        return None
    lines = [f"**`{name}`** ({unit.kind}): {unit.numel:,} parameters"]
    for leaf in unit.leaves:
        for t in leaf.params:
            lines.append(f"- `{'.'.join(leaf.path)}.{t.name}` {_shape(t.shape)}")
    return "\n".join(lines)


def _shard(a: Document, decl: ast.PlanDecl, s: ast.ShardStmt) -> str | None:

    plan = a.plan_ir(decl)
    if plan is None:
        return _shard_unchecked(a, decl, s)
    matches = shard_matches(plan, decl, s.path, layer=s.rule.name.value == "expert")
    if not matches:
        return f"`{s.path}` matches no layer"
    lines = [f"**`shard {s.path}`** matches {len(matches)} layer group{'s' if len(matches) != 1 else ''} (global -> local on one device)", ""]
    for m in matches[:24]:
        rule = f"{m.placement.rule}({', '.join(m.placement.axes)})" if m.placement.sharded else "replicate"
        if m.placement.experts:
            rule += f", experts over {' x '.join(m.placement.experts)}"
        lines.append(f"- `{m.path}` {rule}")
        for name, g, loc in m.tensors:
            lines.append(f"  - `{name}` {_shape(g)} -> {_shape(loc)}")
        for c in m.collectives:
            lines.append(f"  - collective: {c}")
    if len(matches) > 24:
        lines.append(f"- ... {len(matches) - 24} more")
    return "\n".join(lines)


def _shard_unchecked(a: Document, decl: ast.PlanDecl, s: ast.ShardStmt) -> str | None:
    """A plan with errors has no placements yet: still list what the rule matches, with global shapes
    and the split the rule asks for, so the hover helps while the errors are being fixed."""
    from meshllm_dsl.checker.paths import match_path

    mesh = a.sem_result.meshes.get(decl.mesh.value)
    model = a.sem_result.models.get(decl.model.value)
    if mesh is None or model is None:
        return None
    hits = match_path(s.path, model, layer=s.rule.name.value == "expert")
    if not hits:
        return f"`{s.path}` matches no layer"
    axes = [n.value for n in s.rule.axes]
    known = all(mesh.axis(x) is not None for x in axes)
    n = mesh.size(*axes) if axes and known else 1
    lines = [f"**`shard {s.path}`** matches {len(hits)} layer{'s' if len(hits) != 1 else ''} "
             f"(plan `{decl.name.value}` has errors: global shapes only)", ""]
    in_repeat = {id(lf): item.name for item, _unit, lf in model.leaves() if isinstance(item, Repeat)}
    for leaf, blocks in hits[:24]:
        where = ""
        if id(leaf) in in_repeat:
            where = f"{in_repeat[id(leaf)]}.{'*' if blocks is None else ','.join(map(str, sorted(blocks)))}."
        lines.append(f"- `{where}{'.'.join(leaf.path)}` {s.rule.name.value}({', '.join(axes)})"
                     + (f", split {n} ways" if n > 1 else ""))
        for t in leaf.params:
            lines.append(f"  - `{t.name}` {_shape(t.shape)}")
    return "\n".join(lines)


def _seq_entry(a: Document, name: str) -> str:
    """What a plan's `seq -> AXES` is: sequence parallelism (AXES split weights) or context parallelism."""
    plan = a.sem_result.plans.get(name)
    if plan is None:
        return "`seq -> AXES`: sequence parallelism over tensor axes, context parallelism over axes that split no weight"
    n = plan.context_size
    sp = ""
    if plan.roles.sequence:
        axes, t = " x ".join(plan.roles.sequence), plan.sequence_size
        s = f"s / {n * t}" if n > 1 else f"s / {t}"
        sp = (f"**sequence parallelism** over {axes} ({t}): norms and the residual stream hold "
              f"[b, {s}, hidden] between the tensor-parallel sublayers")
        if n == 1:
            return sp
    from meshllm_dsl.planner.formatting import fmt_bytes
    from meshllm_dsl.planner.formulas import kv_gather_bytes_per_layer

    axes = " x ".join(plan.roles.context)
    # mla gathers its latents and rotary keys, which every rank up-projects to its heads' K / V
    what = "the latents" if any(u.kind == "mla" for r in plan.model.repeats for u in r.body) else "K / V"
    cp = (f"**context parallelism** over {axes} ({n}): each rank holds chunks i and {2 * n - 1} - i of {2 * n} of "
          f"every sequence ({plan.seq // n:,} of {plan.seq:,} tokens) through the whole model\n\n"
          f"attention all-gathers {what} over {axes}: {fmt_bytes(kv_gather_bytes_per_layer(plan))} per layer and "
          "microbatch; gradients are averaged over the batch and context axes")
    return cp + (f"\n\n{sp}, its slice of this rank's chunks" if sp else "")


def _plan(a: Document, name: str) -> str:
    plan = a.sem_result.plans.get(name)
    if plan is None:
        return f"plan `{name}` (has errors; see its diagnostics)"
    try:
        from meshllm_dsl.parallel.devices import declared_profiles
        from meshllm_dsl.planner.analyze import analyze, resolve_device
        from meshllm_dsl.planner.formatting import fmt_bytes

        devices, _ = declared_profiles(a.sem_decls.user(ast.DeviceDecl))
        device, assumed = resolve_device(plan, devices)
        rep = analyze(plan, device, device_assumed=assumed)
    except Exception as err:  # noqa: BLE001 - a hover must never take the server down
        return f"plan `{name}`: the planner failed ({type(err).__name__})"
    worst = max(rep.ranks, key=lambda r: r.training_bytes)
    per_rank = ", ".join(f"pp {rc.coord} {fmt_bytes(rc.training_bytes)}" for rc in rep.ranks)
    fits = "fits" if rep.fits else "does NOT fit"
    return (f"**plan `{plan.name}`**: {plan.model.name} on {plan.mesh.name} ({plan.mesh.devices} x {device.name}"
            f"{' (assumed)' if assumed else ''})\n\n"
            f"memory per device (training): {per_rank}; peak {fmt_bytes(worst.training_bytes)} of "
            f"{fmt_bytes(device.memory_bytes)} -> {fits}\n\n"
            f"bubble {rep.bubble:.1%}, schedule {plan.schedule}, {plan.microbatches} microbatches"
            + _precision(plan))


def _precision(plan: PlanIR) -> str:
    """Where a `precision` plan keeps its master weights, as the runtime runs it."""
    if plan.master_dtype is None:
        return ""
    from meshllm_dsl.parallel.placements import runs_fsdp

    shard = " x ".join(plan.roles.batch_shard) or "no axis"
    where = ("whole on every rank (torch.autocast over them)" if not runs_fsdp(plan) else
             f"sharded over {shard} with the moments (Megatron's distributed optimizer, FSDP2)" if plan.zero == 1 else
             f"sharded over {shard} (FSDP2, ZeRO {plan.zero})")
    return (f"\n\nprecision: compute in {plan.dtype}, master weights in {plan.master_dtype} {where}, "
            f"gradients reduced in {plan.reduce_dtype or plan.dtype}")
