"""config.json -> settings for the Llama-shaped architectures (the packs whose `read` this is, and the
attention of the mixture-of-experts ones): one reading, parameterised by the fields of each
architecture's pack (meshllm_dsl/families/pack.py) instead of branching on its name.
"""

from __future__ import annotations

import math
from typing import Any

from meshllm_dsl.families.config_fields import (
    NO_DEFAULT,
    ConfigError,
    ConfigFields,
    ImportError_,
    Setting,
)
from meshllm_dsl.families.pack import FamilyPack, Reading
from meshllm_dsl.runtime.json_values import describe

# Keys of a rope object whose value changes the maths and that the llama family has no setting for.
_ROPE_UNSUPPORTED = ("partial_rotary_factor",)
_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


def read_rope(f: ConfigFields) -> tuple[float, ConfigFields | None]:
    """(rope_theta, the scaling object or None when rope is unscaled)."""
    theta = f.number("rope_theta", 10000.0)
    params = f.obj("rope_parameters")  # transformers >= 5 writes this; older configs rope_scaling
    rope = params if params is not None else f.obj("rope_scaling")
    if rope is None:
        return theta, None
    nested = next((k for k, v in rope.doc.items() if isinstance(v, dict)), None)
    if nested is not None:  # one rope per layer type (e.g. {"full_attention": {...}})
        raise ImportError_(f"{f.where}: `{rope.prefix}{nested}` is a rope per layer type; the llama family "
                           "has one rope for every layer")
    if params is not None:
        theta = params.number("rope_theta", theta)
    kind = rope.text("rope_type", None) or rope.text("type", "default")
    return theta, (None if kind == "default" else rope)


def _factors(scaling: ConfigFields, field: str, rotary: int) -> tuple[float, ...]:
    """longrope's `short_factor` / `long_factor`: a list of `rotary` / 2 positive numbers."""
    value, where = scaling.doc.get(field), f"`{scaling.prefix}{field}`"
    if not isinstance(value, list):
        raise scaling.error(field, f"a list of {rotary // 2} positive numbers (head_dim / 2)")
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0):
            raise ConfigError(f"{scaling.where}: {where} item {i} is {describe(x)}; expected a positive number")
    if len(value) != rotary // 2:
        raise ConfigError(f"{scaling.where}: {where} has {len(value)} numbers; expected {rotary // 2} "
                          f"(head_dim {rotary} / 2, one per rotary frequency)")
    return tuple(float(x) for x in value)


def _original_positions(f: ConfigFields, scaling: ConfigFields, inner_default: Any) -> tuple[Any, Any]:
    """(top-level, rope object's) original_max_position_embeddings, refused when they disagree."""
    outer = f.int("original_max_position_embeddings", None)
    inner = scaling.int("original_max_position_embeddings", inner_default)
    if outer is not None and inner is not None and outer != inner:
        raise ImportError_(f"{f.where}: `original_max_position_embeddings` {outer} and `{scaling.prefix}original_max_"
                           f"position_embeddings` {inner} disagree; transformers would use {outer}")
    return outer, inner


def _longrope_settings(f: ConfigFields, pack: FamilyPack, scaling: ConfigFields, positions: int,
                       head_dim: int) -> list[Setting]:
    """Phi-3's longrope as transformers reads it (_compute_longrope_parameters after
    standardize_rope_params): the trained length from a top-level original_max_position_embeddings
    first (Phi3Config's own default is 4096), the factor `max_position_embeddings / original` where
    the rope object gives none."""
    p = scaling.prefix
    outer, inner = _original_positions(f, scaling, None)
    own = pack.longrope_default_original
    original = outer or (own if own is not None else inner or positions)
    origin = ("`original_max_position_embeddings`" if outer else "Phi3Config's default" if own is not None
              else f"`{p}original_max_position_embeddings`" if inner else "`max_position_embeddings`")
    factor = scaling.number("factor", None)
    settings: list[Setting] = [
        ("rope_type", "longrope", f"`{p}type`" if scaling.doc.get("rope_type") is None else f"`{p}rope_type`"),
        ("rope_factor", factor if factor is not None else positions / original,
         f"`{p}factor`" if factor is not None else "`max_position_embeddings` / `original_max_position_embeddings`"),
        ("rope_original_positions", original, origin),
    ]
    attention = scaling.number("attention_factor", None)
    if attention is not None:
        settings.append(("rope_attention_factor", attention, f"`{p}attention_factor`"))
    return settings + [("rope_short_factor", _factors(scaling, "short_factor", head_dim), f"`{p}short_factor`"),
                       ("rope_long_factor", _factors(scaling, "long_factor", head_dim), f"`{p}long_factor`")]


