"""The DeepSeek-V3 pack: `DeepseekV3ForCausalLM` (config.json `model_type` "deepseek_v3") is the
`deepseek_v3` family.

What a DeepSeek-V3 config says: multi-head latent attention (`q_lora_rank`, null for one query
projection; `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; `rope_interleave`),
default or YaRN rope (`rope_parameters`, with `mscale` / `mscale_all_dim`), the first
`first_k_dense_replace` layers dense (`intermediate_size`), the rest a mixture of `n_routed_experts`
experts of `moe_intermediate_size` routed by sigmoid scores plus a correction bias (`n_group`,
`topk_group`, `num_experts_per_tok`, `norm_topk_prob`, `routed_scaling_factor`) beside
`n_shared_experts` shared experts. A setting the family cannot honour is refused, naming the field.

transformers' DeepseekV3ForCausalLM builds no multi-token-prediction module: `num_nextn_predict_layers`
is ignored there, and here (its layers' tensors in a checkpoint are left over: `--weights-extra ignore`).
`num_key_value_heads` is unused by its attention (every head reads the one latent), as here.

Its checkpoints (runtime/hf/weights.py, runtime/hf/moe.py): `model.layers.{i}` numbers the blocks of both
repeats in turn (block i of `blocks` is layer first_dense + i); the attention's `self_attn.q_a_proj`,
`q_a_layernorm`, `q_b_proj` (or `q_proj`), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`;
each expert's projections apart (`mlp.experts.{e}.gate_proj` ...), `mlp.shared_experts.*`, the router
`mlp.gate.weight` and its buffer `mlp.gate.e_score_correction_bias`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from meshllm_dsl.families.config_fields import ConfigFields, ImportError_, Setting
from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.pack import ExpertNames, FamilyPack, Reading, Want

# transformers' DeepseekV3Config defaults where a config.json leaves a field out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "attention_bias": False, "rope_interleave": True, "hidden_act": "silu",
    "tie_word_embeddings": False,
}
# The rope object's fields by type, as transformers reads them (None: required)
_YARN: dict[str, Any] = {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0, "truncate": True}


def _rope(f: ConfigFields, theta_default: float) -> list[Setting]:
    """rope_theta and, for YaRN, its settings; any other rope type is refused, naming the field."""
    # transformers >= 5 writes rope_parameters; a transformers 4 config.json rope_scaling (read as it)
    field = "rope_parameters" if f.doc.get("rope_parameters") is not None else "rope_scaling"
    params = f.obj(field)
    inner = params is not None and params.doc.get("rope_theta") is not None
    theta = params.number("rope_theta") if params is not None and inner else f.number("rope_theta", theta_default)
    settings: list[Setting] = [("rope_theta", theta, f"`{field}.rope_theta`" if inner else "`rope_theta`")]
    if params is None:
        return settings
    kind = params.text("rope_type", None) or params.text("type", "default")
    if kind == "default":
        return settings
    if kind != "yarn":
        raise ImportError_(f"{f.where}: `{field}.rope_type` = {kind!r}; the deepseek_v3 family has YaRN "
                           "(or unscaled) rope only")
    for name in ("attention_factor", "partial_rotary_factor"):
        if params.doc.get(name) is not None:
            raise ImportError_(f"{f.where}: `{field}.{name}` = {params.doc[name]!r} is not supported by the "
                               "deepseek_v3 family (its attention factor comes from mscale / mscale_all_dim)")
    mscale = params.doc.get("mscale") or 0.0
    mscale_all = params.doc.get("mscale_all_dim") or 0.0
    if mscale and mscale_all:
        mscale, mscale_all = params.number("mscale"), params.number("mscale_all_dim")
    elif mscale or mscale_all:
        # transformers' attention factor takes mscale only beside mscale_all_dim, but the attention
        # scale takes mscale_all_dim alone: a lone mscale changes nothing, a lone mscale_all_dim is read
        mscale, mscale_all = 0.0, params.number("mscale_all_dim") if mscale_all else 0.0
    return settings + [
        ("rope_type", "yarn", f"`{field}.rope_type`"),
        ("rope_factor", params.number("factor"), f"`{field}.factor`"),
        ("rope_original_positions", float(params.int("original_max_position_embeddings")),
         f"`{field}.original_max_position_embeddings`"),
        ("rope_beta_fast", params.number("beta_fast", 32.0), f"`{field}.beta_fast`"),
        ("rope_beta_slow", params.number("beta_slow", 1.0), f"`{field}.beta_slow`"),
        ("rope_truncate", params.flag("truncate", True), f"`{field}.truncate`"),
        ("rope_mscale", float(mscale), f"`{field}.mscale`"),
        ("rope_mscale_all_dim", float(mscale_all), f"`{field}.mscale_all_dim`"),
    ]


def read_deepseek_v3(f: ConfigFields, pack: FamilyPack, dtype: str) -> Reading:
    """(family, settings, positions) of a DeepSeek-V3 config.json (see import_hf.model_settings)."""
    d = _DEFAULTS
    for field, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
        got = f.text(field, want)
        if got != want:
            raise f.refuse(field, f"is not supported: the deepseek_v3 family has {field} = {want!r}")
    if not f.flag("rope_interleave", True):
        raise f.refuse("rope_interleave", "rotates halves; the deepseek_v3 family rotates adjacent pairs (true)")
    f.off("attention_dropout", "drops attention probabilities when training; meshllm has no dropout")
    layers = f.blocks("num_hidden_layers")
    first = f.doc.get("first_k_dense_replace", d["first_k_dense_replace"])
    if isinstance(first, bool) or not isinstance(first, int) or not 1 <= first < layers:
        raise ImportError_(f"{f.where}: `first_k_dense_replace` = {first!r}; the deepseek_v3 family needs at least "
                           f"one dense and one mixture-of-experts block: 1 <= first_k_dense_replace < "
                           f"num_hidden_layers ({layers})")
    q_lora = f.doc.get("q_lora_rank", d["q_lora_rank"])
    settings: list[Setting] = [
        ("vocab", f.int("vocab_size", d["vocab_size"]), "`vocab_size`"),
        ("hidden", f.int("hidden_size", d["hidden_size"]), "`hidden_size`"),
        ("layers", layers, "`num_hidden_layers`"),
        ("heads", f.int("num_attention_heads", d["num_attention_heads"]), "`num_attention_heads`"),
        ("ffn", f.int("intermediate_size", d["intermediate_size"]), "`intermediate_size`"),
        ("expert_ffn", f.int("moe_intermediate_size", d["moe_intermediate_size"]), "`moe_intermediate_size`"),
        ("first_dense", first, "`first_k_dense_replace`"),
        ("q_lora_rank", 0 if q_lora is None else f.int("q_lora_rank", d["q_lora_rank"]), "`q_lora_rank`"),
        ("kv_lora_rank", f.int("kv_lora_rank", d["kv_lora_rank"]), "`kv_lora_rank`"),
        ("qk_nope_head_dim", f.int("qk_nope_head_dim", d["qk_nope_head_dim"]), "`qk_nope_head_dim`"),
        ("qk_rope_head_dim", f.int("qk_rope_head_dim", d["qk_rope_head_dim"]), "`qk_rope_head_dim`"),
        ("v_head_dim", f.int("v_head_dim", d["v_head_dim"]), "`v_head_dim`"),
        ("experts", f.int("n_routed_experts", d["n_routed_experts"]), "`n_routed_experts`"),
        ("top_k", f.int("num_experts_per_tok", d["num_experts_per_tok"]), "`num_experts_per_tok`"),
        ("groups", f.int("n_group", d["n_group"]), "`n_group`"),
        ("topk_groups", f.int("topk_group", d["topk_group"]), "`topk_group`"),
        ("routed_scaling", f.number("routed_scaling_factor", d["routed_scaling_factor"]), "`routed_scaling_factor`"),
        ("shared_experts", f.int("n_shared_experts", d["n_shared_experts"]), "`n_shared_experts`"),
        ("norm_topk_prob", f.flag("norm_topk_prob", d["norm_topk_prob"]), "`norm_topk_prob`"),
        ("norm_eps", f.number("rms_norm_eps", d["rms_norm_eps"]), "`rms_norm_eps`"),
        ("attn_bias", f.flag("attention_bias", d["attention_bias"]), "`attention_bias`"),
        *_rope(f, d["rope_theta"]),
        ("tie_embeddings", f.flag("tie_word_embeddings", d["tie_word_embeddings"]), "`tie_word_embeddings`"),
        ("dtype", dtype, "`torch_dtype`"),
    ]
    positions = f.int("max_position_embeddings", d["max_position_embeddings"])
    return pack.family, settings, positions


# ---------------------------------------------------------------- config.json written and checked


# A moe layer's description leaves out the DeepSeek settings at the values that leave a softmax router
# as it was (primitives/moe.py DEEPSEEK, which a pack does not import): those values where absent.
MOE_UNWRITTEN: dict[str, Any] = {"groups": 1, "topk_groups": 1, "routed_scaling": 1.0, "shared_experts": 0}


def dense_and_moe(lay: Any) -> tuple[Mapping[str, Any], Mapping[str, Any], int]:
    """The layout's dense MLP, its moe layer (every DeepSeek setting filled in), and the dense blocks'
    count (they come first): DeepSeek-V3's and GLM-4.5's shape."""
    dense = next(b for b in lay.bodies[0] if b["kind"] == "mlp" and not b.get("moe"))
    moe = {**MOE_UNWRITTEN, **next(b for b in lay.bodies[1] if b.get("moe"))}
    return dense, moe, lay.repeats[1][1]


def routing_fields(moe: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's routed experts of a sigmoid-routed moe layer (DeepseekV3Config's and Glm4MoeConfig's names)."""
    return {
        "n_routed_experts": int(moe["experts"]),
        "num_experts_per_tok": int(moe["top_k"]),
        "n_group": int(moe["groups"]),
        "topk_group": int(moe["topk_groups"]),
        "n_shared_experts": int(moe["shared_experts"]),
        "routed_scaling_factor": float(moe["routed_scaling"]),
        "norm_topk_prob": bool(moe["norm_topk_prob"]),
    }


