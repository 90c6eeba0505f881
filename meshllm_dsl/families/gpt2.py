"""The GPT-2 pack: `GPT2LMHeadModel` (config.json `model_type` "gpt2") is the `gpt2` family:
learned positions, LayerNorm, a tanh-GELU MLP and tied embeddings by default.
"""

from __future__ import annotations

from meshllm_dsl.families.config_fields import ConfigFields
from meshllm_dsl.families.pack import CheckpointNames, FamilyPack, Reading


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


NAMES = CheckpointNames(
    layout="gpt2",
    top={"embed": "transformer.wte", "pos": "transformer.wpe", "norm": "transformer.ln_f", "head": "lm_head"},
    blocks="transformer.h", norms={"attn_pre": "ln_1", "mlp_pre": "ln_2"},
    attn=("attn", {"qkv": "c_attn", "o": "c_proj"}),
    mlp=("mlp", {"up": "c_fc", "down": "c_proj"}),
    transposed=True, positions=True, fused_qkv=True, norm="layernorm", act=None,
)

PACK = FamilyPack("GPT2LMHeadModel", "gpt2", "gpt2", read_gpt2, NAMES, title="GPT-2", tp_export=True)
