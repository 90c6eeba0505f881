"""The unsharded reference model, built straight from the compiler's model description.

Deliberately written independently of the sharded layers (only ``full_init`` is shared) so that
equivalence tests compare two implementations, not one with itself.  Matches HF Llama / GPT-2.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshllm_dsl.runtime.model import description, rope
from meshllm_dsl.runtime.moe.experts import ReferenceMoE
from meshllm_dsl.runtime.parallel.shards import full_init

__all__ = ["ReferenceModel", "build_reference"]

Layer = Mapping[str, Any]

# The position of a forward's first token: 0, or a document's place in its packed row when the
# document is run alone at the positions it had there (runtime/jobs/compare.py).
_FIRST = 0


@contextlib.contextmanager
def first_position(first: int) -> Iterator[None]:
    """Forwards inside give their tokens positions first, first + 1, ... (rotary and learned)."""
    global _FIRST
    outer, _FIRST = _FIRST, first
    try:
        yield
    finally:
        _FIRST = outer


def rotate_halves(x: Tensor, theta: float, scaling: Any) -> Tensor:
    """Rotary positions on x [b, heads, s, d] whose pairs are its two halves (HF's rotate_half), with
    runtime/model/rope.py's frequencies over d (and yarn's / longrope's factor on cos and sin) for this length."""
    s, d = x.shape[2], x.shape[-1]
    inv_freq, factor = rope.inv_freq(d, theta, scaling, _FIRST + s)
    freqs = torch.outer(torch.arange(_FIRST, _FIRST + s, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0, scale_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.scale_fp32 = scale_fp32

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        var = h.pow(2).mean(-1, keepdim=True)
        if self.offset:  # (offset + weight) applied in fp32, then the cast
            return (h * torch.rsqrt(var + self.eps) * (self.offset + self.weight.to(h.dtype))).to(dtype)
        if self.scale_fp32:  # weight applied in fp32, then the cast
            return (self.weight.to(h.dtype) * (h * torch.rsqrt(var + self.eps))).to(dtype)
        return self.weight * (h * torch.rsqrt(var + self.eps)).to(dtype)


_NORMS: dict[str, Callable[[Layer], nn.Module]] = {
    "rmsnorm": lambda spec: _RMSNorm(spec["dim"], spec["eps"], float(spec.get("offset") or 0.0),
                                     bool(spec.get("scale_fp32"))),
    "layernorm": lambda spec: nn.LayerNorm(spec["dim"], eps=spec["eps"], bias=bool(spec.get("bias", True))),
}


def _norm(spec: Layer) -> nn.Module:
    build = _NORMS.get(spec["kind"])
    if build is None:
        raise ValueError(f"{spec['name']}: not a norm: {spec['kind']}")
    return build(spec)


class _Attention(nn.Module):
    def __init__(self, spec: Layer) -> None:
        super().__init__()
        self.h, self.kvh, self.d = spec["heads"], spec["kv_heads"], spec["head_dim"]
        index = int(spec.get("block", 0))
        self.theta = spec.get("rope_theta")
        # Block `index` of its repeat: windowed unless every `global_every`-th (HF's
        # sliding_window_pattern; layer_types "sliding_attention" / "full_attention").
        every = spec.get("global_every") or 0
        self.window = 0 if every and (index + 1) % every == 0 else int(spec.get("window") or 0)
        if self.window and spec.get("local_rope_theta") is not None:
            self.theta = spec["local_rope_theta"]
        self.softcap = spec.get("softcap")
        self.scale = float(spec.get("scale_dim") or self.d) ** -0.5
        self.scaling = spec.get("rope_scaling")
        self.rotary_dim = int(spec.get("rotary_dim") or self.d)  # partial rotary: each head's first rotary_dim values
        self.fused = bool(spec.get("fused_qkv", False))
        hid, qkv_bias = spec["hidden"], bool(spec.get("qkv_bias", False))
        if self.fused:
            self.qkv = nn.Linear(hid, (self.h + 2 * self.kvh) * self.d, bias=qkv_bias)
        else:
            self.q = nn.Linear(hid, self.h * self.d, bias=qkv_bias)
            self.k = nn.Linear(hid, self.kvh * self.d, bias=qkv_bias)
            self.v = nn.Linear(hid, self.kvh * self.d, bias=qkv_bias)
        self.o = nn.Linear(self.h * self.d, hid, bias=bool(spec.get("o_bias", False)))
        # q / k RMSNorm before rotary: per head over head_dim (`head`) or over the whole projection (`full`).
        self.qk_norm, self.qk_eps = spec.get("qk_norm", "none"), spec.get("qk_norm_eps", 1e-6)
        self.qk_offset = float(spec.get("qk_norm_offset") or 0.0)
        if self.qk_norm != "none":
            for proj, heads in ((self.q, self.h), (self.k, self.kvh)):
                width = self.d if self.qk_norm == "head" else heads * self.d
                proj.register_parameter("norm", nn.Parameter(torch.ones(width)))
        # GPT-OSS's sinks: a logit per head in the softmax's denominator, kept with q (split with its heads).
        self.sinks = bool(spec.get("sinks"))
        if self.sinks:
            self.q.register_parameter("sinks", nn.Parameter(torch.zeros(self.h)))

    def _qk_rms(self, x: Tensor, weight: Tensor) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.qk_eps)
        if self.qk_offset:  # (offset + weight) in fp32, then the cast
            return (h * (self.qk_offset + weight.to(h.dtype))).to(x.dtype)
        # `full` scales before casting back, `head` after (the same in fp32 and fp64)
        return (weight * h).to(x.dtype) if self.qk_norm == "full" else weight * h.to(x.dtype)

    def _rope(self, x: Tensor) -> Tensor:
        # x: [b, heads, s, d]; HF LlamaRotaryEmbedding + apply_rotary_pos_emb, which turns the first
        # rotary_dim values (frequencies over rotary_dim) and passes the rest.
        d = self.rotary_dim
        return torch.cat((rotate_halves(x[..., :d], self.theta, self.scaling), x[..., d:]), dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], -1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_norm == "full":
            q, k = self._qk_rms(q, self.q.norm), self._qk_rms(k, self.k.norm)
        q = q.view(b, s, self.h, self.d).transpose(1, 2)
        k = k.view(b, s, self.kvh, self.d).transpose(1, 2)
        if self.qk_norm == "head":
            q, k = self._qk_rms(q, self.q.norm), self._qk_rms(k, self.k.norm)
        v = v.view(b, s, self.kvh, self.d).transpose(1, 2)
        if self.theta is not None:
            q, k = self._rope(q), self._rope(k)
        rep = self.h // self.kvh
        k = k[:, :, None].expand(b, self.kvh, rep, s, self.d).reshape(b, self.h, s, self.d)
        v = v[:, :, None].expand(b, self.kvh, rep, s, self.d).reshape(b, self.h, s, self.d)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        if self.window:  # query i sees keys i - window + 1 .. i
            causal &= ~torch.ones(s, s, dtype=torch.bool).tril(-self.window)
        scores = scores.masked_fill(~causal, float("-inf"))
        dtype = torch.promote_types(q.dtype, torch.float32)
        if self.sinks:  # one more logit per head, as transformers' eager_attention_forward: max-shifted, then dropped
            combined = torch.cat([scores.to(dtype), self.q.sinks.to(dtype).view(1, self.h, 1, 1).expand(b, self.h, s, 1)], -1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            a = torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype) @ v
        else:
            a = torch.softmax(scores.to(dtype), dim=-1).to(q.dtype) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, self.h * self.d))


