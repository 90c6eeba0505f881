"""The GPT-OSS pack: `GptOssForCausalLM` (config.json `model_type` "gpt_oss") is the `gpt_oss` family.

What a GPT-OSS config says beyond Llama's: which blocks attend to a sliding window (`layer_types`),
YaRN rope (`rope_parameters`, with `truncate`), the experts (`num_local_experts`,
`num_experts_per_tok`, `intermediate_size` their width) and their clamped SwiGLU (`swiglu_alpha`,
`swiglu_limit`). A setting the family cannot honour is refused, naming the field.

What the layer kinds do for it (transformers' modeling_gpt_oss.py): attention with q, k, v, o biases
and sinks (`sinks = true`: a logit per head in the softmax's denominator), windowed blocks
alternating with full ones (`window`, `global_every`), YaRN (`rope_type = yarn`); RMSNorm scaling in
fp32 (`scale_fp32`); the moe layer's router bias, expert biases and clamped SwiGLU (`router_bias`,
`expert_bias`, `act = swiglu_clamped`). GptOssTopKRouter takes the softmax of each token's top_k
logits; the moe layer takes the top_k of the softmax and renormalises them (`norm_topk_prob`):
the same weights (softmax is monotonic, and the renormalisation divides out the other experts'
share), in the activations' dtype (`weights_fp32 = false`).

Its checkpoints (runtime/hf/weights.py, runtime/hf/fused_experts.py) store each layer's experts fused
and 3-D, as transformers does: `mlp.experts.gate_up_proj` [experts, hidden, 2 ffn] with gate and up
interleaved (gate `[..., ::2]`, up `[..., 1::2]`), `mlp.experts.down_proj` [experts, ffn, hidden],
their biases `gate_up_proj_bias` [experts, 2 ffn] and `down_proj_bias` [experts, hidden]; the router
`mlp.router.{weight,bias}`; the sinks `self_attn.sinks` [heads].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from meshllm_dsl.families.config_fields import ConfigError, ConfigFields, ImportError_, Setting
from meshllm_dsl.families.gemma import FULL, SLIDING, _global_every, layer_types
from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.llama_config import rope_settings
from meshllm_dsl.families.pack import ExpertNames, FamilyPack, Reading, Want

# transformers' GptOssConfig defaults where a config.json leaves a field out
_DEFAULTS: dict[str, Any] = {"head_dim": 64, "rms_norm_eps": 1e-5, "sliding_window": 128, "swiglu_alpha": 1.702,
                             "swiglu_limit": 7.0, "num_local_experts": 128, "num_experts_per_tok": 4,
                             "max_position_embeddings": 131072, "rope_theta": 150000.0}
_DEFAULT_ROPE: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}


def _types(f: ConfigFields, layers: int) -> list[str]:
    """Each layer's attention type: `layer_types`, or GptOssConfig's own (the first of each pair windowed)."""
    types = f.doc.get("layer_types")
    if types is None:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if not (isinstance(types, list) and all(t in (SLIDING, FULL) for t in types)):
        raise f.error("layer_types", f'a list of "{SLIDING}" / "{FULL}", one per layer')
    if len(types) != layers:
        raise ConfigError(f"{f.where}: `layer_types` has {len(types)} entries; expected one per layer "
                          f"(`num_hidden_layers` = {layers})")
    return list(types)


def _rope(f: ConfigFields, pack: FamilyPack, positions: int, head_dim: int) -> list[Setting]:
    """rope_theta and the YaRN settings (GptOssConfig's own rope where the config gives none)."""
    # transformers >= 5 writes rope_parameters; the hub's config.json (transformers 4) rope_scaling, which
    # transformers 5 reads as rope_parameters
    params = f.obj("rope_parameters")
    if params is None and f.doc.get("rope_scaling") is not None:
        params = f.obj("rope_scaling")
    if params is None:
        params = f.with_doc({**f.doc, "rope_parameters": dict(_DEFAULT_ROPE)}).obj("rope_parameters")
        assert params is not None
    inner = params.doc.get("rope_theta") is not None
    theta = params.number("rope_theta") if inner else f.number("rope_theta", _DEFAULTS["rope_theta"])
    settings: list[Setting] = [("rope_theta", theta, f"`{params.prefix}rope_theta`" if inner else "`rope_theta`")]
    kind = params.text("rope_type", "default")
    if kind == "default":
        return settings + [("rope_type", "default", "`rope_parameters.rope_type`")]
    if kind != "yarn":
        raise ImportError_(f"{f.where}: `rope_parameters.rope_type` = {kind!r}; the gpt_oss family has YaRN "
                           "(or unscaled) rope only")
    for field in ("partial_rotary_factor",):
        if params.doc.get(field) not in (None, 1, 1.0):
            raise ImportError_(f"{f.where}: `rope_parameters.{field}` = {params.doc[field]!r} rotates only part of "
                               "each head (not supported)")
    yarn = rope_settings(f, pack, params, positions, head_dim)
    if not any(name == "rope_truncate" for name, _, _ in yarn):
        # the family's own default is GPT-OSS's truncate = false; transformers' default when absent is true
        yarn.append(("rope_truncate", True, "`rope_parameters.truncate` (absent: true)"))
    return settings + yarn


def read_gpt_oss(f: ConfigFields, pack: FamilyPack, dtype: str) -> Reading:
    """(family, settings, positions) of a GPT-OSS config.json (see import_hf.model_settings)."""
    if not f.flag("attention_bias", True):
        raise f.refuse("attention_bias", "drops the q, k, v and o biases the gpt_oss family has")
    f.off("attention_dropout", "drops attention probabilities when training; meshllm has no dropout")
    f.off("router_jitter_noise", "scales the router's input by noise when training (not supported)")
    layers = f.blocks("num_hidden_layers")
    positions = f.int("max_position_embeddings", _DEFAULTS["max_position_embeddings"])
    heads = f.int("num_attention_heads")
    head_dim = f.int("head_dim", _DEFAULTS["head_dim"])
    types = _types(f, layers)
    every = _global_every(types)
    if every is None:
        raise ImportError_(f"{f.where}: `layer_types` = {types!r} is no pattern of one full-attention layer in "
                           "every N; the gpt_oss family's global_every gives those only")
    window = f.int("sliding_window", _DEFAULTS["sliding_window"]) if SLIDING in types else 0
    settings: list[Setting] = [
        ("vocab", f.int("vocab_size"), "`vocab_size`"), ("hidden", f.int("hidden_size"), "`hidden_size`"),
        ("layers", layers, "`num_hidden_layers`"), ("heads", heads, "`num_attention_heads`"),
        ("kv_heads", f.int("num_key_value_heads", heads), "`num_key_value_heads`"),
        ("head_dim", head_dim, "`head_dim`"),
        ("ffn", f.int("intermediate_size"), "`intermediate_size`"),
        ("experts", f.int("num_local_experts", _DEFAULTS["num_local_experts"]), "`num_local_experts`"),
        ("top_k", f.int("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"]), "`num_experts_per_tok`"),
        ("swiglu_alpha", f.number("swiglu_alpha", _DEFAULTS["swiglu_alpha"]), "`swiglu_alpha`"),
        ("swiglu_limit", f.number("swiglu_limit", _DEFAULTS["swiglu_limit"]), "`swiglu_limit`"),
        ("norm_eps", f.number("rms_norm_eps", _DEFAULTS["rms_norm_eps"]), "`rms_norm_eps`"),
    ]
    settings += _rope(f, pack, positions, head_dim)
    settings += [("window", window, "`sliding_window`" if window else "`layer_types` (no sliding_attention)"),
                 ("global_every", every, "`layer_types`")]
    if f.flag("output_router_logits", False) and f.doc.get("router_aux_loss_coef") not in (None, 0, 0.0):
        # transformers adds router_aux_loss_coef x the load-balancing loss only with output_router_logits.
        settings.append(("aux_loss_coef", f.number("router_aux_loss_coef"), "`router_aux_loss_coef`"))
    settings += [("tie_embeddings", f.flag("tie_word_embeddings", False), "`tie_word_embeddings`"),
                 ("dtype", dtype, "`torch_dtype`")]
    return pack.family, settings, positions


