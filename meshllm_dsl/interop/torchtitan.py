"""`meshc export --to torchtitan`: a checked plan as the command line torchtitan 0.3 runs.

torchtitan 0.3's `ConfigManager` takes `--module M --config F` (F a config_registry function of module
M, which may be any importable module) and `--section.key value` overrides; there is no TOML. The
export writes both: a shell file with the `torchrun ... -m torchtitan.train` line, one flag a line,
and next to it a Python module whose config_registry function builds the plan's Llama with
torchtitan's own classes (and its float8 converter), since neither the model's dimensions nor a
model converter is a command-line flag there. Everything comes from the checked `PlanIR`; what
torchtitan cannot express is a located diagnostic (E1201-E1206), never a silently different plan.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import E1201, E1202, E1203, E1204, E1205, E1206, W1203
from meshllm_dsl.diagnostics import Diagnostic, SpecError
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import Declarations
from meshllm_dsl.interop.export import (
    _Findings,
    _matmul_span,
    _plan_decl,
    _seq_span,
    _setting_span,
    _stmt_span,
    _zero_span,
)
from meshllm_dsl.interop.layered import layered_build
from meshllm_dsl.ir import PlanIR, Repeat

TORCHTITAN = "0.3"
TARGET = "torchtitan"  # meshc export's --to beside export.TARGETS

# meshllm's schedule -> torch.distributed.pipelining's name (get_schedule_class), which torchtitan takes.
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}

# The overrides the export writes (and `meshc import-torchtitan` reads back): --section.key -> the
# type of its value, or None for a bare switch. `--module` / `--config` name the config function.
KEYS: dict[str, type | None] = {
    "--module": str, "--config": str,
    "--parallelism.data_parallel_replicate_degree": int, "--parallelism.data_parallel_shard_degree": int,
    "--parallelism.fsdp_reshard_after_forward": str, "--parallelism.tensor_parallel_degree": int,
    "--parallelism.enable_sequence_parallel": None, "--parallelism.no-enable_sequence_parallel": None,
    "--parallelism.context_parallel_degree": int, "--parallelism.context_parallel_load_balancer": str, "--parallelism.expert_parallel_degree": int,
    "--parallelism.pipeline_parallel_degree": int, "--parallelism.pipeline_parallel_schedule": str,
    "--parallelism.pipeline_parallel_layers_per_stage": int,
    "--parallelism.pipeline_parallel_first_stage_less_layers": int,
    "--parallelism.pipeline_parallel_last_stage_less_layers": int,
    "--parallelism.pipeline_parallel_microbatch_size": int, "--training.disable_cuda_graphs": None,
    "--training.local_batch_size": int, "--training.global_batch_size": int, "--training.seq_len": int,
    "--training.dtype": str, "--training.mixed_precision_param": str,
    "--compile.enable": None, "--compile.components": str,
}
# the subcommand the line ends with -> meshllm's recompute region
SUBCOMMANDS = {"activation-checkpoint:none": "none", "activation-checkpoint:full": "blocks",
               "activation-checkpoint:selective": "ops"}

# torchtitan's llama3 (models/llama3): RMSNorm, SwiGLU, GQA, RoPE, untied head, no biases.
_LLAMA_FIXED = (
    ("attn_bias", False, "biases on q / k / v"),
    ("attn_out_bias", False, "a bias on the attention output"),
    ("tie_embeddings", False, "tied embeddings"),
    ("window", 0, "sliding-window attention"),
)


@attrs.frozen
class TitanExport:
    """What the two files say, decided once."""

    flags: tuple[tuple[str, str | None], ...]  # (--section.key, value or None for a bare flag)
    subcommand: str  # activation-checkpoint:full / selective / none
    nproc: int
    model: dict[str, Any]  # the config_registry function's arguments
    converter: str | None  # the float8 converter's constructor expression, or None
    warnings: tuple[Diagnostic, ...] = ()


# torchtitan's llama3 tensor-parallel plan (models/llama3/parallelize.py), in the plan's leaf names.
_TOP_RULES = {"embed": "vocab_parallel", "norm": "replicate", "lm_head": "column"}
_BLOCK_RULES = {"attn_norm": "replicate", "mlp_norm": "replicate", "attn.q": "column", "attn.k": "column",
                "attn.v": "column", "attn.o": "row", "mlp.gate": "column", "mlp.up": "column", "mlp.down": "row",
                "mlp.router": "replicate",
                # deepseek_v3 (models/deepseek_v3/sharding.py): the latents' down-projections replicated, the
                # up-projections column; the shared experts split like a dense MLP
                "attn.q_a": "replicate", "attn.kv_a": "replicate", "attn.q_b": "column", "attn.kv_b": "column",
                "mlp.shared_gate": "column", "mlp.shared_up": "column", "mlp.shared_down": "row"}
# torchtitan's MoE blocks under EP (models/common/moe_sharding.py): the router replicated, the routed
# experts whole on every tensor rank (split over the expert-parallel ranks only), the shared experts
# column / row. Without EP the routed experts are column / row over TP too: _BLOCK_RULES.
_MOE_RULES = {**_BLOCK_RULES, "mlp.gate": "experts", "mlp.up": "experts", "mlp.down": "experts"}


def _class_placements_ok(found: _Findings) -> None:
    """torchtitan's llama3 tensor-parallel plan is fixed (Megatron: q / k / v / gate / up column, o / down
    row, embedding vocab-parallel and head column over the tensor axis): a plan whose shards differ is
    refused, never exported as torchtitan's."""
    plan = found.plan
    if not plan.roles.tensor:
        return
    if len(plan.roles.tensor) > 1:
        found.refuse(E1205, f"torchtitan has one tensor-parallel mesh dimension, but this plan shards over "
                     f"{' and '.join(plan.roles.tensor)}", plan.span, label="several tensor axes",
                     help="shard every layer over one tensor axis")
        return
    axis = plan.roles.tensor
    # torchtitan's MoE: without EP the experts split by ffn over TP like a dense MLP; with EP whole,
    # as EP borrows the TP ranks (there is no expert tensor parallelism beside EP)
    routed = {it.name for it in plan.model.items
              if isinstance(it, Repeat) and any(primitives.of(u).routes_experts for u in it.body)}
    got = [(path, p, _TOP_RULES.get(path)) for path, p in plan.top_placements]
    for bc in plan.block_classes:
        rules = _MOE_RULES if plan.roles.expert and bc.repeat in routed else _BLOCK_RULES
        got += [(f"{bc.repeat}.{bc.indices[0]}.{path}", p, rules.get(path)) for path, p in bc.placements]
    for path, p, want in got:
        if want is None:
            continue
        if want == "experts":  # with EP, torchtitan 0.3 borrows the TP ranks for it: experts whole over TP
            if axis[0] in p.axes:
                found.refuse(E1205, f"`{path}` splits the experts' ffn over `{axis[0]}` beside expert parallelism: "
                             "torchtitan 0.3's EP borrows the tensor ranks (no expert tensor parallelism)",
                             p.span or plan.span, label="expert tensor parallelism",
                             help=f"keep the experts whole over `{axis[0]}` under `experts -> AXIS`, or drop "
                                  "`experts -> AXIS` and split their ffn over the tensor axis")
                return
            continue
        ok = p.rule == want and (tuple(p.axes) == tuple(axis) if want != "replicate" else not p.sharded)
        if not ok:
            rule = f"{p.rule}({', '.join(p.axes)})" if p.axes else p.rule
            found.refuse(E1205, f"`{path}` is {rule}, but torchtitan's llama3 tensor-parallel plan makes it "
                         f"{want}" + (f"({axis[0]})" if want != "replicate" else ""), p.span or plan.span,
                         label="torchtitan's TP plan is fixed",
                         help="shard q / k / v / gate / up column, o / down row, embed vocab_parallel and "
                              "lm_head column over the tensor axis (or export without tensor parallelism)")
            return


