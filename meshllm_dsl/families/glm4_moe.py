"""The GLM-4.5 pack: `Glm4MoeForCausalLM` (config.json `model_type` "glm4_moe") is the `glm4_moe` family.

What a GLM-4.5 config says: grouped-query attention (`num_attention_heads`, `num_key_value_heads`,
`head_dim`) with q, k, v biases where `attention_bias` (o has none), q and k normalised per head where
`use_qk_norm`, rotary over each head's first head_dim x `partial_rotary_factor` values (halves rotated,
default rope only); the first `first_k_dense_replace` layers dense (`intermediate_size`), the rest a
mixture of `n_routed_experts` experts of `moe_intermediate_size` routed as DeepSeek-V3's (sigmoid
scores plus a correction bias, `n_group`, `topk_group`, `num_experts_per_tok`, `norm_topk_prob`,
`routed_scaling_factor`) beside `n_shared_experts` shared experts. A setting the family cannot honour
is refused, naming the field.

transformers' Glm4MoeForCausalLM builds no multi-token-prediction module: `num_nextn_predict_layers`
is ignored there, and here (its layers' tensors in a checkpoint are left over: `--weights-extra ignore`).

Its checkpoints (runtime/hf/weights.py, runtime/hf/moe.py): `model.layers.{i}` numbers the blocks of both
repeats in turn (block i of `blocks` is layer first_dense + i); Llama's attention names with
`self_attn.q_norm` / `k_norm`; the experts as DeepSeek-V3's (each expert's projections apart,
`mlp.shared_experts.*`, the router `mlp.gate.weight` and its buffer `mlp.gate.e_score_correction_bias`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from meshllm_dsl.families.config_fields import ConfigFields, ImportError_, Setting
from meshllm_dsl.families.deepseek_v3 import EXPERTS as DEEPSEEK_V3_EXPERTS
from meshllm_dsl.families.deepseek_v3 import _same, dense_and_moe, routing_fields, routing_wants
from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.pack import FamilyPack, Reading, Want

# transformers' Glm4MoeConfig defaults where a config.json leaves a field out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "attention_bias": False, "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False,
    "hidden_act": "silu", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
}


def _rope(f: ConfigFields) -> tuple[float, float, str]:
    """(rope_theta, partial_rotary_factor, the field holding them) of a default rope; any other refused."""
    field = "rope_parameters" if f.doc.get("rope_parameters") is not None else "rope_scaling"
    params = f.obj(field)
    inner = params is not None and params.doc.get("rope_theta") is not None
    theta = params.number("rope_theta") if params is not None and inner else f.number("rope_theta", _DEFAULTS["rope_theta"])
    kind = "default" if params is None else params.text("rope_type", None) or params.text("type", "default")
    if kind != "default":
        raise ImportError_(f"{f.where}: `{field}.rope_type` = {kind!r}; the glm4_moe family has unscaled rope only")
    if params is not None and params.doc.get("partial_rotary_factor") is not None:
        return theta, params.number("partial_rotary_factor"), f"`{field}.partial_rotary_factor`"
    return theta, f.number("partial_rotary_factor", _DEFAULTS["partial_rotary_factor"]), "`partial_rotary_factor`"


def read_glm4_moe(f: ConfigFields, pack: FamilyPack, dtype: str) -> Reading:
    """(family, settings, positions) of a GLM-4.5 config.json (see import_hf.model_settings)."""
    d = _DEFAULTS
    if f.text("hidden_act", "silu") != "silu":
        raise f.refuse("hidden_act", "is not supported: the glm4_moe family has hidden_act = 'silu'")
    f.off("attention_dropout", "drops attention probabilities when training; meshllm has no dropout")
    layers = f.blocks("num_hidden_layers")
    first = f.doc.get("first_k_dense_replace", d["first_k_dense_replace"])
    if isinstance(first, bool) or not isinstance(first, int) or not 1 <= first < layers:
        raise ImportError_(f"{f.where}: `first_k_dense_replace` = {first!r}; the glm4_moe family needs at least "
                           f"one dense and one mixture-of-experts block: 1 <= first_k_dense_replace < "
                           f"num_hidden_layers ({layers})")
    hidden = f.int("hidden_size", d["hidden_size"])
    heads = f.int("num_attention_heads", d["num_attention_heads"])
    head_dim = f.int("head_dim", hidden // heads)
    theta, factor, factor_field = _rope(f)
    rotary = int(head_dim * factor)  # as transformers' rotary embedding
    if not 0 < factor <= 1 or rotary < 2 or rotary % 2:
        raise ImportError_(f"{f.where}: {factor_field} = {factor!r} turns {rotary} of head_dim {head_dim}; the "
                           "glm4_moe family needs an even rotary width from 2 to head_dim")
    settings: list[Setting] = [
        ("vocab", f.int("vocab_size", d["vocab_size"]), "`vocab_size`"),
        ("hidden", hidden, "`hidden_size`"),
        ("layers", layers, "`num_hidden_layers`"),
        ("heads", heads, "`num_attention_heads`"),
        ("kv_heads", f.int("num_key_value_heads", d["num_key_value_heads"]), "`num_key_value_heads`"),
        ("head_dim", head_dim, "`head_dim`"),
        ("rotary_dim", rotary, factor_field),
        ("ffn", f.int("intermediate_size", d["intermediate_size"]), "`intermediate_size`"),
        ("expert_ffn", f.int("moe_intermediate_size", d["moe_intermediate_size"]), "`moe_intermediate_size`"),
        ("first_dense", first, "`first_k_dense_replace`"),
        ("experts", f.int("n_routed_experts", d["n_routed_experts"]), "`n_routed_experts`"),
        ("top_k", f.int("num_experts_per_tok", d["num_experts_per_tok"]), "`num_experts_per_tok`"),
        ("groups", f.int("n_group", d["n_group"]), "`n_group`"),
        ("topk_groups", f.int("topk_group", d["topk_group"]), "`topk_group`"),
        ("routed_scaling", f.number("routed_scaling_factor", d["routed_scaling_factor"]), "`routed_scaling_factor`"),
        ("shared_experts", f.int("n_shared_experts", d["n_shared_experts"]), "`n_shared_experts`"),
        ("norm_topk_prob", f.flag("norm_topk_prob", d["norm_topk_prob"]), "`norm_topk_prob`"),
        ("norm_eps", f.number("rms_norm_eps", d["rms_norm_eps"]), "`rms_norm_eps`"),
        ("attn_bias", f.flag("attention_bias", d["attention_bias"]), "`attention_bias`"),
        ("qk_norm", "head" if f.flag("use_qk_norm", d["use_qk_norm"]) else "none", "`use_qk_norm`"),
        ("rope_theta", theta, "`rope_theta`"),
        ("tie_embeddings", f.flag("tie_word_embeddings", d["tie_word_embeddings"]), "`tie_word_embeddings`"),
        ("dtype", dtype, "`torch_dtype`"),
    ]
    positions = f.int("max_position_embeddings", d["max_position_embeddings"])
    return pack.family, settings, positions


# ---------------------------------------------------------------- config.json written and checked


def _parts(lay: Any) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any], int]:
    """The layout's attention, dense MLP, moe layer, and the dense blocks' count (they come first)."""
    attn = next(b for b in lay.bodies[0] if b["kind"] == "attention")
    return (attn, *dense_and_moe(lay))


def _factor(attn: Mapping[str, Any]) -> float:
    return int(attn.get("rotary_dim") or attn["head_dim"]) / int(attn["head_dim"])


def _write_config(model: Mapping[str, Any], lay: Any, vocab: int, tied: bool, dtype_name: str,
                  positions: int) -> dict[str, Any]:
    """config.json of a GLM-4.5-shaped model (transformers' Glm4MoeConfig fields)."""
    attn, dense, moe, first = _parts(lay)
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": vocab,
        "hidden_size": lay.hidden,
        "intermediate_size": int(dense["ffn"]),
        "moe_intermediate_size": int(moe["ffn"]),
        "num_hidden_layers": lay.count,
        "first_k_dense_replace": first,
        "num_attention_heads": int(attn["heads"]),
        "num_key_value_heads": int(attn["kv_heads"]),
        "head_dim": int(attn["head_dim"]),
        **routing_fields(moe),
        "rms_norm_eps": float(lay.norm["eps"]),
        "attention_bias": bool(attn["qkv_bias"]),
        "use_qk_norm": attn.get("qk_norm") == "head",
        "rope_parameters": {"rope_theta": float(attn["rope_theta"]), "rope_type": "default",
                            "partial_rotary_factor": _factor(attn)},
        "partial_rotary_factor": _factor(attn),
        "max_position_embeddings": positions,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "torch_dtype": dtype_name,
    }


