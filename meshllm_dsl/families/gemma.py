"""The Gemma 2 and Gemma 3 (text) packs: `Gemma2ForCausalLM` / `Gemma3ForCausalLM` are the `gemma2` /
`gemma3` families.  One module holds both: they differ in a few fields.

What a Gemma config says beyond Llama's: which blocks attend to a sliding window (`layer_types`,
or the pattern transformers builds it from), each kind of block's rope base, the attention scale
(`query_pre_attn_scalar`) and the soft-caps (Gemma 2 only). A setting the families cannot honour
is refused, naming the field.

The runtime reads and writes a Gemma checkpoint's config.json here too (``gemma_config``,
``check_gemma_config``; runtime/hf/weights.py holds the tensor names): a Gemma block is Llama's with
a (1 + weight) RMSNorm before and after each sublayer, and what differs between the two versions
lives in config.json.

What the layer kinds do for it: RMSNorm with `offset = 1.0` (x * (1 + weight) in fp32, norm.py)
before and after each sublayer (`post`), the token table scaled by sqrt(hidden) (`scaled`), GeGLU with
tanh GELU (`geglu_tanh`), sliding-window blocks alternating with global ones (`window`,
`global_every`) with their own rope base (`local_rope_theta`), Gemma 2's attention and final-logit
soft-caps (`softcap`, eager attention) and Gemma 3's q / k norms per head with the same offset
(`qk_norm = head`, `qk_norm_offset`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from meshllm_dsl.families.config_fields import ConfigError, ConfigFields, ImportError_, Setting
from meshllm_dsl.families.llama import NAMES as LLAMA_NAMES
from meshllm_dsl.families.pack import FamilyPack, Reading

SLIDING, FULL = "sliding_attention", "full_attention"


def _global_every(types: list[str]) -> int | None:
    """The `global_every` that gives these layer types (0: every block windowed), or None."""
    n = len(types)
    for every in [0, *range(1, n + 2)]:
        if types == [FULL if every and (i + 1) % every == 0 else SLIDING for i in range(n)]:
            return every
    return None


def _refuse_unlike_gemma(f: ConfigFields, family: str) -> None:
    """The activation, biases and attention direction every Gemma has."""
    act_field = "hidden_activation" if f.doc.get("hidden_activation") is not None else "hidden_act"
    if f.text(act_field, "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise f.refuse(act_field, f"is not the tanh GELU of the {family} family's GeGLU")
    if f.flag("attention_bias", False):
        raise f.refuse("attention_bias", f"adds attention biases the {family} family does not have")
    if f.flag("use_bidirectional_attention", False):
        raise f.refuse("use_bidirectional_attention", "makes attention bidirectional; meshllm's is causal")


def _layer_types(f: ConfigFields, family: str, layers: int, window: int | None) -> tuple[list[str], int]:
    """(each layer's attention type, the global_every that gives them)."""
    types = f.doc.get("layer_types")
    if types is None:
        pattern = f.int("sliding_window_pattern", 6) if family == "gemma3" else 2
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    elif not (isinstance(types, list) and all(t in (SLIDING, FULL) for t in types)):
        raise f.error("layer_types", f'a list of "{SLIDING}" / "{FULL}", one per layer')
    if len(types) != layers:
        raise ConfigError(f"{f.where}: `layer_types` has {len(types)} entries; expected one per layer "
                          f"(`num_hidden_layers` = {layers})")
    every = _global_every(types)
    if every is None:
        raise ImportError_(f"{f.where}: `layer_types` = {types!r} is no pattern of one full-attention layer in "
                           f"every N; the {family} family's global_every gives those only")
    if SLIDING in types and window is None:
        raise ConfigError(f"{f.where}: no `sliding_window`; expected a positive integer for the sliding_attention layers")
    return types, every


def _softcaps(f: ConfigFields, family: str) -> list[Setting]:
    """Gemma 2's attention and final soft-caps (always on); Gemma 3 refuses any."""
    settings: list[Setting] = []
    for field, name, default in (("attn_logit_softcapping", "attn_softcap", 50.0),
                                 ("final_logit_softcapping", "final_softcap", 30.0)):
        if family == "gemma3":
            f.off(field, "soft-caps logits; the gemma3 family does not")
            continue
        value = f.number(field, None) if field in f.doc else default
        if value is None:
            raise f.refuse(field, "is null: the gemma2 family always soft-caps (transformers' default is "
                           f"{default})")
        settings.append((name, value, f"`{field}`"))
    return settings


def read_gemma(f: ConfigFields, pack: FamilyPack, dtype: str) -> Reading:
    """(family, settings, positions) of a Gemma 2 / Gemma 3 config.json (see import_hf.model_settings)."""
    family = pack.family
    _refuse_unlike_gemma(f, family)
    layers = f.blocks("num_hidden_layers")
    positions = f.int("max_position_embeddings", pack.default_positions)
    window = f.int("sliding_window", None)
    types, every = _layer_types(f, family, layers, window)
    heads = f.int("num_attention_heads")
    settings: list[Setting] = [
        ("vocab", f.int("vocab_size"), "`vocab_size`"), ("hidden", f.int("hidden_size"), "`hidden_size`"),
        ("layers", layers, "`num_hidden_layers`"), ("heads", heads, "`num_attention_heads`"),
        ("kv_heads", f.int("num_key_value_heads", heads), "`num_key_value_heads`"),
        ("head_dim", f.int("head_dim", 256), "`head_dim`"),
        ("ffn", f.int("intermediate_size"), "`intermediate_size`"),
        ("norm_eps", f.number("rms_norm_eps", 1e-6), "`rms_norm_eps`"),
    ]
    settings += _rope(f, family == "gemma3")
    if SLIDING in types:
        settings.append(("window", window, "`sliding_window`"))
    settings += [("global_every", every, "`layer_types`"),
                 ("query_pre_attn_scalar", f.int("query_pre_attn_scalar", 256), "`query_pre_attn_scalar`")]
    settings += _softcaps(f, family)
    settings += [("tie_embeddings", f.flag("tie_word_embeddings", True), "`tie_word_embeddings`"),
                 ("dtype", dtype, "`torch_dtype`")]
    return family, settings, positions


def _gemma2_rope(f: ConfigFields, params: ConfigFields | None) -> list[Setting]:
    """Gemma 2's one rope_theta, refusing a scaled rope."""
    theta, source = f.number("rope_theta", 10000.0), "`rope_theta`"
    if params is not None:
        kind = params.text("rope_type", "default")
        if kind != "default":
            raise ImportError_(f"{f.where}: `rope_parameters.rope_type` = {kind!r}; the gemma2 family has unscaled rope only")
        if params.doc.get("rope_theta") is not None:
            theta, source = params.number("rope_theta"), "`rope_parameters.rope_theta`"
    return [("rope_theta", theta, source)]


def _rope(f: ConfigFields, gemma3: bool) -> list[Setting]:
    """rope_theta (and Gemma 3's local_rope_theta), refusing a scaled rope."""
    if f.doc.get("rope_scaling") is not None:
        raise ImportError_(f"{f.where}: `rope_scaling` is set; the gemma families have unscaled rope only")
    params = f.obj("rope_parameters")
    if not gemma3:
        return _gemma2_rope(f, params)
    out: dict[str, tuple[Any, str]] = {
        FULL: (f.number("rope_theta", 1_000_000.0), "`rope_theta`"),
        SLIDING: (f.number("rope_local_base_freq", 10_000.0), "`rope_local_base_freq`")}
    for kind in (FULL, SLIDING) if params is not None else ():
        sub = params.obj(kind) if params is not None else None
        if sub is None:
            continue
        rope_type = sub.text("rope_type", "default")
        if rope_type != "default":
            raise ImportError_(f"{f.where}: `rope_parameters.{kind}.rope_type` = {rope_type!r}; the gemma3 family "
                               "has unscaled rope only")
        if sub.doc.get("rope_theta") is not None:
            out[kind] = (sub.number("rope_theta"), f"`rope_parameters.{kind}.rope_theta`")
    return [("rope_theta", *out[FULL]), ("local_rope_theta", *out[SLIDING])]


# ---------------------------------------------------------------- the runtime: config.json out and in


def layer_types(attn: Mapping[str, Any], count: int) -> list[str]:
    """Per block of the repeat, HF's name for its attention: windowed unless every
    ``global_every``-th (the rule attention's layer_window applies in the compiler)."""
    window, every = int(attn.get("window") or 0), int(attn.get("global_every") or 0)
    return [FULL if not window or (every and (i + 1) % every == 0) else SLIDING for i in range(count)]


def _gemma3(attn: Mapping[str, Any]) -> bool:
    return attn.get("qk_norm", "none") == "head"


def gemma_config(attn: Mapping[str, Any], mlp: Mapping[str, Any], norm: Mapping[str, Any], head: Mapping[str, Any],
                 vocab: int, hidden: int, count: int, dtype_name: str, seq: int) -> dict[str, Any]:
    """The config.json of a Gemma 2 (no q / k norm) or Gemma 3 text model (q / k norm per head)."""
    types = layer_types(attn, count)
    window = int(attn.get("window") or 0)
    theta = float(attn["rope_theta"])
    local = float(attn.get("local_rope_theta") or theta)
    cfg: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM" if _gemma3(attn) else "Gemma2ForCausalLM"],
        "model_type": "gemma3_text" if _gemma3(attn) else "gemma2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(mlp["ffn"]),
        "num_hidden_layers": count,
        "num_attention_heads": int(attn["heads"]),
        "num_key_value_heads": int(attn["kv_heads"]),
        "head_dim": int(attn["head_dim"]),
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(norm["eps"]),
        "max_position_embeddings": seq,
        "attention_bias": False,
        "query_pre_attn_scalar": int(attn.get("scale_dim") or attn["head_dim"]),
        "sliding_window": window or None,
        "layer_types": types,
        "attn_logit_softcapping": attn.get("softcap"),
        "final_logit_softcapping": head.get("softcap"),
        "tie_word_embeddings": bool(head.get("tie")),
        "torch_dtype": dtype_name,
    }
    if _gemma3(attn):
        cfg["rope_parameters"] = {FULL: {"rope_type": "default", "rope_theta": theta},
                                  SLIDING: {"rope_type": "default", "rope_theta": local}}
    else:
        cfg["rope_theta"] = theta
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return cfg