def routing_wants(d: Mapping[str, Any], moe: Mapping[str, Any]) -> list[Want]:
    """`routing_fields` of a checkpoint's config.json `d` against a moe layer's settings."""
    return [
        ("n_routed_experts", d["n_routed_experts"], moe["experts"], "experts"),
        ("num_experts_per_tok", d["num_experts_per_tok"], moe["top_k"], "top_k"),
        ("n_group", d["n_group"], moe["groups"], "groups"),
        ("topk_group", d["topk_group"], moe["topk_groups"], "topk_groups"),
        ("n_shared_experts", d["n_shared_experts"], moe["shared_experts"], "shared_experts"),
        ("routed_scaling_factor", d["routed_scaling_factor"], moe["routed_scaling"], "routed_scaling"),
        ("norm_topk_prob", bool(d["norm_topk_prob"]), bool(moe["norm_topk_prob"]), "norm_topk_prob"),
    ]


def _rope_parameters(attn: Mapping[str, Any]) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": float(attn["rope_theta"]), "rope_type": "default"}
    scaling = attn.get("rope_scaling")
    if scaling:
        rope.update(rope_type="yarn", factor=float(scaling["factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                    beta_fast=float(scaling["beta_fast"]), beta_slow=float(scaling["beta_slow"]),
                    truncate=bool(scaling["truncate"]), mscale=float(scaling.get("mscale") or 0.0),
                    mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))
    return rope


def _write_config(model: Mapping[str, Any], lay: Any, vocab: int, tied: bool, dtype_name: str,
                  positions: int) -> dict[str, Any]:
    """config.json of a DeepSeek-V3-shaped model (transformers' DeepseekV3Config fields)."""
    attn = lay.attn
    dense, moe, first = dense_and_moe(lay)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": lay.hidden,
        "intermediate_size": int(dense["ffn"]),
        "moe_intermediate_size": int(moe["ffn"]),
        "num_hidden_layers": lay.count,
        "first_k_dense_replace": first,
        "num_attention_heads": int(attn["heads"]),
        "num_key_value_heads": int(attn["heads"]),
        "q_lora_rank": int(attn["q_lora_rank"]) or None,
        "kv_lora_rank": int(attn["kv_lora_rank"]),
        "qk_nope_head_dim": int(attn["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(attn["qk_rope_head_dim"]),
        "v_head_dim": int(attn["v_head_dim"]),
        **routing_fields(moe),
        "rms_norm_eps": float(lay.norm["eps"]),
        "attention_bias": bool(attn["bias"]),
        "rope_interleave": True,
        "rope_parameters": _rope_parameters(attn),
        "max_position_embeddings": positions,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "torch_dtype": dtype_name,
    }


def _refuse_unfit(model: Mapping[str, Any], lay: Any, moe: bool, error: Callable[[str], Exception]) -> None:
    """What transformers' DeepseekV3ForCausalLM cannot hold: anything but dense blocks followed by
    sigmoid-routed moe blocks of one attention, each block's norms alike, a dropless router."""
    name = model.get("name", "model")
    if len(lay.repeats) != 2 or any(b.get("moe") for b in lay.bodies[0]) or not any(b.get("moe") for b in lay.bodies[1]):
        raise error(f"model `{name}`: DeepseekV3ForCausalLM has dense blocks then mixture-of-experts blocks: "
                    "expected two repeats, the first with an mlp, the second with a moe")
    _, m, _ = dense_and_moe(lay)
    if m.get("scoring") != "sigmoid" or not m.get("shared_experts") or m.get("capacity") \
            or m.get("shared_ffn") != m["ffn"] * m["shared_experts"]:
        raise error(f"model `{name}`: DeepseekV3ForCausalLM's experts are dropless, sigmoid-scored, beside "
                    f"shared experts of shared_experts x ffn: expected scoring = sigmoid, shared_experts >= 1, "
                    f"capacity = 0, shared_ffn = {m['ffn']} x shared_experts")
    attns = [next(b for b in body if b["kind"] == "mla") for body in lay.bodies]
    norms = [tuple(b for b in body if b["kind"] == "rmsnorm") for body in lay.bodies]
    eps = {float(lay.norm["eps"])} | {float(n["eps"]) for ns in norms for n in ns} \
        | {float(a["norm_eps"]) for a in attns}
    if attns[0] != attns[1] or len(eps) != 1:
        raise error(f"model `{name}`: DeepseekV3ForCausalLM has one attention and one rms_norm_eps for every "
                    "block: expected both repeats' mla alike and every norm's eps (the latents' too) equal")


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, Mapping) and isinstance(want, Mapping):
        return set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(got, (int, float)) and isinstance(want, (int, float)) and not isinstance(got, bool) \
            and not isinstance(want, bool):
        return math.isclose(float(got), float(want), rel_tol=1e-9)
    return bool(got == want)


def _their_rope(d: Mapping[str, Any]) -> Any:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        return rope
    theirs = {"rope_theta": d.get("rope_theta", _DEFAULTS["rope_theta"]), **rope}
    kind = theirs.pop("type", None)
    theirs["rope_type"] = theirs.get("rope_type") or kind or "default"
    if theirs["rope_type"] == "yarn":
        theirs = {**{k: v for k, v in _YARN.items() if v is not None}, **{k: v for k, v in theirs.items() if v is not None}}
        if not (theirs.get("mscale") and theirs.get("mscale_all_dim")):
            theirs["mscale"] = 0.0  # read only beside mscale_all_dim
    return theirs


def _check_config(model: Mapping[str, Any], lay: Any, vocab: int, cfg: Mapping[str, Any], where: str,
                  error: Callable[[str], Exception]) -> None:
    """Raise ``error(message)`` (one line, naming the field) at the first field of a DeepSeek-V3
    config.json the model disagrees with (transformers' defaults where a field is absent)."""
    name = model.get("name", "model")
    if cfg.get("model_type") != "deepseek_v3":
        raise error(f"{where}: `model_type` is {cfg.get('model_type')!r}, but model `{name}` is deepseek_v3 shaped "
                    "(latent attention, dense then sigmoid-routed moe blocks)")
    if cfg.get("quantization_config"):
        raise error(f"{where}: `quantization_config` is set; meshllm loads unquantized weights only")
    _refuse_unfit(model, lay, True, error)
    d = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}}
    attn = lay.attn
    dense, moe, first = dense_and_moe(lay)
    ours_rope = _rope_parameters(attn)
    wants: list[Want] = [
        ("vocab_size", d["vocab_size"], vocab, "vocab"),
        ("hidden_size", d["hidden_size"], lay.hidden, "hidden"),
        ("num_hidden_layers", d["num_hidden_layers"], lay.count, "layers"),
        ("first_k_dense_replace", d["first_k_dense_replace"], first, "first_dense (the first repeat's blocks)"),
        ("intermediate_size", d["intermediate_size"], dense["ffn"], "ffn"),
        ("moe_intermediate_size", d["moe_intermediate_size"], moe["ffn"], "expert_ffn"),
        ("num_attention_heads", d["num_attention_heads"], attn["heads"], "heads"),
        ("q_lora_rank", d["q_lora_rank"] or 0, attn["q_lora_rank"], "q_lora_rank"),
        ("kv_lora_rank", d["kv_lora_rank"], attn["kv_lora_rank"], "kv_lora_rank"),
        ("qk_nope_head_dim", d["qk_nope_head_dim"], attn["qk_nope_head_dim"], "qk_nope_head_dim"),
        ("qk_rope_head_dim", d["qk_rope_head_dim"], attn["qk_rope_head_dim"], "qk_rope_head_dim"),
        ("v_head_dim", d["v_head_dim"], attn["v_head_dim"], "v_head_dim"),
        ("attention_bias", bool(d["attention_bias"]), bool(attn["bias"]), "attn_bias"),
        ("rope_interleave", bool(d["rope_interleave"]), bool(attn["rope_interleave"]), "rope_interleave"),
        *routing_wants(d, moe),
        ("rms_norm_eps", d["rms_norm_eps"], lay.norm["eps"], "norm_eps"),
        ("hidden_act", d["hidden_act"], "silu", "SwiGLU experts"),
        ("scoring_func", d.get("scoring_func", "sigmoid"), "sigmoid", "scoring"),
        ("topk_method", d.get("topk_method", "noaux_tc"), "noaux_tc", "groups / topk_groups with the correction bias"),
        ("rope_parameters", _their_rope(d), ours_rope, "rope_theta / rope scaling"),
        ("tie_word_embeddings", bool(d["tie_word_embeddings"]), bool(lay.head.get("tie")), "a tied head"),
    ]
    for field, got, want, what in wants:
        if not _same(got, want):
            if got is None:
                raise error(f"{where}: `{field}` is missing; model `{name}` has {what} = {want!r}")
            raise error(f"{where}: `{field}` is {got!r}, but model `{name}` has {what} = {want!r}")


