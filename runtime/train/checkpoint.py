"""Atomic, verified, sharded checkpoints of the whole training state, loadable into any layout.

A checkpoint root ``DIR`` holds ``step-NNNNNN/`` directories and a ``latest`` file naming the
newest complete one.  A step directory is written under a temporary sibling name, flushed to disk,
given a ``manifest.json`` (every file with its size and sha256) and only then renamed into place;
``latest`` is replaced atomically after that, and old steps are pruned last.  A crash at any point
therefore leaves the previous checkpoint loadable and ``latest`` pointing at a complete one.

Tensors go through ``torch.distributed.checkpoint`` (DCP) under layout-independent keys:
``model/NAME`` for every parameter at its full name and ``optim/NAME/KEY`` for its optimizer state
(AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``, ...), and ``buffer/NAME`` for the state a model
holds beside its parameters: the sigmoid routers' correction biases (runtime/moe/routing.py),
replicated on every rank of their stage.  A sharded tensor is given to DCP as a
DTensor over the axes it is split on, so DCP records which slice of the full tensor each rank
holds and reshards on load; copies on several ranks (data replicas, tied weights) are written once.
A fused tensor chunked segment by segment (qkv rows [q | k | v] split over ``tensor``) is not one
DTensor placement: it is described as a ShardedTensor with one local shard per segment, which
still saves under the one key ``model/NAME``, so a plan that shards qkv and one that does not read
each other's checkpoints.  With ZeRO each data rank writes the optimizer state of the parameters it
owns and reads back those it owns in the new layout.  With ZeRO 2 / 3 (FSDP2's DTensors sharded
over the data ranks) each tensor is gathered over the data ranks one at a time and written like an
unsharded one, and each data rank keeps its own slice of what it reads: same keys, any layout.

DCP's ``get_state_dict`` helpers do not fit here: they expect FSDP / DTensor parameters, while a
meshllm stage holds plain local tensors whose layout only its ``ShardSpec`` knows.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
import os
import pickle
import re
import shutil
import uuid
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from meshllm_dsl.runtime.model import description
from meshllm_dsl.runtime.parallel.fsdp import is_sharded, like_sharded, store_tp_local, tp_local
from meshllm_dsl.runtime.parallel.mesh import Mesh
from meshllm_dsl.runtime.parallel.shards import ShardSpec
from meshllm_dsl.runtime.train.program import Built, Optimizers, optimizer_parts

# torch.distributed.checkpoint and DTensor are imported where used: they cost about a second per
# process, and every generated module imports this file through the launcher.

__all__ = [
    "CheckpointError",
    "check_save_root",
    "lineage",
    "load",
    "resolve",
    "save",
    "start_lineage",
    "verify",
]

FORMAT = "meshllm-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP = re.compile(r"step-(\d{6,})")
_TMP_PREFIX = ".tmp-"


class CheckpointError(Exception):
    """A checkpoint cannot be written or read; the message is one line naming what is wrong."""


# ---------------------------------------------------------------------------- files (no torch)


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking step directories of ``root`` (renamed into place), oldest first."""
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _STEP.fullmatch(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _ours(entry: Path) -> bool:
    """Whether ``entry`` of a checkpoint root is something ``save`` writes."""
    name = entry.name
    return name == LATEST or name.startswith(_TMP_PREFIX) or bool(_STEP.fullmatch(name))


def _check_root_files(root: Path) -> None:
    """Raise ``CheckpointError`` unless ``root`` can be a checkpoint root: absent (and creatable),
    empty, or holding only what ``save`` writes; and writable."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"--save {root}: exists and is not a directory")
    if root.is_dir():
        foreign = sorted(p.name for p in root.iterdir() if not _ours(p))
        if foreign:
            raise CheckpointError(
                f"--save {root}: directory holds files that are not meshllm checkpoints "
                f"({_some(foreign)}); choose an empty or new directory"
            )
        probe = root
    else:
        probe = next((p for p in root.parents if p.exists()), Path("."))
        if not probe.is_dir():
            raise CheckpointError(f"--save {root}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise CheckpointError(f"--save {root}: {probe} is not writable")


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def run_of(step_dir: Path) -> str | None:
    """The run (lineage) id the manifest of ``step_dir`` records; None if it records none."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    run = manifest.get("run") if isinstance(manifest, dict) else None
    return run if isinstance(run, str) and run else None


def _latest_name(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_bytes().decode("utf-8", "replace").strip()
    except OSError:
        return None
    return name if _STEP.fullmatch(name) else None


def check_save_root(root: str | Path, resume: str | Path | None = None, save_over: bool = False) -> None:
    """Before the first step: raise ``CheckpointError`` unless a run may write checkpoints into
    ``root`` (see ``_check_root_files``) without replacing, pruning or going back behind another
    run's: a root with checkpoints is only continued by a run that ``--resume``s their lineage
    from no earlier than its ``latest``, or taken over with ``save_over`` (``--save-over``)."""
    root = Path(root)
    _check_root_files(root)
    steps = list_steps(root)
    if not steps or save_over:
        return
    latest = _latest_name(root)
    span = steps[0][1].name + (f" .. {steps[-1][1].name}" if len(steps) > 1 else "")
    held = f"{len(steps)} checkpoint{'s' * (len(steps) > 1)} ({span}{f', latest {latest}' if latest else ''})"
    choices = (f"--resume {root} continues them, --save-over starts this run over in it (it replaces"
               " theirs only at the steps it saves and prunes none), or choose a new directory")
    if resume is None:
        raise CheckpointError(f"--save {root}: holds {held} that this new run did not write; {choices}")
    try:
        manifest = verify(resume, checksums=False)
    except CheckpointError as err:
        raise CheckpointError(f"--resume: {err}") from None
    run = manifest.get("run")
    foreign = [p.name for _, p in steps if run is None or run_of(p) != run]
    if foreign:
        raise CheckpointError(
            f"--save {root}: holds {held}, of which {_some(foreign)} were not written by the run that"
            f" --resume {resume} continues; {choices}"
        )
    if latest is not None and int(latest.split("-")[1]) > int(manifest["step"]):
        raise CheckpointError(
            f"--save {root}: its latest is {latest}, later than step {manifest['step']} that --resume"
            f" {resume} continues from, and this run would move `latest` back; --resume {root}"
            " continues from its latest, --save-over branches off from there"
        )


# One lineage id per run, recorded in every checkpoint it writes and inherited by the runs that
# resume from them: `--keep` prunes only checkpoints of the saving run's lineage.
_LINEAGE: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def lineage(built: Built) -> str:
    """The run id ``built``'s checkpoints carry: inherited from a resumed checkpoint, else new."""
    if built not in _LINEAGE:
        _LINEAGE[built] = uuid.uuid4().hex
    return _LINEAGE[built]


def start_lineage(built: Built) -> str:
    """A new run id for ``built`` (``--save-over``: this run starts over, even when resumed)."""
    _LINEAGE[built] = uuid.uuid4().hex
    return _LINEAGE[built]


def resolve(path: str | Path) -> Path:
    """The step directory ``path`` names: itself, or its root's ``latest``."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such directory")
    if (path / MANIFEST).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        name = latest.read_bytes().decode("utf-8", "replace").strip()
        if not _STEP.fullmatch(name):
            raise CheckpointError(f"checkpoint {path}: `latest` holds {name[:40]!r}, not a step")
        if not (path / name).is_dir():
            raise CheckpointError(f"checkpoint {path}: `latest` names {name}, which is missing")
        return path / name
    if (path / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint {path}: no {MANIFEST}: an incomplete save or not written by meshllm"
        )
    if list_steps(path):
        raise CheckpointError(f"checkpoint {path}: has step directories but no `latest` file")
    raise CheckpointError(f"checkpoint {path}: not a meshllm checkpoint (no {MANIFEST})")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        os.fsync(f.fileno())  # the bytes hashed are the bytes on disk before the rename
    return h.hexdigest()


def _files(step_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(step_dir))
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def verify(path: str | Path, checksums: bool = True) -> dict[str, Any]:
    """The manifest of the checkpoint ``path`` names, after checking it is complete and intact.

    Raises ``CheckpointError`` naming the first problem: no or unreadable manifest, another format,
    a file missing, extra, of the wrong size or (with ``checksums``) with other contents.
    """
    step_dir = resolve(path)
    try:
        manifest = json.loads((step_dir / MANIFEST).read_bytes())
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"checkpoint {step_dir}: unreadable {MANIFEST} ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST} is not a {FORMAT} manifest")
    _check_manifest(manifest, step_dir / MANIFEST)
    listed: dict[str, dict[str, Any]] = manifest["files"]
    present = _files(step_dir)
    extra = sorted(set(present) - set(listed))
    if extra:
        raise CheckpointError(f"checkpoint {step_dir}: file {extra[0]} is not in the manifest")
    for name, info in sorted(listed.items()):
        f = step_dir / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {step_dir}: file {name} is missing")
        size = f.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint {step_dir}: file {name} has {size} bytes, the manifest says "
                f"{info['size']} (truncated or overwritten)"
            )
        if checksums and _sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint {step_dir}: file {name} fails its sha256 check")
    manifest["path"] = str(step_dir)
    return manifest


def _is_int(v: Any, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _inside(name: Any) -> bool:
    """A relative path that stays inside the step directory."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return False
    parts = name.split("/")
    return not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _check_manifest(manifest: Mapping[str, Any], where: Path) -> None:
    """Every field ``verify`` / ``load`` / ``--resume`` read, of the type they read it as."""
    from meshllm_dsl.runtime.hf.weights import describe

    def bad(field: str, value: Any, expected: str) -> CheckpointError:
        got = "missing" if value is _MISSING else f"{describe(value)}"
        return CheckpointError(f"checkpoint {where}: `{field}` is {got}; expected {expected}")

    files = manifest.get("files", _MISSING)
    if not isinstance(files, dict):
        raise bad("files", files, "an object of file name -> {size, sha256}")
    for name, info in files.items():
        if not _inside(name):
            raise bad("files", name, "names of files inside the step directory (a key is not)")
        if not isinstance(info, dict):
            raise bad(f"files.{name}", info, "an object {size, sha256}")
        if not _is_int(info.get("size", _MISSING)):
            raise bad(f"files.{name}.size", info.get("size", _MISSING), "a byte count (an integer >= 0)")
        sha = info.get("sha256", _MISSING)
        if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise bad(f"files.{name}.sha256", sha, "64 hexadecimal digits")
    checks: list[tuple[str, bool, Any, str]] = [
        ("step", True, _is_int, "the step it was saved at (an integer >= 0)"),
        ("layout", True, lambda v: isinstance(v, dict), "an object {axes, ranks}"),
        ("optimizer", False, lambda v: isinstance(v, bool), "true or false"),
        ("param_groups", False, lambda v: isinstance(v, list) and all(isinstance(g, dict) for g in v),
         "a list of objects"),
        ("state", False, lambda v: isinstance(v, dict), "an object"),
        ("run", False, lambda v: isinstance(v, str), "a run id (a string)"),
    ]
    for field, required, ok, expected in checks:
        value = manifest.get(field, _MISSING)
        if (value is _MISSING and required) or (value is not _MISSING and not ok(value)):
            raise bad(field, value, expected)
    state = manifest.get("state", {})
    for field in ("step", "seed"):
        if field in state and not _is_int(state[field], least=0 if field == "step" else -(2**63)):
            raise bad(f"state.{field}", state[field], "an integer")


_MISSING: Any = object()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _commit(tmp: Path, root: Path, step: int, manifest: dict[str, Any], keep: int | None) -> Path:
    """Manifest, rename, ``latest``, prune: the order that keeps every crash recoverable."""
    files = {name: {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
             for name in _files(tmp)}
    manifest = {**manifest, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / step_name(step)
    if final.exists():  # the same step saved again (a resumed run): swap, never a gap in between
        aside = root / f"{_TMP_PREFIX}old-{final.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name + "\n")
    if keep is not None and keep > 0:
        # Only this run's lineage: another run's checkpoints in the root are never pruned.
        run = manifest.get("run")
        own = [p for _, p in list_steps(root) if run is not None and run_of(p) == run]
        for old in own[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------- collectives


def _group(mesh: Mesh) -> dist.ProcessGroup | None:
    return mesh.group(*mesh.names) if mesh.size() > 1 else None


def _first(mesh: Mesh) -> bool:
    return mesh.rank == mesh.ranks[0]


def _from_first(mesh: Mesh, obj: Any) -> Any:
    """``obj`` as the mesh's first rank has it, on every rank (collective)."""
    group = _group(mesh)
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=mesh.ranks[0], group=group)
    return box[0]


def _raise_first(mesh: Mesh, error: str | None) -> None:
    """Raise the mesh's first rank's ``error`` (if any) on every rank (collective)."""
    error = _from_first(mesh, error)
    if error is not None:
        raise CheckpointError(error)


def _agree(mesh: Mesh, error: str | None) -> None:
    """Raise the first rank's error (in rank order) on every rank, or return if none failed."""
    group = _group(mesh)
    errors = [error]
    if group is not None:
        errors = [None] * mesh.size()
        dist.all_gather_object(errors, error, group=group)
    for rank, err in zip(mesh.ranks, errors):
        if err is not None:
            raise CheckpointError(err if rank == mesh.rank else f"rank {rank}: {err}")


def _dist_kwargs(mesh: Mesh) -> dict[str, Any]:
    # A one-rank mesh has no group; DCP's default would be the whole world (hang in the pool).
    group = _group(mesh)
    return {"no_dist": True} if group is None else {"process_group": group}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # DCP warns that ShardedTensor is deprecated and, with no_dist, that it runs on one process:
    # neither helps a user reading a training log.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


# ---------------------------------------------------------------------------- tensors


def _split_dims(mesh: Mesh, spec: ShardSpec) -> list[tuple[int, tuple[str, ...]]]:
    """The dims of ``spec`` that are really split on this mesh (axes of size 1 split nothing)."""
    return [(dim, axes) for dim, axes in spec.dims if mesh.size(*axes) > 1]


def _device_mesh(mesh: Mesh, spec: ShardSpec, device_type: str) -> Any:
    """A DeviceMesh over the split axes of ``spec`` (one mesh dim per split tensor dim).

    Built from the groups ``Mesh`` already has (``from_group`` creates none), which also works in
    the worker pool where the mesh is smaller than the world.
    """
    from torch.distributed.device_mesh import DeviceMesh

    axes_per_dim = [axes for _, axes in _split_dims(mesh, spec)]
    groups = [mesh.group(*axes) for axes in axes_per_dim]
    sizes = [mesh.size(*axes) for axes in axes_per_dim]
    ranks = torch.empty(sizes, dtype=torch.long)
    for idx in (
        torch.cartesian_prod(*[torch.arange(s) for s in sizes]).reshape(-1, len(sizes)).tolist()
    ):
        at: dict[str, int] = {}
        for axes, flat in zip(axes_per_dim, idx):
            for a in reversed(axes):  # unflatten row-major
                at[a], flat = flat % mesh.size(a), flat // mesh.size(a)
        ranks[tuple(idx)] = mesh.rank_at(**at)
    names = tuple("x".join(axes) for axes in axes_per_dim)
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device_type, ranks, mesh_dim_names=names)  # type: ignore[arg-type]
    return DeviceMesh.from_group(groups, device_type, ranks, mesh_dim_names=names)  # type: ignore[arg-type]


def _segmented(mesh: Mesh, spec: ShardSpec, local: Tensor, device: torch.device) -> Any:
    """``local`` (a rank's segment-wise chunk of a fused tensor) as a ShardedTensor.

    Every chunk of the full tensor is listed once in the global metadata (DCP only reads the
    local shards' offsets; the placements are not used for I/O), and this rank's chunks are views
    of ``local`` in segment order.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as StShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    assert spec.segments is not None
    dims = _split_dims(mesh, spec)
    placement = f"rank:0/{device}"
    # Per tensor dim: the (offset, size) chunks of the full dim, and which one this rank holds.
    per_dim: list[list[tuple[int, int]]] = [[(0, n)] for n in spec.shape]
    mine: list[list[int]] = [[0] for _ in spec.shape]
    for k, (dim, axes) in enumerate(dims):
        n, i = mesh.size(*axes), mesh.index(*axes)
        parts = spec.segments if k == 0 and dim == spec.dims[0][0] else (spec.shape[dim],)
        chunks, held, start = [], [], 0
        for part in parts:
            for j in range(n):
                if j == i:
                    held.append(len(chunks))
                chunks.append((start + j * (part // n), part // n))
            start += part
        per_dim[dim], mine[dim] = chunks, held
    everything = [
        ShardMetadata([c[0] for c in combo], [c[1] for c in combo], placement)
        for combo in _product(per_dim)
    ]
    local_shards = []
    for combo in _product([[per_dim[d][j] for j in mine[d]] for d in range(len(spec.shape))]):
        view, md = local, ShardMetadata([c[0] for c in combo], [c[1] for c in combo], placement)
        for d, (offset, size) in enumerate(combo):
            held_offsets = [per_dim[d][j][0] for j in mine[d]]
            view = view.narrow(d, held_offsets.index(offset) * size, size)
        local_shards.append(StShard(view, md))
    meta = ShardedTensorMetadata(
        everything, torch.Size(spec.shape), TensorProperties.create_from_tensor(local)
    )
    # The base constructor skips the per-rank placement validation, which would reject the
    # same chunk held by several data replicas; DCP deduplicates those writes itself.
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata(local_shards, meta)
    assert isinstance(st, ShardedTensor)
    st._process_group = _group(mesh) or dist.group.WORLD  # read by DCP's load path
    return st


def _product(lists: list[list[Any]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [()]
    for options in lists:
        out = [prefix + (o,) for prefix in out for o in options]
    return out


def _dcp_value(mesh: Mesh, spec: ShardSpec, local: Tensor, device: torch.device) -> Any:
    """What DCP is given for a tensor laid out like ``spec`` whose local part is ``local``."""
    from torch.distributed.tensor import DTensor, Shard

    dims = _split_dims(mesh, spec)
    if not dims:
        return local
    if spec.segments is not None and dims[0][0] == spec.dims[0][0]:
        return _segmented(mesh, spec, local, device)
    shape = list(spec.shape)
    stride = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    return DTensor.from_local(
        local,
        _device_mesh(mesh, spec, device.type),
        [Shard(dim) for dim, _ in dims],
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(stride),
    )


def _read_back(value: Any, local: Tensor) -> None:
    """Copy what DCP loaded into ``value`` into ``local`` (a no-op where they share storage)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local.copy_(value.to_local())
    elif isinstance(value, Tensor) and not hasattr(value, "local_shards") and value is not local:
        local.copy_(value)
    # A ShardedTensor's local shards are views of ``local``: DCP already wrote into it.


# ---------------------------------------------------------------------------- state


def _holders(built: Built) -> dict[str, list[tuple[Tensor, ShardSpec]]]:
    """Full name -> this rank's parameters holding it (several for tied copies), first first."""
    out: dict[str, list[tuple[Tensor, ShardSpec]]] = {}
    for i in built.stage_ids:
        for name, spec in built.specs[i].items():
            param = built.modules[i].get_parameter(spec.local)
            if all(p is not param for p, _ in out.get(name, [])):
                out.setdefault(name, []).append((param, spec))
    return out


def _owner(built: Built, param: Tensor) -> tuple[torch.optim.Optimizer, dict[str, Any]] | None:
    """The optimizer holding ``param``'s state on this rank (ZeRO: of its partition) and its
    parameter group; None where another rank's ZeRO partition has it."""
    for inner in optimizer_parts(built.optimizer):
        for group in inner.param_groups:
            if any(q is param for q in group["params"]):
                return inner, group
    return None


def _owned(built: Built) -> set[int]:
    return {id(p) for inner in optimizer_parts(built.optimizer) for group in inner.param_groups for p in group["params"]}


def fingerprint(built: Built) -> str:
    """A hash of every full parameter name and shape: equal for every plan of one model."""
    shapes = sorted({(n, s.shape) for specs in built.specs.values() for n, s in specs.items()})
    return hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]


def _param_groups(built: Built) -> list[dict[str, Any]]:
    out = []
    for group in built.optimizer.param_groups:
        out.append(
            {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}
        )
    return out


def _set_param_groups(built: Built, saved: list[dict[str, Any]], where: str = "") -> None:
    targets = [built.optimizer.param_groups]
    parts = built.optimizer.parts if isinstance(built.optimizer, Optimizers) else [built.optimizer]
    if any(inner is not part for inner, part in zip(optimizer_parts(built.optimizer), parts)):
        # ZeRO's local optimizers, in the order of the parts (one group each, as their ZeRO's).
        targets.append([g for inner in optimizer_parts(built.optimizer) for g in inner.param_groups])
    for groups in targets:
        if len(groups) != len(saved):
            raise CheckpointError(
                f"checkpoint has {len(saved)} optimizer parameter groups, this run {len(groups)}"
            )
        for i, (group, values) in enumerate(zip(groups, saved)):
            for k, v in values.items():
                if k in group:
                    if not _same_kind(group[k], v):
                        from meshllm_dsl.runtime.hf.weights import describe

                        raise CheckpointError(
                            f"checkpoint {where}: `param_groups[{i}].{k}` is {describe(v)}; this run's is"
                            f" {describe(group[k])}"
                        )
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _same_kind(ours: Any, saved: Any) -> bool:
    """Whether an optimizer setting read from a manifest can stand where ``ours`` is."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if isinstance(ours, bool) or ours is None:
        return isinstance(saved, bool) or saved is None
    if number(ours):
        return number(saved)
    if isinstance(ours, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(ours) and all(map(_same_kind, ours, saved))
    return isinstance(saved, type(ours))


def _save_state(built: Built, optimizer: bool) -> dict[str, Any]:
    state: dict[str, Any] = {f"buffer/{name}": buf.detach() for name, buf in built.routing_buffers().items()}
    for name, holders in _holders(built).items():
        param, spec = holders[0]
        state[f"model/{name}"] = _dcp_value(built.mesh, spec, tp_local(param.detach()), built.device)
        if not optimizer:
            continue
        for p, _ in holders:
            owner = _owner(built, p)
            if owner is not None and owner[0].state.get(p):
                for key, value in owner[0].state[p].items():
                    state[f"optim/{name}/{key}"] = _optim_value(built, spec, p, key, value)
                break
    return state


def _optim_value(built: Built, spec: ShardSpec, param: Tensor, key: str, value: Any) -> Any:
    if isinstance(value, Tensor) and value.shape == param.shape:
        return _dcp_value(built.mesh, spec, tp_local(value.detach()), built.device)
    if isinstance(value, Tensor) and value.dim() == 0:
        return value.detach().clone()
    raise CheckpointError(f"optimizer state {key!r} of a parameter has an unexpected shape")


def save(
    built: Built,
    root: str | Path,
    step: int = 0,
    state: Mapping[str, Any] | None = None,
    keep: int | None = None,
    optimizer: bool = True,
) -> Path:
    """Write ``root/step-NNNNNN`` atomically and point ``root/latest`` at it (collective).

    Holds every parameter, the optimizer state (with ``optimizer``), this rank's RNG states and
    ``state`` (JSON: step, data position, ...).  Keeps the newest ``keep`` steps (None: all).
    Raises ``CheckpointError`` on every rank if any rank fails to write.
    """
    import torch.distributed.checkpoint as dcp

    root, mesh = Path(root), built.mesh
    tmp = root / f"{_TMP_PREFIX}{step_name(step)}"
    error = None
    if _first(mesh):
        try:
            _check_root_files(root)
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.iterdir():
                if stale.name.startswith(_TMP_PREFIX):  # left by a save that crashed
                    shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            tmp.mkdir()
        except (OSError, CheckpointError) as err:
            error = str(err) if isinstance(err, CheckpointError) else f"--save {root}: {err}"
    _raise_first(mesh, error)
    tensors = _save_state(built, optimizer)
    with _quiet():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 **_dist_kwargs(mesh))
    error = None
    try:
        rng = {"cpu": torch.get_rng_state()}
        if built.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(built.device)
        with open(tmp / f"rng-{mesh.rank}.pt", "wb") as f:
            torch.save(rng, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        error = f"--save {root}: {err}"
    _agree(mesh, error)
    final = root / step_name(step)
    if _first(mesh):
        manifest = {
            "format": FORMAT,
            "step": step,
            "model": fingerprint(built),
            "run": lineage(built),
            "layout": {"axes": [list(a) for a in mesh.axes], "ranks": list(mesh.ranks)},
            "optimizer": optimizer,
            "param_groups": _param_groups(built) if optimizer else [],
            "state": dict(state or {}),
        }
        try:
            final = _commit(tmp, root, step, manifest, keep)
        except OSError as err:
            error = f"--save {root}: {err}"
    _raise_first(mesh, error)
    return final


# What DCP's `.metadata` (a pickle) holds: its own metadata classes, torch sizes, dtypes, layouts
# and memory formats, and paths.  Anything else in it would be code run on load, not metadata.
_METADATA_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("builtins", "set"), ("builtins", "frozenset"),
})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:  # a dotted name would walk attributes: os.system through a module's `os`
            if (module, name) in _METADATA_GLOBALS:
                return super().find_class(module, name)
            value = getattr(torch, name, None) if module == "torch" else None
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
            if module.startswith("torch.distributed.checkpoint."):
                found = getattr(importlib.import_module(module), name, None)
                if isinstance(found, type) and found.__module__ == module:
                    return found
        raise pickle.UnpicklingError(f"{module}.{name}")


def _read_metadata(step_dir: Path) -> Any:
    """DCP's metadata of ``step_dir``, unpickled with only what DCP writes allowed, and holding
    tensors only (DCP reads any other entry with ``torch.load(weights_only=False)``)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = step_dir / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"checkpoint {step_dir}: .metadata refers to {err}, which DCP metadata never holds; not loading"
            " it (unpickling it could run code)"
        ) from None
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
        raise CheckpointError(f"checkpoint {step_dir}: unreadable .metadata ({type(err).__name__}: {err})") from None
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict):
        raise CheckpointError(f"checkpoint {step_dir}: .metadata is not torch.distributed.checkpoint metadata")
    for key, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {step_dir}: .metadata entry {str(key)[:80]} is {type(md).__name__}, not a tensor;"
                " meshllm checkpoints hold tensors only"
            )
    return metadata


