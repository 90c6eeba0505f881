"""`meshc import-hf` for mixture-of-experts checkpoints: Mixtral (`mixtral` family), Qwen2-MoE
(`qwen2_moe`) and Qwen3-MoE (`qwen3_moe`), from config.json (meshllm_dsl/interop/import_hf.py holds the reading and everything shared).

Their attention is Mistral's, Qwen2's and Qwen3's, so the shared llama reading runs on the config as that
architecture's and its settings are kept where the MoE family has them; the experts' settings are
added. A setting the families cannot honour is refused, naming the field.
"""

from __future__ import annotations

from typing import Any

MOE = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
MODEL_TYPES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# The architecture whose attention each one has, and the llama settings its family takes.
_ATTENTION = {"MixtralForCausalLM": ("MistralForCausalLM", "mistral"), "Qwen2MoeForCausalLM": ("Qwen2ForCausalLM", "qwen2"),
              "Qwen3MoeForCausalLM": ("Qwen3ForCausalLM", "qwen3")}
_KEPT = ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "norm_eps", "rope_theta",
         "tie_embeddings", "dtype")
# Settings the MoE family has built in: Qwen2-MoE's q / k / v biases, Qwen3-MoE's q / k norms.
_BUILT_IN = {"qwen2_moe": ("attn_bias", "attn_out_bias"), "qwen3_moe": ("qk_norm",), "mixtral": ()}


def moe_settings(cfg: dict[str, Any], where: str, arch: str) -> tuple[str, list[tuple[str, Any, str]], int]:
    """(family, settings, positions) of a Mixtral / Qwen2-MoE config.json (see import_hf.model_settings)."""
    from meshllm_dsl.interop.import_hf import ImportError_, _Fields, model_settings

    f = _Fields(cfg, where)
    family = MOE[arch]
    as_arch, as_type = _ATTENTION[arch]
    qwen = family != "mixtral"
    attention = {**cfg, "architectures": [as_arch], "model_type": as_type}
    if qwen:
        attention["intermediate_size"] = f.int("moe_intermediate_size")  # the experts' width
        if not f.flag("use_sliding_window", False):
            attention.pop("sliding_window", None)  # transformers writes 0 there for "no window"
    _, llama, positions = model_settings(attention, where)
    extra = [name for name, _, _ in llama if name not in _KEPT and name not in _BUILT_IN[family]]
    if extra:
        name, _, source = next(s for s in llama if s[0] == extra[0])
        raise ImportError_(f"{where}: {source} gives `{name}`, which the {family} family does not have (not supported)")
    settings = [s for s in llama if s[0] in _KEPT]
    if qwen:  # its `ffn` is the experts' width
        settings = [(n, v, "`moe_intermediate_size`" if n == "ffn" else src) for n, v, src in settings]
    if qwen:
        step, dense = f.int("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ImportError_(f"{where}: `decoder_sparse_step` = {step}, `mlp_only_layers` = {dense!r}: some layers "
                               "are dense; the qwen2_moe family has a mixture of experts in every layer")
        n_field = "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts"  # Qwen3-MoE, transformers 5
        settings += [("experts", f.int(n_field), f"`{n_field}`"),
                     ("norm_topk_prob", f.flag("norm_topk_prob", False), "`norm_topk_prob`")]
        if family == "qwen2_moe":
            settings.append(("shared_ffn", f.int("shared_expert_intermediate_size"), "`shared_expert_intermediate_size`"))
    else:
        if cfg.get("router_jitter_noise") not in (None, 0, 0.0):
            raise ImportError_(f"{where}: `router_jitter_noise` = {cfg.get('router_jitter_noise')!r} scales the "
                               "router's input by noise when training (not supported)")
        settings += [("experts", f.int("num_local_experts"), "`num_local_experts`")]
    settings.append(("top_k", f.int("num_experts_per_tok"), "`num_experts_per_tok`"))
    if f.flag("output_router_logits", False) and cfg.get("router_aux_loss_coef") not in (None, 0, 0.0):
        # transformers adds router_aux_loss_coef x the load-balancing loss only with output_router_logits.
        settings.append(("aux_loss_coef", f.number("router_aux_loss_coef"), "`router_aux_loss_coef`"))
    return family, settings, positions
