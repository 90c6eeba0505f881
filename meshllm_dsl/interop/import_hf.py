"""`meshc import-hf DIR -o FILE.mesh`: a .mesh spec (the model and one plan) from a Hugging Face model.

Reads config.json only (no torch): the architecture picks the family (its pack's, meshllm_dsl/families:
several architectures may share one) and every setting that changes the
maths is written out; a setting the families cannot honour is an error naming it, never a silently
different model.  The plan `train` for N devices of a kind is the one `meshc suggest` ranks first
(or, when nothing fits the device's memory, the first layout the checker accepts).  Weights then
load with `meshc run FILE --weights DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshllm_dsl.codegen.slurm import script_value_problem
from meshllm_dsl.codes import W0801
from meshllm_dsl.families import BY_ARCHITECTURE, BY_MODEL_TYPE, SUPPORTED
from meshllm_dsl.families.config_fields import (
    ConfigError,
    ConfigFields,
    ImportError_,
    Limits,
    Setting,
)
from meshllm_dsl.front.limits import MAX_BLOCKS, MAX_DEVICES, MAX_INT, MAX_NAME
from meshllm_dsl.front.names import identifier_problem
from meshllm_dsl.runtime.json_values import describe

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
# The spec's bounds on a field: a config.json value above them could never be a spec's.
_LIMITS = Limits(max_int=MAX_INT, max_blocks=MAX_BLOCKS)
__all__ = ["SUPPORTED", "ConfigError", "ImportError_", "model_settings", "read_config", "spec_text"]


# A config.json is a few KB; this bounds what a link to a device or a huge file costs to refuse.
MAX_CONFIG_BYTES = 16 * 2**20


def _fields(doc: dict[str, Any], where: str) -> ConfigFields:
    """Typed reads of a config.json object, within the spec's bounds."""
    return ConfigFields(doc, where, _LIMITS)


def _num(x: Any) -> str:
    if isinstance(x, str):  # a choice (qk_norm = head)
        return x
    if isinstance(x, tuple):  # longrope's factors: on one line here (the settings map to lines), fmt wraps them
        return "[" + ", ".join(_num(float(v)) for v in x) + "]"
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    text = repr(float(x))
    return text if ("." in text or "e" in text) else text + ".0"


