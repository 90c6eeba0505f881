"""Tiny Llama and GPT-2 descriptions and stage modules written the way ``meshc`` generates them.

Imported by the test modules and, through pickled job functions, by the pool's worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import meshllm_dsl.runtime as rt

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, SEQ_MAX = 64, 32, 8, 4, 4, 64, 16


def llama_model(layers: int = 2, tie: bool = False) -> dict[str, Any]:
    return {
        "layers": [
            {"name": "embed", "kind": "embedding", "num": VOCAB, "dim": HIDDEN},
            {
                "name": "blocks",
                "kind": "repeat",
                "count": layers,
                "body": [
                    {"name": "attn_norm", "kind": "rmsnorm", "dim": HIDDEN, "eps": 1e-5},
                    {
                        "name": "attn",
                        "kind": "attention",
                        "hidden": HIDDEN,
                        "heads": HEADS,
                        "kv_heads": KV_HEADS,
                        "head_dim": HEAD_DIM,
                        "rope_theta": 10000.0,
                        "qkv_bias": False,
                        "o_bias": False,
                        "fused_qkv": False,
                    },
                    {"name": "mlp_norm", "kind": "rmsnorm", "dim": HIDDEN, "eps": 1e-5},
                    {
                        "name": "mlp",
                        "kind": "mlp",
                        "hidden": HIDDEN,
                        "ffn": FFN,
                        "act": "swiglu",
                        "bias": False,
                    },
                ],
            },
            {"name": "norm", "kind": "rmsnorm", "dim": HIDDEN, "eps": 1e-5},
            {
                "name": "lm_head",
                "kind": "linear",
                "in": HIDDEN,
                "out": VOCAB,
                "bias": False,
                "tie": "embed" if tie else None,
            },
        ]
    }


def gpt2_model(layers: int = 2) -> dict[str, Any]:
    return {
        "layers": [
            {"name": "embed", "kind": "embedding", "num": VOCAB, "dim": HIDDEN},
            {"name": "pos", "kind": "positional", "num": SEQ_MAX, "dim": HIDDEN},
            {
                "name": "blocks",
                "kind": "repeat",
                "count": layers,
                "body": [
                    {"name": "attn_norm", "kind": "layernorm", "dim": HIDDEN, "eps": 1e-5},
                    {
                        "name": "attn",
                        "kind": "attention",
                        "hidden": HIDDEN,
                        "heads": HEADS,
                        "kv_heads": HEADS,
                        "head_dim": HEAD_DIM,
                        "rope_theta": None,
                        "qkv_bias": True,
                        "o_bias": True,
                        "fused_qkv": True,
                    },
                    {"name": "mlp_norm", "kind": "layernorm", "dim": HIDDEN, "eps": 1e-5},
                    {
                        "name": "mlp",
                        "kind": "mlp",
                        "hidden": HIDDEN,
                        "ffn": FFN,
                        "act": "gelu_tanh",
                        "bias": True,
                    },
                ],
            },
            {"name": "norm", "kind": "layernorm", "dim": HIDDEN, "eps": 1e-5},
            {
                "name": "lm_head",
                "kind": "linear",
                "in": HIDDEN,
                "out": VOCAB,
                "bias": False,
                "tie": "embed",
            },
        ]
    }


class LlamaBlock(nn.Module):
    """Column-parallel q/k/v/gate/up, row-parallel o/down over ``tensor`` (size tp)."""

    def __init__(self, mesh: rt.Mesh) -> None:
        super().__init__()
        tp = mesh.size("tensor")
        self.tensor = mesh.group("tensor")
        self.heads, self.kv_heads = HEADS // tp, KV_HEADS // tp
        self.attn_norm = rt.RMSNorm(HIDDEN, eps=1e-5)
        self.attn_q = nn.Linear(HIDDEN, self.heads * HEAD_DIM, bias=False)
        self.attn_k = nn.Linear(HIDDEN, self.kv_heads * HEAD_DIM, bias=False)
        self.attn_v = nn.Linear(HIDDEN, self.kv_heads * HEAD_DIM, bias=False)
        self.attn_o = nn.Linear(self.heads * HEAD_DIM, HIDDEN, bias=False)
        self.mlp_norm = rt.RMSNorm(HIDDEN, eps=1e-5)
        self.mlp_gate = nn.Linear(HIDDEN, FFN // tp, bias=False)
        self.mlp_up = nn.Linear(HIDDEN, FFN // tp, bias=False)
        self.mlp_down = nn.Linear(FFN // tp, HIDDEN, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # x: [b, s, HIDDEN] Replicate
        b, s, _ = x.shape
        q, k, v = rt.copy_to_linear(self.attn_norm(x), self.tensor, self.attn_q, self.attn_k, self.attn_v)
        q = q.view(b, s, self.heads, HEAD_DIM)
        k = k.view(b, s, self.kv_heads, HEAD_DIM)
        v = v.view(b, s, self.kv_heads, HEAD_DIM)
        q, k = rt.apply_rotary(q, k, rt.positions(s, x.device), theta=10000.0)
        a = rt.attention(q, k, v)  # [b, s, heads_local * HEAD_DIM]
        x = x + rt.reduce_from(self.attn_o(a), self.tensor)  # Partial(tensor) -> [b, s, HIDDEN]
        gate, up = rt.copy_to_linear(self.mlp_norm(x), self.tensor, self.mlp_gate, self.mlp_up)
        h = torch.nn.functional.silu(gate) * up  # [b, s, FFN / tp]
        return x + rt.reduce_from(self.mlp_down(h), self.tensor)


class Gpt2Block(nn.Module):
    """Fused column-parallel qkv (biased), row-parallel o/down with biases added after the reduce."""

    def __init__(self, mesh: rt.Mesh) -> None:
        super().__init__()
        tp = mesh.size("tensor")
        self.tensor = mesh.group("tensor")
        self.heads = HEADS // tp
        self.attn_norm = nn.LayerNorm(HIDDEN, eps=1e-5)
        self.attn_qkv = nn.Linear(HIDDEN, 3 * self.heads * HEAD_DIM, bias=True)
        self.attn_o = nn.Linear(self.heads * HEAD_DIM, HIDDEN, bias=False)
        self.attn_o_bias = nn.Parameter(torch.zeros(HIDDEN))
        self.mlp_norm = nn.LayerNorm(HIDDEN, eps=1e-5)
        self.mlp_up = nn.Linear(HIDDEN, FFN // tp, bias=True)
        self.mlp_down = nn.Linear(FFN // tp, HIDDEN, bias=False)
        self.mlp_down_bias = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x: Tensor) -> Tensor:  # x: [b, s, HIDDEN] Replicate
        b, s, _ = x.shape
        (qkv,) = rt.copy_to_linear(self.attn_norm(x), self.tensor, self.attn_qkv)
        q, k, v = qkv.view(b, s, 3, self.heads, HEAD_DIM).unbind(2)
        a = rt.attention(q, k, v)  # [b, s, heads_local * HEAD_DIM]
        x = x + rt.reduce_from(self.attn_o(a), self.tensor) + self.attn_o_bias
        (up,) = rt.copy_to_linear(self.mlp_norm(x), self.tensor, self.mlp_up)
        h = rt.activation("gelu_tanh")(up)  # [b, s, FFN / tp]
        return x + rt.reduce_from(self.mlp_down(h), self.tensor) + self.mlp_down_bias


def block_specs(kind: str, full: int, prefix: str) -> dict[str, rt.ShardSpec]:
    """Shard specs of block ``full`` (global index) living at module path prefix ``prefix``."""
    col, row, t = ((0, ("tensor",)),), ((1, ("tensor",)),), f"blocks.{full}"
    if kind == "llama":
        return {
            f"{t}.attn_norm.weight": rt.ShardSpec(f"{prefix}attn_norm.weight", (HIDDEN,)),
            f"{t}.attn.q.weight": rt.ShardSpec(
                f"{prefix}attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), col
            ),
            f"{t}.attn.k.weight": rt.ShardSpec(
                f"{prefix}attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), col
            ),
            f"{t}.attn.v.weight": rt.ShardSpec(
                f"{prefix}attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), col
            ),
            f"{t}.attn.o.weight": rt.ShardSpec(
                f"{prefix}attn_o.weight", (HIDDEN, HEADS * HEAD_DIM), row
            ),
            f"{t}.mlp_norm.weight": rt.ShardSpec(f"{prefix}mlp_norm.weight", (HIDDEN,)),
            f"{t}.mlp.gate.weight": rt.ShardSpec(f"{prefix}mlp_gate.weight", (FFN, HIDDEN), col),
            f"{t}.mlp.up.weight": rt.ShardSpec(f"{prefix}mlp_up.weight", (FFN, HIDDEN), col),
            f"{t}.mlp.down.weight": rt.ShardSpec(f"{prefix}mlp_down.weight", (HIDDEN, FFN), row),
        }
    qkv = (HEADS * HEAD_DIM,) * 3
    return {
        f"{t}.attn_norm.weight": rt.ShardSpec(f"{prefix}attn_norm.weight", (HIDDEN,)),
        f"{t}.attn_norm.bias": rt.ShardSpec(f"{prefix}attn_norm.bias", (HIDDEN,)),
        f"{t}.attn.qkv.weight": rt.ShardSpec(
            f"{prefix}attn_qkv.weight", (3 * HEADS * HEAD_DIM, HIDDEN), col, qkv
        ),
        f"{t}.attn.qkv.bias": rt.ShardSpec(
            f"{prefix}attn_qkv.bias", (3 * HEADS * HEAD_DIM,), col, qkv
        ),
        f"{t}.attn.o.weight": rt.ShardSpec(
            f"{prefix}attn_o.weight", (HIDDEN, HEADS * HEAD_DIM), row
        ),
        f"{t}.attn.o.bias": rt.ShardSpec(f"{prefix}attn_o_bias", (HIDDEN,)),
        f"{t}.mlp_norm.weight": rt.ShardSpec(f"{prefix}mlp_norm.weight", (HIDDEN,)),
        f"{t}.mlp_norm.bias": rt.ShardSpec(f"{prefix}mlp_norm.bias", (HIDDEN,)),
        f"{t}.mlp.up.weight": rt.ShardSpec(f"{prefix}mlp_up.weight", (FFN, HIDDEN), col),
        f"{t}.mlp.up.bias": rt.ShardSpec(f"{prefix}mlp_up.bias", (FFN,), col),
        f"{t}.mlp.down.weight": rt.ShardSpec(f"{prefix}mlp_down.weight", (HIDDEN, FFN), row),
        f"{t}.mlp.down.bias": rt.ShardSpec(f"{prefix}mlp_down_bias", (HIDDEN,)),
    }


class Stage(nn.Module):
    """One pipeline stage: optional embedding, blocks ``first_block ..``, optional norm + head.

    Logits leave the last stage sharded over the vocab ([b, s, VOCAB / tp]) for the vocab-parallel
    loss; a tied head multiplies by its own copy of the embedding shard.
    """

    def __init__(
        self, mesh: rt.Mesh, kind: str, n_blocks: int, first: bool, last: bool, tie: bool
    ) -> None:
        super().__init__()
        tp = mesh.size("tensor")
        self.tensor = mesh.group("tensor")
        self.first, self.last, self.tie, self.kind = first, last, tie, kind
        if first:
            self.embed = rt.VocabParallelEmbedding(
                VOCAB // tp, HIDDEN, start=mesh.index("tensor") * (VOCAB // tp)
            )
            if kind == "gpt2":
                self.pos = nn.Embedding(SEQ_MAX, HIDDEN)
        block = LlamaBlock if kind == "llama" else Gpt2Block
        self.blocks = nn.ModuleList(block(mesh) for _ in range(n_blocks))
        if last:
            self.norm = (
                rt.RMSNorm(HIDDEN, eps=1e-5) if kind == "llama" else nn.LayerNorm(HIDDEN, eps=1e-5)
            )
            if tie and not first:
                self.lm_head_weight = nn.Parameter(torch.empty(VOCAB // tp, HIDDEN))
            elif not tie:
                self.lm_head = nn.Linear(HIDDEN, VOCAB // tp, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.first:  # x: [b, s] token ids
            s = x.shape[1]
            x = rt.reduce_from(self.embed(x), self.tensor)  # Partial(tensor) -> [b, s, HIDDEN]
            if self.kind == "gpt2":
                x = x + self.pos(rt.positions(s, x.device))
        for blk in self.blocks:
            x = blk(x)
        if self.last:
            if self.tie:
                h = rt.copy_to(self.norm(x), self.tensor)
                w = self.embed.weight if self.first else self.lm_head_weight
                return h @ w.t()  # [b, s, VOCAB / tp] Shard(-1)
            return rt.copy_to_linear(self.norm(x), self.tensor, self.lm_head)[0]  # [b, s, VOCAB / tp] Shard(-1)
        return x


def stage_specs(
    kind: str, blocks: range, first: bool, last: bool, tie: bool
) -> dict[str, rt.ShardSpec]:
    vocab = ((0, ("tensor",)),)
    specs: dict[str, rt.ShardSpec] = {}
    if first:
        specs["embed.weight"] = rt.ShardSpec("embed.weight", (VOCAB, HIDDEN), vocab)
        if kind == "gpt2":
            specs["pos.weight"] = rt.ShardSpec("pos.weight", (SEQ_MAX, HIDDEN))
    for j, i in enumerate(blocks):
        specs.update(block_specs(kind, i, f"blocks.{j}."))
    if last:
        specs["norm.weight"] = rt.ShardSpec("norm.weight", (HIDDEN,))
        if kind == "gpt2":
            specs["norm.bias"] = rt.ShardSpec("norm.bias", (HIDDEN,))
        if tie and not first:
            specs["embed.weight"] = rt.ShardSpec("lm_head_weight", (VOCAB, HIDDEN), vocab)
        elif not tie:
            specs["lm_head.weight"] = rt.ShardSpec("lm_head.weight", (VOCAB, HIDDEN), vocab)
    return specs


def vocab_loss(mesh: rt.Mesh) -> Any:
    group, start = mesh.group("tensor"), mesh.index("tensor") * (VOCAB // mesh.size("tensor"))

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return rt.vocab_parallel_cross_entropy(logits, targets, group, start)

    return loss


@dataclass(frozen=True)
class StageDef:
    """Stands in for a generated stage class: ``StageDef(...)(mesh)`` and ``.params()``."""

    kind: str
    blocks: range
    first: bool
    last: bool
    tie: bool = False

    def __call__(self, mesh: rt.Mesh) -> nn.Module:
        return Stage(mesh, self.kind, len(self.blocks), self.first, self.last, self.tie)

    def params(self, prefix: str = "") -> dict[str, rt.ShardSpec]:
        assert prefix == ""
        return stage_specs(self.kind, self.blocks, self.first, self.last, self.tie)


def split_stages(kind: str, layers: int, n: int, tie: bool = False) -> tuple[StageDef, ...]:
    per = layers // n
    return tuple(
        StageDef(kind, range(i * per, (i + 1) * per), i == 0, i == n - 1, tie) for i in range(n)
    )