class _LatentAttention(nn.Module):
    """Multi-head latent attention as transformers' DeepseekV3Attention computes it: queries through
    an optional low-rank latent, keys and values from a normed latent of kv_lora_rank plus one rotary
    key shared by every head, rotary on the rope parts only, YaRN's mscale in the softmax scale."""

    def __init__(self, spec: Layer) -> None:
        super().__init__()
        hid, self.h = spec["hidden"], spec["heads"]
        self.ql, self.kvl = int(spec["q_lora_rank"]), int(spec["kv_lora_rank"])
        self.nope, self.rope, self.vd = spec["qk_nope_head_dim"], spec["qk_rope_head_dim"], spec["v_head_dim"]
        self.theta, self.scaling = spec["rope_theta"], spec.get("rope_scaling")
        self.interleave, self.eps = bool(spec["rope_interleave"]), float(spec["norm_eps"])
        bias, qk = bool(spec["bias"]), self.nope + self.rope
        if self.ql:
            self.q_a = nn.Linear(hid, self.ql, bias=bias)
            self.q_a.register_parameter("norm", nn.Parameter(torch.ones(self.ql)))
            self.q_b = nn.Linear(self.ql, self.h * qk, bias=False)
        else:
            self.q = nn.Linear(hid, self.h * qk, bias=False)
        self.kv_a = nn.Linear(hid, self.kvl + self.rope, bias=bias)
        self.kv_a.register_parameter("norm", nn.Parameter(torch.ones(self.kvl)))
        self.kv_b = nn.Linear(self.kvl, self.h * (self.nope + self.vd), bias=False)
        self.o = nn.Linear(self.h * self.vd, hid, bias=bias)
        self.scale = qk ** -0.5
        sc = dict(self.scaling or {})
        if sc.get("mscale_all_dim") and float(sc["factor"]) > 1:  # transformers' yarn_apply_mscale
            m = 0.1 * float(sc["mscale_all_dim"]) * math.log(float(sc["factor"])) + 1.0
            self.scale = self.scale * m * m

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x: Tensor) -> Tensor:
        # x: [b, heads, s, rope]; pairs (x0, x1), (x2, x3).. first made halves where they interleave
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return rotate_halves(x, self.theta, self.scaling)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.q_b(self._norm(self.q_a(x), self.q_a.norm)) if self.ql else self.q(x)
        q = q.view(b, s, self.h, self.nope + self.rope).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a(x).split([self.kvl, self.rope], dim=-1)
        kv = self.kv_b(self._norm(latent, self.kv_a.norm)).view(b, s, self.h, self.nope + self.vd).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)
        q_pe, k_pe = self._rope(q_pe), self._rope(k_pe.view(b, 1, s, self.rope))
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe.expand(b, self.h, s, self.rope)), dim=-1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        p = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), dim=-1).to(q.dtype)
        return self.o((p @ v).transpose(1, 2).reshape(b, s, self.h * self.vd))


