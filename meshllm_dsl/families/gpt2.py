"""The GPT-2 pack: `GPT2LMHeadModel` (config.json `model_type` "gpt2") is the `gpt2` family:
learned positions, LayerNorm, a tanh-GELU MLP and tied embeddings by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshllm_dsl.families.config_fields import ConfigFields
from meshllm_dsl.families.pack import CheckpointNames, FamilyPack, Reading, Want
from meshllm_dsl.runtime.model import description


def read_gpt2(f: ConfigFields, pack: FamilyPack, dtype: str) -> Reading:
    """(family, settings, positions) of a GPT-2 config.json (see import_hf.model_settings)."""
    act = f.text("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise f.refuse("activation_function", "is not the tanh GELU the gpt2 family uses")
    if f.flag("scale_attn_by_inverse_layer_idx", False):
        raise f.refuse("scale_attn_by_inverse_layer_idx", "changes the attention maths (not supported)")
    if not f.flag("scale_attn_weights", True):
        raise f.refuse("scale_attn_weights", "changes the attention maths (not supported)")
    if f.flag("add_cross_attention", False):
        raise f.refuse("add_cross_attention", "adds cross-attention layers (not supported)")
    hidden = f.int("n_embd")
    positions = f.int("n_positions")
    return pack.family, [
        ("vocab", f.int("vocab_size"), "`vocab_size`"), ("hidden", hidden, "`n_embd`"),
        ("layers", f.blocks("n_layer"), "`n_layer`"), ("heads", f.int("n_head"), "`n_head`"),
        ("ffn", f.int("n_inner", 4 * hidden), "`n_inner` (or 4 x `n_embd`)"),
        ("positions", positions, "`n_positions`"),
        ("norm_eps", f.number("layer_norm_epsilon", 1e-5), "`layer_norm_epsilon`"),
        ("tie_embeddings", f.flag("tie_word_embeddings", True), "`tie_word_embeddings`"),
        ("dtype", dtype, "`torch_dtype`"),
    ], positions


def _positions(model: Mapping[str, Any]) -> Mapping[str, Any]:
    table = description.position_table(model)
    assert table is not None  # the gpt2 layout fits only models with learned positions
    return table


def _write_config(model: Mapping[str, Any], lay: Any, vocab: int, tied: bool, dtype_name: str,
                  seq: int) -> dict[str, Any]:
    """The config.json of a model of the gpt2 layout (``lay``: runtime/hf/weights.py's)."""
    attn, mlp = lay.attn, lay.mlp
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_embd": lay.hidden,
        "n_layer": lay.count,
        "n_head": int(attn["heads"]),
        "n_positions": int(_positions(model)["num"]),
        "n_inner": int(mlp["ffn"]),
        "layer_norm_epsilon": float(lay.body[0]["eps"]),
        "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                                "silu": "silu"}[mlp["act"]],
        "tie_word_embeddings": tied,
        "torch_dtype": dtype_name,
    }


def _config_wants(model: Mapping[str, Any], lay: Any, vocab: int, cfg: Mapping[str, Any], model_type: Any,
                  where: str, error: type[Exception]) -> list[Want]:
    """GPT-2's fields against the model's; refuses the attention variants the gpt2 family lacks."""
    attn, mlp, name = lay.attn, lay.mlp, model.get("name", "model")
    if model_type != "gpt2":
        raise error(f"{where}: model_type {model_type!r}, but model `{name}` is GPT-2 shaped")
    inner = cfg.get("n_inner") or 4 * int(cfg.get("n_embd", 0))
    wants: list[Want] = [
        ("vocab_size", cfg.get("vocab_size"), vocab, "vocab"),
        ("n_embd", cfg.get("n_embd"), lay.hidden, "hidden"),
        ("n_layer", cfg.get("n_layer"), lay.count, "layers"),
        ("n_head", cfg.get("n_head"), attn["heads"], "heads"),
        ("n_inner", inner, mlp["ffn"], "ffn"),
        ("layer_norm_epsilon", cfg.get("layer_norm_epsilon", 1e-5), lay.body[0]["eps"], "norm_eps"),
    ]
    given = cfg.get("activation_function", "gelu_new")
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
           "relu": "relu", "silu": "silu"}.get(given, given)
    wants.append(("activation_function", act, mlp["act"], "act"))
    wants.append(("n_positions", cfg.get("n_positions"), _positions(model)["num"], "positions"))
    for flag, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if bool(cfg.get(flag, ok)) != ok:
            raise error(f"{where}: `{flag}` = {cfg.get(flag)!r} changes the attention maths; "
                        "meshllm's gpt2 family does not support it")
    return wants


NAMES = CheckpointNames(
    layout="gpt2",
    top={"embed": "transformer.wte", "pos": "transformer.wpe", "norm": "transformer.ln_f", "head": "lm_head"},
    blocks="transformer.h", norms={"attn_pre": "ln_1", "mlp_pre": "ln_2"},
    attn=("attn", {"qkv": "c_attn", "o": "c_proj"}),
    mlp=("mlp", {"up": "c_fc", "down": "c_proj"}),
    transposed=True, positions=True, fused_qkv=True, norm="layernorm", act=None,
    write_config=_write_config, config_wants=_config_wants, tied_by_default=True,
)

PACK = FamilyPack("GPT2LMHeadModel", "gpt2", "gpt2", read_gpt2, NAMES, title="GPT-2", tp_export=True)