def _rope(found: _Findings, v: dict[str, Any], span: Any, module: str) -> dict[str, Any]:
    """torchtitan's RoPE.Config fields (the default or the llama3 rope; llama3 and qwen3 share the class's
    fields)."""
    rope_type = getattr(v.get("rope_type"), "name", str(v.get("rope_type", "default")))
    if module == "qwen3" and rope_type == "llama3" and float(v.get("rope_factor", 1.0)) == 1.0:
        rope_type = "default"  # llama3 scaling by 1 is the plain rope, which qwen3's CosSinRoPE computes
    if rope_type not in (("default", "llama3") if module == "llama3" else ("default",)):
        found.refuse(E1204, f"rope `{rope_type}` is not one torchtitan's {module} builds", span,
                     label="rope scaling", help="use the default rope" + (" or the llama3 rope" if module == "llama3"
                                                                           else " (qwen3's CosSinRoPE has no llama3 scaling)"))
    return {"theta": float(v["rope_theta"]), "scaling": "llama" if rope_type == "llama3" else "none",
            "scaling_factor": float(v.get("rope_factor", 8.0)),
            "low_freq_factor": float(v.get("rope_low_freq_factor", 1.0)),
            "high_freq_factor": float(v.get("rope_high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(v.get("rope_original_positions", 8192))}


def _module(m: Any) -> str | None:
    """torchtitan's module for the plan's model: llama3 (a llama without q / k norms), qwen3 (a llama with
    per-head q / k norms, i.e. Qwen3, or the qwen3_moe family), or None."""
    v = dict(m.values)
    if m.family == "deepseek_v3" or (m.family is None and any(
            u.kind == "mla" for item in m.items for u in (item.body if isinstance(item, Repeat) else (item,)))):
        return "deepseek_v3"
    if m.family == "qwen3_moe":
        return "qwen3"
    if m.family == "llama":
        return "qwen3" if getattr(v.get("qk_norm"), "name", "none") == "head" else "llama3"
    return None


def _model(found: _Findings) -> dict[str, Any] | None:
    plan = found.plan
    m = plan.model
    span = m.span or plan.span
    routes = any(primitives.of(u).routes_experts
                 for item in m.items for u in (item.body if isinstance(item, Repeat) else (item,)))
    module = _module(m)
    if module == "deepseek_v3":
        return _deepseek(found)
    if module is None or routes != (m.family == "qwen3_moe"):
        what = "mixture-of-experts layers" if routes else f"the `{m.family or 'primitives'}` family"
        found.refuse(E1204, f"model `{m.name}` ({what}) is not exported to torchtitan",
                     span, label="no torchtitan model for this",
                     help="export a model of the `llama` family (torchtitan's llama3 module, or its qwen3 module "
                          "with `qk_norm = head`), the `qwen3_moe` family (torchtitan's qwen3 MoE) or the "
                          "`deepseek_v3` family (torchtitan's deepseek_v3)")
        return None
    v = dict(m.values)
    fixed = _LLAMA_FIXED if module == "llama3" else _LLAMA_FIXED[:2] + _LLAMA_FIXED[3:]  # qwen3 may tie
    for key, want, what in fixed:
        if v.get(key, want) != want:
            found.refuse(E1204, f"model `{m.name}` has {what}, which torchtitan's {module} does not",
                         span, label=f"`{key}` = {v.get(key)}", help=f"drop `{key}` to export to torchtitan")
    qk = getattr(v.get("qk_norm"), "name", "head" if m.family == "qwen3_moe" else "none")
    if module == "llama3" and qk != "none":
        found.refuse(E1204, f"model `{m.name}` has q / k norms over `{qk}`, which torchtitan's llama3 and qwen3 do "
                     "not", span, label="`qk_norm`", help="use `qk_norm = head` (torchtitan's qwen3) or none")
    eps = {"llama3": 1e-5, "qwen3": 1e-6}[module]  # the modules' fixed RMSNorm eps
    if float(v["norm_eps"]) != eps:
        found.refuse(E1204, f"norm_eps {v['norm_eps']} is not torchtitan's {module} RMSNorm eps ({eps})", span,
                     label="`norm_eps`", help=f"set `norm_eps = {eps}` to export to torchtitan")
    if module == "llama3" and v["head_dim"] * v["heads"] != v["hidden"]:
        found.refuse(E1204, f"model `{m.name}` has head_dim {v['head_dim']} x {v['heads']} heads != hidden "
                     f"{v['hidden']}", span, label="torchtitan's llama3 derives head_dim = dim / n_heads",
                     help="drop `head_dim`")
    out: dict[str, Any] = {
        "module": module, "dim": v["hidden"], "n_layers": v["layers"], "n_heads": v["heads"],
        "n_kv_heads": v["kv_heads"], "head_dim": v["head_dim"], "hidden_dim": v["ffn"], "vocab_size": v["vocab"],
        "norm_eps": float(v["norm_eps"]), "tie": bool(v.get("tie_embeddings", False)),
        "max_seq_len": max(plan.seq, 2048), **_rope(found, v, span, module)}
    if m.family == "qwen3_moe":
        # torchtitan's qwen3 MoE router: softmax, top-k renormalised (route_norm), dropless, no router loss
        for key, want, what, hlp in (
                ("norm_topk_prob", True, "top-k weights not renormalised", "torchtitan's qwen3 router renormalises"),
                ("capacity", 0.0, "a capacity factor", "torchtitan's qwen3 MoE is dropless"),
                ("aux_loss_coef", 0.0, "a load-balancing loss", "torchtitan's MoE has no auxiliary loss"),
                ("z_loss_coef", 0.0, "a router z-loss", "torchtitan's MoE has no z-loss")):
            if v.get(key, want) != want:
                found.refuse(E1204, f"model `{m.name}` has {what}, which torchtitan's qwen3 MoE does not", span,
                             label=f"`{key}` = {v.get(key)}", help=f"{hlp}: drop `{key}`")
        out.update(num_experts=v["experts"], top_k=v["top_k"])
    return out


def _deepseek(found: _Findings) -> dict[str, Any] | None:
    """torchtitan's deepseek_v3 (`build_mla_moe_layers`) for a model of DeepSeek-V3's build: embed, dense
    blocks, moe blocks (rmsnorm, multi-latent attention, rmsnorm, mlp / moe), norm, head; read from its
    units, so a primitives model of that shape (examples/deepseek_v3_671b.mesh) is one too."""
    plan = found.plan
    m = plan.model
    span = m.span or plan.span

    def refuse(what: str, label: str, help: str) -> None:  # noqa: A002
        found.refuse(E1204, f"model `{m.name}` has {what}, which torchtitan's deepseek_v3 does not", span,
                     label=label, help=help)

    build = layered_build(m)
    if build is None or any(b["attn"].kind != "mla" for b in build.bodies):
        refuse("another build than embed, dense blocks, moe blocks, norm, head", "not torchtitan's DeepSeek-V3",
               "export a model of DeepSeek-V3's build (a `deepseek_v3` family model)")
        return None
    tops, dense = build.tops, build.dense
    a, e = dict(build.attn.attrs), dict(build.experts.attrs)
    if not build.same_attention():
        refuse("dense and moe blocks with different attention", "attention differs", "give every block the same attention")
    norms = build.norms()
    eps = {float(n.attr("eps")) for n in norms} | {float(a["norm_eps"])}  # type: ignore[arg-type]
    if any(n.kind != "rmsnorm" or n.attr("offset") or n.attr("post") for n in norms) or len(eps) != 1:
        refuse("norms other than one pre-norm RMSNorm eps (the latents' included)", "norms",
               "use rmsnorm with one eps everywhere")
    head, embed = dict(tops["lm_head"].attrs), dict(tops["embed"].attrs)
    for what, bad in (("tied embeddings", head.get("tie")), ("a head bias or softcap", head.get("bias") or head.get("softcap")),
                      ("a scaled embedding", embed.get("scaled")), ("biases in the latent attention", a.get("bias")),
                      ("a rotary key rotating halves", not a.get("rope_interleave", True))):
        if bad:
            refuse(what, what, "drop it (torchtitan's DeepSeek-V3 has none)")
    rope = dict(a.get("rope_scaling") or ())
    if rope and rope.get("rope_type") != "yarn":
        refuse(f"rope `{rope.get('rope_type')}`", "rope scaling", "use YaRN or no scaling")
    if rope and float(rope.get("mscale", 1.0)) != float(rope.get("mscale_all_dim", 0.0)):
        # transformers scales cos / sin by mscale / mscale_all_dim; torchtitan's rope is a pure rotation and
        # folds mscale_all_dim into the softmax scale only
        refuse(f"YaRN mscale {rope.get('mscale')} != mscale_all_dim {rope.get('mscale_all_dim')}", "`rope_mscale`",
               "make `rope_mscale` equal `rope_mscale_all_dim` (torchtitan's rope is a pure rotation)")
    if e["scoring"] != "sigmoid" or not e["norm_topk_prob"]:
        refuse(f"`{e['scoring']}` scoring" + ("" if e["norm_topk_prob"] else " without renormalised top-k"),
               "`scoring`", "use sigmoid scoring with renormalised top-k (DeepSeek-V3's)")
    if float(e["balance_rate"]):  # type: ignore[arg-type]
        # torchtitan subtracts the update's mean (components/optimizer.py); meshllm's is DeepSeek's sign update
        refuse(f"an expert-bias update of {e['balance_rate']}", "`balance_rate`",
               "torchtitan centres the bias update on zero, meshllm's is sign(mean - load): drop `balance_rate`")
    for key, what in (("capacity", "a capacity factor"), ("aux_loss_coef", "a load-balancing loss"),
                      ("z_loss_coef", "a router z-loss"), ("seq_aux_loss", "a sequence-wise auxiliary loss"),
                      ("router_bias", "a router bias"), ("expert_bias", "biases on the experts")):
        if e.get(key):
            refuse(what, f"`{key}`", f"drop `{key}`")
    if not e.get("shared_expert") or int(e["shared_ffn"]) % int(e["ffn"]):  # type: ignore[arg-type]
        refuse("no whole shared experts", "`shared_experts`", "torchtitan's DeepSeek-V3 always has shared experts")
    groups = int(e["groups"])  # type: ignore[arg-type]
    dense_ffn = build.dense_ffn
    theta = float(a["rope_theta"])  # type: ignore[arg-type]
    return {
        "module": "deepseek_v3", "dim": a["hidden"], "vocab_size": embed["num"], "norm_eps": min(eps),
        "n_layers": build.layers, "n_dense_layers": dense.count if dense else 0,
        "n_heads": a["heads"], "q_lora_rank": a.get("q_lora_rank") or 0, "kv_lora_rank": a["kv_lora_rank"],
        "qk_nope_head_dim": a["qk_nope_head_dim"], "qk_rope_head_dim": a["qk_rope_head_dim"],
        "v_head_dim": a["v_head_dim"], "mscale": float(rope.get("mscale_all_dim", 0.0)) if rope else 0.0,
        "dense_hidden_dim": dense_ffn, "moe_hidden_dim": e["ffn"], "num_experts": e["experts"],
        "num_shared_experts": int(e["shared_ffn"]) // int(e["ffn"]) if e.get("shared_expert") else 0,  # type: ignore[arg-type]
        "top_k": e["top_k"], "groups": groups if groups > 1 else None,
        "limited_groups": int(e["topk_groups"]) if groups > 1 else None,  # type: ignore[arg-type]
        "route_scale": float(e["routed_scaling"]), "theta": theta,  # type: ignore[arg-type]
        "scaling": "yarn" if rope else "none", "rope_factor": float(rope.get("factor", 1.0)),
        "beta_fast": float(rope.get("beta_fast", 32.0)), "beta_slow": float(rope.get("beta_slow", 1.0)),
        "original_seq_len": int(rope.get("original_max_position_embeddings", 4096)),
        "truncate": bool(rope.get("truncate", True)), "max_seq_len": max(plan.seq, 2048),
    }


def _converter(found: _Findings) -> str | None:
    """torchtitan's float8 model converter for `precision { matmul }`: rowwise (Float8LinearConverter) and
    mxfp8 (MXFP8LinearConverter); whole blocks kept in bf16 become `filter_fqns`."""
    plan, decl = found.plan, found.decl
    f8 = plan.float8
    if f8 is None:
        return None
    span = _matmul_span(decl, plan.span)
    if f8.recipe == "fp8_tensorwise":
        found.refuse(E1206, "float8 `fp8_tensorwise` is not a torchtitan 0.3 recipe", span,
                     label="torchtitan's Float8LinearConverter offers rowwise only",
                     help="use `matmul = fp8_rowwise` (or `mxfp8`) to export to torchtitan")
        return None
    converted = {p.split(".")[1] for p, _ in f8.layers if p.startswith("blocks.")}
    skipped = {p.split(".")[1] for p, _ in f8.skipped if p.startswith("blocks.")}
    kept = skipped - converted  # whole blocks in bf16
    partial = sorted(skipped & converted, key=int)
    if partial:
        found.refuse(E1206, f"a part of block {partial[0]} stays in bf16 while the rest is float8", span,
                     label="torchtitan filters float8 by module name",
                     help="keep a whole block in bf16 (`precision blocks.N matmul = bf16`) or none of it")
    filters = [f"layers.{b}" for b in sorted(kept, key=int)] + ["lm_head"]
    if f8.recipe == "fp8_rowwise":
        return (f"Float8LinearConverter.Config(recipe_name='rowwise', filter_fqns={filters!r}, "
                f"model_compile_enabled={plan.compile == 'blocks'})")
    if f8.recipe == "mxfp8":
        if kept:
            found.refuse(E1206, "mxfp8 with blocks kept in bf16 is not exported to torchtitan", span,
                         label="MXFP8LinearConverter selects by fqns", help="convert every block")
        return f"MXFP8LinearConverter.Config(fqns=['layers'], model_compile_enabled={plan.compile == 'blocks'})"
    found.refuse(E1206, f"float8 `{f8.recipe}` is not a torchtitan 0.3 recipe", span, label="recipe",
                 help="use `fp8_rowwise` or `mxfp8`")
    return None


def analyze(plan: PlanIR, decls: Declarations | None) -> TitanExport:
    found = _Findings(plan, _plan_decl(decls, plan.name), "torchtitan")
    decl, refuse = found.decl, found.refuse
    roles, mesh = plan.roles, plan.mesh
    flags: list[tuple[str, str | None]] = []

    model = _model(found)
    _class_placements_ok(found)

    # data parallelism: ZeRO axes -> FSDP shard degree, the other batch axes -> replicate degree
    replicate = mesh.size(*[a for a in roles.batch if a not in roles.batch_shard]) if roles.batch else 1
    # torchtitan's FSDP mesh is dp_shard x cp: ZeRO over a context axis is its own, not a shard degree
    shard_axes = [a for a in roles.batch_shard if a not in roles.context]
    shard = mesh.size(*shard_axes) if shard_axes else 1
    if roles.context and (plan.zero < 2 or not set(roles.context) <= set(roles.batch_shard)):
        refuse(E1203, f"context parallelism over {' x '.join(roles.context)} without ZeRO 2 / 3 over "
               f"{' x '.join(roles.context)}", _zero_span(decl, _seq_span(decl, plan.span)),
               label="torchtitan shards the weights over dp_shard x cp",
               help=f"add the context axes to ZeRO (`zero 3 over ... * {' * '.join(roles.context)}`)")
    if plan.zero == 1:
        refuse(E1202, "ZeRO 1 (optimizer states sharded, weights and gradients whole) has no counterpart in "
               "torchtitan's FSDP2", _zero_span(decl, plan.span), label="zero 1",
               help="use `zero 2` (reshard_after_forward never) or `zero 3` (always)")
    tensor = mesh.size(*roles.tensor) if roles.tensor else 1
    context = mesh.size(*roles.context) if roles.context else 1
    pipeline = mesh.size(roles.pipeline) if roles.pipeline else 1
    expert = mesh.size(*roles.expert) if roles.expert else 1
    # torchtitan's EP borrows from the FSDP x context x tensor ranks (dp_shard * cp * tp = efsdp * ep)
    borrowable = set(shard_axes) | set(roles.context) | set(roles.tensor)
    if roles.expert and not set(roles.expert) <= borrowable:
        other = [a for a in roles.expert if a not in borrowable]
        refuse(E1203, f"experts split over {' x '.join(other)}, which is neither a ZeRO, context nor tensor axis",
               _stmt_span(decl, ast.LayoutStmt, plan.span), label="torchtitan's EP borrows dp_shard x cp x tp",
               help=f"add {' * '.join(other)} to ZeRO 2 / 3 (torchtitan's dp_shard) or split the experts over it")
    if roles.sequence and tuple(roles.sequence) != tuple(roles.tensor):
        refuse(E1203, f"sequence parallelism over {' x '.join(roles.sequence)} but tensor parallelism over "
               f"{' x '.join(roles.tensor)}", _seq_span(decl, plan.span), label="torchtitan's SP is over the TP axis",
               help="split `seq` over the tensor axis")
    if pipeline * replicate * shard * context * tensor != mesh.devices:
        used = set(roles.batch) | set(roles.tensor) | set(roles.context) | {roles.pipeline}
        idle = [a.name for a in mesh.axes if a.name not in used]
        refuse(E1206, f"the mesh has {mesh.devices} devices but torchtitan's degrees multiply to "
               f"{pipeline * replicate * shard * context * tensor}" + (f" (axes {', '.join(idle)} hold replicas "
               "of everything)" if idle else ""), plan.span, label="an axis torchtitan has no degree for",
               help="give every axis a role (batch, tensor, seq, stages)")
    flags += [("parallelism.data_parallel_replicate_degree", str(replicate)),
              ("parallelism.data_parallel_shard_degree", str(shard))]
    if plan.zero >= 2:
        flags.append(("parallelism.fsdp_reshard_after_forward", "always" if plan.zero == 3 else "never"))
    flags.append(("parallelism.tensor_parallel_degree", str(tensor)))
    if tensor > 1 and not roles.sequence:
        flags.append(("parallelism.no-enable_sequence_parallel", None))
    flags.append(("parallelism.context_parallel_degree", str(context)))
    flags.append(("parallelism.expert_parallel_degree", str(expert)))

    # batch: plan.batch is the global batch; torchtitan's local batch is per data-parallel rank per step
    dp = replicate * shard
    flags.append(("parallelism.pipeline_parallel_degree", str(pipeline)))
    if roles.pipeline is not None:
        stage_span = _stmt_span(decl, ast.StagesStmt, plan.span)
        sched = SCHEDULES.get(plan.schedule)
        if sched is None:
            refuse(E1201, f"schedule `{plan.schedule}` is not one torchtitan runs", _stmt_span(decl, ast.ScheduleStmt, stage_span),
                label="pipeline schedule", help=f"use one of {', '.join(SCHEDULES)}")
        counts = []
        for stage in plan.stages:
            n = 0
            for piece in stage.pieces:
                if piece.start is not None:
                    n += piece.stop - piece.start
            counts.append(n)
        if len(set(counts)) != 1:
            refuse(E1201, f"stages of {', '.join(map(str, counts))} blocks: torchtitan's layers per stage are even",
                   stage_span, label="uneven stages", help="balance the stages so each holds as many blocks")
        flags += [("parallelism.pipeline_parallel_schedule", sched or plan.schedule),
                  ("parallelism.pipeline_parallel_layers_per_stage", str(counts[0] if counts else 1)),
                  ("parallelism.pipeline_parallel_first_stage_less_layers", "0"),
                  ("parallelism.pipeline_parallel_last_stage_less_layers", "0"),
                  ("parallelism.pipeline_parallel_microbatch_size", str(max(plan.batch // dp // plan.microbatches, 1))),
                  ("training.disable_cuda_graphs", None)]
        local = plan.batch // dp
    else:
        local = plan.batch // (dp * plan.microbatches)  # microbatches without stages: gradient accumulation
    if expert > 1 and roles.pipeline is None:
        # torchtitan refuses CUDA graphs with its all-to-all token dispatcher (it synchronises with the CPU)
        flags.append(("training.disable_cuda_graphs", None))
    flags += [("training.local_batch_size", str(local)),
              ("training.global_batch_size", str(plan.batch)),
              ("training.seq_len", str(plan.seq))]
    # dtypes: torchtitan trains wholly in training.dtype, or keeps fp32 weights and computes in
    # mixed_precision_param (FSDP2's MixedPrecisionPolicy, autocast under DDP), reducing in fp32
    names = {"bf16": "bfloat16", "fp32": "float32"}
    master = plan.master_dtype or plan.dtype
    pspan = _stmt_span(decl, ast.PrecisionStmt, plan.span)
    if plan.dtype not in names or master not in names or (master != plan.dtype and master != "fp32"):
        refuse(E1206, f"params {plan.dtype} with master weights in {master} is not a torchtitan dtype", pspan,
               label="torchtitan trains in bfloat16 or float32", help="use bf16 or fp32 params (fp32 master)")
    elif plan.reduce_dtype not in (None, "fp32") and master != plan.dtype:
        refuse(E1206, f"gradients reduced in {plan.reduce_dtype} under mixed precision: torchtitan reduces in "
               "float32", pspan, label="mixed_precision_reduce is float32 only", help="use `reduce = fp32`")
    else:
        flags += [("training.dtype", names[master]), ("training.mixed_precision_param", names[plan.dtype])]

    # activation checkpointing
    rspan = _setting_span(decl, "recompute", plan.span)
    sub = {"none": "none", "blocks": "full", "ops": "selective"}.get(plan.recompute)
    if sub is None:
        refuse(E1206, f"`recompute = {plan.recompute}` has no torchtitan policy", rspan,
               label="activation recomputation", help="use `recompute = blocks` (full) or `ops` (selective)")
        sub = "none"
    elif plan.recompute_every != 1:
        refuse(E1206, f"`recompute = {plan.recompute} every {plan.recompute_every}` is not a torchtitan 0.3 policy",
               rspan, label="every N", help="recompute every block")

    # Documents: torchtitan 0.3's language models always attend block-causally within the documents its
    # dataloader packs, positions restarting at each (models/common/config_utils.py get_attention_config,
    # Decoder.get_attention_masks): `pack = documents` with `positions = restart` is its run.
    pack_span = _setting_span(decl, "pack", plan.span)
    if not plan.document_mask:
        found.warnings.append(Diagnostic(
            W1203, "torchtitan masks attention at document boundaries and restarts positions at each document; "
            "this plan attends across them", pack_span, label="attention across documents",
            help="add `pack = documents` and `positions = restart` to describe the run torchtitan trains"))
    elif not plan.restart_positions:
        refuse(E1206, "`pack = documents` with positions continuing over the row: torchtitan restarts them at "
               "every document", pack_span, label="positions continue", help="add `positions = restart`")
    if plan.context_balance == "ptrr":
        flags.append(("parallelism.context_parallel_load_balancer", "ptrr"))
    elif plan.context_balance != "headtail":
        refuse(E1206, f"`context_balance = {plan.context_balance}`: torchtitan balances context ranks head-tail or "
               "by PTRR", _setting_span(decl, "context_balance", plan.span), label="context balance",
               help="use `context_balance = ptrr` (torchtitan's context_parallel_load_balancer) or head-tail")

    # compile
    if plan.compile == "blocks":
        flags += [("compile.enable", None), ("compile.components", "model")]
    converter = _converter(found)
    if found.errors:
        raise SpecError(found.errors)
    assert model is not None
    return TitanExport(tuple(flags), f"activation-checkpoint:{sub}", mesh.devices, model, converter,
                       tuple(found.warnings))


def config_name(plan: PlanIR) -> str:
    return f"meshllm_{plan.name}"


def _registration(module: str, configs: str, base: str, fn: str, conv: str, vocab: object) -> str:
    """The end of every written config_registry module: the model config registered under ``fn`` in
    torchtitan's ``module`` registry, and the function `--config` names (``base``'s trainer config with
    that model, the float8 converters ``conv`` and a chunked cross-entropy over ``vocab``)."""
    return f'''
{module}.{configs}[{fn!r}] = _model


def {fn}() -> Trainer.Config:
    config = _base.{base}()
    config.model_spec = {module}.model_registry({fn!r}, converters={conv})
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size={vocab}))
    return config
'''


def render_config(exp: TitanExport, plan: PlanIR, source_path: str) -> str:
    """The config_registry module `--module` names: the plan's Llama with torchtitan's classes."""
    m = exp.model
    fn = config_name(plan)
    conv = f"[{exp.converter}]" if exp.converter else "None"
    if m["module"] == "qwen3":
        return _render_qwen3(exp, plan, source_path)
    if m["module"] == "deepseek_v3":
        return _render_deepseek(exp, plan, source_path)
    text = f'''"""torchtitan {TORCHTITAN} config_registry for plan `{plan.name}` of {source_path} (written by `meshc export`).

`{fn}()` is torchtitan's llama3_debugmodel() (its optimizer, data and schedule settings) with the
plan's model registered as llama3 flavor `{fn}`; the command line meshc wrote next to it sets the
parallelism, batch, activation checkpointing and compile. The model is built with torchtitan {TORCHTITAN}'s own
llama3 helpers (`_build_llama3_layers`, its init tables), which are private: another torchtitan
version may need the export again. Data, tokenizer (`--hf_assets_path`) and optimizer are the debug
model's: set them with more flags.
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.quantization import Float8LinearConverter, MXFP8LinearConverter  # noqa: F401
from torchtitan.models import llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.llama3 import config_registry as _base
from torchtitan.trainer import Trainer


def _model(attn_backend: str = "flex", tp_gemm_backend: str = "default") -> llama3.Llama3Model.Config:
    dim, n_heads, vocab = {m["dim"]}, {m["n_heads"]}, {m["vocab_size"]}
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            n_layers={m["n_layers"]},
            dim=dim,
            n_heads=n_heads,
            n_kv_heads={m["n_kv_heads"]},
            hidden_dim={m["hidden_dim"]},
            rope=ComplexRoPE.Config(
                dim=dim // n_heads,
                max_seq_len={m["max_seq_len"]},
                theta={m["theta"]!r},
                scaling={m["scaling"]!r},
                scaling_factor={m["scaling_factor"]!r},
                low_freq_factor={m["low_freq_factor"]!r},
                high_freq_factor={m["high_freq_factor"]!r},
                original_max_position_embeddings={m["original_max_position_embeddings"]},
            ),
            attn_backend=attn_backend,
            tp_gemm_backend=tp_gemm_backend,
        ),
    )

'''
    text += _registration("llama3", "llama3_configs", "llama3_debugmodel", fn, conv, m["vocab_size"])
    compile(text, "<torchtitan config>", "exec")
    return text


def _render_qwen3(exp: TitanExport, plan: PlanIR, source_path: str) -> str:
    """The config_registry module for torchtitan's qwen3 (dense, or MoE for the qwen3_moe family)."""
    m = exp.model
    fn = config_name(plan)
    conv = f"[{exp.converter}]" if exp.converter else "None"
    moe = "num_experts" in m
    if moe:
        layers = f"""qwen3._build_qwen3_moe_layers(
        n_layers={m["n_layers"]},
        dim=dim,
        n_heads={m["n_heads"]},
        n_kv_heads={m["n_kv_heads"]},
        head_dim=head_dim,
        moe_hidden_dim={m["hidden_dim"]},
        num_experts={m["num_experts"]},
        top_k={m["top_k"]},
        attn_backend=attn_backend,
        moe_comm_backend=moe_comm_backend,
        rope=rope,
    )
    # meshllm's qwen3_moe routes by the router's scores alone: no auxiliary-loss-free expert bias
    for layer in layers:
        layer.moe.load_balance_coeff = None"""
        base, extra = "qwen3_moe_debug", ', moe_comm_backend: str = "standard"'
    else:
        layers = f"""qwen3._build_qwen3_layers(
        n_layers={m["n_layers"]},
        dim=dim,
        n_heads={m["n_heads"]},
        n_kv_heads={m["n_kv_heads"]},
        head_dim=head_dim,
        hidden_dim={m["hidden_dim"]},
        attn_backend=attn_backend,
        rope=rope,
    )"""
        base, extra = "qwen3_debugmodel", ""
    text = f'''"""torchtitan {TORCHTITAN} config_registry for plan `{plan.name}` of {source_path} (written by `meshc export`).

`{fn}()` is torchtitan's {base}() (its optimizer, data and schedule settings) with the plan's
model registered as qwen3 flavor `{fn}`; the command line meshc wrote next to it sets the
parallelism, batch, activation checkpointing and compile. The model is built with torchtitan {TORCHTITAN}'s own
qwen3 helpers (`{"_build_qwen3_moe_layers" if moe else "_build_qwen3_layers"}`, its init tables), which are private: another
torchtitan version may need the export again. Data, tokenizer (`--hf_assets_path`) and optimizer are the
debug model's: set them with more flags.
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.quantization import Float8LinearConverter, MXFP8LinearConverter  # noqa: F401
from torchtitan.models import qwen3
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.qwen3 import config_registry as _base
from torchtitan.trainer import Trainer


def _model(attn_backend: str = "flex"{extra}) -> qwen3.Qwen3Model.Config:
    dim, head_dim, vocab = {m["dim"]}, {m["head_dim"]}, {m["vocab_size"]}
    rope = CosSinRoPE.Config(
        dim=head_dim,
        max_seq_len={m["max_seq_len"]},
        theta={m["theta"]!r},
        scaling={m["scaling"]!r},
        scaling_factor={m["scaling_factor"]!r},
        low_freq_factor={m["low_freq_factor"]!r},
        high_freq_factor={m["high_freq_factor"]!r},
        original_max_position_embeddings={m["original_max_position_embeddings"]},
    )
    layers = {layers}
    return qwen3.Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        enable_weight_tying={m["tie"]},
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=layers,
    )

'''
    text += _registration("qwen3", "qwen3_configs", base, fn, conv, m["vocab_size"])
    compile(text, "<torchtitan config>", "exec")
    return text


def _render_deepseek(exp: TitanExport, plan: PlanIR, source_path: str) -> str:
    """The config_registry module for torchtitan's deepseek_v3: its `_build_dsv3_layers` with the plan's
    shape, every RMSNorm at the model's eps (torchtitan's default is 1e-5), no expert-bias update."""
    m = exp.model
    fn = config_name(plan)
    conv = f"[{exp.converter}]" if exp.converter else "None"
    text = f'''"""torchtitan {TORCHTITAN} config_registry for plan `{plan.name}` of {source_path} (written by `meshc export`).

`{fn}()` is torchtitan's deepseek_v3_debugmodel() (its optimizer, data and schedule settings) with
the plan's model registered as deepseek_v3 flavor `{fn}`; the command line meshc wrote next to it sets
the parallelism, batch, activation checkpointing and compile. The model is built with torchtitan
{TORCHTITAN}'s own deepseek_v3 helpers (`_build_dsv3_layers`, its init tables), which are private: another
torchtitan version may need the export again. No MTP layers (meshllm's model has none).
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.quantization import Float8LinearConverter, MXFP8LinearConverter  # noqa: F401
from torchtitan.models import deepseek_v3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.deepseek_v3 import config_registry as _base
from torchtitan.trainer import Trainer

EPS = {m["norm_eps"]!r}


def _model(
    attn_backend: str = "flex",
    moe_comm_backend: str = "standard",
    non_blocking_capacity_factor: float | None = None,
    num_mtp_layers: int = 0,
) -> deepseek_v3.DeepSeekV3Model.Config:
    dim, vocab = {m["dim"]}, {m["vocab_size"]}
    layers = deepseek_v3._build_dsv3_layers(
        n_layers={m["n_layers"]},
        n_dense_layers={m["n_dense_layers"]},
        dim=dim,
        n_heads={m["n_heads"]},
        q_lora_rank={m["q_lora_rank"]},
        kv_lora_rank={m["kv_lora_rank"]},
        qk_nope_head_dim={m["qk_nope_head_dim"]},
        qk_rope_head_dim={m["qk_rope_head_dim"]},
        v_head_dim={m["v_head_dim"]},
        mscale={m["mscale"]!r},
        dense_hidden_dim={m["dense_hidden_dim"]},
        moe_hidden_dim={m["moe_hidden_dim"]},
        num_experts={m["num_experts"]},
        num_shared_experts={m["num_shared_experts"]},
        router_top_k={m["top_k"]},
        router_score_func="sigmoid",
        router_num_expert_groups={m["groups"]!r},
        router_num_limited_groups={m["limited_groups"]!r},
        router_route_scale={m["route_scale"]!r},
        router_route_norm=True,
        attn_backend=attn_backend,
        moe_comm_backend=moe_comm_backend,
        non_blocking_capacity_factor=non_blocking_capacity_factor,
        rope=ComplexRoPE.Config(
            dim={m["qk_rope_head_dim"]},
            max_seq_len={m["max_seq_len"]},
            theta={m["theta"]!r},
            scaling={m["scaling"]!r},
            rope_factor={m["rope_factor"]!r},
            beta_fast={m["beta_fast"]!r},
            beta_slow={m["beta_slow"]!r},
            original_seq_len={m["original_seq_len"]},
            truncate={m["truncate"]!r},
        ),
    )
    for layer in layers:
        # the model's eps in every norm, the latents' included (torchtitan's RMSNorm defaults to 1e-5)
        for norm in (layer.attention_norm, layer.ffn_norm, layer.attention.q_norm, layer.attention.kv_norm):
            norm.eps = EPS
        if layer.moe is not None:  # meshllm's correction bias does not move (balance_rate 0)
            layer.moe.load_balance_coeff = None
    return deepseek_v3.DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=deepseek_v3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=EPS, param_init=deepseek_v3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=deepseek_v3._output_linear_init(dim)),
        layers=layers,
        mtp_layers=[],
    )

'''
    text += _registration("deepseek_v3", "deepseekv3_configs", "deepseek_v3_debugmodel", fn, conv, m["vocab_size"])
    compile(text, "<torchtitan config>", "exec")
    return text


def command_args(exp: TitanExport, module: str, plan: PlanIR) -> list[str]:
    """The arguments ConfigManager().parse_args takes (after `-m torchtitan.train`)."""
    args = ["--module", module, "--config", config_name(plan)]
    for key, value in exp.flags:
        args.append(f"--{key}")
        if value is not None:
            args.append(value)
    args.append(exp.subcommand)
    return args


def render_command(exp: TitanExport, plan: PlanIR, source_path: str, module: str, digest: str) -> str:
    lines = [f"--module {shlex.quote(module)}", f"--config {config_name(plan)}"]
    lines += [f"--{key}" if value is None else f"--{key} {shlex.quote(value)}" for key, value in exp.flags]
    lines += ['"$@"', exp.subcommand]
    body = " \\\n  ".join(lines)
    return (f"#!/bin/sh\n# torchtitan {TORCHTITAN} launch for plan `{plan.name}` of {source_path} "
            f"(sha256 {digest}), written by `meshc export --to torchtitan`.\n"
            f"# {module}.py (next to this file) holds the config_registry function `{config_name(plan)}`.\n"
            f'here="$(cd "$(dirname "$0")" && pwd)"\n'
            f'PYTHONPATH="$here${{PYTHONPATH:+:$PYTHONPATH}}" \\\n'
            f"torchrun --nproc_per_node {exp.nproc} -m torchtitan.train \\\n  {body}\n")


def export_torchtitan(plan: PlanIR, decls: Declarations | None, source_path: str, source_text: str,
                      out: Path) -> tuple[dict[Path, str], tuple[Diagnostic, ...]]:
    """{path: text} of the launch script `out` and its config_registry module; SpecError on refusals."""
    from meshllm_dsl.interop.export import _digest

    exp = analyze(plan, decls)
    module = f"{out.stem.replace('-', '_').replace('.', '_')}_config"
    return ({out: render_command(exp, plan, source_path, module, _digest(source_text)),
             out.with_name(module + ".py"): render_config(exp, plan, source_path)}, exp.warnings)


__all__ = ["KEYS", "SCHEDULES", "SUBCOMMANDS", "TARGET", "TitanExport", "analyze", "command_args", "export_torchtitan"]