def _checked_with_the_rest(pack: FamilyPack, moe: Mapping[str, Any], cfg: Mapping[str, Any], where: str,
                           error: type[Exception]) -> list[Want]:
    """The layout checks its whole config.json itself (`_check_config`): nothing more here."""
    return []


# Llama's names for the embedding, the block norms, the dense MLP and the head; the latent attention's
# projections, and the norms of its latents (our `q_a.norm`, `kv_a.norm`).
NAMES = attrs.evolve(
    LLAMA_NAMES, layout="deepseek_v3", attention_kind="mla",
    attn=("self_attn", {"q_a": "q_a_proj", "q_b": "q_b_proj", "q": "q_proj", "kv_a": "kv_a_proj_with_mqa",
                        "kv_b": "kv_b_proj", "o": "o_proj"}),
    projection_norms={"q_a": "q_a_layernorm", "kv_a": "kv_a_layernorm"}, null_fields=("q_lora_rank",),
    write_config=_write_config, check_config=_check_config, refuse_unfit=_refuse_unfit)

EXPERTS = ExpertNames(
    "mlp",
    {"router": "gate", "gate": "experts.{e}.gate_proj", "up": "experts.{e}.up_proj", "down": "experts.{e}.down_proj",
     "shared_gate": "shared_experts.gate_proj", "shared_up": "shared_experts.up_proj",
     "shared_down": "shared_experts.down_proj"},
    weights_fp32=True, renormalised=None,
    fits="sigmoid scoring with the correction bias, shared experts, weights in fp32",
    # its expert fields are written and checked with the rest of config.json (NAMES: _write_config, _check_config)
    write_config=lambda moe: {}, check_config=_checked_with_the_rest,
    scoring="sigmoid", buffers={"router.e_score_correction_bias": "gate.e_score_correction_bias"})

PACK = FamilyPack("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek_v3", read_deepseek_v3, NAMES,
                  title="DeepSeek-V3", default_positions=4096, experts=EXPERTS, shared_expert=True, tp_export=True,
                  ep_export=True)