def _check_keys(built: Built, metadata: Any, where: Path) -> None:
    """Refuse a checkpoint whose parameters differ from this model's: missing, extra, shape."""
    have = {
        key[len("model/") :]: tuple(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model/")
    }
    want = {n: s.shape for specs in built.specs.values() for n, s in specs.items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing ({', '.join(missing[:3])}{' ...' * (len(missing) > 3)})")
    if extra:
        problems.append(f"{len(extra)} unexpected ({', '.join(extra[:3])}{' ...' * (len(extra) > 3)})")
    for name in sorted(set(want) & set(have)):
        if want[name] != have[name]:
            problems.append(f"{name} is {list(have[name])} there, {list(want[name])} here")
            break
    if problems:
        raise CheckpointError(
            f"checkpoint {where} is of another model: tensors " + "; ".join(problems)
        )


def _check_buffers(built: Built, metadata: Any, where: Path) -> None:
    """Refuse, on every rank, a checkpoint lacking a correction bias one of this model's stages
    holds (a checkpoint from before the bias moved would resume a different run). Only for a model
    with sigmoid routers (the same answer on every rank), so other loads run no extra collective."""
    if not any(layer.get("scoring") == "sigmoid" for layer in description.moe_layers(built.program.model)):
        return
    have = {key[len("buffer/") :] for key in metadata.state_dict_metadata if key.startswith("buffer/")}
    missing = sorted(set(built.routing_buffers()) - have)
    error = None
    if missing:
        error = (f"checkpoint {where} is of another model: no router correction bias "
                 f"{', '.join(missing[:3])}{' ...' * (len(missing) > 3)}")
    _agree(built.mesh, error)


@torch.no_grad()
def load(built: Built, path: str | Path, optimizer: bool = False) -> dict[str, Any]:
    """Load a checkpoint from any layout into ``built`` (collective); return its manifest.

    ``path`` is a step directory or a root (its ``latest``).  The checkpoint is verified first
    (manifest, sizes, checksums, tensor names and shapes); any problem raises ``CheckpointError``
    with one line on every rank.  With ``optimizer``, the optimizer state and step are restored
    too, and the RNG states when the layout is the same.
    """
    import torch.distributed.checkpoint as dcp

    mesh = built.mesh
    found: tuple[str, dict[str, Any]] | str | None = None
    if _first(mesh):
        try:
            manifest = verify(path)
            found = (manifest["path"], manifest)
        except CheckpointError as err:
            found = str(err)
    found = _from_first(mesh, found)
    if isinstance(found, str):
        raise CheckpointError(found)
    assert found is not None
    step_dir, manifest = Path(found[0]), found[1]
    reader = dcp.FileSystemReader(step_dir)
    metadata = _read_metadata(step_dir)  # before DCP unpickles it without restriction
    _check_keys(built, metadata, step_dir)
    _check_buffers(built, metadata, step_dir)
    if optimizer and not manifest.get("optimizer"):
        raise CheckpointError(f"checkpoint {step_dir} holds weights only; use --load to start from it")

    holders = _holders(built)
    # The correction biases load in place (plain replicated tensors).
    tensors: dict[str, Any] = {f"buffer/{name}": buf for name, buf in built.routing_buffers().items()}
    targets: dict[str, Tensor] = dict(tensors)
    for name, held in holders.items():
        param, spec = held[0]
        # ZeRO 2 / 3: read the whole tensor-parallel shard, then keep this data rank's slice.
        target = torch.empty(param.shape, dtype=param.dtype, device=built.device) if is_sharded(param) else param.detach()
        targets[f"model/{name}"] = target
        tensors[f"model/{name}"] = _dcp_value(mesh, spec, target, built.device)
    if optimizer:
        owned = _owned(built)
        by_name: dict[str, list[str]] = {}
        for key in metadata.state_dict_metadata:
            if key.startswith("optim/"):
                name, _, sub = key[len("optim/") :].rpartition("/")
                by_name.setdefault(name, []).append(sub)
        for name, held in holders.items():
            mine = [(p, spec) for p, spec in held if id(p) in owned]
            if not mine:
                continue
            param, spec = mine[0]
            owner = _owner(built, param)
            assert owner is not None
            group = owner[1]
            for sub in by_name.get(name, []):
                md = metadata.state_dict_metadata[f"optim/{name}/{sub}"]
                dtype = md.properties.dtype
                if tuple(md.size) == spec.shape:
                    local = torch.empty(param.shape, dtype=dtype, device=built.device)
                    value: Any = _dcp_value(mesh, spec, local, built.device)
                elif len(md.size) == 0:
                    # Where AdamW keeps its step: on the device only when capturable / fused.
                    on = param.device if group.get("capturable") or group.get("fused") else "cpu"
                    local = value = torch.empty((), dtype=dtype, device=on)
                else:
                    raise CheckpointError(f"checkpoint {step_dir}: optim/{name}/{sub} has shape {list(md.size)}")
                tensors[f"optim/{name}/{sub}"], targets[f"optim/{name}/{sub}"] = value, local
    with _quiet():
        dcp.load(tensors, storage_reader=reader, **_dist_kwargs(mesh))
    for key, value in tensors.items():
        _read_back(value, targets[key])
    for name, held in holders.items():
        if is_sharded(held[0][0]):
            store_tp_local(held[0][0], targets[f"model/{name}"])
    # Tied copies beyond the first holder on this rank.
    for held in holders.values():
        for p, _ in held[1:]:
            p.copy_(held[0][0])
    if optimizer:
        for name, held in holders.items():
            subs = {k.rpartition("/")[2]: v for k, v in targets.items() if k.startswith(f"optim/{name}/")}
            for p, _ in held:
                owner = _owner(built, p)
                if owner is not None and subs:
                    owner[0].state[p] = {
                        k: like_sharded(p, v) if is_sharded(p) and v.shape == p.shape else v.clone()
                        for k, v in subs.items()
                    }
        _set_param_groups(built, manifest.get("param_groups", []), str(step_dir))
        if manifest.get("run"):
            _LINEAGE[built] = manifest["run"]  # a resumed run continues the lineage
        built.steps_done = int(manifest["step"])  # the learning-rate schedule's clock
        same = manifest["layout"] == {"axes": [list(a) for a in mesh.axes], "ranks": list(mesh.ranks)}
        rng_file = step_dir / f"rng-{mesh.rank}.pt"
        if same and rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and built.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], built.device)
    return manifest