# ---------------------------------------------------------------- the runtime: config.json out and in


def _rope_parameters(attn: Mapping[str, Any]) -> dict[str, Any]:
    scaling = dict(attn.get("rope_scaling") or {})
    return {"rope_theta": float(attn["rope_theta"]), **(scaling or {"rope_type": "default"})}


def _write_config(model: Mapping[str, Any], lay: Any, vocab: int, tied: bool, dtype_name: str,
                  seq: int) -> dict[str, Any]:
    """The config.json of the runtime's layout of ``model`` (runtime/hf/weights.py)."""
    attn, moe = lay.attn, lay.mlp
    rope = _rope_parameters(attn)
    positions = max(seq, int(float(rope.get("factor", 1.0)) * int(rope.get("original_max_position_embeddings", 0))))
    coef = float(moe.get("aux_loss_coef") or 0.0)
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": vocab,
        "hidden_size": lay.hidden,
        "intermediate_size": int(moe["ffn"]),
        "num_hidden_layers": lay.count,
        "num_attention_heads": int(attn["heads"]),
        "num_key_value_heads": int(attn["kv_heads"]),
        "head_dim": int(attn["head_dim"]),
        "num_local_experts": int(moe["experts"]),
        "num_experts_per_tok": int(moe["top_k"]),
        "swiglu_alpha": float(moe["swiglu_alpha"]),
        "swiglu_limit": float(moe["swiglu_limit"]),
        "rms_norm_eps": float(lay.norm["eps"]),
        "sliding_window": int(attn.get("window") or 0) or None,
        "layer_types": layer_types(attn, lay.count),
        "rope_parameters": rope,
        "max_position_embeddings": positions,
        "attention_bias": True,
        "hidden_act": "silu",
        "output_router_logits": bool(coef),
        "router_aux_loss_coef": coef,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype_name,
    }