def _architecture(f: ConfigFields) -> str:
    archs = f.doc.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise f.error("architectures", 'a list of class names such as ["LlamaForCausalLM"]')
    model_type = f.text("model_type", None)
    pack = BY_MODEL_TYPE.get(model_type or "")
    arch = archs[0] if archs else (pack.architecture if pack else None)
    if arch not in SUPPORTED:
        shown = arch if arch is not None else model_type
        raise ImportError_(f"{f.where}: architecture {shown!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return arch


def _dtype(f: ConfigFields) -> str:
    field = "torch_dtype" if f.doc.get("torch_dtype") is not None else "dtype"
    name = f.text(field, "float32")
    if name not in _DTYPES:
        raise ImportError_(f"{f.where}: `{field}` = {name!r} is not a dtype meshllm computes in; "
                           f"expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def model_settings(cfg: dict[str, Any], where: str) -> tuple[str, list[Setting], int]:
    """(family, [(setting, value, the config.json fields it comes from)], positions) for a config.json
    object; positions: the context it was trained for (the default sequence length).

    Raises ConfigError for a field of the wrong type or range, ImportError_ for a well-formed
    setting the families cannot honour; either names the field."""
    f = _fields(cfg, where)
    if cfg.get("quantization_config"):
        raise ImportError_(f"{where}: `quantization_config` is set; meshllm loads unquantized weights only")
    arch = _architecture(f)
    dtype = _dtype(f)
    pack = BY_ARCHITECTURE[arch]
    return pack.read(f, pack, dtype)


def read_config(directory: Path) -> dict[str, Any]:
    """``directory/config.json`` as a JSON object; ConfigError (one line naming it) otherwise."""
    path = directory / "config.json"
    try:
        st = path.stat()  # follows links; a loop is ELOOP
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{path}: is a directory; expected a JSON file")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block, a device never end
            raise ConfigError(f"{path}: is not a regular file; expected a JSON file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: is {st.st_size:,} bytes; a config.json is at most {MAX_CONFIG_BYTES:,}")
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (is {directory} a Hugging Face model directory?)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); expected a JSON file") from None
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: holds {describe(doc)}; expected a JSON object")
    return doc


def _identifier(name: str) -> str:
    """A model name from a directory name: deterministic, and an identifier a spec accepts whatever
    the directory is called (leaving room for the mesh's `_mesh`)."""
    ident = re.sub(r"[^A-Za-z0-9_]", "_", name).strip("_").lower()[: MAX_NAME - len("_mesh")].rstrip("_") or "model"
    ident = "m_" + ident if ident[0].isdigit() else ident
    return ident if identifier_problem(ident) is None else ident[: MAX_NAME - len("_model_mesh")] + "_model"


def _shell_word(path: str) -> str:
    """``path`` as one shell word on one line, for a comment a user copies into a shell: quoted as
    is where every character shows, else bash's $'...' with each other byte as \\xHH (a newline in a
    directory name must not end the comment and start a line of spec)."""
    if script_value_problem(path) is None:
        return shlex.quote(path)
    return "$'" + "".join(chr(b) if 0x20 <= b < 0x7F and b not in b"\\'" else f"\\x{b:02x}"
                          for b in os.fsencode(path)) + "'"


def spec_text(directory: str, devices: int = 1, device: str = "cpu", batch: int | None = None,
              seq: int | None = None) -> str:
    """The .mesh text for the model in ``directory`` with a plan `train` on ``devices`` x ``device``."""
    return _generate(directory, devices, device, batch, seq)[0]


def _refused_by_checker(diag: Any, settings: list[tuple[str, Any, str]], first_line: int, where: str) -> ImportError_:
    """The checker's first error on the imported model, as one line naming the config.json field."""
    index = diag.span.line - first_line if diag.span is not None else -1
    label = f" ({diag.label})" if diag.label else ""
    if 0 <= index < len(settings):
        key, value, source = settings[index]
        return ImportError_(f"{where}: {source} = {value if key == 'dtype' else _num(value)}: {diag.message}{label} "
                            f"[{diag.code}]")
    # A rule between settings (heads a multiple of kv_heads): name the fields behind the names it uses.
    named = [f"{key} = {source} {_num(value)}" for key, value, source in settings
             if key != "dtype" and re.search(rf"\b{key}\b", diag.message)]
    fields = f"; from config.json: {', '.join(named)}" if named else ""
    return ImportError_(f"{where}: the model it describes does not check: {diag.message}{label} [{diag.code}]{fields}")


def _generate(directory: str, devices: int, device: str, batch: int | None, seq: int | None) -> tuple[str, bool]:
    """(the .mesh text, whether its plan fits the device's memory)."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.front.fmt import format_text
    from meshllm_dsl.parallel.devices import PROFILES
    from meshllm_dsl.planner.suggest import MESH_NAME, PLAN_NAME, candidates, plan_text, suggest

    if device not in PROFILES:
        raise ValueError(f"unknown device `{device}` (known: {', '.join(sorted(PROFILES))})")
    d = Path(directory)
    cfg_path = d / "config.json"
    cfg = read_config(d)
    family, settings, positions = model_settings(cfg, str(cfg_path))
    seq = min(2048, positions) if seq is None else seq
    batch = max(8, devices) if batch is None else batch
    # a family with learned positions has a table of `positions` rows
    if any(p.family == family and p.checkpoint.positions for p in BY_ARCHITECTURE.values()) and seq > positions:
        raise ValueError(f"--seq {seq} is longer than the {positions} positions of the model's position table "
                         f"(`n_positions` in {cfg_path})")
    dir_name = d.resolve().name
    name = _identifier(dir_name)
    arch = _architecture(_fields(cfg, str(cfg_path)))
    # The two comment lines are the only place a path reaches the spec: one shell word each, so no
    # character of a directory name can end the comment.
    header = (f"# {arch} imported from {_shell_word(dir_name)} by `meshc import-hf`.\n"
              f"# Load its weights with: meshc run THIS_FILE --weights {_shell_word(str(d))}\n")
    body = [f"    {k} = {v if k == 'dtype' else _num(v)}" for k, v, _ in settings]
    model = header + f"model {name} = {family} {{\n" + "\n".join(body) + "\n}\n"
    first_setting_line = header.count("\n") + 2
    with tempfile.TemporaryDirectory(prefix="meshc-import-") as tmp:
        path = Path(tmp) / f"{name}.mesh"
        path.write_text(model)
        base = check_text(model, str(path))
        if not base.ok:  # a value in range for its type that the checker refuses (e.g. rope_theta 1e300)
            raise _refused_by_checker(next(iter(base.errors)), settings, first_setting_line, str(cfg_path))
        result = suggest(str(path), name, devices=devices, device=PROFILES[device], batch=batch, seq=seq, top=1)
        block = result.best.text if result.best else None
        if block is None:  # nothing fits the device's memory: the first layout the checker accepts
            ir = base.models[name]
            for c in candidates(ir, devices, batch, min(devices, PROFILES[device].per_host)):
                text = plan_text(c, ir, device, batch, seq)
                if check_text(model + "\n" + text, str(path)).ok:
                    block = text
                    break
        if block is None:
            why = f": {result.rejected[0][1]}" if result.rejected else ""
            raise ImportError_(f"no plan for {devices} x {device} at batch {batch} x seq {seq} passes the checker{why} "
                               "(try other --devices, --batch or --seq)")
    block = block.replace(f"plan {PLAN_NAME} on {MESH_NAME}", f"plan train on {name}_mesh", 1)
    block = block.replace(f"mesh {MESH_NAME} ", f"mesh {name}_mesh ", 1)
    if result.best is None:
        block = "# Nothing fits the device's memory (see `meshc plan`): the first layout that checks.\n" + block
    return format_text(model + "\n" + block, str(path)), result.best is not None


def _flag(value: int | None, flag: str, maximum: int) -> None:
    from meshllm_dsl.cli.main import UsageError

    if value is not None and not 1 <= value <= maximum:
        raise UsageError(f"{flag} must be a positive integer (at most {maximum:,}), got {value}")


def _fit_warnings(text: str, out: Path, device: str) -> str:
    """W0801 for the plan written to ``out``, rendered against it (as `meshc plan` would)."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.diagnostics import render_all
    from meshllm_dsl.parallel.devices import PROFILES
    from meshllm_dsl.planner.analyze import analyze, plan_warnings

    plan = check_text(text, str(out)).plans["train"]
    return render_all([w for w in plan_warnings(analyze(plan, PROFILES[device])) if w.code == W0801])


def cmd_import_hf(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.runtime.outputs import check_new_file, write_output

    if not Path(args.dir).is_dir():
        raise UsageError(f"no such directory: {args.dir}")
    _flag(args.devices, "--devices", MAX_DEVICES)
    _flag(args.batch, "--batch", MAX_INT)
    _flag(args.seq, "--seq", MAX_INT)
    out = Path(args.output)
    check_new_file(out, ".mesh file", args.force)
    config = Path(args.dir) / "config.json"
    if out.exists() and config.exists() and os.path.samefile(out, config):
        raise UsageError(f"-o {out} is the input {config}; name a new .mesh file")
    try:
        text, fits = _generate(args.dir, args.devices, args.device, args.batch, args.seq)
    except ImportError_ as err:
        print(f"meshc: error: {err}", file=sys.stderr)
        return 1
    except ConfigError as err:
        print(f"meshc: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        raise UsageError(str(err)) from None
    write_output(out, text.encode())
    print(f"wrote {out}")
    if not fits:
        print(_fit_warnings(text, out, args.device), end="", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("import-hf", help="a .mesh spec (model + plan `train`) from a Hugging Face model directory")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("-o", "--output", required=True, metavar="FILE.mesh")
    p.add_argument("--force", action="store_true", help="replace FILE.mesh if it exists")
    p.add_argument("--devices", type=int, default=1, help="devices of the plan (default 1)")
    p.add_argument("--device", default="cpu", help="device profile (default cpu)")
    p.add_argument("--batch", type=int, help="global batch (default max(8, devices))")
    p.add_argument("--seq", type=int, help="sequence length (default min(2048, the model's positions))")
    p.set_defaults(func=cmd_import_hf)
