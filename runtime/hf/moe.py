"""Hugging Face checkpoints of mixture-of-experts models (the packs with `experts`) for runtime/hf/weights.py.

transformers 5.24 keeps each expert's projections as tensors of their own on disk
(``block_sparse_moe.experts.E.w1.weight`` [ffn, hidden], ``mlp.experts.E.gate_proj.weight``) and
``from_pretrained`` reads that layout; meshllm stacks them into one parameter per projection
([out, experts, in], runtime/moe/experts.py StackedLinear). So one of our names stands for one stored tensor
per expert: its key is a template with ``{e}`` where the expert's number goes (``EXPERT``). A rank
reads only its slice of each expert it holds, and export writes the experts apart again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from meshllm_dsl.families import PACKS
from meshllm_dsl.families.pack import ExpertNames, FamilyPack
from meshllm_dsl.runtime.parallel.mesh import Mesh
from meshllm_dsl.runtime.parallel.shards import ShardSpec

EXPERT = "{e}"


# The packs whose checkpoints have experts (meshllm_dsl/families, FamilyPack.experts), in the registry's order
_MOE_PACKS: tuple[FamilyPack, ...] = tuple(p for p in PACKS if p.experts is not None)


def _experts(pack: FamilyPack) -> ExpertNames:
    assert pack.experts is not None
    return pack.experts


def as_mlp(layer: Mapping[str, Any]) -> Mapping[str, Any]:
    """A block's layer as hf.py's layouts read it: a moe layer stands where the MLP does (its
    experts are SwiGLU, or the moe layer's own `act`), marked `moe` so the names, config and checks below take it."""
    return {**layer, "kind": "mlp", "act": layer.get("act", "swiglu"), "moe": True} if layer["kind"] == "moe" else layer


def is_moe(body: Any) -> bool:
    """Whether a block (as_mlp's layer descriptions) has a mixture of experts."""
    return any(b.get("moe") for b in body)


def moe_layout(moe: Mapping[str, Any], name: str, error: type[Exception]) -> FamilyPack:
    """The pack whose checkpoint layout a moe layer's settings fit, or ``error`` saying why none does."""
    shared = moe.get("shared_ffn") is not None
    for pack in _MOE_PACKS:
        ex = _experts(pack)
        if (pack.shared_expert == shared and ex.weights_fp32 == bool(moe["weights_fp32"])
                and ex.renormalised in (None, bool(moe["norm_topk_prob"]))
                and ex.act == moe.get("act", "swiglu") and ex.scoring == moe.get("scoring", "softmax")
                and ex.biased == bool(moe.get("router_bias")) == bool(moe.get("expert_bias"))):
            return pack
    each = [f"{p.title}'s ({_experts(p).fits})" for p in _MOE_PACKS]
    raise error(f"model `{name}`: a moe layer with scoring {moe.get('scoring', 'softmax')}, shared expert {shared}, "
                f"weights_fp32 {moe['weights_fp32']}, "
                f"norm_topk_prob {moe['norm_topk_prob']}, act {moe.get('act', 'swiglu')}, router_bias "
                f"{bool(moe.get('router_bias'))}, expert_bias {bool(moe.get('expert_bias'))} has no Hugging Face layout; expected "
                f"{', '.join(each[:-1])} or {each[-1]}")


def key(block: str, body: Any, unit: str, rest: list[str], name: str, error: type[Exception]) -> str | None:
    """The stored name (or ``{e}`` template) of our parameter ``name`` (``REPEAT.I.UNIT.LEAF.weight``,
    ``rest`` being ``[LEAF, weight]``) when UNIT is the moe layer of a block (``body``) stored under
    HF's ``block`` (``model.layers.7``); None for any other parameter."""
    if not is_moe(body) or len(rest) != 2:
        return None
    moe = next(b for b in body if b.get("moe"))
    if unit != moe["name"]:
        return None
    ex = _experts(moe_layout(moe, "model", error))
    if ex.tensors is not None:  # each tensor named (GPT-OSS: biases, experts fused: runtime/hf/fused_experts.py)
        theirs = ex.tensors.get(f"{rest[0]}.{rest[1]}")
        if theirs is None:
            raise error(f"parameter {name} has no Hugging Face name")
        return f"{block}.{ex.module}.{theirs}"
    if rest[0] not in ex.names or rest[1] != "weight":
        raise error(f"parameter {name} has no Hugging Face name")
    return f"{block}.{ex.module}.{ex.names[rest[0]]}.weight"


def buffers(layer: Mapping[str, Any], error: type[Exception]) -> dict[str, str]:
    """A block's layer's buffers a checkpoint holds: ``LEAF.BUFFER`` -> its name inside the block
    (``mlp.gate.e_score_correction_bias``); none but a moe layer's."""
    if not layer.get("moe"):
        return {}
    ex = _experts(moe_layout(layer, "model", error))
    return {f"{layer['name']}.{ours}": f"{ex.module}.{theirs}" for ours, theirs in ex.buffers.items()}


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
    pack = moe_layout(moe, model.get("name", "model"), error)
    cfg = {k: v for k, v in base.items() if k not in ("attention_bias", "mlp_bias", "use_sliding_window")}
    if moe.get("capacity"):
        raise error(f"model `{model.get('name', 'model')}` drops tokens past capacity = {moe['capacity']:g}; "
                    f"transformers' {pack.architecture} is dropless and would compute another model: "
                    "expected capacity = 0")
    coef = float(moe.get("aux_loss_coef") or 0.0)  # the z-loss has no transformers field: training only
    cfg.update(architectures=[pack.architecture], model_type=pack.model_type, num_experts_per_tok=int(moe["top_k"]),
               output_router_logits=bool(coef), router_aux_loss_coef=coef)
    cfg.update(_experts(pack).write_config(moe))
    return cfg


def as_attention_config(model: Mapping[str, Any], lay: Any, cfg: Mapping[str, Any], where: str,
                        error: type[Exception]) -> tuple[dict[str, Any], list[tuple[str, Any, Any, str]]]:
    """A MoE model's config.json as hf.check_config checks the rest of it: the model type of the
    architecture its attention comes from (the pack's `attention`) and the experts' width as the llama
    layout's `intermediate_size`; with its expert fields as (field, theirs, ours, our name).
    Settings meshllm cannot honour raise ``error``."""
    moe = _moe(lay)
    pack = moe_layout(moe, model.get("name", "model"), error)
    if cfg.get("model_type") != pack.model_type:
        raise error(f"{where}: model_type {cfg.get('model_type')!r}, but model `{model.get('name', 'model')}` "
                    f"has {pack.model_type}'s mixture of experts")
    wants = _experts(pack).check_config(pack, moe, cfg, where, error)
    assert pack.attention is not None
    attention = {**cfg, "model_type": pack.attention.model_type}
    if pack.experts_width_field is not None:
        # intermediate_size is the width of dense layers, which this model has none of
        attention["intermediate_size"] = cfg.get(pack.experts_width_field)
    wants.append(("num_experts_per_tok", cfg.get("num_experts_per_tok"), moe["top_k"], "top_k"))
    # transformers adds coef x the load-balancing loss to the training loss only with output_router_logits.
    theirs = float(cfg.get("router_aux_loss_coef") or 0.0) if cfg.get("output_router_logits") else 0.0
    wants.append(("router_aux_loss_coef", theirs, float(moe.get("aux_loss_coef") or 0.0),
                  "aux_loss_coef (with output_router_logits)"))
    return attention, wants
