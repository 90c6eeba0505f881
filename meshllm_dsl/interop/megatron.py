"""`meshc export --to megatron`: a checked plan as the Megatron-LM `pretrain_gpt.py` argument line.

Megatron-LM takes every setting as a flag (megatron/training/arguments.py; the transformer ones are
generated from megatron-core's TransformerConfig fields): the parallel sizes, the pipeline split
(`--num-layers-per-virtual-pipeline-stage` when every stage holds as many blocks, else
`--pipeline-model-parallel-layout`), the distributed optimizer or Megatron-FSDP for ZeRO, activation
recomputation, bf16 / fp8 and the model's shape. The export writes a shell file with the `torchrun
pretrain_gpt.py` line, one flag a line. Megatron's GPT model is one fixed architecture with switches,
so only what those switches say is exported (the `llama`, `gpt2`, `mixtral`, `qwen2_moe` and
`qwen3_moe` families); Megatron's
tensor-parallel plan is fixed too (q / k / v / gate / up column, o / down row, embedding vocab-parallel,
head column over one tensor group). Everything comes from the checked `PlanIR`; what Megatron cannot
express is a located diagnostic (E1201-E1206), never a silently different plan.

`meshllm_dsl/interop/import_engines.py` reads such a line back into a `.mesh` plan (`FLAGS` below is
the table both sides share).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import E1201, E1203, E1204, E1205, E1206
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

TARGET = "megatron"  # meshc export's --to beside export.TARGETS
MEGATRON = "megatron-core 0.16"

# The flags written (and read back by `meshc import-megatron`), as Megatron-LM's arguments.py spells
# them: flag -> the argparse type of its value, or None for a store_true switch.
FLAGS: dict[str, type | None] = {
    # parallelism (_add_distributed_args and TransformerConfig's parallel fields)
    "--tensor-model-parallel-size": int, "--pipeline-model-parallel-size": int,
    "--num-layers-per-virtual-pipeline-stage": int, "--pipeline-model-parallel-layout": str,
    "--context-parallel-size": int, "--expert-model-parallel-size": int, "--expert-tensor-parallel-size": int,
    "--sequence-parallel": None, "--use-distributed-optimizer": None, "--use-megatron-fsdp": None,
    "--data-parallel-sharding-strategy": str, "--ckpt-format": str,
    # batch; packed documents (GPTDatasetConfig: attention and positions reset after each end-of-document id)
    "--micro-batch-size": int, "--global-batch-size": int, "--seq-length": int,
    "--reset-attention-mask": None, "--reset-position-ids": None,
    # recomputation
    "--recompute-granularity": str, "--recompute-method": str, "--recompute-num-layers": int,
    "--recompute-modules": str,
    # precision
    "--bf16": None, "--grad-reduce-in-bf16": None, "--fp8-format": str, "--fp8-recipe": str,
    "--first-last-layers-bf16": None, "--num-layers-at-start-in-bf16": int, "--num-layers-at-end-in-bf16": int,
    # model shape
    "--num-layers": int, "--hidden-size": int, "--ffn-hidden-size": int, "--num-attention-heads": int,
    "--attention-dropout": float, "--hidden-dropout": float,
    "--group-query-attention": None, "--num-query-groups": int, "--kv-channels": int,
    "--normalization": str, "--norm-epsilon": float, "--swiglu": None, "--openai-gelu": None,
    "--position-embedding-type": str, "--max-position-embeddings": int, "--rotary-base": int,
    "--use-rope-scaling": None, "--rope-scaling-factor": float,
    "--disable-bias-linear": None, "--add-qkv-bias": None, "--qk-layernorm": None,
    "--untie-embeddings-and-output-weights": None, "--vocab-size": int, "--make-vocab-size-divisible-by": int,
    # mixture of experts
    "--num-experts": int, "--moe-router-topk": int, "--moe-ffn-hidden-size": int,
    "--moe-router-load-balancing-type": str, "--moe-z-loss-coeff": float,
    "--moe-token-dispatcher-type": str, "--moe-router-pre-softmax": None,
    "--moe-shared-expert-intermediate-size": int, "--moe-shared-expert-gate": None,
    # DeepSeek-V3-class models: multi-latent attention, YaRN, sigmoid routing with the expert bias,
    # node-limited groups, dense first blocks (the MoE layer pattern); GLM-4.5's partial rotary
    "--multi-latent-attention": None, "--q-lora-rank": int, "--kv-lora-rank": int, "--qk-head-dim": int,
    "--qk-pos-emb-head-dim": int, "--v-head-dim": int, "--rope-type": str, "--rotary-scaling-factor": float,
    "--mscale": float, "--mscale-all-dim": float, "--rotary-percent": float,
    "--moe-router-score-function": str, "--moe-router-enable-expert-bias": None,
    "--moe-router-bias-update-rate": float, "--moe-router-num-groups": int, "--moe-router-group-topk": int,
    "--moe-router-topk-scaling-factor": float, "--moe-router-dtype": str, "--moe-layer-freq": str,
}

# Models of DeepSeek-V3's build (embed, dense blocks, then moe blocks, norm, head): the deepseek_v3 and
# glm4_moe families, or a primitives model of that shape (examples/deepseek_v3_671b.mesh).
LAYERED_FAMILIES = ("deepseek_v3", "glm4_moe")
# What Megatron-LM has no flag for in multi-latent attention's YaRN (MLATransformerConfig's defaults).
_MLA_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}

# meshllm's mixture-of-experts families Megatron's GPT model expresses: Mixtral's router, Qwen2-MoE's
# (a gated shared expert, q / k / v biases), Qwen3-MoE's (per-head q / k norms).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")

# meshllm's zero stage -> the Megatron switches that shard the same states over the data-parallel
# group: the distributed optimizer (optimizer states, ZeRO 1), Megatron-FSDP's sharding strategies
# (arguments.py: Megatron-FSDP runs with the distributed optimizer and the fsdp_dtensor checkpoints).
ZERO: dict[int, tuple[tuple[str, str | None], ...]] = {
    1: (("--use-distributed-optimizer", None),),
    2: (("--use-distributed-optimizer", None), ("--use-megatron-fsdp", None),
        ("--data-parallel-sharding-strategy", "optim_grads"), ("--ckpt-format", "fsdp_dtensor")),
    3: (("--use-distributed-optimizer", None), ("--use-megatron-fsdp", None),
        ("--data-parallel-sharding-strategy", "optim_grads_params"), ("--ckpt-format", "fsdp_dtensor")),
}

# Megatron's llama3 rope scaling (RotaryEmbedding._apply_scaling) fixes these; only the factor is a flag.
_ROPE_LLAMA3 = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_positions": 8192}

# Megatron's tensor-parallel plan in the plan's leaf names (megatron/core/models/gpt): fixed.
_TOP_RULES = {"embed": "vocab_parallel", "pos": "replicate", "norm": "replicate", "lm_head": "column"}
_BLOCK_RULES = {"attn_norm": "replicate", "mlp_norm": "replicate", "attn.q": "column", "attn.k": "column",
                "attn.v": "column", "attn.qkv": "column", "attn.o": "row", "mlp.gate": "column",
                "mlp.up": "column", "mlp.down": "row", "mlp.router": "replicate", "mlp.shared_gate": "column",
                "mlp.shared_up": "column", "mlp.shared_down": "row", "mlp.shared_router": "replicate",
                # multi-latent attention: the down-projections duplicated on every rank, the up-projections column
                "attn.q_a": "replicate", "attn.kv_a": "replicate", "attn.q_b": "column", "attn.kv_b": "column"}


@attrs.frozen
class MegatronExport:
    """What the launch line says, decided once."""

    flags: tuple[tuple[str, str | None], ...]  # (--flag, value or None for a switch)
    nproc: int


def _v(x: Any) -> str:
    return str(getattr(x, "name", x))


def _model(found: _Findings) -> list[tuple[str, str | None]]:
    """The model-shape flags of Megatron's GPT model for the plan's model, or refusals."""
    plan = found.plan
    m = plan.model
    span = m.span or plan.span
    v = dict(m.values)
    units = [u for item in m.items for u in (item.body if isinstance(item, Repeat) else (item,))]
    routes = any(primitives.of(u).routes_experts for u in units)
    if m.family in LAYERED_FAMILIES or (m.family is None and any(u.kind == "mla" for u in units)):
        return _layered_model(found)
    if m.family not in ("llama", "gpt2", *MOE_FAMILIES) or routes != (m.family in MOE_FAMILIES):
        found.refuse(E1204, f"model `{m.name}` (the `{m.family or 'primitives'}` family) is not exported to Megatron",
                     span, label="no Megatron GPT switches for this",
                     help="export a model of the `llama`, `gpt2`, `mixtral`, `qwen2_moe`, `qwen3_moe`, "
                          "`deepseek_v3` or `glm4_moe` family")
        return []

    def refuse(key: str, what: str, help: str) -> None:  # noqa: A002
        found.refuse(E1204, f"model `{m.name}` has {what}, which Megatron's GPT model does not", span,
                     label=f"`{key}` = {_v(v.get(key))}", help=help)

    # meshllm's models have no dropout; Megatron's TransformerConfig defaults to 0.1 on both
    flags: list[tuple[str, str | None]] = [
        ("--num-layers", str(v["layers"])), ("--hidden-size", str(v["hidden"])),
        ("--ffn-hidden-size", str(v["ffn"])), ("--num-attention-heads", str(v["heads"])),
        ("--attention-dropout", "0.0"), ("--hidden-dropout", "0.0")]
    if v.get("vocab_used", v["vocab"]) != v["vocab"]:
        refuse("vocab_used", "a loss over fewer logits than the vocabulary", "drop `vocab_used`")
    if m.family == "gpt2":
        # GPT-2: LayerNorm, tanh GELU (Megatron's openai_gelu), learned positions, biases, tied head
        flags += [("--normalization", "LayerNorm"), ("--norm-epsilon", repr(float(v["norm_eps"]))),
                  ("--openai-gelu", None), ("--position-embedding-type", "learned_absolute"),
                  ("--max-position-embeddings", str(v["positions"]))]
        if not v.get("tie_embeddings", True):
            flags.append(("--untie-embeddings-and-output-weights", None))
    else:
        if v["kv_heads"] != v["heads"]:
            flags += [("--group-query-attention", None), ("--num-query-groups", str(v["kv_heads"]))]
        if v["head_dim"] * v["heads"] != v["hidden"]:
            flags.append(("--kv-channels", str(v["head_dim"])))
        theta = float(v["rope_theta"])
        if theta != int(theta):
            refuse("rope_theta", "a fractional rope base", "Megatron's --rotary-base is an integer")
        flags += [("--normalization", "RMSNorm"), ("--norm-epsilon", repr(float(v["norm_eps"]))),
                  ("--swiglu", None), ("--position-embedding-type", "rope"),
                  ("--max-position-embeddings", str(plan.seq)), ("--rotary-base", str(int(theta))),
                  ("--disable-bias-linear", None)]
        rope_type = _v(v.get("rope_type", "default"))
        if rope_type == "llama3" and float(v["rope_factor"]) != 1.0:  # factor 1: the default rope
            odd = [k for k, want in _ROPE_LLAMA3.items() if float(v[k]) != want]
            if odd:
                refuse(odd[0], "llama3 rope with other constants than Megatron's (low 1, high 4, original 8192)",
                       f"drop `{odd[0]}`")
            flags += [("--use-rope-scaling", None), ("--rope-scaling-factor", repr(float(v["rope_factor"])))]
        elif rope_type not in ("default", "llama3"):
            refuse("rope_type", f"rope `{rope_type}`", "use the default or the llama3 rope")
        if v.get("attn_bias", m.family == "qwen2_moe"):  # the family's fixed q / k / v biases
            flags.append(("--add-qkv-bias", None))
        if v.get("attn_out_bias", False):
            refuse("attn_out_bias", "a bias on the attention output alone", "drop `attn_out_bias`")
        qk = _v(v.get("qk_norm", "head" if m.family == "qwen3_moe" else "none"))  # qwen3_moe: fixed per head
        if qk == "head":
            flags.append(("--qk-layernorm", None))
        elif qk != "none":
            refuse("qk_norm", f"q / k norms over `{qk}`", "use `qk_norm = head` (Megatron's --qk-layernorm)")
        if v.get("window", 0):
            refuse("window", "sliding-window attention", "drop `window`")
        if not v.get("tie_embeddings", False):
            flags.append(("--untie-embeddings-and-output-weights", None))
    # no padding: the plan's vocabulary is the model's (meshllm splits it over the tensor axis as it is)
    flags += [("--vocab-size", str(v["vocab"])), ("--make-vocab-size-divisible-by", "1")]
    if m.family in MOE_FAMILIES:
        # Megatron's router: softmax over the top-k scores (= the renormalised top-k of Mixtral and
        # norm_topk_prob), or with --moe-router-pre-softmax the top-k of the softmax as they are; dropless
        flags += [("--num-experts", str(v["experts"])), ("--moe-router-topk", str(v["top_k"])),
                  ("--moe-ffn-hidden-size", str(v["ffn"])), ("--moe-token-dispatcher-type", "alltoall")]
        if not v.get("norm_topk_prob", True):
            flags.append(("--moe-router-pre-softmax", None))
        if "shared_ffn" in v:  # Qwen2-MoE's shared expert, gated by sigmoid(a linear of the input)
            flags += [("--moe-shared-expert-intermediate-size", str(v["shared_ffn"])), ("--moe-shared-expert-gate", None)]
        if float(v["capacity"]):
            refuse("capacity", "a capacity factor", "drop `capacity` (Megatron's dropless routing)")
        if float(v["aux_loss_coef"]):
            # meshllm's is transformers' load_balancing_loss_func over every layer's router logits at once (a
            # product of sums); Megatron adds one switch loss per layer (a sum of products): another loss
            refuse("aux_loss_coef", "transformers' load-balancing loss over all layers at once",
                   "drop `aux_loss_coef` (Megatron adds a load-balancing loss per layer)")
        flags.append(("--moe-router-load-balancing-type", "none"))
        if float(v["z_loss_coef"]):
            flags.append(("--moe-z-loss-coeff", repr(float(v["z_loss_coef"]))))
    return flags


def _layered_model(found: _Findings) -> list[tuple[str, str | None]]:
    """The flags of a DeepSeek-V3-class model: embed, optionally a repeat of dense blocks, a repeat of
    moe blocks (each rmsnorm, attention or multi-latent attention, rmsnorm, mlp / moe), norm, head.
    Megatron's layers are the blocks in order; `--moe-layer-freq` says which are dense."""
    plan = found.plan
    m = plan.model
    span = m.span or plan.span

    def refuse(what: str, label: str, help: str) -> None:  # noqa: A002
        found.refuse(E1204, f"model `{m.name}` has {what}, which Megatron's GPT model does not", span,
                     label=label, help=help)

    build = layered_build(m)
    if build is None:
        refuse("another build than embed, dense blocks, moe blocks, norm, head", "not Megatron's decoder",
               "export a model of DeepSeek-V3's build (a `deepseek_v3` or `glm4_moe` family model)")
        return []
    tops, dense, bodies = build.tops, build.dense, build.bodies
    attn, moe = build.attn, build.experts
    a, e = dict(attn.attrs), dict(moe.attrs)
    if not build.same_attention():
        refuse("dense and moe blocks with different attention", "attention differs", "give every block the same attention")
    norms = build.norms()
    eps = {float(n.attr("eps")) for n in norms}  # type: ignore[arg-type]
    if any(n.kind != "rmsnorm" or n.attr("offset") or n.attr("post") for n in norms) or len(eps) != 1:
        refuse("norms other than one pre-norm RMSNorm eps", "norms", "use rmsnorm with one eps everywhere")
    head, embed = dict(tops["lm_head"].attrs), dict(tops["embed"].attrs)
    if head.get("bias") or head.get("softcap") or embed.get("scaled"):
        refuse("a head bias, logit softcap or scaled embedding", "lm_head / embed", "drop them")
    layers, dense_ffn = build.layers, build.dense_ffn
    if dense is not None and (bodies[0]["mlp"].attr("act") != "swiglu" or bodies[0]["mlp"].attr("bias")):
        refuse("a dense MLP other than SwiGLU without biases", "dense mlp", "use a SwiGLU mlp")
    flags: list[tuple[str, str | None]] = [
        ("--num-layers", str(layers)), ("--hidden-size", str(a["hidden"])), ("--ffn-hidden-size", str(dense_ffn)),
        ("--num-attention-heads", str(a["heads"])), ("--attention-dropout", "0.0"), ("--hidden-dropout", "0.0"),
        ("--normalization", "RMSNorm"), ("--norm-epsilon", repr(min(eps))), ("--swiglu", None),
        ("--position-embedding-type", "rope"), ("--max-position-embeddings", str(plan.seq))]
    theta = float(a["rope_theta"])  # type: ignore[arg-type]
    if theta != int(theta):
        refuse("a fractional rope base", "`rope_theta`", "Megatron's --rotary-base is an integer")
    flags.append(("--rotary-base", str(int(theta))))
    rope = dict(a.get("rope_scaling") or ())
    if attn.kind == "mla":
        # Megatron's MLA: the latents' norms are its q / kv layernorms; it de-interleaves the rotary
        # halves as DeepSeek's checkpoints do (transformers' rope_interleave)
        flags += [("--multi-latent-attention", None)]
        if a.get("q_lora_rank") is not None:
            flags.append(("--q-lora-rank", str(a["q_lora_rank"])))
        flags += [("--kv-lora-rank", str(a["kv_lora_rank"])), ("--qk-head-dim", str(a["qk_nope_head_dim"])),
                  ("--qk-pos-emb-head-dim", str(a["qk_rope_head_dim"])), ("--v-head-dim", str(a["v_head_dim"])),
                  ("--qk-layernorm", None)]
        if a.get("bias"):
            refuse("biases in the latent attention", "mla bias", "drop the bias")
        if not a.get("rope_interleave", True):
            refuse("a rotary key without DeepSeek's interleaving", "`rope_interleave` = false",
                   "Megatron's MLA de-interleaves the rotary halves (transformers' rope_interleave)")
        if float(a.get("norm_eps", min(eps))) != min(eps):  # type: ignore[arg-type]
            refuse("latent norms of another eps than the blocks'", "mla norm_eps", "use one eps")
        if rope.get("rope_type") == "yarn":
            for key, want in _MLA_YARN_FIXED.items():
                if rope.get(key, want) != want and float(rope.get(key, want)) != float(want):
                    refuse(f"YaRN `{key}` = {rope.get(key)} (Megatron-LM has no flag for it: MLATransformerConfig's "
                           f"{want})", f"`rope_{'original_positions' if key.startswith('original') else key}`",
                           f"set it to {want}")
            flags += [("--rope-type", "yarn"), ("--rotary-scaling-factor", repr(float(rope["factor"]))),
                      ("--mscale", repr(float(rope.get("mscale", 1.0)))),
                      ("--mscale-all-dim", repr(float(rope.get("mscale_all_dim", 0.0))))]
        elif rope:
            refuse(f"rope `{rope.get('rope_type')}` in the latent attention", "rope scaling", "use yarn or none")
        else:
            flags.append(("--rope-type", "rope"))
    else:  # GLM-4.5's attention: GQA, q / k / v biases, per-head q / k norms, a partial rotary
        if a["kv_heads"] != a["heads"]:
            flags += [("--group-query-attention", None), ("--num-query-groups", str(a["kv_heads"]))]
        if int(a["head_dim"]) * int(a["heads"]) != int(a["hidden"]):  # type: ignore[arg-type]
            flags.append(("--kv-channels", str(a["head_dim"])))
        rot = int(a.get("rotary_dim") or a["head_dim"])  # type: ignore[arg-type]
        if rot != a["head_dim"]:
            flags.append(("--rotary-percent", repr(rot / int(a["head_dim"]))))  # type: ignore[arg-type]
        if a.get("bias"):
            flags.append(("--add-qkv-bias", None))
        if a.get("qk_norm") == "head":
            flags.append(("--qk-layernorm", None))
            if float(a.get("qk_norm_eps", min(eps))) != min(eps) or a.get("qk_norm_offset"):  # type: ignore[arg-type]
                refuse("q / k norms of another eps than the blocks'", "qk_norm_eps", "use one eps")
        elif a.get("qk_norm") not in (None, "none"):
            refuse(f"q / k norms over `{a.get('qk_norm')}`", "`qk_norm`", "use `qk_norm = head`")
        for key, what in (("out_bias", "a bias on the attention output"), ("window", "sliding-window attention"),
                          ("softcap", "an attention softcap"), ("sinks", "attention sinks"),
                          ("fused_qkv", "a fused q / k / v projection")):
            if a.get(key):
                refuse(what, f"`{key}`", f"drop `{key}`")
        if rope:
            refuse(f"rope `{rope.get('rope_type')}` scaling", "rope scaling", "use the default rope")
        if a.get("scale_dim", a["head_dim"]) != a["head_dim"]:
            refuse("an attention scale of another width than head_dim", "scale_dim", "drop it")
    flags += [("--disable-bias-linear", None), ("--untie-embeddings-and-output-weights", None)]
    if head.get("tie"):
        refuse("tied embeddings", "`tie_embeddings`", "untie them (DeepSeek-V3 and GLM-4.5 do)")
    flags += [("--vocab-size", str(embed["num"])), ("--make-vocab-size-divisible-by", "1")]

    # the moe layers: Megatron's router (sigmoid scores, the expert bias for choosing, top-k renormalised and
    # scaled), groups scored by their top topk / group_topk experts (DeepSeek's top 2), dropless
    k, groups, chosen_groups = int(e["top_k"]), int(e["groups"]), int(e["topk_groups"])  # type: ignore[arg-type]
    flags += [("--num-experts", str(e["experts"])), ("--moe-router-topk", str(k)),
              ("--moe-ffn-hidden-size", str(e["ffn"])), ("--moe-token-dispatcher-type", "alltoall")]
    if dense is not None:
        flags.append(("--moe-layer-freq", f"([0]*{dense.count}+[1]*{build.moe.count})"))
    if e["scoring"] == "sigmoid":
        if not e["norm_topk_prob"] and k > 1:
            refuse("sigmoid top-k weights not renormalised", "`norm_topk_prob` = false",
                   "Megatron renormalises sigmoid top-k weights")
        flags += [("--moe-router-score-function", "sigmoid"), ("--moe-router-enable-expert-bias", None),
                  ("--moe-router-bias-update-rate", repr(float(e["balance_rate"])))]  # type: ignore[arg-type]
    else:
        refuse(f"`{e['scoring']}` scoring in a DeepSeek-V3-class model", "`scoring`", "use sigmoid scoring")
    if groups > 1:
        if k % chosen_groups or k // chosen_groups != 2:
            refuse(f"groups scored by their top 2 experts with top_k {k} of {chosen_groups} groups (Megatron scores "
                   f"a group by its top top_k / topk_groups = {k // chosen_groups})", "`topk_groups`",
                   "make top_k twice topk_groups (DeepSeek-V3: 8 of 4 groups)")
        flags += [("--moe-router-num-groups", str(groups)), ("--moe-router-group-topk", str(chosen_groups))]
    if float(e["routed_scaling"]) != 1.0:  # type: ignore[arg-type]
        flags.append(("--moe-router-topk-scaling-factor", repr(float(e["routed_scaling"]))))  # type: ignore[arg-type]
    if e.get("weights_fp32"):
        flags.append(("--moe-router-dtype", "fp32"))  # the router's scores in fp32, as DeepSeek's
    if e.get("shared_expert"):
        flags.append(("--moe-shared-expert-intermediate-size", str(e["shared_ffn"])))
    for key, what in (("capacity", "a capacity factor"), ("aux_loss_coef", "transformers' load-balancing loss"),
                      ("seq_aux_loss", "a sequence-wise auxiliary loss"), ("router_bias", "a router bias"),
                      ("expert_bias", "biases on the experts")):
        if e.get(key):
            refuse(what, f"`{key}`", f"drop `{key}`")
    if e.get("act") != "swiglu":
        refuse(f"experts with `{e.get('act')}`", "`act`", "use SwiGLU experts")
    flags.append(("--moe-router-load-balancing-type", "none"))
    if float(e["z_loss_coef"]):  # type: ignore[arg-type]
        flags.append(("--moe-z-loss-coeff", repr(float(e["z_loss_coef"]))))  # type: ignore[arg-type]
    return flags


