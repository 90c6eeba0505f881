"""Checkpoints that store projections fused (the packs' fused_projections): ``self_attn.qkv_proj`` = [q | k | v] rows and
``mlp.gate_up_proj`` = [gate | up] rows, where the model keeps q, k, v and gate, up apart.

Each of our parameters names its rows of the fused tensor in its key, ``BASE@start:stop:total``
(``fuse_keys``).  Loading reads only this rank's rows of its part (``local_rows``: a column shard of
q reads its heads' rows of qkv_proj and nothing of k or v); exporting gathers the parts and writes
their concatenation under the fused name (``put``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from meshllm_dsl.families import PACKS

__all__ = ["MODEL_TYPES", "base", "fuse_keys", "local_rows", "put", "rekey", "rows", "runs", "stored_shape"]

# model_type -> per module, the fused tensor and the separate projections it holds in row order (the
# packs that store projections fused: meshllm_dsl/families, FamilyPack.fused_projections)
MODEL_TYPES: Mapping[str, Mapping[str, tuple[str, tuple[str, ...]]]] = {
    p.model_type: p.fused_projections for p in PACKS if p.fused_projections}


def fuse_keys(keys: Mapping[str, tuple[str, bool]], shapes: Mapping[str, tuple[int, ...]],
              model_type: str) -> dict[str, tuple[str, bool]]:
    """``keys`` (our name -> (separate HF name, transposed)) with each fused part's name replaced by
    the fused tensor's and its rows; ``shapes``: our full shapes."""
    fused = MODEL_TYPES[model_type]
    by_key = {key: name for name, (key, _) in keys.items()}
    out = dict(keys)
    for name, (key, transposed) in keys.items():
        prefix, _, tail = key.rpartition(".")  # tail: weight / bias
        owner, _, proj = prefix.rpartition(".")
        module = owner.rpartition(".")[2]
        if module not in fused or proj not in fused[module][1]:
            continue
        target, parts = fused[module]
        sizes = []
        for p in parts:
            sibling = by_key.get(f"{owner}.{p}.{tail}")
            if sibling is None:
                raise ValueError(f"{key}: fused with {owner}.{p}.{tail}, which the model lacks")
            sizes.append(shapes[sibling][0])
        i = parts.index(proj)
        start = sum(sizes[:i])
        out[name] = (f"{owner}.{target}.{tail}@{start}:{start + sizes[i]}:{sum(sizes)}", transposed)
    return out


def base(key: str) -> str:
    """The stored tensor's name of ``key`` (the fused name, without the rows)."""
    return key.partition("@")[0]


def rows(key: str) -> tuple[int, int, int] | None:
    """(start, stop, total rows of the fused tensor) of a fused part's key, else None."""
    _, at, spec = key.partition("@")
    if not at:
        return None
    start, stop, total = (int(x) for x in spec.split(":"))
    return start, stop, total


def rekey(key: str, stored: str) -> str:
    """``key`` with its base replaced by the name as stored (``HFCheckpoint.key``)."""
    return stored + key[len(base(key)):]


def stored_shape(key: str, part: tuple[int, ...]) -> tuple[int, ...]:
    """The stored tensor's shape for a part of shape ``part``: all the fused rows."""
    r = rows(key)
    return part if r is None else (r[2], *part[1:])


def runs(idx: Tensor) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of consecutive values in the index list ``idx``."""
    values = idx.tolist()
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v:
            runs[-1] = (runs[-1][0], v + 1)
        else:
            runs.append((v, v + 1))
    return runs


def local_rows(ckpt: Any, key: str, idx: list[Tensor], dtype: torch.dtype) -> Tensor:
    """This rank's shard of a fused part: ``idx`` the part's full-tensor indices per dim this rank
    holds (hf._local_indices); reads those rows (shifted to the part's place) and columns only."""
    start = rows(key)[0]  # type: ignore[index]
    out = torch.empty([len(i) for i in idx], dtype=dtype)
    col_runs = runs(idx[1]) if len(idx) > 1 else [None]
    with ckpt.open(base(key)) as sl:
        r = 0
        for a, b in runs(idx[0] + start):
            c = 0
            for cols in col_runs:
                if cols is None:
                    piece = sl[a:b]
                    out[r:r + b - a] = piece.to(dtype)
                else:
                    piece = sl[a:b, cols[0]:cols[1]]
                    out[r:r + b - a, c:c + cols[1] - cols[0]] = piece.to(dtype)
                    c += cols[1] - cols[0]
                ckpt.bytes_read += piece.numel() * piece.element_size()
            r += b - a
    return out


def put(pending: dict[str, Tensor], weight_map: dict[str, str], fusing: dict[str, dict[int, Tensor]],
        key: str, t: Tensor, file: str) -> None:
    """Export: ``t`` under ``key`` into ``pending``, or, a fused part, held until the fused tensor's
    parts are all there and then written concatenated, in the file of its last part."""
    r = rows(key)
    if r is None:
        pending[key], weight_map[key] = t, file
        return
    parts = fusing.setdefault(base(key), {})
    parts[r[0]] = t
    if sum(p.shape[0] for p in parts.values()) == r[2]:
        name = base(key)
        pending[name] = torch.cat([parts[s] for s in sorted(parts)], dim=0)
        weight_map[name] = file
        del fusing[name]
