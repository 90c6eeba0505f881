"""Deterministic initialisation, ShardSpec slicing and gathering, Mesh coordinates and groups."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool


def test_full_init_depends_only_on_name_shape_and_seed() -> None:
    a = rt.full_init("blocks.0.attn.q.weight", (8, 4), seed=3)
    assert torch.equal(a, rt.full_init("blocks.0.attn.q.weight", (8, 4), seed=3))
    assert not torch.equal(a, rt.full_init("blocks.1.attn.q.weight", (8, 4), seed=3))
    assert not torch.equal(a, rt.full_init("blocks.0.attn.q.weight", (8, 4), seed=4))
    assert 0.01 < a.std().item() < 0.03
    assert torch.equal(
        rt.full_init("x.weight", (8, 4), 3, torch.float64),
        rt.full_init("x.weight", (8, 4), 3).double(),
    )
    assert torch.equal(rt.full_init("norm.weight", (4,), 0), torch.ones(4))
    assert torch.equal(rt.full_init("blocks.0.mlp.up.bias", (4,), 0), torch.zeros(4))


def _fake_mesh(axes: tuple[tuple[str, int], ...], rank: int) -> rt.Mesh:
    # local_slice needs coordinates only; no process groups.
    return rt.Mesh(axes, tuple(range(math.prod(s for _, s in axes))), rank)


AXES = (("data", 2), ("pipeline", 3), ("tensor", 2))


@st.composite
def _specs(draw: st.DrawFn) -> rt.ShardSpec:
    ndim = draw(st.integers(1, 3))
    choices = [("tensor",), ("data",), ("data", "tensor"), ("pipeline",)]
    n_sharded = draw(st.integers(0, min(ndim, 2)))
    dims = draw(st.permutations(range(ndim)))[:n_sharded]
    axes_used: list[tuple[str, ...]] = []
    for _ in dims:
        options = [c for c in choices if not set(c) & {a for used in axes_used for a in used}]
        axes_used.append(draw(st.sampled_from(options)))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    segments = None
    for k, (d, axes) in enumerate(zip(dims, axes_used)):
        n = math.prod(dict(AXES)[a] for a in axes)
        if k == 0 and draw(st.booleans()):
            segments = tuple(n * draw(st.integers(1, 3)) for _ in range(draw(st.integers(2, 3))))
            shape[d] = sum(segments)
        else:
            shape[d] *= n
    return rt.ShardSpec("p", tuple(shape), tuple(zip(dims, axes_used)), segments)


@settings(max_examples=60, deadline=None)
@given(_specs())
def test_local_slices_cover_every_element_once(spec: rt.ShardSpec) -> None:
    full = torch.arange(math.prod(spec.shape), dtype=torch.float64).reshape(spec.shape)
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    for rank in range(12):
        mesh = _fake_mesh(AXES, rank)
        piece = rt.local_slice(full, spec, mesh)
        assert tuple(piece.shape) == spec.local_shape(mesh)
        key = tuple(mesh.index(*axes) for _, axes in spec.dims)
        if key in seen:
            assert torch.equal(seen[key], piece)  # replicas along the other axes agree
        seen[key] = piece
    values = torch.cat([p.flatten() for p in seen.values()]).sort().values
    assert torch.equal(values, full.flatten())


def test_segments_must_cover_the_sharded_dim() -> None:
    with pytest.raises(ValueError, match="segments"):
        rt.ShardSpec("qkv", (12, 4), ((0, ("tensor",)),), (4, 4))


def test_gather_full_inverts_local_slice(pool: WorkerPool) -> None:
    pool.run(_gather_job, 8, (("data", 2), ("pipeline", 2), ("tensor", 2)))


def _gather_job(ctx: RankContext, axes: tuple[tuple[str, int], ...]) -> None:
    mesh = ctx.mesh(axes)
    specs = [
        rt.ShardSpec("a", (8, 6), ((0, ("tensor",)), (1, ("pipeline",)))),
        rt.ShardSpec("qkv", (16, 4), ((0, ("data", "tensor")),), (8, 4, 4)),
        rt.ShardSpec("r", (3,)),
    ]
    for spec in specs:
        full = torch.randn(spec.shape, generator=torch.Generator().manual_seed(1))
        assert torch.equal(rt.gather_full(rt.local_slice(full, spec, mesh), spec, mesh), full)


def _mesh_job(ctx: RankContext) -> dict[str, object]:
    mesh = ctx.mesh((("data", 2), ("pipeline", 2), ("tensor", 2)))
    g = mesh.group("data", "tensor")
    assert g is not None and dist.get_rank(g) == mesh.index("data", "tensor")
    with pytest.raises(ValueError, match="mesh order"):
        mesh.group("tensor", "data")
    return {
        "coords": (mesh.coord("data"), mesh.coord("pipeline"), mesh.coord("tensor")),
        "along_tensor": mesh.ranks_along("tensor"),
        "along_data_tensor": mesh.ranks_along("data", "tensor"),
        "size": (mesh.size(), mesh.size("data", "tensor")),
    }


def test_mesh_coordinates_and_groups_are_row_major(pool: WorkerPool) -> None:
    out = pool.run(_mesh_job, 8)
    assert out[5]["coords"] == (1, 0, 1)
    assert out[5]["along_tensor"] == (4, 5)
    assert out[5]["along_data_tensor"] == (0, 1, 4, 5)
    assert out[0]["size"] == (8, 4)


def _bad_mesh_job(ctx: RankContext) -> None:
    ctx.mesh((("tensor", 3),))


def test_mesh_size_must_match_its_ranks(pool: WorkerPool) -> None:
    with pytest.raises(Exception, match="3 positions but 2 ranks"):
        pool.run(_bad_mesh_job, 2)