def _refuse_unfit(model: Mapping[str, Any], lay: Any, moe: bool, error: Callable[[str], Exception]) -> None:
    """What transformers' Glm4MoeForCausalLM cannot hold: anything but dense blocks followed by
    sigmoid-routed moe blocks of one attention (q, k, v biases alike, no o bias, per-head q / k norms
    or none, default rope), each block's norms alike, a dropless router."""
    name = model.get("name", "model")
    if len(lay.repeats) != 2 or any(b.get("moe") for b in lay.bodies[0]) or not any(b.get("moe") for b in lay.bodies[1]):
        raise error(f"model `{name}`: Glm4MoeForCausalLM has dense blocks then mixture-of-experts blocks: "
                    "expected two repeats, the first with an mlp, the second with a moe")
    _, _, m, _ = _parts(lay)
    if m.get("scoring") != "sigmoid" or not m.get("shared_experts") or m.get("capacity") \
            or m.get("shared_ffn") != m["ffn"] * m["shared_experts"]:
        raise error(f"model `{name}`: Glm4MoeForCausalLM's experts are dropless, sigmoid-scored, beside "
                    f"shared experts of shared_experts x ffn: expected scoring = sigmoid, shared_experts >= 1, "
                    f"capacity = 0, shared_ffn = {m['ffn']} x shared_experts")
    attns = [next(b for b in body if b["kind"] == "attention") for body in lay.bodies]
    a = attns[0]
    if attns[0] != attns[1] or a.get("o_bias") or a.get("qk_norm", "none") not in ("none", "head") \
            or any(a.get(k) for k in ("fused_qkv", "qk_norm_offset", "rope_scaling", "sinks", "window", "softcap",
                                      "scale_dim")):
        raise error(f"model `{name}`: Glm4MoeForCausalLM has one attention for every block: q, k, v biases or "
                    "none, no o bias, q and k normalised per head or not at all, unscaled rope over halves, "
                    "no window: expected both repeats' attention alike and so")
    norms = [tuple(b for b in body if b["kind"] == "rmsnorm") for body in lay.bodies]
    eps = {float(lay.norm["eps"])} | {float(n["eps"]) for ns in norms for n in ns}
    if a.get("qk_norm") == "head":
        eps.add(float(a["qk_norm_eps"]))
    if len(eps) != 1:
        raise error(f"model `{name}`: Glm4MoeForCausalLM has one rms_norm_eps for every norm: expected every "
                    "norm's eps (q and k norms' too) equal")


