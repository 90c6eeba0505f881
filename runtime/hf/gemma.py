"""Gemma 2 / Gemma 3 (text) config.json in and out (``runtime/hf/weights.py`` holds their tensor names).

A Gemma block is Llama's with a (1 + weight) RMSNorm before and after each sublayer; what differs
between the two versions and from Llama lives in config.json: which layers attend to a sliding
window (``layer_types``, or the pattern they come from), the rope base of each kind of layer, the
attention scale (``query_pre_attn_scalar``), the soft-caps, and Gemma 3's q / k norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["check_gemma_config", "gemma_config", "layer_types"]

SLIDING, FULL = "sliding_attention", "full_attention"


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