def _rope_kind(f: ConfigFields, pack: FamilyPack, scaling: ConfigFields) -> str:
    """The rope scaling type as the architecture's config reads it."""
    kind = scaling.text("rope_type", None) or scaling.text("type")
    if pack.longrope_only:
        if kind in ("su", "yarn"):  # Phi3Config reads its older names as longrope
            kind = "longrope"
        elif kind != "longrope":  # Phi3Config raises for any other type
            raise ImportError_(f"{f.where}: `{scaling.prefix}rope_type` = {kind!r}; Phi-3's config takes longrope only")
    if kind not in _ROPE_TYPES:
        raise ImportError_(f"{f.where}: rope scaling type {kind!r} is not supported "
                           f"({', '.join(map(repr, _ROPE_TYPES))})")
    return kind


def _yarn_settings(f: ConfigFields, scaling: ConfigFields, outer: Any, inner: Any, positions: int) -> list[Setting]:
    """yarn's settings beyond its factor (transformers: `beta_fast or 32`, `beta_slow or 1`)."""
    p = scaling.prefix
    for field in ("mscale", "mscale_all_dim"):  # DeepSeek's variant of yarn's attention factor
        scaling.off(field, "changes yarn's attention factor (not supported)")
    original = outer or inner
    settings: list[Setting] = [("rope_original_positions", original or positions,
                                f"`{p}original_max_position_embeddings`" if original else "`max_position_embeddings`")]
    attention = scaling.number("attention_factor", None)
    if attention is not None:
        settings.append(("rope_attention_factor", attention, f"`{p}attention_factor`"))
    for key, field in (("rope_beta_fast", "beta_fast"), ("rope_beta_slow", "beta_slow")):
        if scaling.doc.get(field) not in (None, 0):  # 0 is the default too
            settings.append((key, scaling.number(field), f"`{p}{field}`"))
    if not scaling.flag("truncate", True):
        settings.append(("rope_truncate", False, f"`{p}truncate`"))
    return settings


def rope_settings(f: ConfigFields, pack: FamilyPack, scaling: ConfigFields, positions: int,
                  head_dim: int) -> list[Setting]:
    """The llama family's rope settings for a rope scaling object, as transformers reads it
    (modeling_rope_utils: the fields each type's initialiser takes and their defaults)."""
    p = scaling.prefix
    kind = _rope_kind(f, pack, scaling)
    if kind == "longrope":
        return _longrope_settings(f, pack, scaling, positions, head_dim)
    settings: list[Setting] = [("rope_type", kind, f"`{p}rope_type`"),
                               ("rope_factor", scaling.number("factor"), f"`{p}factor`")]
    if kind == "dynamic":  # NTK scales from the config's max_position_embeddings
        return settings + [("rope_original_positions", positions, "`max_position_embeddings`")]
    if kind == "linear":
        return settings
    # transformers prefers a top-level original_max_position_embeddings to the rope object's
    outer, inner = _original_positions(f, scaling, None if kind == "yarn" else NO_DEFAULT)
    if kind == "llama3":
        return settings + [
            ("rope_low_freq_factor", scaling.number("low_freq_factor", 1.0), f"`{p}low_freq_factor`"),
            ("rope_high_freq_factor", scaling.number("high_freq_factor", 4.0), f"`{p}high_freq_factor`"),
            ("rope_original_positions", inner, f"`{p}original_max_position_embeddings`")]
    return settings + _yarn_settings(f, scaling, outer, inner, positions)


