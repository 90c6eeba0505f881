"""The record every model family's pack fills in: one per Hugging Face architecture.

A pack says, in one place, what is specific to one HF model family: its class and `model_type`,
the `.mesh` family it becomes, and how its config.json becomes that family's settings.  Packs are
torch-free and import nothing of the compiler, so the runtime reads the same records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from meshllm_dsl.families.config_fields import ConfigFields, Setting

# A config.json field checked against a model: (field, the config's value, ours, our name for it)
Want = tuple[str, Any, Any, str]


@attrs.frozen
class CheckpointNames:
    """One checkpoint layout (a family's adapter, as torchtitan's state_dict_adapter): which models
    it fits (positions, fused qkv, the norm kind, the activation it needs) and how it names things:
    the top-level layers, the block list, and per block the norms and the attention / MLP
    submodules with our projection -> theirs (runtime/hf/weights.py reads it)."""

    layout: str  # the layout's name, shared by the packs that store their tensors alike ("llama")
    top: Mapping[str, str]  # our role (embed, pos, norm, head) -> HF module
    blocks: str
    norms: Mapping[str, str]  # a block's norms: role (attn_pre, attn_post, mlp_pre, mlp_post) -> HF module
    attn: tuple[str, Mapping[str, str]]
    mlp: tuple[str, Mapping[str, str]]
    transposed: bool  # GPT-2's Conv1D stores attention / MLP weights [in, out]
    positions: bool  # learned positions (a `positional` layer) after the embedding
    fused_qkv: bool
    norm: str  # the norm kind of its blocks and the final norm
    act: str | None  # the mlp activation it needs (None: any the checkpoint's config names)
    norm_offset: float = 0.0  # an RMSNorm that scales by (1 + weight) has 1.0
    # A layout whose config.json is not Llama-shaped (runtime/hf/weights.py writes and checks those):
    # (model, its layout, vocab, tied head, dtype name, positions) -> its config.json
    write_config: Callable[..., dict[str, Any]] | None = None
    # (model, its layout, vocab, config.json, where, error) -> None: checks a config.json wholly
    check_config: Callable[..., None] | None = None
    # (model, its layout, vocab, config.json, model_type, where, error) -> the fields the runtime
    # compares with the model's, in place of the Llama-shaped ones
    config_wants: Callable[..., list[Want]] | None = None
    tied_by_default: bool = False  # a config.json without `tie_word_embeddings` ties the head
    # (model, its layout, whether its MLP is a mixture of experts, error) -> None: refuses a model of
    # this layout that its architecture cannot hold
    refuse_unfit: Callable[..., None] | None = None
    attention_kind: str = "attention"  # the layer kind of its blocks' attention (DeepSeek-V3: mla)
    # The norms a projection carries (mla's latents: our `q_a.norm`) -> their HF module in the attention
    projection_norms: Mapping[str, str] = attrs.field(factory=dict)
    # config.json fields whose null is a value of its own, not the default (DeepSeek-V3's q_lora_rank:
    # no query latent): kept for check_config, which drops other nulls
    null_fields: tuple[str, ...] = ()
    # Its config.json carries partial rotary (`partial_rotary_factor`: GLM-4.5), written and checked by
    # write_config / check_config: attention's rotary_dim is mapped, not refused
    partial_rotary: bool = False


@attrs.frozen
class ExpertNames:
    """A mixture-of-experts checkpoint layout (runtime/hf/moe.py reads it): the block's MoE module,
    per parameter of ours its name inside it (``{e}``: the expert's number), the moe settings it
    fits, and its config.json's expert fields."""

    module: str
    names: Mapping[str, str]  # ours -> theirs ({e}: the expert)
    weights_fp32: bool  # the router's weights are computed in fp32
    renormalised: bool | None  # the norm_topk_prob it needs (None: either)
    fits: str  # the settings it fits, for messages
    # a moe layer's settings -> the expert fields its config.json has, in order
    write_config: Callable[[Mapping[str, Any]], dict[str, Any]]
    # (its pack, the moe layer's settings, config.json, where, error) -> the expert fields to compare
    check_config: Callable[[FamilyPack, Mapping[str, Any], Mapping[str, Any], str, type[Exception]], list[Want]]
    # Checkpoints naming each tensor of ours (`LEAF.TENSOR` -> its name inside `module`) in place of
    # `names` (GPT-OSS: biases, and experts stored fused and 3-D: runtime/hf/fused_experts.py)
    tensors: Mapping[str, str] | None = None
    act: str = "swiglu"  # the moe layer's `act` it fits
    biased: bool = False  # a router bias and expert biases (router_bias, expert_bias)
    scoring: str = "softmax"  # the moe layer's `scoring` it fits (DeepSeek-V3: sigmoid)
    # The moe layer's buffers (`LEAF.BUFFER`) -> their name inside `module` (the sigmoid router's correction bias)
    buffers: Mapping[str, str] = attrs.field(factory=dict)


# (the .mesh family, its settings in order, the positions it was trained for)
Reading = tuple[str, list[Setting], int]


@attrs.frozen
class FamilyPack:
    """One HF architecture: its names, its `.mesh` family, and its config.json reading."""

    architecture: str  # transformers' class, e.g. "LlamaForCausalLM" (config.json's `architectures[0]`)
    model_type: str  # config.json's `model_type`, read when `architectures` is absent
    family: str  # the `.mesh` family a model of it is declared from (stdlib/families.mesh)
    read: Callable[[ConfigFields, FamilyPack, str], Reading]  # (fields, this pack, dtype) -> reading
    checkpoint: CheckpointNames  # its tensors' names in a checkpoint
    title: str = ""  # how people write the architecture's name ("Phi-3"), for messages
    # `meshc export` is proven (tests/integration/test_export.py) for this architecture's module names
    tp_export: bool = False
    # `meshc export --to hf-ep-plan` (transformers' expert parallelism) is proven (tests/integration/test_export_ep.py)
    ep_export: bool = False
    # transformers' default for max_position_embeddings where a config leaves it out
    default_positions: int | None = None
    # Llama-shaped attention (meshllm_dsl/families/llama_config.py): what differs per architecture.
    honours_sliding_window: bool = False  # Mistral, Phi-3: attend within `sliding_window` when set
    refuses_use_sliding_window: bool = False  # Qwen2 / 3: `use_sliding_window` is refused
    ignores_mlp_bias: bool = False  # its MLP has no bias whatever the config says
    default_norm_eps: float = 1e-6
    qkv_bias_built_in: bool = False  # Qwen2: q, k, v biases (no o bias) whatever the config says
    qk_norm: str | None = None  # a q / k norm the architecture has built in: "head" (per head), as a setting
    longrope_only: bool = False  # Phi-3: its config reads `su` / `yarn` as longrope, refuses other types
    longrope_default_original: int | None = None  # Phi3Config's own original_max_position_embeddings
    has_mlp_bias_field: bool = True  # its config.json has an `mlp_bias` field
    # The dim of the heads in the input of its per-head q / k norm, in transformers' model code (Qwen3's
    # norm takes [batch, seq, heads, head_dim], Gemma 3's [batch, heads, seq, head_dim]): `meshc export
    # --to dtensor` shards that dim (SequenceParallel) so the norm's scale gets its whole gradient
    head_norm_heads_dim: int = 2
    checkpoint_qk_norm: str = "none"  # its checkpoints' q / k norms (attention's qk_norm: head, full)
    # Checkpoints that store projections fused (Phi-3): per module, the fused tensor and the separate
    # projections it holds in row order (runtime/hf/fused.py)
    fused_projections: dict[str, tuple[str, tuple[str, ...]]] = attrs.field(factory=dict)
    # Mixture of experts (meshllm_dsl/families/moe_config.py).
    attention: FamilyPack | None = None  # the Llama-shaped architecture whose attention it has
    built_in_settings: tuple[str, ...] = ()  # that attention's settings its family has built in
    experts_width_field: str | None = None  # Qwen-MoE: the experts' width (`ffn`) comes from this field
    shared_expert: bool = False  # Qwen2-MoE: a shared expert of `shared_expert_intermediate_size`
    experts: ExpertNames | None = None  # its checkpoints' experts (runtime/hf/moe.py)
