"""The Gemma 2 and Gemma 3 (text) packs: `Gemma2ForCausalLM` / `Gemma3ForCausalLM` are the `gemma2` /
`gemma3` families.  One module holds both: they differ in a few fields.

What a Gemma config says beyond Llama's: which blocks attend to a sliding window (`layer_types`,
or the pattern transformers builds it from), each kind of block's rope base, the attention scale
(`query_pre_attn_scalar`) and the soft-caps (Gemma 2 only). A setting the families cannot honour
is refused, naming the field.
"""

from __future__ import annotations

from typing import Any

from meshllm_dsl.families.config_fields import ConfigError, ConfigFields, ImportError_, Setting
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


GEMMA2 = FamilyPack("Gemma2ForCausalLM", "gemma2", "gemma2", read_gemma, title="Gemma 2", default_positions=8192)
GEMMA3 = FamilyPack("Gemma3ForCausalLM", "gemma3_text", "gemma3", read_gemma, title="Gemma 3", default_positions=131072)
