"""Hugging Face checkpoints of mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) for runtime/hf/weights.py.

transformers 5.24 keeps each expert's projections as tensors of their own on disk
(``block_sparse_moe.experts.E.w1.weight`` [ffn, hidden], ``mlp.experts.E.gate_proj.weight``) and
``from_pretrained`` reads that layout; meshllm stacks them into one parameter per projection
([out, experts, in], runtime/moe/experts.py StackedLinear). So one of our names stands for one stored tensor
per expert: its key is a template with ``{e}`` where the expert's number goes (``EXPERT``). A rank
reads only its slice of each expert it holds, and export writes the experts apart again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from meshllm_dsl.runtime.parallel.mesh import Mesh
from meshllm_dsl.runtime.parallel.shards import ShardSpec

EXPERT = "{e}"


@dataclass(frozen=True)
class _MoeLayout:
    """One family's names: the block's MoE module and, per parameter of ours, its name inside it."""

    arch: str
    model_type: str
    module: str
    names: Mapping[str, str]  # ours -> theirs ({e}: the expert)


MIXTRAL = _MoeLayout("MixtralForCausalLM", "mixtral", "block_sparse_moe", {
    "router": "gate", "gate": "experts.{e}.w1", "up": "experts.{e}.w3", "down": "experts.{e}.w2"})
QWEN2_MOE = _MoeLayout("Qwen2MoeForCausalLM", "qwen2_moe", "mlp", {
    "router": "gate", "gate": "experts.{e}.gate_proj", "up": "experts.{e}.up_proj", "down": "experts.{e}.down_proj",
    "shared_gate": "shared_expert.gate_proj", "shared_up": "shared_expert.up_proj",
    "shared_down": "shared_expert.down_proj", "shared_router": "shared_expert_gate"})
QWEN3_MOE = _MoeLayout("Qwen3MoeForCausalLM", "qwen3_moe", "mlp", {
    "router": "gate", "gate": "experts.{e}.gate_proj", "up": "experts.{e}.up_proj", "down": "experts.{e}.down_proj"})


def as_mlp(layer: Mapping[str, Any]) -> Mapping[str, Any]:
    """A block's layer as hf.py's layouts read it: a moe layer stands where the MLP does (its
    experts are SwiGLU), marked `moe` so the names, config and checks below take it."""
    return {**layer, "kind": "mlp", "act": "swiglu", "moe": True} if layer["kind"] == "moe" else layer


def is_moe(body: Any) -> bool:
    """Whether a block (as_mlp's layer descriptions) has a mixture of experts."""
    return any(b.get("moe") for b in body)


def moe_layout(moe: Mapping[str, Any], name: str, error: type[Exception]) -> _MoeLayout:
    """The checkpoint layout a moe layer's settings fit, or ``error`` saying why none does."""
    shared = moe.get("shared_ffn") is not None
    if shared and not moe["weights_fp32"]:
        return QWEN2_MOE
    if not shared and moe["weights_fp32"] and moe["norm_topk_prob"]:
        return MIXTRAL
    if not shared and not moe["weights_fp32"]:
        return QWEN3_MOE
    raise error(f"model `{name}`: a moe layer with shared expert {shared}, weights_fp32 {moe['weights_fp32']}, "
                f"norm_topk_prob {moe['norm_topk_prob']} has no Hugging Face layout; expected Mixtral's "
                "(no shared expert, fp32 weights, renormalised), Qwen2-MoE's (a shared expert, weights in "
                "the activations' dtype) or Qwen3-MoE's (no shared expert, weights in the activations' dtype)")


def key(blocks: str, lay: Any, parts: list[str], error: type[Exception]) -> str | None:
    """The stored name (or ``{e}`` template) of our ``REPEAT.I.UNIT.LEAF.weight`` when UNIT is a moe
    layer of a block under HF's ``blocks`` list; None for any other parameter."""
    if not is_moe(lay.body) or len(parts) != 5 or parts[0] != lay.repeat:
        return None
    moe = _moe(lay)
    if parts[2] != moe["name"]:
        return None
    fam = moe_layout(moe, "model", error)
    if parts[3] not in fam.names or parts[4] != "weight":
        raise error(f"parameter {'.'.join(parts)} has no Hugging Face name")
    return f"{blocks}.{parts[1]}.{fam.module}.{fam.names[parts[3]]}.weight"


def is_stacked(k: str) -> bool:
    return EXPERT in k


def stored(k: str, shape: tuple[int, ...]) -> list[str]:
    """The stored tensors behind key ``k`` of a parameter of full ``shape``."""
    return [k.replace(EXPERT, str(e)) for e in range(shape[1])] if is_stacked(k) else [k]


def check_stacked(ckpt: Any, k: str, shape: tuple[int, ...], name: str, floating: frozenset[str],
                  error: type[Exception]) -> None:
    """Every expert's tensor is there, floating point, [out, in] of ``shape`` [out, experts, in]."""
    for one in stored(k, shape):
        found = ckpt.key(one)
        if found is None:
            files = sorted({p.name for p in ckpt.where.values()})
            raise error(f"tensor {one} (expert of {name}) is missing from {ckpt.dir} ({', '.join(files)})")
        if ckpt.dtypes.get(found) not in floating:
            raise error(f"tensor {found} in {ckpt.where[found]} is stored as {ckpt.dtypes.get(found)}, but {name} "
                        f"is a floating-point parameter; expected one of {', '.join(sorted(floating))}")
        want = (shape[0], shape[2])
        if tuple(ckpt.shape(found)) != want:
            raise error(f"tensor {found} in {ckpt.where[found]} has shape {tuple(ckpt.shape(found))}, but each "
                        f"expert of {name} needs {want}")
    more = k.replace(EXPERT, str(shape[1]))
    if ckpt.key(more) is not None:
        raise error(f"tensor {more} in {ckpt.where[ckpt.key(more)]}: the checkpoint has more than the "
                    f"{shape[1]} experts of {name}")


def local_stacked(ckpt: Any, k: str, spec: ShardSpec, mesh: Mesh, dtype: torch.dtype,
                  read: Callable[..., Tensor]) -> Tensor:
    """This rank's shard [out_l, experts_l, in_l] of a stacked parameter: of each expert it holds,
    only its slice, read by ``read`` (hf.local_from_hf) as a 2-D [out, in] tensor."""
    out_f, n_exp, in_f = spec.shape
    dims2 = tuple(((0 if d == 0 else 1), axes) for d, axes in spec.dims if d != 1)
    experts = torch.arange(n_exp)
    for d, axes in spec.dims:
        if d == 1:  # the experts split over an axis (expert parallelism)
            experts = experts.chunk(mesh.size(*axes))[mesh.index(*axes)]
    one = ShardSpec(spec.local, (out_f, in_f), dims2)
    pieces = [read(ckpt, ckpt.key(k.replace(EXPERT, str(e))), False, one, mesh, dtype) for e in experts.tolist()]
    return torch.stack(pieces, dim=1)


def split_stacked(k: str, full: Tensor) -> dict[str, Tensor]:
    """A full stacked parameter [out, experts, in] as the stored tensor of each expert."""
    return {k.replace(EXPERT, str(e)): full[:, e] for e in range(full.shape[1])}


def _moe(lay: Any) -> Mapping[str, Any]:
    return next(b for b in lay.body if b.get("moe"))


def hf_config(model: Mapping[str, Any], lay: Any, base: Mapping[str, Any], error: type[Exception]) -> dict[str, Any]:
    """The config.json of a MoE model: the llama layout's fields (``base``) with its architecture
    and expert settings."""
    moe = _moe(lay)
    fam = moe_layout(moe, model.get("name", "model"), error)
    cfg = {k: v for k, v in base.items() if k not in ("attention_bias", "mlp_bias", "use_sliding_window")}
    if moe.get("capacity"):
        raise error(f"model `{model.get('name', 'model')}` drops tokens past capacity = {moe['capacity']:g}; "
                    f"transformers' {fam.arch} is dropless and would compute another model: expected capacity = 0")
    coef = float(moe.get("aux_loss_coef") or 0.0)  # the z-loss has no transformers field: training only
    cfg.update(architectures=[fam.arch], model_type=fam.model_type, num_experts_per_tok=int(moe["top_k"]),
               output_router_logits=bool(coef), router_aux_loss_coef=coef)
    if fam is MIXTRAL:
        cfg.update(intermediate_size=int(moe["ffn"]), num_local_experts=int(moe["experts"]), router_jitter_noise=0.0)
    elif fam is QWEN3_MOE:
        cfg.update(moe_intermediate_size=int(moe["ffn"]), num_local_experts=int(moe["experts"]),
                   norm_topk_prob=bool(moe["norm_topk_prob"]), decoder_sparse_step=1, mlp_only_layers=[],
                   use_sliding_window=False)
    else:
        cfg.update(moe_intermediate_size=int(moe["ffn"]), shared_expert_intermediate_size=int(moe["shared_ffn"]),
                   intermediate_size=int(moe["shared_ffn"]), num_experts=int(moe["experts"]),
                   norm_topk_prob=bool(moe["norm_topk_prob"]), decoder_sparse_step=1, mlp_only_layers=[],
                   use_sliding_window=False, qkv_bias=True)
    return cfg


def as_attention_config(model: Mapping[str, Any], lay: Any, cfg: Mapping[str, Any], where: str,
                        error: type[Exception]) -> tuple[dict[str, Any], list[tuple[str, Any, Any, str]]]:
    """A MoE model's config.json as hf.check_config checks the rest of it: the model type of the
    family its attention comes from (Mixtral: Mistral's, Qwen2-MoE: Qwen2's) and the experts' width as
    the llama layout's `intermediate_size`; with its expert fields as (field, theirs, ours, our name).
    Settings meshllm cannot honour raise ``error``."""
    moe = _moe(lay)
    fam = moe_layout(moe, model.get("name", "model"), error)
    if cfg.get("model_type") != fam.model_type:
        raise error(f"{where}: model_type {cfg.get('model_type')!r}, but model `{model.get('name', 'model')}` "
                    f"has {fam.model_type}'s mixture of experts")
    if fam is MIXTRAL:
        wants = [("num_local_experts", cfg.get("num_local_experts"), moe["experts"], "experts"),
                 ("router_jitter_noise", cfg.get("router_jitter_noise", 0.0), 0.0, "router jitter (none)")]
        attention = {**cfg, "model_type": "mistral"}
    else:  # Qwen2-MoE, Qwen3-MoE
        sparse_step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers", [])
        if sparse_step != 1 or dense:
            raise error(f"{where}: `decoder_sparse_step` = {sparse_step!r}, `mlp_only_layers` = {dense!r}: some "
                        "layers are dense; meshllm's qwen2_moe family has a mixture of experts in every layer "
                        "(expected 1 and [])")
        # Qwen3-MoE's config names it num_local_experts in transformers 5 (num_experts before)
        n_field = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
        wants = [(n_field, cfg.get(n_field), moe["experts"], "experts"),
                 ("norm_topk_prob", bool(cfg.get("norm_topk_prob", False)), moe["norm_topk_prob"], "norm_topk_prob")]
        if fam is QWEN2_MOE:
            wants.append(("shared_expert_intermediate_size", cfg.get("shared_expert_intermediate_size"),
                          moe["shared_ffn"], "shared_ffn"))
        # intermediate_size is the width of dense layers, which this model has none of
        attention = {**cfg, "model_type": "qwen2" if fam is QWEN2_MOE else "qwen3",
                     "intermediate_size": cfg.get("moe_intermediate_size")}
    wants.append(("num_experts_per_tok", cfg.get("num_experts_per_tok"), moe["top_k"], "top_k"))
    # transformers adds coef x the load-balancing loss to the training loss only with output_router_logits.
    theirs = float(cfg.get("router_aux_loss_coef") or 0.0) if cfg.get("output_router_logits") else 0.0
    wants.append(("router_aux_loss_coef", theirs, float(moe.get("aux_loss_coef") or 0.0),
                  "aux_loss_coef (with output_router_logits)"))
    return attention, wants