class _MLP(nn.Module):
    def __init__(self, spec: Layer) -> None:
        super().__init__()
        hid, ffn, bias = spec["hidden"], spec["ffn"], bool(spec.get("bias", False))
        self.act = spec["act"]
        if self.act in ("swiglu", "geglu_tanh"):
            self.gate = nn.Linear(hid, ffn, bias=bias)
        self.up = nn.Linear(hid, ffn, bias=bias)
        self.down = nn.Linear(ffn, hid, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.act == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.act == "geglu_tanh":  # gelu_pytorch_tanh on the gate
            return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))
        h = self.up(x)
        if self.act == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        elif self.act == "gelu":
            h = F.gelu(h)
        elif self.act == "relu":
            h = F.relu(h)
        elif self.act == "silu":
            h = F.silu(h)
        else:
            raise ValueError(f"unknown activation {self.act!r}")
        return self.down(h)


class _Block(nn.Module):
    """Residual block: each sublayer with the norm before it (pre) and / or a `post` norm after it,
    x = x + post(sub(pre(x))); Llama / GPT-2 have pre norms only, some families both."""

    def __init__(self, body: list[Layer], index: int = 0) -> None:
        super().__init__()
        self.steps: list[tuple[str | None, str, str | None]] = []  # (pre norm, sublayer, post norm)
        pre: str | None = None
        for spec in body:
            if spec["kind"] in _NORMS:
                self.add_module(spec["name"], _norm(spec))
                if spec.get("post"):
                    if not self.steps or self.steps[-1][2] is not None or pre is not None:
                        raise ValueError(f"{spec['name']}: a post norm must follow a sublayer")
                    self.steps[-1] = (*self.steps[-1][:2], spec["name"])
                elif pre is not None:
                    raise ValueError(f"{spec['name']}: two norms before a sublayer")
                else:
                    pre = spec["name"]
                continue
            build = _SUBLAYERS.get(spec["kind"])
            if build is None:
                raise ValueError(f"{spec['name']}: unsupported sublayer kind {spec['kind']!r}")
            # attention's sliding window depends on the block (some families alternate)
            self.add_module(spec["name"], build({**spec, "block": index} if spec["kind"] == "attention" else spec))
            self.steps.append((pre, spec["name"], None))
            pre = None
        if pre is not None:
            raise ValueError(f"{pre}: a norm with no sublayer after it")

    def forward(self, x: Tensor) -> Tensor:
        for pre, sub, post in self.steps:
            h = getattr(self, sub)(x if pre is None else getattr(self, pre)(x))
            x = x + (h if post is None else getattr(self, post)(h))
        return x