def _check_attention_shape(f: ConfigFields, pack: FamilyPack) -> int | None:
    """Refuse what changes the attention maths; the sliding window the architecture honours, or None."""
    positions = f.int("max_position_embeddings", pack.default_positions)
    window = f.int("sliding_window", None)
    # Mistral and Phi-3 attend within sliding_window whenever it is set (a window no shorter than
    # the positions changes nothing, and is left out).
    window = window if pack.honours_sliding_window and window is not None and window < positions else None
    if pack.refuses_use_sliding_window and f.flag("use_sliding_window", False):
        raise f.refuse("use_sliding_window", "limits attention to a window; meshllm computes full causal attention")
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "logits_scaling"):
        f.off(field, "changes the logits (not supported)")
    layer_types = f.doc.get("layer_types")  # transformers >= 5: which layers attend to a window
    if layer_types is not None:
        if not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
            raise f.error("layer_types", 'a list of attention types such as ["full_attention", ...]')
        other = next((t for t in layer_types if t != "full_attention"), None)
        if other is not None:
            raise ImportError_(f"{f.where}: `layer_types` holds {other!r}; meshllm computes full causal attention "
                               "in every layer")
    return window


def _checked_rope(f: ConfigFields) -> tuple[float, ConfigFields | None]:
    """read_rope, refusing a rope that rotates only part of each head."""
    theta, scaling = read_rope(f)
    for rope in (f, scaling):
        for field in _ROPE_UNSUPPORTED:
            if rope is not None and rope.doc.get(field) is not None and rope.number(field) != 1.0:
                raise ImportError_(f"{f.where}: `{rope.prefix}{field}` = {rope.doc[field]!r} rotates only part of "
                                   "each head (not supported)")
    return theta, scaling


def _shape_settings(f: ConfigFields, pack: FamilyPack, theta: float) -> list[Setting]:
    """vocab ... rope_theta: the sizes every Llama-shaped config gives."""
    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    head_dim = f.int("head_dim", None)
    if head_dim is None and hidden < heads:  # transformers' default hidden // heads would be 0
        raise ConfigError(f"{f.where}: `hidden_size` {hidden} is smaller than `num_attention_heads` {heads} "
                          "and there is no `head_dim`; expected hidden_size >= num_attention_heads")
    return [
        ("vocab", f.int("vocab_size"), "`vocab_size`"), ("hidden", hidden, "`hidden_size`"),
        ("layers", f.blocks("num_hidden_layers"), "`num_hidden_layers`"),
        ("heads", heads, "`num_attention_heads`"),
        ("kv_heads", f.int("num_key_value_heads", heads), "`num_key_value_heads`"),
        # transformers' own default when head_dim is absent: floor division
        ("head_dim", head_dim or hidden // heads, "`head_dim`" if head_dim else "`hidden_size` // `num_attention_heads`"),
        ("ffn", f.int("intermediate_size"), "`intermediate_size`"),
        ("norm_eps", f.number("rms_norm_eps", pack.default_norm_eps), "`rms_norm_eps`"),
        ("rope_theta", theta, "`rope_theta`"),
    ]


def read_llama_shaped(f: ConfigFields, pack: FamilyPack, dtype: str) -> Reading:
    """(family, settings, positions) of a Llama-shaped config.json (see import_hf.model_settings)."""
    family = pack.family
    if f.text("hidden_act", "silu") != "silu":
        raise f.refuse("hidden_act", f"is not the SiLU of SwiGLU that the {family} family uses")
    if not pack.ignores_mlp_bias and f.flag("mlp_bias", False):
        raise f.refuse("mlp_bias", "adds MLP biases the llama family does not have")
    positions = f.int("max_position_embeddings", pack.default_positions)
    window = _check_attention_shape(f, pack)
    theta, scaling = _checked_rope(f)
    settings = _shape_settings(f, pack, theta)
    if scaling is not None:
        settings += rope_settings(f, pack, scaling, positions, settings[5][1])
    if pack.qkv_bias_built_in:
        settings += [("attn_bias", True, "the architecture"), ("attn_out_bias", False, "the architecture")]
    elif f.flag("attention_bias", False):
        settings += [("attn_bias", True, "`attention_bias`")]
    if pack.qk_norm is not None:  # q and k normalised per head, with rms_norm_eps
        settings += [("qk_norm", pack.qk_norm, "the architecture")]
    if window is not None:
        settings += [("window", window, "`sliding_window`")]
    settings += [("tie_embeddings", f.flag("tie_word_embeddings", False), "`tie_word_embeddings`"),
                 ("dtype", dtype, "`torch_dtype`")]
    # What a family's block has built in (norms after the sublayers, say) needs no setting.
    return family, settings, positions