def _refuse_unfit(model: Mapping[str, Any], lay: Any, moe: bool, error: Callable[[str], Exception]) -> None:
    """What transformers' GptOssForCausalLM cannot hold: a model that drops tokens past a capacity."""
    if lay.mlp.get("capacity"):
        raise error(f"model `{model.get('name', 'model')}` drops tokens past capacity = {lay.mlp['capacity']:g}; "
                    "transformers' GptOssForCausalLM is dropless and would compute another model: expected capacity = 0")


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, (int, float)) and isinstance(want, (int, float)) and not isinstance(got, bool) \
            and not isinstance(want, bool):
        return math.isclose(float(got), float(want), rel_tol=1e-9)
    return bool(got == want)


def _check_config(model: Mapping[str, Any], lay: Any, vocab: int, cfg: Mapping[str, Any], where: str,
                  error: Callable[[str], Exception]) -> None:
    """Raise ``error(message)`` (one line, naming the field) at the first field of a GPT-OSS
    config.json the model disagrees with (transformers' defaults where a field is absent)."""
    name = model.get("name", "model")
    attn, moe = lay.attn, lay.mlp
    if cfg.get("model_type") != "gpt_oss":
        raise error(f"{where}: `model_type` is {cfg.get('model_type')!r}, but model `{name}` is gpt_oss shaped "
                    "(attention sinks, biased experts)")
    if cfg.get("quantization_config"):
        raise error(f"{where}: `quantization_config` is set; meshllm loads unquantized weights only")
    d = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "sliding_window"}}
    heads = d.get("num_attention_heads")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or dict(_DEFAULT_ROPE)
    theirs_rope = {"rope_theta": d["rope_theta"], **rope} if isinstance(rope, Mapping) else rope
    if isinstance(theirs_rope, dict) and theirs_rope.get("rope_type", "default") == "yarn":
        theirs_rope = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, **theirs_rope}
    count = int(d.get("num_hidden_layers") or 0)
    theirs_types = d.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(count)]
    theirs_aux = float(d.get("router_aux_loss_coef") or 0.0) if d.get("output_router_logits") else 0.0
    ours_types = layer_types(attn, lay.count)
    wants: list[Want] = [
        ("vocab_size", d.get("vocab_size"), vocab, "vocab"),
        ("hidden_size", d.get("hidden_size"), lay.hidden, "hidden"),
        ("num_hidden_layers", d.get("num_hidden_layers"), lay.count, "layers"),
        ("num_attention_heads", heads, attn["heads"], "heads"),
        ("num_key_value_heads", d.get("num_key_value_heads", heads), attn["kv_heads"], "kv_heads"),
        ("head_dim", d["head_dim"], attn["head_dim"], "head_dim"),
        ("intermediate_size", d.get("intermediate_size"), moe["ffn"], "ffn"),
        ("num_local_experts", d["num_local_experts"], moe["experts"], "experts"),
        ("num_experts_per_tok", d["num_experts_per_tok"], moe["top_k"], "top_k"),
        ("swiglu_alpha", d["swiglu_alpha"], moe["swiglu_alpha"], "swiglu_alpha"),
        ("swiglu_limit", d["swiglu_limit"], moe["swiglu_limit"], "swiglu_limit"),
        ("rms_norm_eps", d["rms_norm_eps"], lay.norm["eps"], "norm_eps"),
        ("attention_bias", bool(d.get("attention_bias", True)), True, "attention biases"),
        ("layer_types", theirs_types, ours_types, "window / global_every"),
        ("rope_parameters", theirs_rope, _rope_parameters(attn), "rope_theta / rope scaling"),
        ("router_aux_loss_coef", theirs_aux, float(moe.get("aux_loss_coef") or 0.0),
         "aux_loss_coef (with output_router_logits)"),
        ("tie_word_embeddings", bool(d.get("tie_word_embeddings", False)), bool(lay.head.get("tie")), "a tied head"),
    ]
    if SLIDING in ours_types:
        wants.append(("sliding_window", cfg.get("sliding_window", _DEFAULTS["sliding_window"]), attn.get("window"),
                      "window"))
    for field, got, want, what in wants:
        if field == "rope_parameters" and isinstance(got, Mapping) and isinstance(want, Mapping):
            same = set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
        else:
            same = _same(got, want)
        if not same:
            if got is None:
                raise error(f"{where}: `{field}` is missing; model `{name}` has {what} = {want!r}")
            raise error(f"{where}: `{field}` is {got!r}, but model `{name}` has {what} = {want!r}")


