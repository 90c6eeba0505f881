"""Named device mesh: process groups for every combination of named axes.

Process groups are built with ``dist.new_group`` rather than ``init_device_mesh``: a ``DeviceMesh``
must span the whole world and combines axes only through the private ``_flatten``, while the worker
pool runs jobs on a subset of its world and generated code asks for groups over arbitrary axis
products (``mesh.group("data", "tensor")``).

``new_group`` names a group after a per-process counter (or, with ``use_local_synchronization``,
after the number of groups the process already has), so every rank of the *world* must create the
same groups in the same order, members or not.  ``Mesh.build`` therefore creates every group of the
mesh (not just this rank's) in a fixed order; when the mesh is smaller than the world, global rank 0
broadcasts the list to the ranks outside it, which wait in ``serve_group_creation``.  Groups are
cached by rank tuple for the life of the process, so a long-lived worker creates each group once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Mesh", "end_group_creation", "serve_group_creation", "set_group_timeout"]

# How long a collective on a group made here may wait for a peer.  ``new_group`` without a
# timeout gives PyTorch's 30-minute default whatever ``init_process_group`` got, so a stopped rank
# would hang the job that long; launchers set this to their ``--timeout`` (the pool to its own).
_TIMEOUT = timedelta(seconds=300)


def set_group_timeout(timeout: timedelta) -> None:
    """Timeout of the groups created from now on (set it to the ``init_process_group`` one)."""
    global _TIMEOUT
    _TIMEOUT = timeout

# Rank tuple -> group (None on ranks outside it).  Every rank of the world creates every group, so
# every rank holds the same keys and cache hits never desynchronise group creation.
_GROUPS: dict[tuple[int, ...], ProcessGroup | None] = {}


def _create_groups(all_ranks: Sequence[tuple[int, ...]]) -> None:
    for ranks in all_ranks:
        if ranks not in _GROUPS:
            group = dist.new_group(list(ranks), timeout=_TIMEOUT)
            _GROUPS[ranks] = group if isinstance(group, ProcessGroup) else None


def serve_group_creation() -> None:
    """On a rank outside the meshes being built: join their group creation until released.

    Pairs with ``Mesh.build`` on a mesh smaller than the world and ``end_group_creation``.
    """
    while True:
        box: list[object] = [None]
        # A list of rank tuples (or None: done) from global rank 0, over the whole world.
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        _create_groups(box[0])  # type: ignore[arg-type]


def end_group_creation() -> None:
    """On every rank of the meshes: release the ranks waiting in ``serve_group_creation``."""
    dist.broadcast_object_list([None], src=0)


@dataclass(frozen=True)
class Mesh:
    """A logical N-D mesh of global ranks with named axes (row-major: last axis fastest)."""

    axes: tuple[tuple[str, int], ...]
    ranks: tuple[int, ...]
    rank: int

    @classmethod
    def build(cls, axes: Sequence[tuple[str, int]], ranks: Sequence[int] | None = None) -> Mesh:
        """Build the mesh and create the groups of every subset of its axes.

        Must be called by every rank in ``ranks`` with the same arguments (and, when the mesh is
        smaller than the world, with the other ranks in ``serve_group_creation``).
        """
        axes_t = tuple((str(n), int(s)) for n, s in axes)
        names = [n for n, _ in axes_t]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate mesh axis in {names}")
        if any(s < 1 for _, s in axes_t):
            raise ValueError(f"mesh axis sizes must be positive: {axes_t}")
        if not dist.is_initialized():
            raise RuntimeError("Mesh.build needs torch.distributed to be initialised first")
        size = math.prod(s for _, s in axes_t)
        ranks_t = tuple(range(dist.get_world_size())) if ranks is None else tuple(ranks)
        if len(ranks_t) != size:
            raise ValueError(f"mesh {axes_t} has {size} positions but {len(ranks_t)} ranks given")
        me = dist.get_rank()
        if me not in ranks_t:
            raise ValueError(f"rank {me} is not part of the mesh ranks {ranks_t}")
        mesh = cls(axes_t, ranks_t, me)
        groups = mesh._all_groups()
        if len(ranks_t) < dist.get_world_size():
            if ranks_t[0] != 0:
                raise ValueError("a mesh smaller than the world must contain global rank 0")
            box: list[object] = [groups]
            dist.broadcast_object_list(box, src=0)
            groups = box[0]  # type: ignore[assignment]
        _create_groups(groups)
        return mesh

    def make_groups(
        self, groups: Sequence[tuple[int, ...]]
    ) -> dict[tuple[int, ...], ProcessGroup | None]:
        """Create extra groups (sorted global rank tuples) beyond the axis groups.

        Collective over the mesh: every rank must pass the same list, including groups it is not
        in, so that creation stays in step across the world.
        """
        if len(self.ranks) < dist.get_world_size():
            box: list[object] = [list(groups)]
            dist.broadcast_object_list(box, src=0)
            groups = box[0]  # type: ignore[assignment]
        _create_groups(groups)
        return {g: _GROUPS[g] for g in groups}

    def _all_groups(self) -> list[tuple[int, ...]]:
        """Every group of every axis subset (mesh order), in an order all ranks agree on."""
        out: dict[tuple[int, ...], None] = {}  # an ordered set
        for k in range(1, len(self.axes) + 1):
            for subset in itertools.combinations(self.names, k):
                rest = [a for a in self.names if a not in subset]
                for point in itertools.product(*(range(self.size(a)) for a in rest)):
                    at = Mesh(self.axes, self.ranks, self.rank_at(**dict(zip(rest, point))))
                    members = at._members(subset)
                    if len(members) > 1:
                        out[members] = None
        return list(out)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def size(self, *axes: str) -> int:
        """Product of the sizes of ``axes`` (all axes when none are given)."""
        sizes = dict(self.axes)
        return math.prod(sizes[self._check(a)] for a in (axes or self.names))

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self._coords()[self.names.index(self._check(axis))]

    def index(self, *axes: str) -> int:
        """This rank's row-major flattened coordinate over ``axes`` in the order given."""
        idx = 0
        for a in axes:
            idx = idx * self.size(a) + self.coord(a)
        return idx

    def group(self, *axes: str) -> ProcessGroup | None:
        """The group of ranks that differ from this one only along ``axes``; None if of size 1.

        Group rank == ``index(*axes)``: the axes must be listed in mesh order (and the mesh ranks be
        ascending along them), since torch orders a group's members by global rank.
        """
        if not axes:
            raise ValueError("mesh.group needs at least one axis")
        members = self._members(axes)
        if len(members) == 1:
            return None
        if list(members) != sorted(members):
            raise ValueError(
                f"group over {axes} would not be ordered by global rank; list the axes in mesh "
                f"order {self.names}"
            )
        group = _GROUPS.get(members)
        assert group is not None, f"group {members} was not created by Mesh.build"
        return group

    def ranks_along(self, *axes: str) -> tuple[int, ...]:
        """Global ranks of the group over ``axes`` containing this rank, in flattened order."""
        return self._members(axes)

    def rank_at(self, **coords: int) -> int:
        """Global rank at this rank's coordinates, overridden by ``coords``."""
        c = list(self._coords())
        for a, v in coords.items():
            c[self.names.index(self._check(a))] = v
        flat = 0
        for (_, s), v in zip(self.axes, c):
            flat = flat * s + v
        return self.ranks[flat]

    def _check(self, axis: str) -> str:
        if axis not in self.names:
            raise KeyError(f"unknown mesh axis {axis!r}; axes are {self.names}")
        return axis

    def _coords(self) -> tuple[int, ...]:
        flat = self.ranks.index(self.rank)
        coords = []
        for _, s in reversed(self.axes):
            coords.append(flat % s)
            flat //= s
        return tuple(reversed(coords))

    def _members(self, axes: Sequence[str]) -> tuple[int, ...]:
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis listed twice in {tuple(axes)}")
        ranges = [range(self.size(a)) for a in axes]
        return tuple(self.rank_at(**dict(zip(axes, point))) for point in itertools.product(*ranges))
