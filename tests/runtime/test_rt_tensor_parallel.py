"""Hand-assembled tensor-parallel Llama / GPT-2 (as generated code looks) vs the unsharded reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from rt_models import (
    HIDDEN,
    VOCAB,
    Gpt2Block,
    LlamaBlock,
    Stage,
    block_specs,
    gpt2_model,
    llama_model,
    stage_specs,
    vocab_loss,
)
from torch import nn

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool
from meshllm_dsl.runtime.model.reference import build_reference
from meshllm_dsl.runtime.parallel.collectives import all_reduce_sum

TOL = {"float32": 1e-5, "float64": 1e-10}


def _perturbed_reference(model: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    # Non-trivial norms and biases (full_init makes them ones / zeros) so their sharding is tested.
    ref = build_reference(model, dtype)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    return ref


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return {k: (a[k].double() - b[k].double()).abs().max().item() for k in a}


def _block_job(ctx: RankContext, kind: str, tp: int, dtype_name: str) -> dict[str, float]:
    dtype = getattr(torch, dtype_name)
    mesh = ctx.mesh([("tensor", tp)])
    model = llama_model(1) if kind == "llama" else gpt2_model(1)
    ref = _perturbed_reference(model, dtype)
    block = (LlamaBlock if kind == "llama" else Gpt2Block)(mesh).to(dtype)
    specs = block_specs(kind, 0, "")
    rt.load_full(block, specs, mesh, ref.state_dict())

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 8, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(2, 8, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref.blocks[0](x_ref)
    (out_ref * w).sum().backward()
    out_tp = block(x_tp)
    (out_tp * w).sum().backward()

    got = {
        "out": out_tp.detach(),
        "x.grad": x_tp.grad,
        **rt.gather_module(block, specs, mesh, grads=True),
    }
    want = {"out": out_ref.detach(), "x.grad": x_ref.grad}
    want.update({k: p.grad for k, p in ref.named_parameters() if k in specs})
    return _max_err(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_block_outputs_and_grads_match_reference(
    pool: WorkerPool, kind: str, tp: int, dtype: str
) -> None:
    for rank, errs in enumerate(pool.run(_block_job, tp, kind, tp, dtype)):
        bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errs) > 8


def _model_job(
    ctx: RankContext, kind: str, tp: int, dtype_name: str, tie: bool
) -> dict[str, float]:
    """Embedding (vocab-parallel) + blocks + head (column) + vocab-parallel loss on one stage."""
    dtype = getattr(torch, dtype_name)
    mesh = ctx.mesh([("tensor", tp)])
    model = llama_model(2, tie=tie) if kind == "llama" else gpt2_model(2)
    ref = _perturbed_reference(model, dtype)
    stage = Stage(mesh, kind, 2, first=True, last=True, tie=tie).to(dtype)
    specs = stage_specs(kind, range(2), True, True, tie)
    rt.load_full(stage, specs, mesh, ref.state_dict())

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (3, 8), generator=gen)
    targets = torch.randint(0, VOCAB, (3, 8), generator=gen)
    loss_ref = rt.cross_entropy(ref(tokens), targets)
    loss_ref.backward()
    local_logits = stage(tokens)
    loss = vocab_loss(mesh)(local_logits, targets)
    loss.backward()
    logits = rt.gather_from(local_logits.detach(), mesh.group("tensor"), dim=-1)

    got = {
        "loss": loss.detach(),
        "logits": logits,
        **rt.gather_module(stage, specs, mesh, grads=True),
    }
    want = {"loss": loss_ref.detach(), "logits": ref(tokens).detach()}
    want.update({k: p.grad for k, p in ref.named_parameters()})
    return _max_err(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    ("kind", "tp", "tie"),
    [("llama", 2, False), ("llama", 4, True), ("gpt2", 2, True), ("gpt2", 4, True)],
)
def test_full_model_with_vocab_parallel_embedding_and_loss(
    pool: WorkerPool, kind: str, tp: int, tie: bool, dtype: str
) -> None:
    for rank, errs in enumerate(pool.run(_model_job, tp, kind, tp, dtype, tie)):
        bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
        assert not bad, f"rank {rank}: {bad}"


def _naive_all_reduce_job(ctx: RankContext) -> tuple[float, float]:
    """Row-parallel linear reduced with torch.distributed.nn's all_reduce vs our reduce_from."""
    from torch.distributed.nn.functional import all_reduce

    mesh = ctx.mesh([("tensor", 2)])
    group = mesh.group("tensor")
    gen = torch.Generator().manual_seed(0)
    w_full = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    ref_w = w_full.clone().requires_grad_()
    (x @ ref_w.t()).sum().backward()
    spec = rt.ShardSpec("w", (4, 6), ((1, ("tensor",)),))
    ratios = []
    for reduce in (lambda t: all_reduce(t, group=group), lambda t: rt.reduce_from(t, group)):
        w = rt.local_slice(w_full, spec, mesh).requires_grad_()
        x_local = rt.split_to(x, group, dim=-1)
        reduce(x_local @ w.t()).sum().backward()
        ratios.append((rt.gather_full(w.grad, spec, mesh) / ref_w.grad).mean().item())
    return ratios[0], ratios[1]


