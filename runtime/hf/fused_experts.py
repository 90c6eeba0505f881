"""Checkpoints that store a layer's experts fused and 3-D (GPT-OSS, as transformers' GptOssExperts keeps
them): ``experts.gate_up_proj`` [experts, hidden, 2 ffn] with gate and up interleaved (gate the even
columns ``[..., ::2]``, up the odd ``[..., 1::2]``), ``experts.down_proj`` [experts, ffn, hidden] and
their biases [experts, 2 ffn] / [experts, hidden].

meshllm keeps each projection apart, out-major ([out, experts, in], biases [out, experts]:
runtime/moe/experts.py StackedLinear), so each of our tensors is the stored one's even / odd / all
last-dim columns, that dim moved first: ours = pick(stored).movedim(-1, 0). Its key names the
stored tensor and the pick: ``BASE%even``, ``BASE%odd``, ``BASE%all`` (the pack's ExpertNames.tensors).

Loading reads only this rank's part: the experts it holds (the stored tensor's dim 0), of each its
slice of the ffn (gate's or up's interleaved columns by a strided read); exporting writes the transposed tensor, interleaving gate and up back
once both are gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["SEP", "base", "is_fused", "local", "put", "rekey", "stored_shape", "to_ours"]

SEP = "%"
_PICKS = {"even": 0, "odd": 1}  # the interleaved columns' offset; "all": every column


def is_fused(key: str) -> bool:
    return SEP in key


def base(key: str) -> str:
    """The stored tensor's name of ``key``."""
    return key.partition(SEP)[0]


def _pick(key: str) -> str:
    return key.partition(SEP)[2]


def rekey(key: str, stored: str) -> str:
    """``key`` with its base replaced by the name as stored (``HFCheckpoint.key``)."""
    return stored + SEP + _pick(key)


def stored_shape(key: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The stored tensor's shape for our full ``ours`` [out, experts, ...]: [experts, ..., out] (2 out interleaved)."""
    return (*ours[1:], ours[0] * (1 if _pick(key) == "all" else 2))


def to_ours(key: str, stored: Tensor) -> Tensor:
    """Our tensor (or experts' slice of it) from the stored one's."""
    pick = _pick(key)
    t = stored if pick == "all" else stored[..., _PICKS[pick]::2]
    return t.movedim(-1, 0)


def local(ckpt: Any, key: str, idx: list[Tensor], dtype: torch.dtype) -> Tensor:
    """This rank's shard: ``idx`` our full-tensor indices per dim this rank holds (dim 1 the experts,
    hf._local_indices). Reads one box of the stored tensor: per dim the range covering what the
    rank holds, gate's or up's columns only (a stride of 2 across the interleaved ones)."""
    pick = _pick(key)
    step = 1 if pick == "all" else 2
    last = idx[0] if pick == "all" else step * idx[0] + _PICKS[pick]
    wanted = [idx[1], *idx[2:], last]  # per stored dim: [experts, ..., out]
    box = tuple(slice(int(w.min()), int(w.max()) + 1, step if d == len(wanted) - 1 else 1)
                for d, w in enumerate(wanted))
    with ckpt.open(base(key)) as sl:
        piece = sl[box]
    ckpt.bytes_read += piece.numel() * piece.element_size()
    for d, (w, b) in enumerate(zip(wanted, box)):
        piece = piece.index_select(d, (w - b.start) // (b.step or 1))
    return piece.movedim(-1, 0).to(dtype).contiguous()


def put(pending: dict[str, Tensor], weight_map: dict[str, str], fusing: dict[str, dict[int, Tensor]],
        key: str, full: Tensor, file: str) -> None:
    """Export: our full tensor under its stored name in ``pending``; gate's and up's held until
    both are there, then written interleaved, in the file of the second."""
    stored = full.detach().to("cpu").movedim(0, -1)  # [experts, ..., out]
    name, pick = base(key), _pick(key)
    if pick == "all":
        pending[name], weight_map[name] = stored.contiguous().clone(), file
        return
    parts = fusing.setdefault(name, {})
    parts[_PICKS[pick]] = stored
    if len(parts) == 2:
        gate, up = parts[0], parts[1]
        pending[name] = torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1]).contiguous()
        weight_map[name] = file
        del fusing[name]