def _placements_ok(found: _Findings) -> tuple[str, ...]:
    """The tensor axis of Megatron's fixed tensor-parallel plan (none: everything replicated)."""
    plan = found.plan
    if len(plan.roles.tensor) > 1:
        found.refuse(E1205, f"Megatron has one tensor-parallel group, but this plan shards over "
                     f"{' and '.join(plan.roles.tensor)}", plan.span, label="several tensor axes",
                     help="shard every layer over one tensor axis")
        return ()
    axis = plan.roles.tensor
    got = [(path, p, _TOP_RULES.get(path)) for path, p in plan.top_placements]
    for bc in plan.block_classes:
        got += [(f"blocks.{bc.indices[0]}.{path}", p, _BLOCK_RULES.get(path)) for path, p in bc.placements]
    for path, p, want in got:
        want = want if axis else "replicate"
        ok = want is not None and (p.rule == want and (tuple(p.axes) == axis if want != "replicate" else not p.sharded))
        if not ok:
            rule = f"{p.rule}({', '.join(p.axes)})" if p.axes else p.rule
            found.refuse(E1205, f"`{path}` is {rule}, but Megatron's tensor-parallel plan makes it {want}"
                         + (f"({axis[0]})" if want not in (None, "replicate") else ""), p.span or plan.span,
                         label="Megatron's TP plan is fixed",
                         help="shard q / k / v / gate / up column, o / down row, embed vocab_parallel and "
                              "lm_head column over the tensor axis, norms and the router replicated")
            return axis
    return axis