def _checked_with_the_rest(pack: FamilyPack, moe: Mapping[str, Any], cfg: Mapping[str, Any], where: str,
                         error: type[Exception]) -> list[Want]:
    """The layout checks its whole config.json itself (`_check_config`): nothing more here."""
    return []


# Llama's names for the embedding, norms and attention (with `self_attn.sinks`); the experts fused and
# 3-D (runtime/hf/fused_experts.py: `%even` / `%odd` take gate's / up's interleaved columns of the
# fused tensor, `%all` the whole of it), the router with its bias.
NAMES = attrs.evolve(LLAMA_NAMES, layout="gpt_oss", mlp=("mlp", {}), act=None,
                     write_config=_write_config, check_config=_check_config, refuse_unfit=_refuse_unfit)

EXPERTS = ExpertNames(
    "mlp", {}, weights_fp32=False, renormalised=True,
    fits="no shared expert, weights in the activations' dtype, renormalised, biased router and experts, clamped SwiGLU",
    # its expert fields are written and checked with the rest of config.json (NAMES: _write_config, _check_config)
    write_config=lambda moe: {}, check_config=_checked_with_the_rest,
    tensors={"router.weight": "router.weight", "router.bias": "router.bias",
             "gate.weight": "experts.gate_up_proj%even", "up.weight": "experts.gate_up_proj%odd",
             "down.weight": "experts.down_proj%all",
             "gate.bias": "experts.gate_up_proj_bias%even", "up.bias": "experts.gate_up_proj_bias%odd",
             "down.bias": "experts.down_proj_bias%all"},
    act="swiglu_clamped", biased=True)

PACK = FamilyPack("GptOssForCausalLM", "gpt_oss", "gpt_oss", read_gpt_oss, NAMES, title="GPT-OSS",
                  default_positions=131072, experts=EXPERTS, tp_export=True,
                  ep_export=True)