def _thetas(cfg: Mapping[str, Any], gemma3: bool, where: str, error: Callable[[str], Exception]) -> dict[str, float]:
    """The rope base of each kind of layer, refusing a scaled rope (which meshllm's Gemma lacks)."""
    params = cfg.get("rope_parameters")
    if gemma3:
        per: dict[str, float] = {FULL: float(cfg.get("rope_theta", 1_000_000.0)),
                                 SLIDING: float(cfg.get("rope_local_base_freq", 10_000.0))}
        if isinstance(params, Mapping):
            for kind in (FULL, SLIDING):
                sub = params.get(kind)
                if isinstance(sub, Mapping):
                    if sub.get("rope_type", "default") != "default":
                        raise error(f"`rope_parameters.{kind}.rope_type` = {sub.get('rope_type')!r}: meshllm's "
                                    "gemma3 family has unscaled rope only")
                    if sub.get("rope_theta") is not None:
                        per[kind] = float(sub["rope_theta"])
        if cfg.get("rope_scaling"):
            raise error("`rope_scaling` is set: meshllm's gemma3 family has unscaled rope only")
        return per
    theta = float(cfg.get("rope_theta", 10_000.0))
    if isinstance(params, Mapping):
        if params.get("rope_type", "default") != "default":
            raise error(f"`rope_parameters.rope_type` = {params.get('rope_type')!r}: meshllm's gemma2 family "
                        "has unscaled rope only")
        theta = float(params.get("rope_theta", theta))
    return {FULL: theta, SLIDING: theta}


