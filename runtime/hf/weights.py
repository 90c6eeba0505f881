"""Hugging Face checkpoints in and out: ``--weights DIR`` and ``--export-hf DIR``.

Loading: every rank reads only its own slices of the safetensors files (``safe_open(..).get_slice``),
straight into its local shards, so no rank ever holds a full tensor it does not own and no
full-size random initialisation happens first.  Before reading anything, every rank checks the
whole checkpoint against the program (config.json against the model, every tensor present with the
expected shape, every file readable), so a bad checkpoint stops every rank with the same message,
naming the tensor and the file.

Names follow the model's structure, not the family's name: an embedding, optional learned
positions, one repeat of [norm, attention, norm, mlp], a final norm and a head map onto the
checkpoint layout (a pack's ``CheckpointNames``, meshllm_dsl/families) whose positions, fused qkv,
norms and activation they have (weights a layout stores [in, out] are transposed here); a layout's
config.json is Llama-shaped unless its pack writes and checks it.

Exporting gathers one tensor at a time onto the mesh's first rank, which writes config.json and
safetensors files (sharded above ``max_shard_bytes``, with an index) that ``from_pretrained`` loads,
under ``meshc compile -o``'s rule for output directories (``_ExportWriter``).

What can be known from the files alone is checked before any rank starts (``check_weights``,
``check_export_dir``): every file of --weights is a plain name of its directory (links: see
``_link_escapes``), every config field meshllm reads has its type, every tensor a floating dtype,
and none is left over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from meshllm_dsl.families import BY_MODEL_TYPE, PACKS
from meshllm_dsl.families.pack import CheckpointNames, FamilyPack
from meshllm_dsl.runtime.hf import fused as hf_fused
from meshllm_dsl.runtime.hf import fused_experts as hf_fx
from meshllm_dsl.runtime.hf import moe as hf_moe
from meshllm_dsl.runtime.hf.fused import runs as _runs
from meshllm_dsl.runtime.json_values import describe
from meshllm_dsl.runtime.model import description
from meshllm_dsl.runtime.outputs import MANIFEST, manifest_bytes, read_manifest, write_file_atomic
from meshllm_dsl.runtime.parallel.fsdp import tp_local
from meshllm_dsl.runtime.parallel.mesh import Mesh
from meshllm_dsl.runtime.parallel.shards import ShardSpec, gather_full

__all__ = [
    "HFCheckpoint",
    "WeightsError",
    "check_config",
    "check_export_dir",
    "check_weights",
    "export_hf",
    "extras_note",
    "hf_config",
    "hf_key_map",
    "local_from_hf",
    "model_arch",
    "padded_vocab",
    "plan_load",
]

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


# safetensors' names of the dtypes a parameter can be read from (converted to the plan's dtype).
_FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


class WeightsError(ValueError):
    """A checkpoint that does not fit the program: names the tensor / field and the file."""


# ---------------------------------------------------------------- the model's structure


@dataclass(frozen=True)
class _Layout:
    arch: str  # the checkpoint layout's name (CheckpointNames.layout)
    embed: str
    pos: str | None
    repeat: str  # the last repeat (the one with the experts, where blocks are of two kinds)
    count: int  # the blocks of every repeat
    body: tuple[Mapping[str, Any], ...]  # norm, attention, norm, mlp (or with post norms: the layout's norms)
    norm: Mapping[str, Any]
    head: Mapping[str, Any]
    vocab: int
    hidden: int
    norms: Mapping[str, Mapping[str, Any]]  # a block's norms by role: attn_pre, attn_post, mlp_pre, mlp_post
    # Each repeat in order: (its name, the checkpoint's number of its first block, its blocks). HF's
    # block list numbers the blocks of every repeat in turn (DeepSeek-V3: the dense ones, then the moe ones).
    repeats: tuple[tuple[str, int, int], ...] = ()
    bodies: tuple[tuple[Mapping[str, Any], ...], ...] = ()  # each repeat's block, as `body`
    all_norms: tuple[Mapping[str, Mapping[str, Any]], ...] = ()  # each repeat's norms by role, as `norms`

    @property
    def attn(self) -> Mapping[str, Any]:
        return _sublayer(self.body, "attn")

    @property
    def mlp(self) -> Mapping[str, Any]:
        return _sublayer(self.body, "mlp")


# The sublayers a checkpoint's block holds, by the MODEL's layer kind: their role in the block (the
# CheckpointNames' `attn` / `mlp` submodules, the norms' `attn_pre` ... `mlp_post`).
_SUBLAYER_ROLES = {"attention": "attn", "mla": "attn", "mlp": "mlp"}


def _sublayer(body: tuple[Mapping[str, Any], ...], role: str) -> Mapping[str, Any]:
    return next(b for b in body if _SUBLAYER_ROLES.get(b["kind"]) == role)


def _block_norms(body: tuple[Mapping[str, Any], ...]) -> dict[str, Mapping[str, Any]] | None:
    """The norms of a [pre norm] attention [post norm] [pre norm] mlp [post norm] block by role, or
    None for any other block."""
    roles: dict[str, Mapping[str, Any]] = {}
    subs = iter(("attn", "mlp"))
    pending: Mapping[str, Any] | None = None
    last = None
    for b in body:
        role = _SUBLAYER_ROLES.get(b["kind"])
        if role is not None:
            last = next(subs, None)
            if last != role:
                return None
            if pending is not None:
                roles[f"{last}_pre"], pending = pending, None
        elif b.get("post"):
            if last is None or f"{last}_post" in roles:
                return None
            roles[f"{last}_post"] = b
        elif pending is None:
            pending = b
        else:
            return None
    return roles if last == "mlp" and pending is None else None


def _layout(model: Mapping[str, Any]) -> _Layout:
    layers = list(model["layers"])
    kinds = [x["kind"] for x in layers]
    name = model.get("name", "model")
    norms = sorted({a.norm for a in _HF_NAMES.values()})
    middle = kinds[1:-2][1:] if kinds[1:2] == ["positional"] else kinds[1:-2]
    if not (len(kinds) >= 4 and kinds[0] == "embedding" and middle and set(middle) == {"repeat"}
            and kinds[-2] in norms and kinds[-1] == "linear"):
        raise WeightsError(
            f"model `{name}` ({', '.join(kinds)}) has no Hugging Face layout: expected an embedding,"
            " optional positions, repeats of blocks, a final norm and a head"
        )
    reps = [x for x in layers if x["kind"] == "repeat"]
    bodies = tuple(tuple(hf_moe.as_mlp(b) for b in rep["body"]) for rep in reps)  # a moe layer stands where the MLP does
    all_roles: list[dict[str, Mapping[str, Any]]] = []
    for rep, body in zip(reps, bodies, strict=True):
        roles = _block_norms(body)
        if roles is None or any(b["kind"] not in norms for b in roles.values()):
            raise WeightsError(
                f"model `{name}`: a block of `{rep['name']}` is "
                f"{', '.join(b['kind'] for b in body)}; Hugging Face layouts need norm, attention, norm, mlp"
                " (Gemma: a post norm after each sublayer; OLMo 2: attention, post norm, mlp, post norm)"
            )
        all_roles.append(roles)
    # The block with the experts where the repeats differ by their MLP (DeepSeek-V3's dense blocks first)
    last = next((i for i, body in enumerate(bodies) if hf_moe.is_moe(body)), len(bodies) - 1)
    body, roles, rep = bodies[last], all_roles[last], reps[last]
    attn, mlp = _sublayer(body, "attn"), _sublayer(body, "mlp")
    table = description.position_table(model)
    pos = None if table is None else table["name"]
    kind = next(iter(roles.values()))["kind"]
    offset = float(layers[-2].get("offset") or 0.0)
    # The family's own layout where the model names its family; else the one its structure fits.
    family_layout = _FAMILY_LAYOUT.get(str(model.get("family")))
    arch = next((arch for arch, a in _HF_NAMES.items() if family_layout in (None, arch)
                 and a.positions == (pos is not None) and a.attention_kind == attn["kind"]
                 and a.fused_qkv == bool(attn.get("fused_qkv")) and a.norm == kind
                 and set(a.norms) == set(roles) and a.norm_offset == offset), None)
    if arch is None or _HF_NAMES[arch].act not in (None, mlp["act"]):
        raise WeightsError(
            f"model `{name}` mixes conventions ({attn['kind']}, positions {pos is not None}, fused qkv "
            f"{bool(attn.get('fused_qkv'))}, {kind} {'/'.join(roles)} with offset {offset}, {mlp['act']}):"
            " no checkpoint layout (Llama, GPT-2, Gemma 2 / 3, OLMo 2, DeepSeek-V3, GLM-4.5) fits"
        )
    if len(reps) > 1 and _HF_NAMES[arch].write_config is None:
        # one Llama-shaped config.json describes one kind of block
        raise WeightsError(
            f"model `{name}` has {len(reps)} repeats ({', '.join(r['name'] for r in reps)}); its Hugging Face "
            f"layout ({_BY_LAYOUT[arch].title or arch}) has blocks of one kind: expected one repeat "
            "(blocks of two kinds: the deepseek_v3 and glm4_moe families)"
        )
    firsts: list[tuple[str, int, int]] = []
    at = 0
    for r in reps:
        firsts.append((r["name"], at, int(r["count"])))
        at += int(r["count"])
    embed = layers[0]
    return _Layout(
        arch=arch,
        embed=embed["name"],
        pos=pos,
        repeat=rep["name"],
        count=at,
        body=body,
        norm=layers[-2],
        head=layers[-1],
        vocab=int(embed["num"]),
        hidden=int(embed["dim"]),
        norms=roles,
        repeats=tuple(firsts),
        bodies=bodies,
        all_norms=tuple(all_roles),
    )


def model_arch(model: Mapping[str, Any]) -> str:
    """The name of the checkpoint layout the model reads and writes (a pack's ``CheckpointNames.layout``)."""
    return _layout(model).arch


def maps_partial_rotary(model: Mapping[str, Any]) -> bool:
    """Whether the model's checkpoint layout maps attention's rotary_dim (config.json's
    partial_rotary_factor, GLM-4.5); False where no layout fits (the load says why)."""
    try:
        return _HF_NAMES[_layout(model).arch].partial_rotary
    except WeightsError:
        return False


def padded_vocab(model: Mapping[str, Any]) -> tuple[int, int]:
    """(rows of the embedding, real vocab): rows past the real vocab are padding."""
    lay = _layout(model)
    embed = description.token_embedding(model)
    return lay.vocab, int(embed.get("used") or lay.vocab)


# The checkpoint layouts, from the family packs (meshllm_dsl/families): layout name -> its names, in
# the order of the layouts' first packs.
_HF_NAMES: dict[str, CheckpointNames] = {p.checkpoint.layout: p.checkpoint for p in PACKS}
# A compiled model declared from a family carries the family's name (MODEL["family"]): its layout.
_FAMILY_LAYOUT: dict[str, str] = {p.family: p.checkpoint.layout for p in PACKS}
# Each layout's first pack (for its title in messages).
_BY_LAYOUT: dict[str, FamilyPack] = {}
for _p in PACKS:
    _BY_LAYOUT.setdefault(_p.checkpoint.layout, _p)
# The layout with norms after the sublayers and none before.
_POST_LAYOUT = next(name for name, a in _HF_NAMES.items() if "attn_pre" not in a.norms)


# Every layer kind some checkpoint layout holds (runtime/ cannot import the compiler's registry;
# tests/frontend/test_primitive_registry.py checks this against it).
ADAPTER_KINDS = frozenset({"embedding", "linear", "attention", "mlp", "moe"}
                          | {a.norm for a in _HF_NAMES.values()} | {a.attention_kind for a in _HF_NAMES.values()}
                          | ({"positional"} if any(a.positions for a in _HF_NAMES.values()) else set()))


def hf_key_map(model: Mapping[str, Any], names: list[str]) -> dict[str, tuple[str, bool]]:
    """Our full parameter name -> (HF tensor name, stored transposed) for every name in ``names``."""
    lay = _layout(model)
    hf = _HF_NAMES[lay.arch]
    ours = {"embed": lay.embed, "pos": lay.pos, "norm": lay.norm["name"], "head": lay.head["name"]}
    top = {ours[role]: module for role, module in hf.top.items()}
    repeats = {rname: (first, bodies, roles)
               for (rname, first, _), bodies, roles in zip(lay.repeats, lay.bodies, lay.all_norms, strict=True)}
    out: dict[str, tuple[str, bool]] = {}
    for name in names:
        parts = name.split(".")
        key: str | None = None
        transposed = False
        if parts[0] in top:
            key = f"{top[parts[0]]}.{parts[1]}"
        elif parts[0] in repeats and len(parts) >= 4:
            first, body, roles = repeats[parts[0]]
            i, unit, rest = first + int(parts[1]), parts[2], parts[3:]
            moe_key = hf_moe.key(f"{hf.blocks}.{i}", body, unit, rest, name, WeightsError)
            if moe_key is not None:  # a mixture of experts: runtime/hf/moe.py
                out[name] = (moe_key, False)
                continue
            units: dict[str, tuple[str, Mapping[str, str] | None]] = {
                _sublayer(body, "attn")["name"]: hf.attn, _sublayer(body, "mlp")["name"]: hf.mlp,
                **{b["name"]: (hf.norms[role], None) for role, b in roles.items()},
            }
            module, projections = units.get(unit, ("", {}))
            if projections is None:  # a norm: its parameters directly
                key = f"{hf.blocks}.{i}.{module}.{rest[0]}"
            elif rest[0] in hf.projection_norms and rest[1:] == ["norm"] and unit == _sublayer(body, "attn")["name"]:
                key = f"{hf.blocks}.{i}.{module}.{hf.projection_norms[rest[0]]}.weight"  # mla's latents' norms
            elif rest[0] in projections and rest[1:] == ["norm"]:  # attention's q / k norm scale
                key = f"{hf.blocks}.{i}.{module}.{rest[0]}_norm.weight"
            elif rest == ["q", "sinks"] and unit in units:  # attention's sinks (GPT-OSS): one logit per head, kept with q
                key = f"{hf.blocks}.{i}.{module}.sinks"
            elif rest[0] in projections:
                key = f"{hf.blocks}.{i}.{module}.{projections[rest[0]]}.{rest[1]}"
            transposed = hf.transposed and projections is not None and rest[-1] == "weight"
        if key is None:
            raise WeightsError(f"parameter {name} has no Hugging Face name")
        out[name] = (key, transposed)
    return out


def hf_buffer_map(model: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our full name -> (the HF tensor, its shape) of every buffer a checkpoint holds (the sigmoid
    routers' correction biases ``REPEAT.I.UNIT.router.e_score_correction_bias`` [experts]), over every block."""
    lay = _layout(model)
    blocks = _HF_NAMES[lay.arch].blocks
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for (rname, first, count), body in zip(lay.repeats, lay.bodies, strict=True):
        for b in body:
            for leaf, theirs in hf_moe.buffers(b, WeightsError).items():
                for i in range(count):
                    out[f"{rname}.{i}.{leaf}"] = (f"{blocks}.{first + i}.{theirs}", (int(b["experts"]),))
    return out


def plan_buffers(ckpt: HFCheckpoint, model: Mapping[str, Any]) -> dict[str, str]:
    """Check every buffer the checkpoint holds for the model (present, floating point, its shape);
    return our full name -> its stored key."""
    out: dict[str, str] = {}
    for name, (key, shape) in hf_buffer_map(model).items():
        stored = ckpt.key(key)
        if stored is None:
            files = sorted({p.name for p in ckpt.where.values()})
            raise WeightsError(f"tensor {key} (for the buffer {name}) is missing from {ckpt.dir} ({', '.join(files)})")
        if ckpt.dtypes.get(stored) not in _FLOATING:
            raise WeightsError(f"tensor {stored} in {ckpt.where[stored]} is stored as {ckpt.dtypes.get(stored)}, but "
                               f"{name} is a floating-point buffer; expected one of {', '.join(sorted(_FLOATING))}")
        if tuple(ckpt.shape(stored)) != shape:
            raise WeightsError(f"tensor {stored} in {ckpt.where[stored]} has shape {tuple(ckpt.shape(stored))}, but "
                               f"{name} needs {shape}")
        out[name] = stored
    return out


def read_buffer(ckpt: HFCheckpoint, key: str, mesh: Mesh, dtype: torch.dtype) -> Tensor:
    """A buffer whole (every rank of its stage holds all of it)."""
    return local_from_hf(ckpt, key, False, ShardSpec(key, tuple(ckpt.shape(key)), ()), mesh, dtype)


# ---------------------------------------------------------------- files from outside

# Every file read from a --weights directory is named by the directory plus a plain name, and a
# symbolic link among them is followed only where it stays inside the directory or, for a
# snapshot of the Hugging Face cache (whose files all link to ../../blobs/<sha>), inside that
# repository's blobs/.  Anything else would read (and an export would disclose) a file the
# user never named.


def _plain_name(name: Any) -> bool:
    """A file name directly inside a directory: no separators, no ``..``, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in name for c in "/\\\0"))


def _hf_blobs(model_dir: Path) -> Path | None:
    """``blobs/`` of the Hugging Face cache repository whose snapshot ``model_dir`` (resolved) is."""
    snapshots, repo = model_dir.parent, model_dir.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return Path(os.path.realpath(repo / "blobs"))
    return None


def _link_escapes(path: Path, model_dir: Path) -> str | None:
    """Where ``path`` (a plain name in ``model_dir``) leads when it is a link to a file outside
    the directory (and outside its cache repository's blobs/), else None."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))  # realpath, not resolve: a link loop is a path here
    root = Path(os.path.realpath(model_dir))
    blobs = _hf_blobs(root)
    if target.is_relative_to(root) or (blobs is not None and target.is_relative_to(blobs)):
        return None
    return str(target)


def _source_file(model_dir: Path, name: str) -> Path:
    """``model_dir / name`` for reading; ``WeightsError`` if it is a link leading outside."""
    path = model_dir / name
    outside = _link_escapes(path, model_dir)
    if outside is not None:
        raise WeightsError(
            f"{path}: a symbolic link to {outside}, outside {model_dir}; expected a file of the model"
            " directory (or of its Hugging Face cache repository)"
        )
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WeightsError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WeightsError(f"{path}: is a directory; expected a JSON file") from None
    except UnicodeDecodeError as err:
        raise WeightsError(f"{path}: not UTF-8 text (byte {err.start}); expected a JSON file") from None
    except OSError as err:
        raise WeightsError(f"{path}: cannot read it ({err.strerror or err})") from None
    except ValueError as err:
        raise WeightsError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise WeightsError(f"{path}: JSON nested too deeply to read") from None


def _read_object(path: Path) -> dict[str, Any]:
    doc = _read_json(path)
    if not isinstance(doc, dict):
        raise WeightsError(f"{path}: holds {describe(doc)}; expected a JSON object")
    return doc


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _token_ids(v: Any) -> bool:
    one = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
    return one(v) or (isinstance(v, list) and bool(v) and all(one(x) for x in v))


_CONFIG_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "max_position_embeddings", "original_max_position_embeddings", "sliding_window",
    "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "n_ctx",
)
_CONFIG_NUMBERS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta")
_CONFIG_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
                 "scale_attn_weights", "scale_attn_by_inverse_layer_idx")
_CONFIG_TEXT = ("model_type", "hidden_act", "activation_function", "torch_dtype")
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# What each rope type needs besides rope_theta (transformers' rope initialisers read these).
_ROPE_NEEDS = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor"),
}  # other types: refused by the comparison with the spec, whatever they hold
_ROPE_LISTS = ("short_factor", "long_factor")  # longrope's: one positive number per rotary frequency
_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "rope_theta", "attention_factor",
                 "beta_fast", "beta_slow")