def _pipeline(found: _Findings, pp: int) -> list[tuple[str, str | None]]:
    """Megatron's pipeline split: virtual stages in round-robin order (stage i on rank i % pp), the
    embedding on the first and the head on the last; even stages as layers per virtual stage, uneven
    ones as the layout string."""
    plan, decl = found.plan, found.decl
    span = _stmt_span(decl, ast.StagesStmt, plan.span)
    want = "interleaved_1f1b" if plan.virtual > 1 else "1f1b"
    if plan.schedule != want:
        found.refuse(E1201, f"schedule `{plan.schedule}` with {plan.virtual} virtual stage(s) is not one Megatron runs",
                     _stmt_span(decl, ast.ScheduleStmt, span), label="pipeline schedule",
                     help=f"use `schedule {want}` (Megatron runs 1F1B, interleaved with virtual stages)")
    counts: list[int] = []
    last = len(plan.stages) - 1
    # Megatron's decoder: the blocks, or DeepSeek-V3's dense blocks then moe blocks (one layer list)
    decoder = ("dense", "blocks") if plan.model.family in LAYERED_FAMILIES or any(
        isinstance(it, Repeat) and it.name == "dense" for it in plan.model.items) else ("blocks",)
    for stage in plan.stages:
        if stage.coord != stage.index % pp:
            found.refuse(E1201, f"stage {stage.index} runs on pipeline rank {stage.coord}: Megatron places virtual "
                         f"stage i on rank i % {pp}", span, label="stage order",
                         help="place the stages round-robin (`stages over P virtual V balanced`)")
            return []
        n = 0
        for piece in stage.pieces:
            if piece.start is not None and piece.stop is not None:
                if piece.item not in decoder:
                    found.refuse(E1201, f"repeat `{piece.item}` is not Megatron's decoder", span, label="repeat",
                                 help="export a model whose blocks are one repeat (or dense then moe blocks)")
                n += piece.stop - piece.start
            else:
                edge = 0 if piece.item in ("embed", "pos") else last
                if stage.index != edge:
                    found.refuse(E1201, f"`{piece.item}` is on stage {stage.index}: Megatron keeps the embedding on "
                                 "the first stage and the final norm and head on the last", span,
                                 label="stage contents", help="leave embed first and norm / lm_head last")
        counts.append(n)
    flags: list[tuple[str, str | None]] = [("--pipeline-model-parallel-size", str(pp))]
    if len(set(counts)) == 1:
        if plan.virtual > 1:
            flags.append(("--num-layers-per-virtual-pipeline-stage", str(counts[0])))
    else:
        layout = "|".join(("E" if i == 0 else "") + "t" * n + ("L" if i == last else "") for i, n in enumerate(counts))
        flags.append(("--pipeline-model-parallel-layout", layout))
    return flags


