"""`meshc explain`'s placements are the ones torch builds: the same plan's parameters made DTensors by
torch's own tensor parallelism and FSDP2, and activations pushed through DTensor's sharding
propagation, on 4 gloo ranks of a (data, tensor) mesh. Compared as torch prints them."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mesh_snippets import MEGATRON  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool  # noqa: E402
from meshllm_dsl.views.explain import explain_json  # noqa: E402

SPEC = """
mesh m {{ axes data = 2, tensor = 2 }}
model t = llama {{ vocab = 256, hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 128 }}
plan p on m for t {{
{body}
    layout {{ batch -> data }}
    batch = 4, seq = 16
    optimizer adamw {{ zero 3 over data }}
}}
"""
SP = "    layout { seq -> tensor }\n"


def _explained(body: str) -> dict[str, dict[str, Any]]:
    result = check_text(SPEC.format(body=body))
    assert result.ok, [(d.code, d.message) for d in result.errors]
    explained = explain_json(result.plans["p"])
    assert explained["dtensor_mesh"] == ["data", "tensor"]
    return {u["name"]: u for e in explained["layers"] for u in e["units"]}


def _params(units: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    return {f"{name}.{p['name']}": p["placements"] for name, u in units.items() for p in u["params"] if "placements" in p}


def _activations(units: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    return {f"{name}.{a['at']}": a["placements"] for name, u in units.items() for a in u["activations"]}


# The torch module of _torch_job -> the parameter's name in explain.
EXPLAIN_KEYS = {"embed": "embed.weight", "attn_norm": "attn_norm.weight",
                **{x: f"attn.{x}.weight" for x in ("q", "k", "v", "o")},
                **{x: f"mlp.{x}.weight" for x in ("gate", "up", "down")}, "lm_head": "lm_head.weight"}


def _device_mesh(ctx: RankContext) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = ctx.mesh([("data", 2), ("tensor", 2)])
    layout = torch.tensor([[mesh.rank_at(data=d, tensor=t) for t in range(2)] for d in range(2)])
    return DeviceMesh.from_group([mesh.group("data"), mesh.group("tensor")], "cpu", layout,
                                 mesh_dim_names=("data", "tensor"))


def _placements(t: Any) -> list[str]:
    return [repr(p) for p in t.placements]


def _torch_job(ctx: RankContext, plans: list[dict[str, list[str]]]) -> dict[str, Any]:
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _device_mesh(ctx)
    tp, dp = mesh["tensor"], mesh["data"]
    # Parameters: torch's tensor parallelism over `tensor`, then FSDP2 (ZeRO 3) over `data`.
    model = nn.ModuleDict({
        "embed": nn.Embedding(256, 64), "attn_norm": nn.RMSNorm(64), "q": nn.Linear(64, 64, bias=False),
        "k": nn.Linear(64, 32, bias=False), "v": nn.Linear(64, 32, bias=False), "o": nn.Linear(64, 64, bias=False),
        "gate": nn.Linear(64, 128, bias=False), "up": nn.Linear(64, 128, bias=False),
        "down": nn.Linear(128, 64, bias=False), "lm_head": nn.Linear(64, 256, bias=False)})
    col, row = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, tp, {"embed": RowwiseParallel(), "q": col, "k": col, "v": col, "o": row,
                                   "gate": col, "up": col, "down": row, "lm_head": col})
    distribute_module(model["attn_norm"], tp)  # replicated over `tensor`
    for module in model.values():
        fully_shard(module, mesh=dp)
    params = {name: _placements(module.weight) for name, module in model.items()}
    return {"params": params, "activations": [_propagated(mesh, acts) for acts in plans]}


def _propagated(mesh: Any, activations: dict[str, list[str]]) -> dict[str, list[str]]:
    """From the placements explain gives a unit's input, those DTensor's sharding propagation gives
    after each layer of it."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    def placed(at: str) -> tuple[Any, ...]:
        return tuple(Replicate() if text == "Replicate()" else Shard(int(text.removeprefix("Shard(dim=").rstrip(")")))
                     for text in activations[at])

    def weight(shape: tuple[int, ...], dim: int) -> Any:
        return distribute_tensor(torch.randn(shape), mesh, (Replicate(), Shard(dim)))

    stream = placed("attn_norm.input")
    x = DTensor.from_local(torch.randn(2, 16 // (2 if stream[1] == Shard(1) else 1), 64), mesh, stream)
    got: dict[str, list[str]] = {}
    normed = F.rms_norm(x, (64,), distribute_tensor(torch.ones(64), mesh, (Replicate(), Replicate())))
    got["attn_norm.output"] = _placements(normed)
    # The column layers read the whole sequence: sequence parallelism's gather in front of them.
    h = normed.redistribute(mesh, placed("attn.input")).redistribute(mesh, (Shard(0), Replicate()))
    q = F.linear(h, weight((64, 64), 0))
    got["attn.q"] = _placements(q)
    got["attn.o"] = _placements(F.linear(q, weight((64, 64), 1)))
    up = F.linear(h, weight((128, 64), 0))
    got["mlp.up"] = _placements(up)
    got["mlp.down"] = _placements(F.linear(F.silu(up), weight((64, 128), 1)))
    got["lm_head.output"] = _placements(F.linear(h, weight((256, 64), 0)))
    return got


def test_explain_prints_the_placements_torch_builds(pool: WorkerPool) -> None:
    plans = [_explained(MEGATRON), _explained(MEGATRON + SP)]  # tensor parallel; and sequence parallel
    acts = [_activations(units) for units in plans]
    assert acts[1]["attn_norm.input"] == ["Shard(dim=0)", "Shard(dim=1)"]  # [b / data, s / tensor, hidden]
    for rank, got in enumerate(pool.run(_torch_job, 4, acts)):
        for units in plans:  # the parameters lie alike with and without sequence parallelism
            explained = _params(units)
            assert got["params"] == {module: explained[key] for module, key in EXPLAIN_KEYS.items()}, rank
        for want, propagated in zip(acts, got["activations"]):
            assert propagated == {at: want[at] for at in propagated}, rank