def check_gemma_config(attn: Mapping[str, Any], mlp: Mapping[str, Any], norm: Mapping[str, Any],
                       head: Mapping[str, Any], vocab: int, hidden: int, count: int, name: str,
                       cfg: Mapping[str, Any], where: str, error: Callable[[str], Exception]) -> None:
    """Raise ``error(message)`` (one line, naming the field) at the first field of a Gemma 2 / 3
    config.json the model disagrees with."""
    model_type = cfg.get("model_type")
    gemma3 = _gemma3(attn)
    want_type = "gemma3_text" if gemma3 else "gemma2"
    if model_type != want_type:
        raise error(f"{where}: `model_type` is {model_type!r}, but model `{name}` is {want_type} shaped "
                    f"({'with' if gemma3 else 'without'} q / k norms)")
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim", 256)
    window = cfg.get("sliding_window")
    pattern = cfg.get("sliding_window_pattern", 6) if gemma3 else 2
    theirs_types = cfg.get("layer_types")
    if theirs_types is None and isinstance(pattern, int) and pattern > 0:
        theirs_types = [SLIDING if (i + 1) % pattern else FULL for i in range(int(cfg.get("num_hidden_layers", 0)))]
    thetas = _thetas(cfg, gemma3, where, lambda m: error(f"{where}: {m}"))
    ours_types = layer_types(attn, count)
    wants: list[tuple[str, Any, Any, str]] = [
        ("vocab_size", cfg.get("vocab_size"), vocab, "vocab"),
        ("hidden_size", cfg.get("hidden_size"), hidden, "hidden"),
        ("num_hidden_layers", cfg.get("num_hidden_layers"), count, "layers"),
        ("num_attention_heads", heads, attn["heads"], "heads"),
        ("num_key_value_heads", cfg.get("num_key_value_heads", heads), attn["kv_heads"], "kv_heads"),
        ("head_dim", head_dim, attn["head_dim"], "head_dim"),
        ("intermediate_size", cfg.get("intermediate_size"), mlp["ffn"], "ffn"),
        ("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6), norm["eps"], "norm_eps"),
        ("hidden_activation", cfg.get("hidden_activation", "gelu_pytorch_tanh"), "gelu_pytorch_tanh",
         "GeGLU's activation"),
        ("query_pre_attn_scalar", cfg.get("query_pre_attn_scalar", 256), attn.get("scale_dim") or attn["head_dim"],
         "query_pre_attn_scalar"),
        ("attn_logit_softcapping", cfg.get("attn_logit_softcapping", None if gemma3 else 50.0), attn.get("softcap"),
         "attn_softcap"),
        ("final_logit_softcapping", cfg.get("final_logit_softcapping", None if gemma3 else 30.0), head.get("softcap"),
         "final_softcap"),
        ("attention_bias", bool(cfg.get("attention_bias", False)), False, "attention bias"),
        ("layer_types", theirs_types, ours_types, "window / global_every"),
        ("rope_theta" if not gemma3 else "rope_parameters.full_attention.rope_theta", thetas[FULL],
         attn["rope_theta"], "rope_theta"),
        ("tie_word_embeddings", bool(cfg.get("tie_word_embeddings", True)), bool(head.get("tie")), "a tied head"),
    ]
    if SLIDING in ours_types:
        wants.append(("sliding_window", window, attn.get("window"), "window"))
        wants.append(("rope_local_base_freq" if gemma3 else "rope_theta", thetas[SLIDING],
                      attn.get("local_rope_theta") or attn["rope_theta"], "local_rope_theta"))
    for field, got, want, what in wants:
        same = (math.isclose(float(got), float(want), rel_tol=1e-9)
                if isinstance(got, (int, float)) and isinstance(want, (int, float))
                and not isinstance(got, bool) and not isinstance(want, bool) else got == want)
        if not same:
            if got is None:
                raise error(f"{where}: `{field}` is missing; model `{name}` has {what} = {want!r}")
            raise error(f"{where}: `{field}` is {got!r}, but model `{name}` has {what} = {want!r}")


def _write_config(model: Mapping[str, Any], lay: Any, vocab: int, tied: bool, dtype_name: str,
                  seq: int) -> dict[str, Any]:
    """gemma_config of the runtime's layout of ``model`` (runtime/hf/weights.py)."""
    return gemma_config(lay.attn, lay.mlp, lay.norm, lay.head, vocab, lay.hidden, lay.count, dtype_name, seq)


def _check_config(model: Mapping[str, Any], lay: Any, vocab: int, cfg: Mapping[str, Any], where: str,
                  error: Callable[[str], Exception]) -> None:
    """check_gemma_config of the runtime's layout of ``model`` (runtime/hf/weights.py)."""
    check_gemma_config(lay.attn, lay.mlp, lay.norm, lay.head, vocab, lay.hidden, lay.count,
                       model.get("name", "model"), cfg, where, error)


# Llama's names, a norm before and after each sublayer, (1 + weight) norms.
NAMES = attrs.evolve(
    LLAMA_NAMES, layout="gemma",
    norms={"attn_pre": "input_layernorm", "attn_post": "post_attention_layernorm",
           "mlp_pre": "pre_feedforward_layernorm", "mlp_post": "post_feedforward_layernorm"},
    act="geglu_tanh", norm_offset=1.0, write_config=_write_config, check_config=_check_config,
)

GEMMA2 = FamilyPack("Gemma2ForCausalLM", "gemma2", "gemma2", read_gemma, NAMES, title="Gemma 2", tp_export=True,
                   default_positions=8192)
GEMMA3 = FamilyPack("Gemma3ForCausalLM", "gemma3_text", "gemma3", read_gemma, NAMES, title="Gemma 3", tp_export=True, head_norm_heads_dim=1,
                   default_positions=131072)
