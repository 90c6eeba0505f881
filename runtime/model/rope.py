"""Rotary inverse frequencies, as transformers' ``ROPE_INIT_FUNCTIONS`` compute them.

One place for the sharded layers (``layers.apply_rotary``) and the unsharded reference: rope type
``default`` (theta ** (-2i / d)), ``linear`` (divided by the factor), ``dynamic`` (NTK: theta grown
with the sequence once it passes the trained positions), ``yarn`` (interpolated long wavelengths,
extrapolated short ones, a ramp between, and an attention factor on cos / sin), ``longrope``
(Phi-3: per-frequency short or long factors, and an attention factor) and ``llama3``.

A scaling is the attention's ``rope_scaling`` entry, HF's field names: a mapping with ``rope_type``
and the fields that type reads (for ``dynamic``, ``original_max_position_embeddings`` holds the
config's ``max_position_embeddings``, the length its formula scales from).

``dynamic`` and ``longrope`` depend on the sequence: transformers takes the largest position + 1 of
the forward (``dynamic_rope_update``), which this module is given as ``seq_len``.  Where transformers
keeps state between calls (a dynamic model that saw a longer sequence keeps its grown frequencies
for a later, shorter one above the trained length), this is the stateless rule: the frequencies of
this forward's length, which is what transformers computes on a fresh model and while decoding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["ROPE_TYPES", "cache_reset_length", "inv_freq", "llama3_inv_freq"]

# What each rope type reads of the scaling besides rope_type (all but `factor` optional here).
ROPE_TYPES: Mapping[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "truncate",
             "mscale", "mscale_all_dim"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _exponents(d: int, device: torch.device | None = None) -> Tensor:
    # 2i / d for i < d / 2, as transformers builds it (an int64 arange, then float32)
    return torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d


def llama3_inv_freq(
    inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> Tensor:
    """HF's ``rope_type="llama3"``: long wavelengths slowed by ``factor``, short ones kept, a
    smooth blend between (``_compute_llama3_parameters``)."""
    low_wavelen = original / low_freq_factor
    high_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(d: int, theta: float, sc: Mapping[str, Any], device: torch.device | None) -> tuple[Tensor, float]:
    factor, original = float(sc["factor"]), int(sc["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = sc.get("attention_factor")
    if attention is None and sc.get("mscale") and sc.get("mscale_all_dim"):
        # DeepSeek's: mscale(factor, mscale) / mscale(factor, mscale_all_dim) (transformers' _compute_yarn_parameters)
        attention = mscale(factor, float(sc["mscale"])) / mscale(factor, float(sc["mscale_all_dim"]))
    attention = mscale(factor) if attention is None else float(attention)
    beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, d, 2, device=device).to(torch.float) / d)
    extrapolated = 1 - ramp  # 1 where a frequency keeps its value, 0 where it is divided by the factor
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv, attention


def _longrope(d: int, theta: float, sc: Mapping[str, Any], seq_len: int, device: torch.device | None) -> tuple[Tensor, float]:
    original = int(sc["original_max_position_embeddings"])
    factor = float(sc["factor"])
    attention = sc.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    # transformers' longrope_frequency_update: the long factors once the sequence passes the
    # trained positions, the short ones up to them
    ext = sc["long_factor"] if seq_len > original else sc["short_factor"]
    ext_factors = torch.tensor(ext, dtype=torch.float32, device=device)
    return 1.0 / (ext_factors * theta ** _exponents(d, device)), float(attention)


def _dynamic(d: int, theta: float, sc: Mapping[str, Any], seq_len: int, device: torch.device | None) -> Tensor:
    factor, trained = float(sc["factor"]), int(sc["original_max_position_embeddings"])
    if seq_len <= trained:
        # the frequencies transformers computes at init (seq_len = max_position_embeddings), in Python floats
        base = theta * ((factor * trained / trained) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** _exponents(d, device))
    # beyond: recomputed from the length as a 0-dim tensor, in float32 as transformers does
    n = torch.tensor(seq_len, dtype=torch.int64)
    base_t = theta * ((factor * n / trained) - (factor - 1)) ** (d / (d - 2))
    return (1.0 / (base_t ** _exponents(d))).to(device)


@functools.lru_cache(maxsize=256)
def _cached(d: int, theta: float, scaling: tuple[tuple[str, Any], ...] | None, seq_len: int,
            device: torch.device | None) -> tuple[Tensor, float]:
    sc = dict(scaling or ())
    kind = sc.get("rope_type", "default")
    if kind == "yarn":
        return _yarn(d, theta, sc, device)
    if kind == "longrope":
        return _longrope(d, theta, sc, seq_len, device)
    if kind == "dynamic":
        return _dynamic(d, theta, sc, seq_len, device), 1.0
    inv = 1.0 / (theta ** _exponents(d, device))
    if kind == "linear":
        return inv / float(sc["factor"]), 1.0
    if kind == "llama3":
        return llama3_inv_freq(inv, float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"]),
                               int(sc["original_max_position_embeddings"])), 1.0
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not one of {', '.join(ROPE_TYPES)}")
    return inv, 1.0


def _key(scaling: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None) -> tuple[tuple[str, Any], ...] | None:
    if not scaling:
        return None
    items = scaling.items() if isinstance(scaling, Mapping) else scaling
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in items))


def depends_on_length(scaling: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None) -> bool:
    """Whether the frequencies change with the sequence length (dynamic, longrope)."""
    key = _key(scaling)
    return key is not None and dict(key).get("rope_type") in ("dynamic", "longrope")


def cache_reset_length(model: Any) -> int | None:
    """Where greedy decoding recomputes its KV cache: a longrope model's trained positions (the least
    over its attention layers), else None.  Keys cached while the sequence was within them were
    rotated with the short factors; once it grows past them transformers' Phi-3 drops its cache and
    reruns the whole sequence with the long ones (``Phi3ForCausalLM.prepare_inputs_for_generation``)."""
    found: list[int] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            scaling = node.get("rope_scaling")
            if isinstance(scaling, Mapping) and scaling.get("rope_type") == "longrope":
                found.append(int(scaling["original_max_position_embeddings"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(model)
    return min(found) if found else None


def inv_freq(d: int, theta: float, scaling: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None = None,
             seq_len: int = 0, device: torch.device | None = None) -> tuple[Tensor, float]:
    """([d / 2] inverse frequencies in float32, the factor transformers multiplies cos and sin by) for
    head_dim ``d``, base ``theta`` and a rope scaling (None: unscaled); ``seq_len``: the largest
    position + 1 of this forward (read by dynamic and longrope only).  Never written to: cached."""
    key = _key(scaling)
    n = seq_len if depends_on_length(key) else 0
    return _cached(d, float(theta), key, n, device)