_SUBLAYERS: dict[str, Callable[[Layer], nn.Module]] = {"attention": _Attention, "mla": _LatentAttention, "mlp": _MLP}
_SUBLAYERS["moe"] = ReferenceMoE  # mixture of experts: runtime/moe/experts.py

# Top-level layers: the module each kind builds (None: it owns no module, a tied linear) and how it
# applies to the stream `x` given the token ids.
_Apply = Callable[[nn.Module, Tensor, Tensor], Tensor]


class _Embedding(nn.Embedding):
    """A token table; `scaled`: rows times sqrt(dim), that factor rounded to float32 and then to
    the table's dtype, as transformers' scaled word embeddings do."""

    def __init__(self, num: int, dim: int, scaled: bool) -> None:
        super().__init__(num, dim)
        self.factor = dim**0.5 if scaled else None

    def forward(self, tokens: Tensor) -> Tensor:
        out = super().forward(tokens)
        return out if self.factor is None else out * torch.tensor(self.factor).to(out.dtype)


def _linear(spec: Layer) -> nn.Module | None:
    if spec.get("tie"):
        if spec.get("bias"):
            raise ValueError(f"{spec['name']}: a tied linear layer cannot have a bias")
        return None
    return nn.Linear(spec["in"], spec["out"], bias=bool(spec.get("bias")))


def _on_stream(mod: nn.Module, x: Tensor, tokens: Tensor) -> Tensor:
    return mod(x)


_TOP: dict[str, tuple[Callable[[Layer], nn.Module | None], _Apply]] = {
    "embedding": (lambda spec: _Embedding(spec["num"], spec["dim"], bool(spec.get("scaled"))),
                  lambda mod, x, tokens: mod(tokens)),
    "positional": (lambda spec: nn.Embedding(spec["num"], spec["dim"]),
                   lambda mod, x, tokens: x + mod(torch.arange(_FIRST, _FIRST + tokens.shape[1]))),
    **{kind: (build, _on_stream) for kind, build in _NORMS.items()},
    "linear": (_linear, _on_stream),
}

# Every layer kind of the compiler's MODEL description (meshllm_dsl/primitives: the runtime cannot
# import the compiler; tests/frontend/test_primitive_registry.py keeps the two in step).
LAYER_KINDS = frozenset(_TOP) | frozenset(_SUBLAYERS)


class ReferenceModel(nn.Module):
    """tokens [b, s] -> logits [b, s, vocab]."""

    def __init__(self, model: Mapping[str, Any]) -> None:
        super().__init__()
        self.order: list[tuple[str, str]] = []
        self.ties: dict[str, str] = {}
        self.used = description.token_embedding(model).get("used")
        self.softcap = model["layers"][-1].get("softcap")  # the head's final logit soft-cap
        for spec in model["layers"]:
            name, kind = spec["name"], spec["kind"]
            if kind == "repeat":
                self.add_module(
                    name, nn.ModuleList(_Block(list(spec["body"]), i) for i in range(spec["count"]))
                )
            elif kind in _TOP:
                mod = _TOP[kind][0](spec)
                if mod is None:
                    self.ties[name] = spec["tie"]
                else:
                    self.add_module(name, mod)
            else:
                raise ValueError(f"{name}: unsupported layer kind {kind!r}")
            self.order.append((name, kind))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self._forward(tokens)
        if self.softcap:
            x = torch.tanh(x / self.softcap) * self.softcap
        if self.used is not None:  # padded vocab rows are never predicted
            x = torch.cat([x[..., : self.used],
                           torch.full_like(x[..., self.used :], torch.finfo(x.dtype).min)], dim=-1)
        return x

    def _forward(self, tokens: Tensor) -> Tensor:
        x: Tensor = tokens
        for name, kind in self.order:
            if name in self.ties:
                x = x @ getattr(self, self.ties[name]).weight.t()
                continue
            mod: Any = getattr(self, name)
            if kind == "repeat":
                for block in mod:
                    x = block(x)
            else:
                x = _TOP[kind][1](mod, x, tokens)
        return x


def build_reference(
    model: Mapping[str, Any], dtype: torch.dtype = torch.float32, seed: int = 0
) -> ReferenceModel:
    """The unsharded model with every parameter set by ``full_init(name, shape, seed)``."""
    ref = ReferenceModel(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(full_init(name, p.shape, seed, torch.float32))
    return ref.to(dtype)