def _precision(found: _Findings) -> list[tuple[str, str | None]]:
    plan, decl = found.plan, found.decl
    pspan = _stmt_span(decl, ast.PrecisionStmt, plan.span)
    master = plan.master_dtype or plan.dtype
    reduce = plan.reduce_dtype or plan.dtype
    if plan.dtype == "fp32" and master == "fp32" and reduce == "fp32":
        return []
    if plan.dtype == "bf16" and master == "fp32" and reduce in ("fp32", "bf16"):
        # Megatron's --bf16 keeps fp32 main weights and reduces gradients in fp32 unless told bf16
        return [("--bf16", None)] + ([("--grad-reduce-in-bf16", None)] if reduce == "bf16" else [])
    found.refuse(E1206, f"params {plan.dtype}, master weights {master}, gradients reduced in {reduce}: not a "
                 "Megatron precision", pspan, label="Megatron trains in fp32, or bf16 with fp32 main weights",
                 help="use fp32, or `precision { params = bf16, master = fp32, reduce = fp32 }`")
    return []


def _float8(found: _Findings) -> list[tuple[str, str | None]]:
    """Transformer Engine's recipes: tensorwise (e4m3 forward, e5m2 gradients: `hybrid`) and mxfp8;
    whole blocks first / last kept in bf16 (`--first-last-layers-bf16`); the head is never fp8 there."""
    plan, decl = found.plan, found.decl
    f8 = plan.float8
    if f8 is None:
        return []
    span = _matmul_span(decl, plan.span)
    recipe = {"fp8_tensorwise": ("hybrid", "tensorwise"), "mxfp8": ("e4m3", "mxfp8")}.get(f8.recipe)
    if recipe is None:
        found.refuse(E1206, f"float8 `{f8.recipe}` is not a Transformer Engine recipe Megatron takes", span,
                     label="recipe", help="use `fp8_tensorwise` or `mxfp8`")
        return []
    if any(not p.startswith("blocks.") for p, _ in f8.layers):
        found.refuse(E1206, "a layer outside the blocks computes in float8: Megatron's head stays in bf16", span,
                     label="float8 outside the decoder", help="keep `lm_head` in bf16")
    converted = {int(p.split(".")[1]) for p, _ in f8.layers if p.startswith("blocks.")}
    skipped = {int(p.split(".")[1]) for p, _ in f8.skipped if p.startswith("blocks.")}
    if skipped & converted:
        found.refuse(E1206, f"a part of block {min(skipped & converted)} stays in bf16 while the rest is float8", span,
                     label="Megatron converts whole blocks", help="keep a whole block in bf16 or none of it")
    layers = dict(plan.model.values)["layers"]
    kept = sorted(set(range(layers)) - converted)
    start = next((i for i in range(layers) if i not in kept), layers)
    end = layers - 1 - next((i for i in range(layers - 1, -1, -1) if i not in kept), -1)
    if len(kept) != start + end:
        found.refuse(E1206, "blocks kept in bf16 in the middle of the stack", span, label="bf16 blocks",
                     help="keep only first and last blocks in bf16 (Megatron's --first-last-layers-bf16)")
    flags: list[tuple[str, str | None]] = [("--fp8-format", recipe[0]), ("--fp8-recipe", recipe[1])]
    if kept:
        flags += [("--first-last-layers-bf16", None), ("--num-layers-at-start-in-bf16", str(start)),
                  ("--num-layers-at-end-in-bf16", str(end))]
    return flags


