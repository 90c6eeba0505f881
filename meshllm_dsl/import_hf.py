"""`meshc import-hf DIR -o FILE.mesh`: a .mesh spec (the model and one plan) from a Hugging Face model.

Reads config.json only (no torch): the architecture picks the family (`llama` for Llama, Mistral and
Qwen2, `gpt2` for GPT-2) and every setting that changes the maths is written out; a setting the
families cannot honour is an error naming it, never a silently different model.  The plan `train`
for N devices of a kind is the one `meshc suggest` ranks first (or, when nothing fits the device's
memory, the first layout the checker accepts).  Weights then load with `meshc run FILE --weights DIR`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "gpt2": "GPT2LMHeadModel"}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


class ImportError_(Exception):
    """The directory describes a model meshllm cannot reproduce exactly (exit 1)."""


def _num(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    text = repr(float(x))
    return text if ("." in text or "e" in text) else text + ".0"


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = None if params.get("rope_type", params.get("type", "default")) == "default" else dict(params)
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    return float(theta), scaling


def model_settings(cfg: dict[str, Any], where: str) -> tuple[str, list[tuple[str, Any]]]:
    """(family, settings) for a config.json; raises ImportError_ naming what cannot be honoured."""
    if cfg.get("quantization_config"):
        raise ImportError_(f"{where}: `quantization_config` is set; meshllm loads unquantized weights only")
    archs = cfg.get("architectures") or ([_MODEL_TYPES[cfg["model_type"]]] if cfg.get("model_type") in _MODEL_TYPES else [])
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise ImportError_(f"{where}: architecture {arch or cfg.get('model_type')!r} is not supported; "
                           f"supported: {', '.join(SUPPORTED)}")
    dtype = _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), "fp32")

    def refuse(field: str, why: str) -> ImportError_:
        return ImportError_(f"{where}: `{field}` = {cfg.get(field)!r} {why}")

    if arch == "GPT2LMHeadModel":
        act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}.get(cfg.get("activation_function", "gelu_new"))
        if act is None:
            raise refuse("activation_function", "is not the tanh GELU the gpt2 family uses")
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise refuse("scale_attn_by_inverse_layer_idx", "changes the attention maths (not supported)")
        if cfg.get("scale_attn_weights", True) is not True:
            raise refuse("scale_attn_weights", "changes the attention maths (not supported)")
        hidden = int(cfg["n_embd"])
        settings: list[tuple[str, Any]] = [
            ("vocab", int(cfg["vocab_size"])), ("hidden", hidden), ("layers", int(cfg["n_layer"])),
            ("heads", int(cfg["n_head"])), ("ffn", int(cfg.get("n_inner") or 4 * hidden)),
            ("positions", int(cfg["n_positions"])), ("norm_eps", float(cfg.get("layer_norm_epsilon", 1e-5))),
            ("tie_embeddings", bool(cfg.get("tie_word_embeddings", True))), ("dtype", dtype),
        ]
        return "gpt2", settings
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "is not the SiLU of SwiGLU that the llama family uses")
    if cfg.get("mlp_bias"):
        raise refuse("mlp_bias", "adds MLP biases the llama family does not have")
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM" and window is not None and window < cfg.get("max_position_embeddings", 0):
        raise refuse("sliding_window", "limits attention to a window shorter than max_position_embeddings; "
                     "meshllm computes full causal attention")
    if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        raise refuse("use_sliding_window", "limits attention to a window; meshllm computes full causal attention")
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "logits_scaling"):
        if cfg.get(field):
            raise refuse(field, "changes the logits (not supported)")
    theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    settings = [
        ("vocab", int(cfg["vocab_size"])), ("hidden", hidden), ("layers", int(cfg["num_hidden_layers"])),
        ("heads", heads), ("kv_heads", int(cfg.get("num_key_value_heads") or heads)),
        ("head_dim", int(cfg.get("head_dim") or hidden // heads)), ("ffn", int(cfg["intermediate_size"])),
        ("norm_eps", float(cfg.get("rms_norm_eps", 1e-6))), ("rope_theta", theta),
    ]
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ImportError_(f"{where}: rope scaling type {kind!r} is not supported (only 'llama3')")
        settings += [("rope_factor", float(scaling["factor"])),
                     ("rope_low_freq_factor", float(scaling.get("low_freq_factor", 1.0))),
                     ("rope_high_freq_factor", float(scaling.get("high_freq_factor", 4.0))),
                     ("rope_original_positions", int(scaling["original_max_position_embeddings"]))]
    if arch == "Qwen2ForCausalLM":
        settings += [("attn_bias", True), ("attn_out_bias", False)]
    elif cfg.get("attention_bias"):
        settings += [("attn_bias", True)]
    settings += [("tie_embeddings", bool(cfg.get("tie_word_embeddings", False))), ("dtype", dtype)]
    return "llama", settings


def _identifier(name: str) -> str:
    ident = re.sub(r"[^A-Za-z0-9_]", "_", name).strip("_").lower() or "model"
    return "m_" + ident if ident[0].isdigit() else ident


def spec_text(directory: str, devices: int = 1, device: str = "cpu", batch: int | None = None,
              seq: int | None = None) -> str:
    """The .mesh text for the model in ``directory`` with a plan `train` on ``devices`` x ``device``."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.devices import PROFILES
    from meshllm_dsl.fmt import format_text
    from meshllm_dsl.planner_suggest import MESH_NAME, PLAN_NAME, candidates, plan_text, suggest

    d = Path(directory)
    cfg_path = d / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ImportError_(f"{cfg_path}: no such file (is {d} a Hugging Face model directory?)") from None
    except ValueError as err:
        raise ImportError_(f"{cfg_path}: not JSON ({err})") from None
    family, settings = model_settings(cfg, str(cfg_path))
    if device not in PROFILES:
        raise ValueError(f"unknown device `{device}` (known: {', '.join(sorted(PROFILES))})")
    name = _identifier(d.resolve().name)
    arch = (cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "?")])[0]
    body = "\n".join(f"    {k} = {v if k == 'dtype' else _num(v)}" for k, v in settings)
    model = (f"# {arch} imported from {d.resolve().name} by `meshc import-hf`.\n"
             f"# Load its weights with: meshc run THIS_FILE --weights {d}\n"
             f"model {name} = {family} {{\n{body}\n}}\n")
    positions = int(cfg.get("n_positions") or cfg.get("max_position_embeddings") or 2048)
    seq = seq or min(2048, positions)
    batch = batch or max(8, devices)
    with tempfile.TemporaryDirectory(prefix="meshc-import-") as tmp:
        path = Path(tmp) / f"{name}.mesh"
        path.write_text(model)
        base = check_text(model, str(path))
        if not base.ok:  # pragma: no cover - the settings above always check
            raise ImportError_("the imported model does not check:\n" + "\n".join(e.message for e in base.errors))
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
            raise ImportError_(f"no plan for {devices} x {device} passes the checker (try another --devices)")
    block = block.replace(f"plan {PLAN_NAME} on {MESH_NAME}", f"plan train on {name}_mesh")
    block = block.replace(f"mesh {MESH_NAME} ", f"mesh {name}_mesh ")
    if result.best is None:
        block = "# Nothing fits the device's memory (see `meshc plan`): the first layout that checks.\n" + block
    text = model + "\n" + block
    return format_text(text, str(path))


def cmd_import_hf(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli import UsageError
    from meshllm_dsl.outputs import check_new_file, write_output

    if not Path(args.dir).is_dir():
        raise UsageError(f"no such directory: {args.dir}")
    if args.devices < 1:
        raise UsageError("--devices must be positive")
    out = Path(args.output)
    check_new_file(out, ".mesh file", args.force)
    try:
        text = spec_text(args.dir, args.devices, args.device, args.batch, args.seq)
    except ImportError_ as err:
        print(f"meshc: error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        raise UsageError(str(err)) from None
    write_output(out, text.encode())
    print(f"wrote {out}")
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