def _check_fields(doc: Mapping[str, Any], where: str, checks: list[tuple[tuple[str, ...], Callable[[Any], bool], str]]) -> None:
    for fields, ok, expected in checks:
        for field in fields:
            if field in doc and doc[field] is not None and not ok(doc[field]):
                raise WeightsError(f"{where}: `{field}` is {describe(doc[field])}; expected {expected}")


def _check_rope(value: Any, where: str, field: str) -> None:
    if not isinstance(value, dict):
        raise WeightsError(f"{where}: `{field}` is {describe(value)}; expected an object (or null)")
    kind = value.get("rope_type", value.get("type", "default"))
    if not isinstance(kind, str):
        raise WeightsError(f"{where}: `{field}.rope_type` is {describe(kind)}; expected a string such as \"llama3\"")
    for k in _ROPE_NEEDS.get(kind, ()):
        if value.get(k) is None:
            expected = ("a positive integer" if k == "original_max_position_embeddings" else
                        "a list of positive numbers" if k in _ROPE_LISTS else "a positive number")
            raise WeightsError(f"{where}: `{field}` of type {kind!r} has no `{k}`; expected {expected}")
    _check_fields(value, f"{where}: `{field}`", [
        (_ROPE_LISTS, lambda v: isinstance(v, list) and bool(v) and all(_positive_number(x) for x in v),
         "a list of positive numbers"),
        (_ROPE_NUMBERS, _positive_number, "a positive number"),
        (("original_max_position_embeddings",), _positive_int, "a positive integer"),
    ])