def analyze(plan: PlanIR, decls: Declarations | None) -> MegatronExport:
    found = _Findings(plan, _plan_decl(decls, plan.name), TARGET)
    decl, refuse = found.decl, found.refuse
    roles, mesh = plan.roles, plan.mesh
    model = _model(found)
    axis = _placements_ok(found) if model else tuple(plan.roles.tensor)  # a refused model's leaves are not Megatron's
    tp = mesh.size(*axis) if axis else 1
    cp = plan.context_size
    pp = plan.pipeline_size
    dp = plan.data_size
    ep = mesh.size(*roles.expert) if roles.expert else 1
    flags: list[tuple[str, str | None]] = [("--tensor-model-parallel-size", str(tp))]
    if pp * dp * cp * tp != mesh.devices:
        used = set(roles.batch) | set(roles.tensor) | set(roles.context) | {roles.pipeline}
        idle = [a.name for a in mesh.axes if a.name not in used]
        refuse(E1206, f"the mesh has {mesh.devices} devices but Megatron's sizes multiply to {pp * dp * cp * tp}"
               + (f" (axes {', '.join(idle)} hold replicas of everything)" if idle else ""), plan.span,
               label="an axis Megatron has no group for", help="give every axis a role (batch, tensor, seq, stages)")
    if roles.sequence:
        if tuple(roles.sequence) != axis:
            refuse(E1203, f"sequence parallelism over {' x '.join(roles.sequence)}, not the tensor axis",
                   _seq_span(decl, plan.span), label="Megatron's SP is over the TP group",
                   help="split `seq` over the tensor axis")
        flags.append(("--sequence-parallel", None))
    if pp > 1:
        flags += _pipeline(found, pp)
    if cp > 1:
        flags.append(("--context-parallel-size", str(cp)))
    if ep > 1:
        # experts split over the expert axes; within them, the experts' ffn over the tensor axis like a dense one
        flags += [("--expert-model-parallel-size", str(ep)), ("--expert-tensor-parallel-size", str(tp))]
    if plan.zero:
        # Megatron shards over its whole data-parallel group (data x context)
        if set(roles.batch_shard) != set(roles.replicas):
            refuse(E1206, f"ZeRO over {' x '.join(roles.batch_shard)} but the replicas are "
                   f"{' x '.join(roles.replicas)}", _zero_span(decl, plan.span),
                   label="Megatron shards over the whole data-parallel group",
                   help=f"shard over every replica axis (`zero {plan.zero} over {' * '.join(roles.replicas)}`)")
        flags += list(ZERO[plan.zero])
    if plan.batch % (dp * plan.microbatches):
        refuse(E1206, f"batch {plan.batch} is not {dp} replicas x {plan.microbatches} microbatches x a micro batch",
               plan.span, label="Megatron's global batch = micro x data-parallel x microbatches",
               help="make the batch a multiple of data-parallel size x microbatches")
    flags += [("--micro-batch-size", str(max(plan.batch // (dp * plan.microbatches), 1))),
              ("--global-batch-size", str(plan.batch)), ("--seq-length", str(plan.seq))]
    # `pack = documents`: Megatron's GPTDataset masks attention after each end-of-document id (our
    # corpora end every document with one, runtime/data/packing.py) and `positions = restart` resets
    # the position ids there; its context parallelism splits every sequence head-tail.
    if plan.document_mask:
        flags.append(("--reset-attention-mask", None))
    if plan.restart_positions:
        flags.append(("--reset-position-ids", None))
    if plan.context_balance != "headtail":
        refuse(E1206, f"`context_balance = {plan.context_balance}`: Megatron's context parallelism splits every "
               "sequence head-tail", _setting_span(decl, "context_balance", plan.span), label="context balance",
               help="drop `context_balance` (head-tail)")
    rspan = _setting_span(decl, "recompute", plan.span)
    if plan.recompute_every != 1:
        refuse(E1206, f"`recompute = {plan.recompute} every {plan.recompute_every}` is not a Megatron policy", rspan,
               label="every N", help="recompute every block")
    if plan.recompute == "blocks":
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                  ("--recompute-num-layers", "1")]
    elif plan.recompute == "attention":
        flags += [("--recompute-granularity", "selective"), ("--recompute-modules", "core_attn")]
    elif plan.recompute != "none":
        refuse(E1206, f"`recompute = {plan.recompute}` has no Megatron policy", rspan,
               label="Megatron recomputes whole layers or modules",
               help="use `recompute = blocks` (full) or `attention` (selective core_attn)")
    flags += _precision(found) + _float8(found)
    if plan.compile != "none":
        refuse(E1206, f"`compile = {plan.compile}`: Megatron-LM has no torch.compile switch",
               _setting_span(decl, "compile", plan.span), label="compile", help="drop `compile`")
    if found.errors:
        raise SpecError(found.errors)
    return MegatronExport(tuple(flags + model), mesh.devices)


def command_args(exp: MegatronExport) -> list[str]:
    """The arguments pretrain_gpt.py takes, as a list."""
    args: list[str] = []
    for flag, value in exp.flags:
        args.append(flag)
        if value is not None:
            args.append(value)
    return args


def render_command(exp: MegatronExport, plan: PlanIR, source_path: str, digest: str) -> str:
    lines = [flag if value is None else f"{flag} {shlex.quote(value)}" for flag, value in exp.flags]
    body = " \\\n  ".join([*lines, '"$@"'])
    return (f"#!/bin/sh\n# Megatron-LM ({MEGATRON}) launch for plan `{plan.name}` of {source_path} (sha256 {digest}), "
            f"written by `meshc export --to megatron`.\n"
            f"# Run it in a Megatron-LM checkout; data, tokenizer, optimizer and checkpoint flags follow as \"$@\".\n"
            f"torchrun --nproc_per_node {exp.nproc} pretrain_gpt.py \\\n  {body}\n")


def export_megatron(plan: PlanIR, decls: Declarations | None, source_path: str, source_text: str,
                    out: Path) -> tuple[dict[Path, str], tuple[Diagnostic, ...]]:
    """{path: text} of the launch script `out`; SpecError on refusals."""
    from meshllm_dsl.interop.export import _digest

    exp = analyze(plan, decls)
    return {out: render_command(exp, plan, source_path, _digest(source_text))}, ()


__all__ = ["FLAGS", "TARGET", "ZERO", "MegatronExport", "analyze", "command_args", "export_megatron"]