def _check_config(model: Mapping[str, Any], lay: Any, vocab: int, cfg: Mapping[str, Any], where: str,
                  error: Callable[[str], Exception]) -> None:
    """Raise ``error(message)`` (one line, naming the field) at the first field of a GLM-4.5 config.json
    the model disagrees with (transformers' defaults where a field is absent)."""
    name = model.get("name", "model")
    if cfg.get("model_type") != "glm4_moe":
        raise error(f"{where}: `model_type` is {cfg.get('model_type')!r}, but model `{name}` is glm4_moe shaped "
                    "(grouped-query attention, dense then sigmoid-routed moe blocks)")
    if cfg.get("quantization_config"):
        raise error(f"{where}: `quantization_config` is set; meshllm loads unquantized weights only")
    _refuse_unfit(model, lay, True, error)
    d = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    attn, dense, moe, first = _parts(lay)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope = rope if isinstance(rope, Mapping) else {"rope_type": rope}
    theirs_theta = rope.get("rope_theta", d["rope_theta"])
    theirs_kind = rope.get("rope_type") or rope.get("type") or "default"
    theirs_factor = rope.get("partial_rotary_factor", d["partial_rotary_factor"])
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    wants: list[Want] = [
        ("vocab_size", d["vocab_size"], vocab, "vocab"),
        ("hidden_size", d["hidden_size"], lay.hidden, "hidden"),
        ("num_hidden_layers", d["num_hidden_layers"], lay.count, "layers"),
        ("first_k_dense_replace", d["first_k_dense_replace"], first, "first_dense (the first repeat's blocks)"),
        ("intermediate_size", d["intermediate_size"], dense["ffn"], "ffn"),
        ("moe_intermediate_size", d["moe_intermediate_size"], moe["ffn"], "expert_ffn"),
        ("num_attention_heads", d["num_attention_heads"], attn["heads"], "heads"),
        ("num_key_value_heads", d["num_key_value_heads"], attn["kv_heads"], "kv_heads"),
        ("head_dim", head_dim, attn["head_dim"], "head_dim"),
        ("partial_rotary_factor", int(head_dim * float(theirs_factor)), int(attn.get("rotary_dim") or attn["head_dim"]),
         "rotary_dim (head_dim x partial_rotary_factor)"),
        ("attention_bias", bool(d["attention_bias"]), bool(attn["qkv_bias"]), "attn_bias"),
        ("use_qk_norm", bool(d["use_qk_norm"]), attn.get("qk_norm") == "head", "qk_norm = head"),
        *routing_wants(d, moe),
        ("rms_norm_eps", d["rms_norm_eps"], lay.norm["eps"], "norm_eps"),
        ("hidden_act", d["hidden_act"], "silu", "SwiGLU experts"),
        ("rope_parameters.rope_type", theirs_kind, "default", "unscaled rope"),
        ("rope_theta", theirs_theta, attn["rope_theta"], "rope_theta"),
        ("tie_word_embeddings", bool(d["tie_word_embeddings"]), bool(lay.head.get("tie")), "a tied head"),
    ]
    for field, got, want, what in wants:
        if not _same(got, want):
            raise error(f"{where}: `{field}` is {got!r}, but model `{name}` has {what} = {want!r}")


# Llama's names for the embedding, the block norms, the attention (its q / k norms `q_norm`, `k_norm`),
# the dense MLP and the head; DeepSeek-V3's experts.
NAMES = attrs.evolve(LLAMA_NAMES, layout="glm4_moe", write_config=_write_config, check_config=_check_config,
                     refuse_unfit=_refuse_unfit, partial_rotary=True)

PACK = FamilyPack("Glm4MoeForCausalLM", "glm4_moe", "glm4_moe", read_glm4_moe, NAMES, title="GLM-4.5",
                  default_positions=131072, experts=DEEPSEEK_V3_EXPERTS, shared_expert=True,
                  tp_export=True, ep_export=True)
