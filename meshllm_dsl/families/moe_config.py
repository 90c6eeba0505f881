"""config.json -> settings for the mixture-of-experts architectures (the packs whose `read` this is).

Their attention is a Llama-shaped architecture's, so the Llama-shaped reading runs on the config
as that architecture's (the pack's `attention`) and its settings are kept where the MoE family has
them; the experts' settings are added. A setting the families cannot honour is refused, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshllm_dsl.families.config_fields import ConfigFields, ImportError_, Setting
from meshllm_dsl.families.llama_config import read_llama_shaped
from meshllm_dsl.families.pack import FamilyPack, Reading, Want

_KEPT = ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "norm_eps", "rope_theta",
         "tie_embeddings", "dtype")


def _attention_settings(f: ConfigFields, pack: FamilyPack, dtype: str) -> tuple[list[Setting], int]:
    """The Llama-shaped settings of the config read as its attention's architecture."""
    assert pack.attention is not None
    attention: dict[str, Any] = {**f.doc, "architectures": [pack.attention.architecture],
                                 "model_type": pack.attention.model_type}
    if pack.experts_width_field is not None:
        attention["intermediate_size"] = f.int(pack.experts_width_field)  # the experts' width
        if not f.flag("use_sliding_window", False):
            attention.pop("sliding_window", None)  # transformers writes 0 there for "no window"
    _, llama, positions = read_llama_shaped(f.with_doc(attention), pack.attention, dtype)
    extra = [name for name, _, _ in llama if name not in _KEPT and name not in pack.built_in_settings]
    if extra:
        name, _, source = next(s for s in llama if s[0] == extra[0])
        raise ImportError_(f"{f.where}: {source} gives `{name}`, which the {pack.family} family does not have "
                           "(not supported)")
    settings = [s for s in llama if s[0] in _KEPT]
    if pack.experts_width_field is not None:  # its `ffn` is the experts' width
        settings = [(n, v, f"`{pack.experts_width_field}`" if n == "ffn" else src) for n, v, src in settings]
    return settings, positions


def _experts_of_own_width(f: ConfigFields, pack: FamilyPack) -> list[Setting]:
    """Experts of their own width (`experts_width_field`): every layer sparse, their count, top-k
    normalisation, a shared expert."""
    step, dense = f.int("decoder_sparse_step", 1), f.doc.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ImportError_(f"{f.where}: `decoder_sparse_step` = {step}, `mlp_only_layers` = {dense!r}: some layers "
                           "are dense; the qwen2_moe family has a mixture of experts in every layer")
    n_field = "num_local_experts" if f.doc.get("num_local_experts") is not None else "num_experts"  # transformers 5 names it so
    settings: list[Setting] = [("experts", f.int(n_field), f"`{n_field}`"),
                               ("norm_topk_prob", f.flag("norm_topk_prob", False), "`norm_topk_prob`")]
    if pack.shared_expert:
        settings.append(("shared_ffn", f.int("shared_expert_intermediate_size"), "`shared_expert_intermediate_size`"))
    return settings


def _experts_of_full_width(f: ConfigFields) -> list[Setting]:
    """Experts as wide as the config's `intermediate_size`: their count, refusing router jitter."""
    if f.doc.get("router_jitter_noise") not in (None, 0, 0.0):
        raise ImportError_(f"{f.where}: `router_jitter_noise` = {f.doc.get('router_jitter_noise')!r} scales the "
                           "router's input by noise when training (not supported)")
    return [("experts", f.int("num_local_experts"), "`num_local_experts`")]


def read_moe(f: ConfigFields, pack: FamilyPack, dtype: str) -> Reading:
    """(family, settings, positions) of a mixture-of-experts config.json (see import_hf.model_settings)."""
    settings, positions = _attention_settings(f, pack, dtype)
    settings += _experts_of_own_width(f, pack) if pack.experts_width_field is not None else _experts_of_full_width(f)
    settings.append(("top_k", f.int("num_experts_per_tok"), "`num_experts_per_tok`"))
    if f.flag("output_router_logits", False) and f.doc.get("router_aux_loss_coef") not in (None, 0, 0.0):
        # transformers adds router_aux_loss_coef x the load-balancing loss only with output_router_logits.
        settings.append(("aux_loss_coef", f.number("router_aux_loss_coef"), "`router_aux_loss_coef`"))
    return pack.family, settings, positions


def check_own_width_experts(pack: FamilyPack, moe: Mapping[str, Any], cfg: Mapping[str, Any], where: str,
                            error: type[Exception]) -> list[Want]:
    """A checkpoint's config.json expert fields (experts of their own width) against a moe layer's
    settings: every layer sparse, their count, top-k normalisation, a shared expert."""
    sparse_step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers", [])
    if sparse_step != 1 or dense:
        raise error(f"{where}: `decoder_sparse_step` = {sparse_step!r}, `mlp_only_layers` = {dense!r}: some "
                    "layers are dense; meshllm's qwen2_moe family has a mixture of experts in every layer "
                    "(expected 1 and [])")
    # transformers 5 names it num_local_experts (num_experts before)
    n_field = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    wants: list[Want] = [
        (n_field, cfg.get(n_field), moe["experts"], "experts"),
        ("norm_topk_prob", bool(cfg.get("norm_topk_prob", False)), moe["norm_topk_prob"], "norm_topk_prob")]
    if pack.shared_expert:
        wants.append(("shared_expert_intermediate_size", cfg.get("shared_expert_intermediate_size"),
                      moe["shared_ffn"], "shared_ffn"))
    return wants


def check_full_width_experts(pack: FamilyPack, moe: Mapping[str, Any], cfg: Mapping[str, Any], where: str,
                             error: type[Exception]) -> list[Want]:
    """A checkpoint's config.json expert fields (experts as wide as `intermediate_size`) against a moe
    layer's settings: their count, no router jitter."""
    return [("num_local_experts", cfg.get("num_local_experts"), moe["experts"], "experts"),
            ("router_jitter_noise", cfg.get("router_jitter_noise", 0.0), 0.0, "router jitter (none)")]