def test_naive_all_reduce_gives_wrong_row_parallel_grads(pool: WorkerPool) -> None:
    naive, ours = pool.run(_naive_all_reduce_job, 2)[0]
    assert naive == pytest.approx(2.0)  # tensor-size times too large
    assert ours == pytest.approx(1.0)


def _collectives_job(ctx: RankContext) -> dict[str, float]:
    """gather_from / split_to / copy_to round trips with their gradients, on a 2 x 2 mesh."""
    mesh = ctx.mesh([("data", 2), ("tensor", 2)])
    errs = {}
    for axes in (("tensor",), ("data",), ("data", "tensor")):
        g, n, i = mesh.group(*axes), mesh.size(*axes), mesh.index(*axes)
        full = torch.arange(24.0, dtype=torch.float64).view(2, 12).requires_grad_()
        part = rt.split_to(full, g, dim=1)
        errs[f"split{axes}"] = (part - full.detach().chunk(n, 1)[i]).abs().max().item()
        back = rt.gather_from(part * (i + 1), g, dim=1)
        back.sum().backward()
        # d/dfull of sum_r (r+1) * chunk_r: every rank sees the whole (replicated) gradient.
        expect = torch.cat(
            [torch.full((2, 12 // n), float(r + 1)) for r in range(n)], dim=1
        ).double()
        errs[f"grad{axes}"] = (full.grad - expect).abs().max().item()
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    rt.copy_to(x, mesh.group("data", "tensor")).mul(mesh.rank + 1).sum().backward()
    errs["copy_to"] = (x.grad - 10.0).abs().max().item()
    assert rt.copy_to(x, None) is x and rt.reduce_from(x, None) is x
    dist.barrier(mesh.group("data", "tensor"))
    return errs


def test_collectives_round_trip(pool: WorkerPool) -> None:
    for errs in pool.run(_collectives_job, 4):
        assert max(errs.values()) == 0.0, errs


def _copy_to_linear_job(ctx: RankContext) -> dict[str, float]:
    """copy_to_linear (f and the column layers in one Function, the input gradient all-reduced while
    the weight gradients are computed) vs copy_to followed by the layers, on a 2 x 2 mesh: each rank
    holds different column weights and sees different output gradients, so x's gradient is a sum."""
    mesh = ctx.mesh([("data", 2), ("tensor", 2)])
    group = mesh.group("data", "tensor")
    gen = torch.Generator().manual_seed(11 + mesh.rank)
    x = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    x = all_reduce_sum(x, group)  # replicated, as f's input is
    layers = [nn.Linear(6, n, bias=b, dtype=torch.float64) for n, b in ((4, False), (2, True), (3, True))]
    with torch.no_grad():
        for p in (q for m in layers for q in m.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    out_grads = [torch.randn(3, 5, m.out_features, generator=gen, dtype=torch.float64) for m in layers]
    errs: dict[str, float] = {}
    # "frozen": the last layer's weight needs no gradient; "x_frozen": nor does x.
    for case, x_grad in (("all", True), ("frozen", True), ("x_frozen", False)):
        layers[2].weight.requires_grad_(case == "all")
        results = []
        for fused in (True, False):
            for m in layers:
                m.zero_grad()
            xi = x.clone().requires_grad_(x_grad)
            if fused:
                outs = rt.copy_to_linear(xi, group, *layers)
            else:
                h = rt.copy_to(xi, group)
                outs = tuple(m(h) for m in layers)
            sum((o * g).sum() for o, g in zip(outs, out_grads)).backward()
            grads = [xi.grad] + [q.grad for m in layers for q in m.parameters()]
            results.append((outs, grads))
        (outs, grads), (want_outs, want_grads) = results
        errs[f"{case} out"] = max((o - w).abs().max().item() for o, w in zip(outs, want_outs))
        for i, (g, w) in enumerate(zip(grads, want_grads)):
            assert (g is None) == (w is None), (case, i)
            if g is not None:
                errs[f"{case} grad {i}"] = (g - w).abs().max().item()
    # x's gradient is the sum over the 4 ranks of each rank's partial sum (weights differ by rank).
    xi = x.clone().requires_grad_()
    (out,) = rt.copy_to_linear(xi, group, layers[0])
    out.sum().backward()
    local = layers[0].weight.sum(0).expand_as(x)
    errs["x.grad is the sum"] = (xi.grad - all_reduce_sum(local, group)).abs().max().item()
    return errs


def test_copy_to_linear_matches_copy_to_and_layers(pool: WorkerPool) -> None:
    for rank, errs in enumerate(pool.run(_copy_to_linear_job, 4)):
        bad = {k: v for k, v in errs.items() if not v <= 1e-12}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errs) == 3 * 7 - 3 + 1  # 3 cases x (output + 6 gradients), 3 not wanted; the sum


def _vocab_ce_job(ctx: RankContext, tp: int) -> tuple[float, float]:
    """Large-magnitude logits: the sharded loss must stay as stable as the unsharded one."""
    mesh = ctx.mesh([("tensor", tp)])
    group = mesh.group("tensor")
    gen = torch.Generator().manual_seed(5)
    full = (80.0 * torch.randn(3, 5, VOCAB, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, VOCAB, (3, 5), generator=gen)
    want = torch.nn.functional.cross_entropy(full.view(-1, VOCAB), targets.view(-1))
    want.backward()
    local = rt.split_to(full.detach(), group, dim=-1).requires_grad_()
    got = rt.vocab_parallel_cross_entropy(
        local, targets, group, mesh.index("tensor") * (VOCAB // tp)
    )
    got.backward()
    grad = rt.gather_from(local.grad, group, dim=-1)
    return abs(got.item() - want.item()), (grad - full.grad).abs().max().item()


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_matches_unsharded(pool: WorkerPool, tp: int) -> None:
    for loss_err, grad_err in pool.run(_vocab_ce_job, tp, tp):
        assert loss_err <= 1e-10 and grad_err <= 1e-12


def _padded_vocab_ce_job(ctx: RankContext) -> tuple[float, float]:
    """Vocab 5 padded to 8 over 4 ranks: rank 3's shard is all padding, rank 2's half. Its
    log-sum-exp is the dtype's lowest value and must vanish from the global one."""
    mesh = ctx.mesh([("tensor", 4)])
    group, i = mesh.group("tensor"), mesh.index("tensor")
    gen = torch.Generator().manual_seed(9)
    full = (30.0 * torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 5, (2, 3), generator=gen)
    want = torch.nn.functional.cross_entropy(full[..., :5].reshape(-1, 5), targets.view(-1))
    want.backward()
    local = rt.split_to(full.detach(), group, dim=-1).requires_grad_()
    got = rt.vocab_parallel_cross_entropy(rt.mask_vocab(local, 2 * i, 5), targets, group, 2 * i)
    got.backward()
    grad = rt.gather_from(local.grad, group, dim=-1)
    return abs(got.item() - want.item()), (grad - full.grad).abs().max().item()


def test_vocab_parallel_cross_entropy_with_a_shard_of_padding_only(pool: WorkerPool) -> None:
    for loss_err, grad_err in pool.run(_padded_vocab_ce_job, 4):
        assert loss_err <= 1e-12 and grad_err <= 1e-14