def _checked_config(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``cfg`` with every field meshllm reads type-checked and nulls dropped (null: the default)."""
    if cfg.get("sliding_window") == 0 and cfg.get("use_sliding_window") is False:
        cfg = {**cfg, "sliding_window": None}  # how transformers writes "no window" (the MoE packs)
    _check_fields(cfg, where, [
        (_CONFIG_INTS, _positive_int, "a positive integer"),
        (_CONFIG_NUMBERS, _positive_number, "a positive number"),
        (_CONFIG_BOOLS, lambda v: isinstance(v, bool), "true or false"),
        (_CONFIG_TEXT, lambda v: isinstance(v, str), "a string"),
        (_TOKEN_ID_FIELDS, _token_ids, "a token id (an integer >= 0) or a list of them"),
        (("architectures",), lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
         "a list of class names such as [\"LlamaForCausalLM\"]"),
    ])
    for field in ("rope_scaling", "rope_parameters"):
        if cfg.get(field) is not None:
            _check_rope(cfg[field], where, field)
    return {k: v for k, v in cfg.items() if v is not None}


def read_config(model_dir: Path) -> dict[str, Any]:
    """``model_dir/config.json``: a JSON object, every field meshllm reads of the right type."""
    path = _source_file(model_dir, "config.json")
    raw = _read_object(path)
    pack = _pack_of(raw)
    # nulls dropped (the default), but where null is a value of its own to the architecture's layout
    kept = pack.checkpoint.null_fields if pack is not None else ()
    return {**_checked_config(raw, str(path)), **{k: None for k in kept if k in raw and raw[k] is None}}


# ---------------------------------------------------------------- config.json


def _pack_of(cfg: Mapping[str, Any]) -> FamilyPack | None:
    """The pack of a config.json's `model_type`, if one has it."""
    model_type = cfg.get("model_type")
    return BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def _rope(cfg: Mapping[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from a config of transformers 4 (rope_theta / rope_scaling)
    or 5 (rope_parameters)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", cfg.get("rope_theta"))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind == "default" else dict(params)
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
        scaling = dict(scaling) if scaling else None
    if scaling is not None:
        scaling.pop("rope_theta", None)
        scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type"))
        pack = _pack_of(cfg)
        if pack is not None and pack.longrope_only and scaling["rope_type"] in ("su", "yarn"):
            scaling["rope_type"] = "longrope"  # its config class reads the older names as longrope
    return (None if theta is None else float(theta)), scaling


def _llama_shaped_pack(model: Mapping[str, Any], lay: _Layout) -> FamilyPack:
    """The architecture whose config.json a Llama-shaped model writes: its layout's (norms after the
    sublayers), else the one with its q / k norm, its q, k, v biases, or its window, else Llama's."""
    attn = lay.attn

    def first(holds: Callable[[FamilyPack], bool]) -> FamilyPack:
        return next(p for p in _LLAMA_SHAPED.values() if holds(p))

    plain = next(iter(_LLAMA_SHAPED.values()))  # Llama itself, the first of the registry
    if lay.arch != plain.checkpoint.layout:
        pack = first(lambda p: p.checkpoint.layout == lay.arch)
    elif attn.get("qk_norm", "none") != "none":
        pack = first(lambda p: p.checkpoint_qk_norm == attn.get("qk_norm"))
    elif bool(attn.get("qkv_bias")) and not attn.get("o_bias"):
        pack = first(lambda p: p.qkv_bias_built_in)
    else:
        pack = plain
    window = int(attn.get("window") or 0)
    if window and (pack is not plain or attn.get("global_every")):
        raise WeightsError(f"model `{model.get('name', 'model')}`: a sliding window "
                           + ("on some layers only" if attn.get("global_every") else f"in {pack.architecture}'s layout")
                           + " has no Llama-family config.json; expected a window on every layer "
                           f"({first(lambda p: p.honours_sliding_window).title})")
    return first(lambda p: p.honours_sliding_window) if window else pack


def _rope_config(attn: Mapping[str, Any], seq: int) -> tuple[dict[str, Any], int]:
    """(the rope object, max_position_embeddings) of a Llama-shaped config.json."""
    theta = float(attn["rope_theta"])
    scaling = attn.get("rope_scaling")
    rope: dict[str, Any] = {"rope_theta": theta, "rope_type": "default"}
    positions = max(seq, int((scaling or {}).get("original_max_position_embeddings", 0)))
    if scaling:
        rope = {"rope_theta": theta, **scaling}
        if scaling["rope_type"] == "dynamic":  # NTK scales from max_position_embeddings itself
            positions = int(rope.pop("original_max_position_embeddings"))
    return rope, positions


def hf_config(model: Mapping[str, Any], dtype: torch.dtype, seq: int = 2048) -> dict[str, Any]:
    """The config.json that describes ``model`` to transformers."""
    lay = _layout(model)
    attn, mlp = lay.attn, lay.mlp
    vocab = padded_vocab(model)[1]
    tied = bool(lay.head.get("tie"))
    dtype_name = str(dtype).removeprefix("torch.")
    write = _HF_NAMES[lay.arch].write_config
    if write is not None:  # a layout whose config.json is its pack's
        refuse = _HF_NAMES[lay.arch].refuse_unfit
        if refuse is not None:
            refuse(model, lay, hf_moe.is_moe(lay.body), WeightsError)
        return write(model, lay, vocab, tied, dtype_name, seq)
    _refuse_unfit(model, lay)
    pack = _llama_shaped_pack(model, lay)
    rope, positions = _rope_config(attn, seq)
    cfg: dict[str, Any] = {
        "architectures": [pack.architecture],
        "model_type": pack.model_type,
        "vocab_size": vocab,
        "hidden_size": lay.hidden,
        "intermediate_size": int(mlp["ffn"]),
        "num_hidden_layers": lay.count,
        "num_attention_heads": int(attn["heads"]),
        "num_key_value_heads": int(attn["kv_heads"]),
        "head_dim": int(attn["head_dim"]),
        "hidden_act": "silu",
        "rms_norm_eps": float(lay.norm["eps"]),
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "rope_parameters": rope,
        "max_position_embeddings": positions,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype_name,
    }
    if pack.refuses_use_sliding_window:
        cfg["use_sliding_window"] = False
    if attn.get("window"):
        cfg["sliding_window"] = int(attn["window"])
    if not pack.qkv_bias_built_in:  # built-in q, k, v biases are the architecture's, not a field
        cfg["attention_bias"] = bool(attn.get("qkv_bias"))
    if pack.has_mlp_bias_field:
        cfg["mlp_bias"] = False
    return hf_moe.hf_config(model, lay, cfg, WeightsError) if hf_moe.is_moe(lay.body) else cfg


def _refuse_unfit(model: Mapping[str, Any], lay: _Layout) -> None:
    """``WeightsError`` for a model its layout's architecture cannot hold (the pack's refuse_unfit),
    or, in a layout with a norm before the sublayers, with the q / k norm over the whole projection
    that only a layout of norms after them has."""
    hf = _HF_NAMES[lay.arch]
    if hf.refuse_unfit is not None:
        hf.refuse_unfit(model, lay, hf_moe.is_moe(lay.body), WeightsError)
    elif lay.attn.get("qk_norm", "none") == "full":
        raise WeightsError(f"model `{model.get('name', 'model')}`: qk_norm = full (over the whole projection) in a "
                           "norm-before-sublayer block has no Hugging Face architecture; "
                           f"{_FULL_QK.title} (family {_FULL_QK.family}) has it with norms after the sublayers")


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # longrope's factors
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return bool(a == b)


# The Llama-shaped model types a checkpoint may name (the packs whose layout's config.json the runtime
# writes; the mixtures of experts are checked as their attention's), in the registry's order.
_LLAMA_SHAPED = {p.model_type: p for p in PACKS if p.checkpoint.write_config is None and p.attention is None}
# The architecture whose q / k norm is over the whole projection (attention's qk_norm = full).
_FULL_QK = next(p for p in _LLAMA_SHAPED.values() if p.checkpoint_qk_norm == "full")
# The model types of the layouts with norms after the sublayers and none before.
_POST_NORMS = tuple(model_type for model_type, p in _LLAMA_SHAPED.items() if "attn_pre" not in p.checkpoint.norms)
# Those that attend within a config's `sliding_window`, for messages ("A's and B's").
_WINDOWED = "'s and ".join(p.title for p in _LLAMA_SHAPED.values() if p.honours_sliding_window)
# The q / k norm of each (attention's qk_norm).
_QK_NORM = {model_type: p.checkpoint_qk_norm for model_type, p in _LLAMA_SHAPED.items()}
# The model types of the layouts whose config.json fields are their packs' (after the Llama-shaped ones
# in messages).
_OTHER_TYPES = ", ".join(p.model_type for p in PACKS if p.checkpoint.config_wants is not None)
_Want = tuple[str, Any, Any, str]  # (config.json field, its value, the model's, what the model calls it)
_Bad = Callable[[str, Any, Any, str], WeightsError]


def _bad(where: str, name: str) -> _Bad:
    """The error for a field whose value differs from the model's."""
    def bad(field: str, got: Any, want: Any, what: str) -> WeightsError:
        if got is None:
            return WeightsError(f"{where}: `{field}` is missing; model `{name}` has {what} = {want!r}")
        return WeightsError(
            f"{where}: `{field}` is {got!r}, but model `{name}` has {what} = {want!r}"
        )
    return bad


def _check_model_type(model: Mapping[str, Any], lay: _Layout, model_type: Any, where: str) -> None:
    """The model type names the checkpoint layout the model has (norms before or after the sublayers)."""
    name = model.get("name", "model")
    if model_type is None:
        raise WeightsError(f"{where}: `model_type` is missing; expected one of {', '.join(_QK_NORM)}, {_OTHER_TYPES}")
    hf = _HF_NAMES[lay.arch]
    post = "attn_pre" not in hf.norms  # the model's blocks have norms after the sublayers only
    if (model_type in _POST_NORMS) != post:
        title = _BY_LAYOUT[lay.arch].title if post else _BY_LAYOUT[_POST_LAYOUT].title
        shape = (f"{title} shaped (norms after the sublayers)" if post
                 else f"not {title} shaped ({title} has norms after the sublayers, none before)")
        raise WeightsError(f"{where}: `model_type` is {model_type!r}, but model `{name}` is {shape}")
    if hf.refuse_unfit is not None:
        hf.refuse_unfit(model, lay, hf_moe.is_moe(lay.body), WeightsError)


def _llama_wants(model: Mapping[str, Any], lay: _Layout, cfg: Mapping[str, Any], model_type: Any,
                 where: str) -> tuple[list[_Want], Any]:
    """(a Llama-shaped config's fields against the model's, each default its architecture's pack's;
    its rope scaling object)."""
    attn, mlp, vocab = lay.attn, lay.mlp, padded_vocab(model)[1]
    if model_type not in _QK_NORM:
        raise WeightsError(
            f"{where}: model_type {model_type!r} is not supported ({', '.join(_QK_NORM)}, {_OTHER_TYPES})"
        )
    pack = _LLAMA_SHAPED[model_type]
    theta, scaling = _rope(cfg)
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (int(cfg.get("hidden_size", 0)) // int(heads or 1))
    return [
        ("vocab_size", cfg.get("vocab_size"), vocab, "vocab"),
        ("hidden_size", cfg.get("hidden_size"), lay.hidden, "hidden"),
        ("num_hidden_layers", cfg.get("num_hidden_layers"), lay.count, "layers"),
        ("num_attention_heads", heads, attn["heads"], "heads"),
        ("num_key_value_heads", cfg.get("num_key_value_heads", heads), attn["kv_heads"], "kv_heads"),
        ("head_dim", head_dim, attn["head_dim"], "head_dim"),
        ("intermediate_size", cfg.get("intermediate_size"), mlp["ffn"], "ffn"),
        # transformers' default eps where a config leaves it out (the pack's)
        ("rms_norm_eps", cfg.get("rms_norm_eps", pack.default_norm_eps), lay.norm["eps"], "norm_eps"),
        ("rope_theta", theta, attn["rope_theta"], "rope_theta"),
        ("hidden_act", cfg.get("hidden_act", "silu"), "silu", "SwiGLU's activation"),
        (f"model_type ({model_type}'s q / k norm)", _QK_NORM[model_type], attn.get("qk_norm", "none"), "qk_norm"),
        ("attention_bias (q, k, v)", bool(cfg.get("attention_bias", pack.qkv_bias_built_in)),
         bool(attn.get("qkv_bias")), "attention bias"),
        ("attention_bias (o)", bool(cfg.get("attention_bias", False)), bool(attn.get("o_bias")), "attention out_bias"),
        # an MLP the architecture never biases: transformers ignores an mlp_bias in its config
        ("mlp_bias", not pack.ignores_mlp_bias and bool(cfg.get("mlp_bias", False)), bool(mlp.get("bias")), "mlp bias"),
    ], scaling


def _check_window(lay: _Layout, cfg: Mapping[str, Any], model_type: Any, where: str, bad: _Bad) -> None:
    """The architectures that honour `sliding_window` (the packs') need the model's window; others none."""
    window = cfg.get("sliding_window")
    binding = window is not None and window < int(cfg.get("max_position_embeddings", 0))
    honours = _LLAMA_SHAPED[model_type].honours_sliding_window
    if binding and not honours and cfg.get("use_sliding_window"):
        raise WeightsError(
            f"{where}: `sliding_window` = {window} limits {model_type}'s attention to a window; meshllm's"
            f" llama family windows {_WINDOWED}'s attention only"
        )
    # The architectures that honour it attend within the window whenever one is set: the model must have the same one
    # (or none where the window is no shorter than any position).
    theirs = int(window) if honours and window is not None else 0
    ours = int(lay.attn.get("window") or 0)
    if ours != theirs and (ours or binding):
        raise bad("sliding_window", window, ours, "window")


def _check_rope_scaling(lay: _Layout, cfg: Mapping[str, Any], scaling: Any, bad: _Bad) -> None:
    """The rope scaling the config reads as, against the model's."""
    ours = lay.attn.get("rope_scaling")
    theirs = None if scaling is None else _rope_as_read(scaling, cfg)
    if (theirs is None) != (ours is None) or (
        theirs is not None
        and (set(theirs) != set(ours) or any(not _close(theirs[k], v) for k, v in ours.items()))  # type: ignore[union-attr]
    ):
        raise bad("rope_scaling", scaling, ours, "rope scaling")


def check_config(model: Mapping[str, Any], cfg: Mapping[str, Any], where: str) -> None:
    """Raise ``WeightsError`` naming the first config.json field the model disagrees with."""
    lay = _layout(model)
    hf = _HF_NAMES[lay.arch]
    # nulls dropped (the default), but where null is a value of its own to the layout
    cfg = {**_checked_config(cfg, where), **{k: None for k in hf.null_fields if k in cfg and cfg[k] is None}}
    if hf.check_config is not None:  # a layout whose pack checks its config.json wholly (experts too)
        return hf.check_config(model, lay, padded_vocab(model)[1], cfg, where, WeightsError)
    moe_wants: list[_Want] = []
    if hf_moe.is_moe(lay.body):  # checked as the family its attention comes from, and its experts
        cfg, moe_wants = hf_moe.as_attention_config(model, lay, cfg, where, WeightsError)
    model_type = cfg.get("model_type")
    name = model.get("name", "model")
    _check_model_type(model, lay, model_type, where)
    bad = _bad(where, name)
    scaling = None
    if hf.config_wants is not None:  # a layout whose config.json fields are its pack's
        wants = hf.config_wants(model, lay, padded_vocab(model)[1], cfg, model_type, where, WeightsError)
    else:
        wants, scaling = _llama_wants(model, lay, cfg, model_type, where)
        _check_window(lay, cfg, model_type, where, bad)
    tied = bool(cfg.get("tie_word_embeddings", hf.tied_by_default))
    wants.append(("tie_word_embeddings", tied, bool(lay.head.get("tie")), "a tied head"))
    for field, got, want, what in wants + moe_wants:
        if not _close(got, want):
            raise bad(field, got, want, what)
    if hf.config_wants is None:  # Llama-shaped
        _check_rope_scaling(lay, cfg, scaling, bad)


# The fields of each rope type transformers reads, with its defaults where a config leaves them out
# (None: the config's max_position_embeddings); the attention's rope_scaling holds the same.
_ROPE_READS: dict[str, dict[str, Any]] = {
    "linear": {"factor": None},
    "dynamic": {"factor": None},
    "yarn": {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32, "beta_slow": 1,
             "truncate": True},
    "llama3": {"factor": None, "low_freq_factor": None, "high_freq_factor": None, "original_max_position_embeddings": None},
}


def _rope_as_read(scaling: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config's rope scaling as transformers uses it: its type's fields, defaults filled in, and
    for dynamic the length its formula scales from (max_position_embeddings) under the name the
    attention keeps it (original_max_position_embeddings)."""
    kind = scaling.get("rope_type")
    positions = cfg.get("max_position_embeddings")
    if kind == "longrope":
        return _longrope_as_read(scaling, cfg)
    reads = _ROPE_READS.get(kind)  # type: ignore[arg-type]
    if reads is None:
        return dict(scaling)  # a type meshllm lacks: never equal to the model's
    out: dict[str, Any] = {"rope_type": kind}
    for k, default in reads.items():
        v = scaling.get(k)
        if v is None:
            v = positions if k == "original_max_position_embeddings" else default
        out[k] = v
    if kind == "yarn" and scaling.get("attention_factor") is not None:
        out["attention_factor"] = scaling["attention_factor"]
    if kind == "dynamic":
        out["original_max_position_embeddings"] = positions
    return out


def longrope_original(scaling: Mapping[str, Any], cfg: Mapping[str, Any]) -> Any:
    """The trained length longrope switches factors at, as transformers' standardize_rope_params
    finds it: a top-level original_max_position_embeddings first (a pack's longrope_default_original unless
    the config says otherwise), then the rope object's, then max_position_embeddings."""
    top = cfg.get("original_max_position_embeddings")
    pack = _pack_of(cfg)
    if top is None and pack is not None:
        top = pack.longrope_default_original
    return top if top is not None else scaling.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))


def _longrope_as_read(scaling: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    original = longrope_original(scaling, cfg)
    factor = scaling.get("factor")
    if factor is None and original:  # transformers: max_position_embeddings / original
        factor = cfg.get("max_position_embeddings", 0) / original
    out = {"rope_type": "longrope", "factor": factor, "original_max_position_embeddings": original,
           "short_factor": scaling.get("short_factor"), "long_factor": scaling.get("long_factor")}
    if scaling.get("attention_factor") is not None:
        out["attention_factor"] = scaling["attention_factor"]
    return out


# ---------------------------------------------------------------- reading


class HFCheckpoint:
    """A Hugging Face model directory: config.json and its safetensors files, opened lazily."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise WeightsError(f"--weights {self.dir}: not a directory")
        self.config: dict[str, Any] = read_config(self.dir)
        index = self.dir / "model.safetensors.index.json"
        files: list[Path]
        if index.exists() or index.is_symlink():
            files = self._indexed(_source_file(self.dir, index.name))
        else:
            files = [_source_file(self.dir, f.name) for f in sorted(self.dir.glob("*.safetensors"))]
            if not files:
                raise WeightsError(f"--weights {self.dir}: no *.safetensors files (and no index)")
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}  # safetensors' names: F32, BF16, I32, BOOL, ...
        self.bytes_read = 0  # what this rank has read of the tensors (for tests and reports)
        for f in files:
            try:
                # Opened once to let safetensors validate the file, then closed: tensors are read
                # later through a short-lived mapping each (see ``open``).
                with safe_open(str(f), framework="pt") as handle:
                    keys = list(handle.keys())
                size = f.stat().st_size
            except FileNotFoundError:
                raise WeightsError(f"{f}: listed in {index.name} but missing") from None
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise WeightsError(f"{f}: not a readable safetensors file ({err})") from None
            header = self._header(f, keys, size)
            for k in keys:
                if k in self.where:
                    raise WeightsError(f"tensor {k} is stored twice: in {self.where[k]} and in {f}")
                self.where[k] = f
                self.shapes[k] = tuple(header[k]["shape"])
                self.dtypes[k] = str(header[k]["dtype"])

    def _indexed(self, index: Path) -> list[Path]:
        """The files ``model.safetensors.index.json`` names: plain names of this directory only."""
        weight_map = _read_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightsError(
                f"{index}: `weight_map` is {describe(weight_map) if weight_map is not None else 'missing'};"
                " expected an object of tensor name -> safetensors file name"
            )
        files: set[Path] = set()
        for key, name in weight_map.items():
            if not _plain_name(name):
                raise WeightsError(
                    f"{index}: the entry for {key} names {describe(name)}; expected the name of a file"
                    f" in {self.dir} (no directories, no ..)"
                )
            files.add(_source_file(self.dir, name))
        return sorted(files)

    @staticmethod
    def _header(f: Path, keys: list[str], size: int) -> dict[str, Any]:
        # safetensors checks the header against the file length; double-check every tensor's end.
        import struct

        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header: dict[str, Any] = json.loads(fh.read(n))
        for k in keys:
            end = header[k]["data_offsets"][1]
            if 8 + n + end > size:
                raise WeightsError(
                    f"{f}: truncated ({size} bytes); tensor {k} needs bytes up to {8 + n + end}"
                )
        return header

    def key(self, key: str) -> str | None:
        """``key`` as stored: some checkpoints from the hub omit the ``transformer.`` prefix."""
        if key in self.where:
            return key
        if key.startswith("transformer.") and key[len("transformer."):] in self.where:
            return key[len("transformer."):]
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    @contextlib.contextmanager
    def open(self, key: str) -> Iterator[Any]:
        """``get_slice(key)`` of a mapping that lives only while one tensor is read, so the file
        pages a rank touches (all of them for a column slice) leave its memory straight after."""
        from safetensors import safe_open

        with safe_open(str(self.where[key]), framework="pt") as handle:
            yield handle.get_slice(key)


def _local_indices(spec: ShardSpec, mesh: Mesh) -> list[Tensor]:
    """Per dim, the full-tensor indices this rank's shard holds (mirrors ``local_slice``)."""
    idx = [torch.arange(n) for n in spec.shape]
    for k, (dim, axes) in enumerate(spec.dims):
        n, i = mesh.size(*axes), mesh.index(*axes)
        parts = list(idx[dim].split(list(spec.segments))) if (k == 0 and spec.segments) else [idx[dim]]
        idx[dim] = torch.cat([p.chunk(n)[i] for p in parts])
    return idx


def local_from_hf(
    ckpt: HFCheckpoint, key: str, transposed: bool, spec: ShardSpec, mesh: Mesh, dtype: torch.dtype
) -> Tensor:
    """This rank's shard of one HF tensor, read slice by slice (rows past the stored ones: zeros)."""
    if hf_moe.is_stacked(key):  # one stored tensor per expert
        return hf_moe.local_stacked(ckpt, key, spec, mesh, dtype, local_from_hf)
    if hf_fx.is_fused(key):  # experts stored fused and 3-D (runtime/hf/fused_experts.py)
        return hf_fx.local(ckpt, key, _local_indices(spec, mesh), dtype)
    if hf_fused.rows(key) is not None:  # a part of a fused tensor (runtime/hf/fused.py)
        return hf_fused.local_rows(ckpt, key, _local_indices(spec, mesh), dtype)
    idx = _local_indices(spec, mesh)
    stored = ckpt.shape(key)
    stored_ours = tuple(reversed(stored)) if transposed else stored
    out = torch.zeros([len(i) for i in idx], dtype=dtype)
    # Which local positions come from which stored ranges, per dim (padding rows stay zero).
    per_dim: list[list[tuple[int, int, int]]] = []  # (local start, full start, length)
    for d, ix in enumerate(idx):
        runs, pos = [], 0
        for a, b in _runs(ix):
            b2 = min(b, stored_ours[d])
            if b2 > a:
                runs.append((pos, a, b2 - a))
            pos += b - a
        per_dim.append(runs)

    def visit(sl: Any, d: int, local: list[slice], full: list[slice]) -> None:
        if d == len(idx):
            index = tuple(reversed(full)) if transposed else tuple(full)
            piece = sl[index]
            ckpt.bytes_read += piece.numel() * piece.element_size()
            out[tuple(local)] = (piece.t() if transposed else piece).to(dtype)
            return
        for pos, a, n in per_dim[d]:
            visit(sl, d + 1, [*local, slice(pos, pos + n)], [*full, slice(a, a + n)])

    with ckpt.open(key) as sl:
        visit(sl, 0, [], [])
    return out


def plan_load(
    ckpt: HFCheckpoint, model: Mapping[str, Any], specs: Mapping[int, Mapping[str, ShardSpec]]
) -> dict[str, tuple[str, bool]]:
    """Check the checkpoint against every parameter of every stage (not only this rank's), so
    every rank finds the same first problem; return our name -> (stored key, transposed)."""
    check_config(model, ckpt.config, str(ckpt.dir / "config.json"))
    full_shapes: dict[str, tuple[int, ...]] = {}
    for stage in specs.values():
        for name, spec in stage.items():
            full_shapes[name] = spec.shape
    keys = hf_key_map(model, sorted(full_shapes))
    model_type = ckpt.config.get("model_type")
    if model_type in hf_fused.MODEL_TYPES:  # q / k / v and gate / up stored as one tensor each
        keys = hf_fused.fuse_keys(keys, full_shapes, model_type)
    rows, vocab = padded_vocab(model)
    lay = _layout(model)
    out: dict[str, tuple[str, bool]] = {}
    for name in sorted(full_shapes):
        key, transposed = keys[name]
        if hf_moe.is_stacked(key):
            hf_moe.check_stacked(ckpt, key, full_shapes[name], name, _FLOATING, WeightsError)
            out[name] = (key, False)
            continue
        stored_key = ckpt.key(hf_fused.base(hf_fx.base(key)))
        if stored_key is None:
            files = sorted({p.name for p in ckpt.where.values()})
            raise WeightsError(
                f"tensor {key} (for {name}) is missing from {ckpt.dir} ({', '.join(files)})"
            )
        dtype = ckpt.dtypes.get(stored_key)
        if dtype not in _FLOATING:
            raise WeightsError(
                f"tensor {stored_key} in {ckpt.where[stored_key]} is stored as {dtype}, but {name} is a"
                f" floating-point parameter; expected one of {', '.join(sorted(_FLOATING))}"
            )
        want = full_shapes[name]
        if name.split(".")[0] in (lay.embed, lay.head["name"]) and rows != vocab:
            want = (vocab, *want[1:])  # the checkpoint has the real vocab; padding rows are ours
        want_stored = hf_fx.stored_shape(key, want) if hf_fx.is_fused(key) else \
            hf_fused.stored_shape(key, tuple(reversed(want)) if transposed else want)
        got = ckpt.shape(stored_key)
        if got != want_stored:
            raise WeightsError(
                f"tensor {stored_key} in {ckpt.where[stored_key]} has shape {got}, but {name} "
                f"needs {want_stored}" + (" (stored transposed, [in, out])" if transposed else "")
            )
        out[name] = (hf_fx.rekey(key, stored_key) if hf_fx.is_fused(key) else hf_fused.rekey(key, stored_key), transposed)
    return out


# Stored tensors that hold no parameter: buffers older transformers versions saved (a causal
# mask, rotary frequencies), which transformers itself skips on load.
_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
EXTRA_POLICIES = ("error", "ignore")


def check_weights(directory: str | Path, program: Any, extra: str = "error") -> list[str]:
    """Everything about ``--weights DIR`` that can be known before any rank starts (reads only
    config.json, the index and the safetensors headers): ``WeightsError`` naming the first problem.

    Tensors the model has no place for (a layer it does not have, a bias it does not use) are an
    error, or with ``extra="ignore"`` returned so the caller can warn about them.
    """
    ckpt = HFCheckpoint(directory)
    specs = {i: dict(stage.params()) for i, stage in enumerate(program.stages)}
    shapes = {name: spec.shape for stage in specs.values() for name, spec in stage.items()}
    used = {ckpt.key(hf_fused.base(hf_fx.base(k))) or k for name, (key, _) in plan_load(ckpt, program.model, specs).items()
            for k in hf_moe.stored(key, shapes[name])}
    used |= set(plan_buffers(ckpt, program.model).values())
    tied = bool(_layout(program.model).head.get("tie"))
    extras = sorted(
        k for k in ckpt.where
        if k not in used and not _BUFFERS.search(k) and not (tied and k.endswith("lm_head.weight"))
    )
    if extras and extra != "ignore":
        raise WeightsError(
            f"{ckpt.dir}: {len(extras)} tensor{'s' * (len(extras) > 1)} that model "
            f"`{program.model.get('name', 'model')}` has no place for ({_some(extras)}); "
            "pass --weights-extra ignore to load the rest anyway"
        )
    return extras


def extras_note(directory: str | Path, extras: list[str]) -> str:
    """The warning for tensors ``--weights-extra ignore`` let through."""
    return (f"--weights {directory}: ignoring {len(extras)} tensor{'s' * (len(extras) > 1)} the model has"
            f" no place for ({_some(extras)})")


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ---------------------------------------------------------------- writing


# `meshc compile -o` and `--export-hf` share one rule for output directories (runtime/outputs.py):
# a new or empty directory, or one whose marker file says meshc wrote it; only meshc's own, unedited
# files of the names it writes are ever replaced (each atomically), and nothing else is touched.
_EXPORT_NAMES = re.compile(r"config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


class ExportError(Exception):
    """``--export-hf DIR`` cannot be written without replacing something; nothing was written."""


def _export_name(name: str) -> bool:
    return bool(_EXPORT_NAMES.fullmatch(name)) or name in _TOKENIZER_FILES


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _export_state(out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(files, pending) of the meshc manifest of the existing directory ``out``: what an export
    may replace there.  ``ExportError`` when anything of a name it writes is not its own."""
    flag = f"--export-hf {out}"
    entries = sorted(out.iterdir())
    if not entries:
        return {}, {}
    manifest = read_manifest(out)
    if manifest is None:
        raise ExportError(
            f"{flag}: the directory is not empty and meshc did not write it (no {MANIFEST}); expected a"
            " new or empty directory, or one meshc exported to before"
        )
    owned, pending = manifest
    foreign = sorted(n for n in {**owned, **pending} if not _export_name(n))
    if foreign:
        raise ExportError(f"{flag}: holds meshc's generated files ({_some(foreign)}), not an export;"
                          " choose another directory")
    for entry in entries:
        if entry.name == MANIFEST or not _export_name(entry.name):
            continue  # never written, never touched
        if entry.is_symlink() or not entry.is_file():
            why = "is not a regular file meshc wrote"
        elif entry.name not in owned and entry.name not in pending:
            why = "exists and was not written by meshc"
        elif _file_sha256(entry) not in (owned.get(entry.name), pending.get(entry.name)):
            why = "was changed since meshc wrote it"
        else:
            continue
        raise ExportError(f"{flag}: {entry.name} {why}; nothing was written (move it, or choose another directory)")
    return owned, pending


def check_export_dir(out: str | Path, weights: str | Path | None = None) -> None:
    """Before any training: ``ExportError`` unless ``--export-hf out`` can be written without
    replacing anything that is not meshc's own export (see ``_export_state``), or ``weights``."""
    out = Path(out)
    flag = f"--export-hf {out}"
    if out.is_symlink() and not out.exists():
        raise ExportError(f"{flag}: a dangling symbolic link; expected a new or empty directory")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{flag}: exists and is not a directory; expected a new or empty directory, "
                          "or one meshc exported to before")
    if weights is not None:
        real_out, real_in = Path(os.path.realpath(out)), Path(os.path.realpath(weights))
        if real_out.is_relative_to(real_in):
            where = "is" if real_out == real_in else "is inside"
            raise ExportError(f"{flag}: {where} the --weights directory {weights}; the export would"
                              " overwrite the model it was read from; choose another directory")
        _check_source_files(Path(weights))
    if out.is_dir():
        _export_state(out)
        probe = out
    else:
        probe = next((q for q in out.absolute().parents if q.exists()), Path("/"))
        if not probe.is_dir():
            raise ExportError(f"{flag}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ExportError(f"{flag}: {probe} is not writable")


def _check_source_files(src: Path) -> None:
    """The JSON files an export copies from ``src`` verbatim, as transformers will read them back:
    objects, and generation_config.json's token ids token ids (a link leading outside is skipped
    at export, so not read here either)."""
    for name in ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
                 "tokenizer.json", "vocab.json"):
        path = src / name
        if path.is_file() and _link_escapes(path, src) is None:
            doc = _read_object(path)
            if name == "generation_config.json":
                _check_fields(doc, str(path), [
                    (_TOKEN_ID_FIELDS + ("decoder_start_token_id",), _token_ids,
                     "a token id (an integer >= 0) or a list of them"),
                    (("max_new_tokens", "max_length"), _positive_int, "a positive integer"),
                ])


class _ExportWriter:
    """Writes an export directory file by file: a new directory appears whole (a temporary sibling
    renamed into place); in one meshc exported to before, each file is replaced atomically, with
    the manifest naming old and new hashes (`pending`) in between, and stale files of the earlier
    export (a shard count that changed) are removed if unedited."""

    def __init__(self, out: Path) -> None:
        self.out, self.fresh = out, not out.exists()
        if self.fresh:
            out.parent.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            self.owned: dict[str, str] = {}
            self.pending: dict[str, str] = {}
        else:
            self.dir = out
            owned, self.pending = _export_state(out)
            self.owned = {n: h for n, h in owned.items() if (out / n).is_file()}
        self.written: dict[str, str] = {}
        self.umask = os.umask(0)
        os.umask(self.umask)

    def _manifest(self, files: Mapping[str, str], pending: Mapping[str, str]) -> None:
        write_file_atomic(self.dir / MANIFEST, manifest_bytes(files, pending))

    def put(self, name: str, write: Callable[[Path], None]) -> None:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.dir)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            self.written[name] = _file_sha256(tmp)
            if not self.fresh:
                self._manifest(self.owned, {**self.pending, **self.written})
            os.chmod(tmp, 0o666 & ~self.umask)
            os.replace(tmp, self.dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def finish(self) -> None:
        for name, digest in self.owned.items():
            if name not in self.written and _file_sha256(self.dir / name) == digest:
                (self.dir / name).unlink()
        kept = {n: h for n, h in self.owned.items() if n not in self.written and (self.dir / n).is_file()}
        self._manifest({**kept, **self.written}, {})
        if self.fresh:
            os.chmod(self.dir, 0o777 & ~self.umask)
            os.rename(self.dir, self.out)  # not replace: a directory that appeared meanwhile is not ours

    def abandon(self) -> None:
        if self.fresh:
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)


def _copy_source_files(src: Path, writer: _ExportWriter) -> None:
    """The tokenizer files of the --weights directory, into the export (links: see _link_escapes)."""
    for name in _TOKENIZER_FILES:
        path = src / name
        outside = _link_escapes(path, src)
        if outside is not None:
            print(f"--export-hf: not copying {path}: a symbolic link to {outside}, outside the model"
                  " directory", file=sys.stderr, flush=True)
        elif path.is_file():
            data = path.read_bytes()
            writer.put(name, lambda tmp, data=data: tmp.write_bytes(data))  # type: ignore[misc]


def _stage_holder(built: Any, stage: int) -> int:
    return built._pipeline_rank(stage) if built.program.pipeline_axis else built.mesh.rank


@torch.no_grad()
def _export_order(built: Any) -> list[tuple[int, str, ShardSpec]]:
    """(stage, name, spec) of every parameter once, in the order the export writes them."""
    order: list[tuple[int, str, ShardSpec]] = []
    seen: set[str] = set()
    for i in range(len(built.program.stages)):
        for name, spec in sorted(built.specs[i].items()):
            if name not in seen:
                seen.add(name)
                order.append((i, name, spec))
    return order


def _shard_files(order: list[tuple[int, str, ShardSpec]], nbytes_of: Callable[[str, ShardSpec], int],
                 max_shard_bytes: int) -> tuple[list[list[str]], dict[str, str], int]:
    """(names per file, name -> file, total bytes): shard files planned up front from shapes alone, so
    their names carry the count (-of-N)."""
    files: list[list[str]] = [[]]
    size = 0
    total = 0
    for _, name, spec in order:
        nbytes = nbytes_of(name, spec)
        total += nbytes
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    n_files = len(files)
    file_of = {
        name: ("model.safetensors" if n_files == 1 else f"model-{k + 1:05d}-of-{n_files:05d}.safetensors")
        for k, names in enumerate(files)
        for name in names
    }
    return files, file_of, total


def _gathered(built: Any, stage: int, spec: ShardSpec, pp_group: Any) -> Tensor:
    """The full tensor of one parameter, on every rank of its pipeline group."""
    program, mesh = built.program, built.mesh
    if stage in built.modules:
        full = gather_full(tp_local(built.modules[stage].get_parameter(spec.local).detach()), spec, mesh)
    else:
        full = torch.empty(spec.shape, dtype=program.dtype, device=built.device)
    if pp_group is not None:
        # [full shape]: from the pipeline rank holding stage i to the rest of its group.
        dist.broadcast(full, src=_stage_holder(built, stage), group=pp_group)
    return full


def _gathered_buffer(built: Any, stage: int, name: str, shape: tuple[int, ...], pp_group: Any) -> Tensor:
    """A buffer (whole on every rank of its stage), on every rank of its pipeline group."""
    if stage in built.modules:
        full = built.routing_buffers()[name].detach().to(built.program.dtype).clone()
    else:
        full = torch.empty(shape, dtype=built.program.dtype, device=built.device)
    if pp_group is not None:
        # [experts]: from the pipeline rank holding the stage to the rest of its group.
        dist.broadcast(full, src=_stage_holder(built, stage), group=pp_group)
    return full


@dataclass
class _Pending:
    """What rank 0 holds between shard files: tensors to write, their files, fused parts so far."""

    tensors: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    weight_map: dict[str, str] = dataclasses.field(default_factory=dict)
    fusing: dict[str, dict[int, Tensor]] = dataclasses.field(default_factory=dict)  # fused tensors' parts gathered so far

    def put(self, key: str, transposed: bool, full: Tensor, file: str) -> None:
        if hf_moe.is_stacked(key):  # one stored tensor per expert
            for one, part in hf_moe.split_stacked(key, full).items():
                self.tensors[one], self.weight_map[one] = part.to("cpu").contiguous().clone(), file
            return
        if hf_fx.is_fused(key):  # experts stored fused and 3-D (runtime/hf/fused_experts.py)
            hf_fx.put(self.tensors, self.weight_map, self.fusing, key, full, file)
            return
        t = full.t() if transposed else full
        hf_fused.put(self.tensors, self.weight_map, self.fusing, key, t.detach().to("cpu").contiguous().clone(), file)


def _export_config(model: Mapping[str, Any], program: Any, source: str | Path | None, writer: _ExportWriter,
                   tied: bool) -> dict[str, Any]:
    """config.json: the model's own, or the source's (with the plan's dtype), and its files carried over."""
    cfg = hf_config(model, program.dtype, program.seq)
    if source is not None:
        src = Path(source)
        # Nulls kept as they are: for some fields (a sliding_window) null is not the default.
        src_cfg = _read_object(_source_file(src, "config.json"))
        src_cfg["torch_dtype"] = cfg["torch_dtype"]
        src_cfg.pop("dtype", None)
        cfg = src_cfg
        _copy_source_files(src, writer)
    if tied:
        cfg["tie_word_embeddings"] = True
    writer.put("config.json", _text(json.dumps(cfg, indent=2, sort_keys=True) + "\n"))
    return cfg


def export_hf(
    built: Any,
    directory: str | Path,
    source: str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> str | None:
    """Write ``built``'s weights as a Hugging Face model directory (collective; rank 0 writes).

    Returns, on the rank that wrote, the line that says what was written (None elsewhere).

    One tensor at a time is gathered to full shape and handed to the mesh's first rank, so no
    rank holds more than one full tensor beyond its shards.  ``source``: the --weights directory,
    whose config.json (architecture, token ids, ...) and tokenizer files are carried over.
    """
    from safetensors.torch import save_file

    program, mesh, out_dir = built.program, built.mesh, Path(directory)
    model = program.model
    rows, vocab = padded_vocab(model)
    lay = _layout(model)
    order = _export_order(built)
    keys = hf_key_map(model, [n for _, n, _ in order])
    source_type = _read_object(_source_file(Path(source), "config.json")).get("model_type") if source is not None else None
    if source_type in hf_fused.MODEL_TYPES:  # written fused, as the source stores them
        keys = hf_fused.fuse_keys(keys, {n: spec.shape for _, n, spec in order}, source_type)
    itemsize = torch.empty((), dtype=program.dtype).element_size()

    def nbytes_of(name: str, spec: ShardSpec) -> int:
        rows_written = vocab if name.split(".")[0] == lay.embed and rows != vocab else spec.shape[0]
        return math.prod((rows_written, *spec.shape[1:])) * itemsize

    files, file_of, total = _shard_files(order, nbytes_of, max_shard_bytes)
    # Buffers (the routers' correction biases), held by the stage of their router, go in the first file
    buffer_stage = {name: next(s for s, n, _ in order if n.startswith(name.rsplit(".", 1)[0] + "."))
                    for name in hf_buffer_map(model)}
    total += sum(math.prod(shape) * itemsize for _, shape in hf_buffer_map(model).values())
    pp_group = mesh.group(program.pipeline_axis) if program.pipeline_axis else None
    pending = _Pending()
    writer = _ExportWriter(out_dir) if mesh.rank == mesh.ranks[0] else None
    try:
        stage_of = {n: s for s, n, _ in order}
        for name, (key, shape) in hf_buffer_map(model).items():  # the routers' correction biases: in the first file
            full = _gathered_buffer(built, buffer_stage[name], name, shape, pp_group)
            if writer is not None:
                pending.put(key, False, full, file_of[files[0][0]])
        for names in files:
            for name in names:
                full = _gathered(built, stage_of[name], built.specs[stage_of[name]][name], pp_group)
                if writer is not None:
                    cut = name.split(".")[0] == lay.embed and rows != vocab and not hf_moe.is_stacked(keys[name][0])
                    pending.put(*keys[name], full[:vocab] if cut else full, file_of[name])
            if writer is not None:
                tensors, pending.tensors = pending.tensors, {}
                writer.put(file_of[names[0]],
                           lambda tmp, t=tensors: save_file(t, str(tmp), metadata={"format": "pt"}))  # type: ignore[misc]
        if writer is None:
            return None
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(pending.weight_map.items()))}
            writer.put("model.safetensors.index.json", _text(json.dumps(index, indent=2) + "\n"))
        cfg = _export_config(model, program, source, writer, bool(lay.head.get("tie")))
        writer.finish()
        return (f"exported {len(order)} tensors ({total / 2**20:,.1f} MiB {cfg['torch_dtype']}, "
                f"{len(files)} safetensors file{'s' * (len(files) > 1)}) to {out_dir}")
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise


def _text(text: str) -> Callable[[Path], None]:
    return lambda tmp: tmp.write_text(text, encoding="utf-8")  # type: ignore[func-returns-value]
