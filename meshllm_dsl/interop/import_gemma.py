"""`meshc import-hf` for Gemma 2 and Gemma 3 text checkpoints: the `gemma2` / `gemma3` family
settings from config.json (meshllm_dsl/interop/import_hf.py holds the reading and everything shared).

What a Gemma config says beyond Llama's: which blocks attend to a sliding window (`layer_types`,
or the pattern transformers builds it from), each kind of block's rope base, the attention scale
(`query_pre_attn_scalar`) and the soft-caps. A setting the families cannot honour is refused,
naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshllm_dsl.front.limits import MAX_BLOCKS

if TYPE_CHECKING:
    from meshllm_dsl.interop.import_hf import _Fields

GEMMA = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
MODEL_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
DEFAULT_POSITIONS = {"Gemma2ForCausalLM": 8192, "Gemma3ForCausalLM": 131072}
SLIDING, FULL = "sliding_attention", "full_attention"


def _global_every(types: list[str], window: int | None) -> int | None:
    """The `global_every` that gives these layer types (0: every block windowed), or None."""
    n = len(types)
    for every in [0, *range(1, n + 2)]:
        if types == [FULL if every and (i + 1) % every == 0 else SLIDING for i in range(n)]:
            return every
    return None


def gemma_settings(f: _Fields, arch: str, dtype: str) -> tuple[str, list[tuple[str, Any, str]], int]:
    """(family, settings, positions) of a Gemma 2 / Gemma 3 config.json (see import_hf.model_settings)."""
    from meshllm_dsl.interop.import_hf import ConfigError, ImportError_

    where, doc = f.where, f.doc
    family = GEMMA[arch]
    gemma3 = family == "gemma3"

    def refuse(field: str, why: str) -> ImportError_:
        return ImportError_(f"{where}: `{field}` = {doc.get(field)!r} {why}")

    act_field = "hidden_activation" if doc.get("hidden_activation") is not None else "hidden_act"
    if f.text(act_field, "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise refuse(act_field, f"is not the tanh GELU of the {family} family's GeGLU")
    if f.flag("attention_bias", False):
        raise refuse("attention_bias", f"adds attention biases the {family} family does not have")
    if f.flag("use_bidirectional_attention", False):
        raise refuse("use_bidirectional_attention", "makes attention bidirectional; meshllm's is causal")
    layers = f.int("num_hidden_layers", maximum=MAX_BLOCKS)
    positions = f.int("max_position_embeddings", DEFAULT_POSITIONS[arch])
    window = f.int("sliding_window", None)
    types = doc.get("layer_types")
    if types is None:
        pattern = f.int("sliding_window_pattern", 6) if gemma3 else 2
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    elif not (isinstance(types, list) and all(t in (SLIDING, FULL) for t in types)):
        raise f.error("layer_types", f'a list of "{SLIDING}" / "{FULL}", one per layer')
    if len(types) != layers:
        raise ConfigError(f"{where}: `layer_types` has {len(types)} entries; expected one per layer "
                          f"(`num_hidden_layers` = {layers})")
    every = _global_every(types, window)
    if every is None:
        raise ImportError_(f"{where}: `layer_types` = {types!r} is no pattern of one full-attention layer in "
                           f"every N; the {family} family's global_every gives those only")
    if SLIDING in types and window is None:
        raise ConfigError(f"{where}: no `sliding_window`; expected a positive integer for the sliding_attention layers")
    heads = f.int("num_attention_heads")
    head_dim = f.int("head_dim", 256)
    settings: list[tuple[str, Any, str]] = [
        ("vocab", f.int("vocab_size"), "`vocab_size`"), ("hidden", f.int("hidden_size"), "`hidden_size`"),
        ("layers", layers, "`num_hidden_layers`"), ("heads", heads, "`num_attention_heads`"),
        ("kv_heads", f.int("num_key_value_heads", heads), "`num_key_value_heads`"),
        ("head_dim", head_dim, "`head_dim`"),
        ("ffn", f.int("intermediate_size"), "`intermediate_size`"),
        ("norm_eps", f.number("rms_norm_eps", 1e-6), "`rms_norm_eps`"),
    ]
    settings += _rope(f, gemma3)
    if SLIDING in types:
        settings.append(("window", window, "`sliding_window`"))
    settings += [("global_every", every, "`layer_types`"),
                 ("query_pre_attn_scalar", f.int("query_pre_attn_scalar", 256), "`query_pre_attn_scalar`")]
    for field, name, default in (("attn_logit_softcapping", "attn_softcap", 50.0),
                                 ("final_logit_softcapping", "final_softcap", 30.0)):
        if gemma3:
            f.off(field, "soft-caps logits; the gemma3 family does not")
        else:
            value = f.number(field, None) if field in doc else default
            if value is None:
                raise refuse(field, "is null: the gemma2 family always soft-caps (transformers' default is "
                             f"{default})")
            settings.append((name, value, f"`{field}`"))
    settings += [("tie_embeddings", f.flag("tie_word_embeddings", True), "`tie_word_embeddings`"),
                 ("dtype", dtype, "`torch_dtype`")]
    return family, settings, positions


def _rope(f: _Fields, gemma3: bool) -> list[tuple[str, Any, str]]:
    """rope_theta (and Gemma 3's local_rope_theta), refusing a scaled rope."""
    from meshllm_dsl.interop.import_hf import ImportError_

    where = f.where
    if f.doc.get("rope_scaling") is not None:
        raise ImportError_(f"{where}: `rope_scaling` is set; the gemma families have unscaled rope only")
    params = f.obj("rope_parameters")
    if not gemma3:
        theta, source = f.number("rope_theta", 10000.0), "`rope_theta`"
        if params is not None:
            kind = params.text("rope_type", "default")
            if kind != "default":
                raise ImportError_(f"{where}: `rope_parameters.rope_type` = {kind!r}; the gemma2 family has unscaled rope only")
            if params.doc.get("rope_theta") is not None:
                theta, source = params.number("rope_theta"), "`rope_parameters.rope_theta`"
        return [("rope_theta", theta, source)]
    out = {FULL: (f.number("rope_theta", 1_000_000.0), "`rope_theta`"),
           SLIDING: (f.number("rope_local_base_freq", 10_000.0), "`rope_local_base_freq`")}
    if params is not None:
        for kind in (FULL, SLIDING):
            sub = params.obj(kind)
            if sub is None:
                continue
            rope_type = sub.text("rope_type", "default")
            if rope_type != "default":
                raise ImportError_(f"{where}: `rope_parameters.{kind}.rope_type` = {rope_type!r}; the gemma3 family "
                                   "has unscaled rope only")
            if sub.doc.get("rope_theta") is not None:
                out[kind] = (sub.number("rope_theta"), f"`rope_parameters.{kind}.rope_theta`")
    return [("rope_theta", *out[FULL]), ("local_rope_theta", *out[SLIDING])]
