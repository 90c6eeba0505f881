"""`meshc import-hf DIR -o FILE.mesh`: a .mesh spec (the model and one plan) from a Hugging Face model.

Reads config.json only (no torch): the architecture picks the family (`llama` for Llama, Mistral,
Qwen2 / 3 and Phi-3, `olmo2` for OLMo 2, `gpt2` for GPT-2, ...) and every setting that changes the
maths is written out; a setting the families cannot honour is an error naming it, never a silently
different model.  The plan `train` for N devices of a kind is the one `meshc suggest` ranks first
(or, when nothing fits the device's memory, the first layout the checker accepts).  Weights then
load with `meshc run FILE --weights DIR`.
"""

from __future__ import annotations

import argparse
import json
import math
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
from meshllm_dsl.front.limits import MAX_BLOCKS, MAX_DEVICES, MAX_INT, MAX_NAME
from meshllm_dsl.front.names import identifier_problem
from meshllm_dsl.interop.import_gemma import GEMMA, gemma_settings
from meshllm_dsl.interop.import_gemma import MODEL_TYPES as GEMMA_TYPES
from meshllm_dsl.interop.import_moe import MODEL_TYPES as MOE_TYPES
from meshllm_dsl.interop.import_moe import MOE, moe_settings
from meshllm_dsl.runtime.json_values import describe

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
             "Olmo2ForCausalLM", "GPT2LMHeadModel",
             *GEMMA)
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                "gpt2": "GPT2LMHeadModel", **GEMMA_TYPES}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
# Mixture-of-experts architectures (meshllm_dsl/interop/import_moe.py).
SUPPORTED = (*SUPPORTED, *MOE)
_MODEL_TYPES.update(MOE_TYPES)


class ImportError_(Exception):
    """The directory describes a model meshllm cannot reproduce exactly (exit 1)."""


class ConfigError(Exception):
    """config.json is not a description of a model at all: unreadable, not a JSON object, a field
    missing or of the wrong type or range (an input error: exit 2)."""


# A config.json is a few KB; this bounds what a link to a device or a huge file costs to refuse.
MAX_CONFIG_BYTES = 16 * 2**20
_NO_DEFAULT: Any = object()


class _Fields:
    """Typed reads of one JSON object of config.json: each raises ConfigError naming the file, the
    field and what was expected.  ``null`` is the default, as transformers reads a config; a
    field without a default is required.  Integers are JSON integers (64.0 is refused: transformers
    keeps it a float, and torch refuses a float size), booleans JSON booleans (never the string
    "false", which is truthy), numbers finite."""

    def __init__(self, doc: dict[str, Any], where: str, prefix: str = "") -> None:
        self.doc, self.where, self.prefix = doc, where, prefix

    def error(self, field: str, expected: str) -> ConfigError:
        if self.doc.get(field) is None:
            return ConfigError(f"{self.where}: no `{self.prefix}{field}`; expected {expected}")
        return ConfigError(f"{self.where}: `{self.prefix}{field}` is {describe(self.doc[field])}; expected {expected}")

    def _get(self, field: str, default: Any, expected: str) -> Any:
        value = self.doc.get(field)
        if value is None and default is _NO_DEFAULT:
            raise self.error(field, expected)
        return value

    def int(self, field: str, default: Any = _NO_DEFAULT, maximum: int = MAX_INT) -> Any:
        expected = f"a positive integer (at most {maximum:,})"
        value = self._get(field, default, expected)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
            raise self.error(field, expected)
        return value

    def number(self, field: str, default: Any = _NO_DEFAULT) -> Any:
        value = self._get(field, default, "a positive number")
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise self.error(field, "a positive number")
        return float(value)

    def flag(self, field: str, default: bool) -> bool:
        value = self.doc.get(field)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, "true or false")
        return value

    def text(self, field: str, default: Any = _NO_DEFAULT, expected: str = "a string") -> Any:
        value = self._get(field, default, expected)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(field, expected)
        return value

    def obj(self, field: str) -> _Fields | None:
        value = self.doc.get(field)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(field, "an object (or null)")
        return _Fields(value, self.where, f"{self.prefix}{field}.")

    def off(self, field: str, why: str) -> None:
        """A number that must be absent, null or 0: anything else changes the maths (exit 1)."""
        value = self.doc.get(field)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(field, "a number (or null)")
        if value:
            raise ImportError_(f"{self.where}: `{self.prefix}{field}` = {value!r} {why}")


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


def _architecture(f: _Fields) -> str:
    archs = f.doc.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise f.error("architectures", 'a list of class names such as ["LlamaForCausalLM"]')
    model_type = f.text("model_type", None)
    arch = archs[0] if archs else _MODEL_TYPES.get(model_type or "")
    if arch not in SUPPORTED:
        shown = arch if arch is not None else model_type
        raise ImportError_(f"{f.where}: architecture {shown!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return arch


def _dtype(f: _Fields) -> str:
    field = "torch_dtype" if f.doc.get("torch_dtype") is not None else "dtype"
    name = f.text(field, "float32")
    if name not in _DTYPES:
        raise ImportError_(f"{f.where}: `{field}` = {name!r} is not a dtype meshllm computes in; "
                           f"expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


# Keys of a rope object whose value changes the maths and that the llama family has no setting for.
_ROPE_UNSUPPORTED = ("partial_rotary_factor",)


def _rope(f: _Fields) -> tuple[float, _Fields | None]:
    """(rope_theta, the scaling object or None when rope is unscaled)."""
    theta = f.number("rope_theta", 10000.0)
    params = f.obj("rope_parameters")  # transformers >= 5 writes this; older configs rope_scaling
    rope = params if params is not None else f.obj("rope_scaling")
    if rope is None:
        return theta, None
    nested = next((k for k, v in rope.doc.items() if isinstance(v, dict)), None)
    if nested is not None:  # one rope per layer type (e.g. {"full_attention": {...}})
        raise ImportError_(f"{f.where}: `{rope.prefix}{nested}` is a rope per layer type; the llama family "
                           "has one rope for every layer")
    if params is not None:
        theta = params.number("rope_theta", theta)
    kind = rope.text("rope_type", None) or rope.text("type", "default")
    return theta, (None if kind == "default" else rope)


_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


def _factors(scaling: _Fields, field: str, rotary: int) -> tuple[float, ...]:
    """longrope's `short_factor` / `long_factor`: a list of `rotary` / 2 positive numbers."""
    value, where = scaling.doc.get(field), f"`{scaling.prefix}{field}`"
    if not isinstance(value, list):
        raise scaling.error(field, f"a list of {rotary // 2} positive numbers (head_dim / 2)")
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0):
            raise ConfigError(f"{scaling.where}: {where} item {i} is {describe(x)}; expected a positive number")
    if len(value) != rotary // 2:
        raise ConfigError(f"{scaling.where}: {where} has {len(value)} numbers; expected {rotary // 2} "
                          f"(head_dim {rotary} / 2, one per rotary frequency)")
    return tuple(float(x) for x in value)


def _longrope_settings(f: _Fields, scaling: _Fields, positions: int, head_dim: int) -> list[tuple[str, Any, str]]:
    """Phi-3's longrope as transformers reads it (_compute_longrope_parameters after
    standardize_rope_params): the trained length from a top-level original_max_position_embeddings
    first (Phi3Config's own default is 4096), the factor `max_position_embeddings / original` where
    the rope object gives none."""
    where, p = f.where, scaling.prefix
    outer = f.int("original_max_position_embeddings", None)
    inner = scaling.int("original_max_position_embeddings", None)
    if outer is not None and inner is not None and outer != inner:
        raise ImportError_(f"{where}: `original_max_position_embeddings` {outer} and `{p}original_max_position_"
                           f"embeddings` {inner} disagree; transformers would use {outer}")
    phi3 = _architecture(f) == "Phi3ForCausalLM"
    original = outer or (4096 if phi3 else inner or positions)
    origin = ("`original_max_position_embeddings`" if outer else "Phi3Config's default" if phi3
              else f"`{p}original_max_position_embeddings`" if inner else "`max_position_embeddings`")
    factor = scaling.number("factor", None)
    settings: list[tuple[str, Any, str]] = [
        ("rope_type", "longrope", f"`{p}type`" if scaling.doc.get("rope_type") is None else f"`{p}rope_type`"),
        ("rope_factor", factor if factor is not None else positions / original,
         f"`{p}factor`" if factor is not None else "`max_position_embeddings` / `original_max_position_embeddings`"),
        ("rope_original_positions", original, origin),
    ]
    attention = scaling.number("attention_factor", None)
    if attention is not None:
        settings.append(("rope_attention_factor", attention, f"`{p}attention_factor`"))
    return settings + [("rope_short_factor", _factors(scaling, "short_factor", head_dim), f"`{p}short_factor`"),
                       ("rope_long_factor", _factors(scaling, "long_factor", head_dim), f"`{p}long_factor`")]


def _rope_settings(f: _Fields, scaling: _Fields, positions: int, head_dim: int) -> list[tuple[str, Any, str]]:
    """The llama family's rope settings for a rope scaling object, as transformers reads it
    (modeling_rope_utils: the fields each type's initialiser takes and their defaults)."""
    where, p = f.where, scaling.prefix
    kind = scaling.text("rope_type", None) or scaling.text("type")
    if _architecture(f) == "Phi3ForCausalLM":
        if kind in ("su", "yarn"):  # Phi3Config reads its older names as longrope
            kind = "longrope"
        elif kind != "longrope":  # Phi3Config raises for any other type
            raise ImportError_(f"{where}: `{p}rope_type` = {kind!r}; Phi-3's config takes longrope only")
    if kind not in _ROPE_TYPES:
        raise ImportError_(f"{where}: rope scaling type {kind!r} is not supported ({', '.join(map(repr, _ROPE_TYPES))})")
    if kind == "longrope":
        return _longrope_settings(f, scaling, positions, head_dim)
    settings: list[tuple[str, Any, str]] = [("rope_type", kind, f"`{p}rope_type`"),
                                            ("rope_factor", scaling.number("factor"), f"`{p}factor`")]
    if kind == "dynamic":  # NTK scales from the config's max_position_embeddings
        return settings + [("rope_original_positions", positions, "`max_position_embeddings`")]
    if kind == "linear":
        return settings
    # transformers prefers a top-level original_max_position_embeddings to the rope object's
    outer = f.int("original_max_position_embeddings", None)
    inner = scaling.int("original_max_position_embeddings", None if kind == "yarn" else _NO_DEFAULT)
    if outer is not None and inner is not None and outer != inner:
        raise ImportError_(f"{where}: `original_max_position_embeddings` {outer} and `{p}original_max_position_"
                           f"embeddings` {inner} disagree; transformers would use {outer}")
    if kind == "llama3":
        return settings + [
            ("rope_low_freq_factor", scaling.number("low_freq_factor", 1.0), f"`{p}low_freq_factor`"),
            ("rope_high_freq_factor", scaling.number("high_freq_factor", 4.0), f"`{p}high_freq_factor`"),
            ("rope_original_positions", inner, f"`{p}original_max_position_embeddings`")]
    for field in ("mscale", "mscale_all_dim"):  # DeepSeek's variant of yarn's attention factor
        scaling.off(field, "changes yarn's attention factor (not supported)")
    original = outer or inner
    settings.append(("rope_original_positions", original or positions,
                     f"`{p}original_max_position_embeddings`" if original else "`max_position_embeddings`"))
    attention = scaling.number("attention_factor", None)
    if attention is not None:
        settings.append(("rope_attention_factor", attention, f"`{p}attention_factor`"))
    # transformers: `beta_fast or 32`, `beta_slow or 1` (0 is the default too)
    for key, field in (("rope_beta_fast", "beta_fast"), ("rope_beta_slow", "beta_slow")):
        if scaling.doc.get(field) not in (None, 0):
            settings.append((key, scaling.number(field), f"`{p}{field}`"))
    if not scaling.flag("truncate", True):
        settings.append(("rope_truncate", False, f"`{p}truncate`"))
    return settings


def model_settings(cfg: dict[str, Any], where: str) -> tuple[str, list[tuple[str, Any, str]], int]:
    """(family, [(setting, value, the config.json fields it comes from)], positions) for a config.json
    object; positions: the context it was trained for (the default sequence length).

    Raises ConfigError for a field of the wrong type or range, ImportError_ for a well-formed
    setting the families cannot honour; either names the field."""
    f = _Fields(cfg, where)
    if cfg.get("quantization_config"):
        raise ImportError_(f"{where}: `quantization_config` is set; meshllm loads unquantized weights only")
    arch = _architecture(f)
    dtype = _dtype(f)

    def refuse(field: str, why: str) -> ImportError_:
        return ImportError_(f"{where}: `{field}` = {cfg.get(field)!r} {why}")

    if arch in GEMMA:
        return gemma_settings(f, arch, dtype)
    if arch in MOE:
        return moe_settings(cfg, where, arch)
    if arch == "GPT2LMHeadModel":
        act = f.text("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise refuse("activation_function", "is not the tanh GELU the gpt2 family uses")
        if f.flag("scale_attn_by_inverse_layer_idx", False):
            raise refuse("scale_attn_by_inverse_layer_idx", "changes the attention maths (not supported)")
        if not f.flag("scale_attn_weights", True):
            raise refuse("scale_attn_weights", "changes the attention maths (not supported)")
        if f.flag("add_cross_attention", False):
            raise refuse("add_cross_attention", "adds cross-attention layers (not supported)")
        hidden = f.int("n_embd")
        positions = f.int("n_positions")
        return "gpt2", [
            ("vocab", f.int("vocab_size"), "`vocab_size`"), ("hidden", hidden, "`n_embd`"),
            ("layers", f.int("n_layer", maximum=MAX_BLOCKS), "`n_layer`"), ("heads", f.int("n_head"), "`n_head`"),
            ("ffn", f.int("n_inner", 4 * hidden), "`n_inner` (or 4 x `n_embd`)"),
            ("positions", positions, "`n_positions`"),
            ("norm_eps", f.number("layer_norm_epsilon", 1e-5), "`layer_norm_epsilon`"),
            ("tie_embeddings", f.flag("tie_word_embeddings", True), "`tie_word_embeddings`"),
            ("dtype", dtype, "`torch_dtype`"),
        ], positions
    olmo2 = arch == "Olmo2ForCausalLM"
    family = "olmo2" if olmo2 else "llama"
    if f.text("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", f"is not the SiLU of SwiGLU that the {family} family uses")
    if not olmo2 and f.flag("mlp_bias", False):  # Olmo2MLP has no bias whatever the config says
        raise refuse("mlp_bias", "adds MLP biases the llama family does not have")
    positions = f.int("max_position_embeddings", _DEFAULT_POSITIONS[arch])
    window = f.int("sliding_window", None)
    # Mistral and Phi-3 attend within sliding_window whenever it is set (a window no shorter than
    # the positions changes nothing, and is left out).
    window = window if arch in ("MistralForCausalLM", "Phi3ForCausalLM") and window is not None and window < positions else None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and f.flag("use_sliding_window", False):
        raise refuse("use_sliding_window", "limits attention to a window; meshllm computes full causal attention")
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "logits_scaling"):
        f.off(field, "changes the logits (not supported)")
    layer_types = cfg.get("layer_types")  # transformers >= 5: which layers attend to a window
    if layer_types is not None:
        if not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
            raise f.error("layer_types", 'a list of attention types such as ["full_attention", ...]')
        other = next((t for t in layer_types if t != "full_attention"), None)
        if other is not None:
            raise ImportError_(f"{where}: `layer_types` holds {other!r}; meshllm computes full causal attention "
                               "in every layer")
    theta, scaling = _rope(f)
    for rope in (f, scaling):
        for field in _ROPE_UNSUPPORTED:
            if rope is not None and rope.doc.get(field) is not None and rope.number(field) != 1.0:
                raise ImportError_(f"{where}: `{rope.prefix}{field}` = {rope.doc[field]!r} rotates only part of "
                                   "each head (not supported)")
    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    head_dim = f.int("head_dim", None)
    if head_dim is None and hidden < heads:  # transformers' default hidden // heads would be 0
        raise ConfigError(f"{where}: `hidden_size` {hidden} is smaller than `num_attention_heads` {heads} "
                          "and there is no `head_dim`; expected hidden_size >= num_attention_heads")
    settings = [
        ("vocab", f.int("vocab_size"), "`vocab_size`"), ("hidden", hidden, "`hidden_size`"),
        ("layers", f.int("num_hidden_layers", maximum=MAX_BLOCKS), "`num_hidden_layers`"),
        ("heads", heads, "`num_attention_heads`"),
        ("kv_heads", f.int("num_key_value_heads", heads), "`num_key_value_heads`"),
        # transformers' own default when head_dim is absent: floor division
        ("head_dim", head_dim or hidden // heads, "`head_dim`" if head_dim else "`hidden_size` // `num_attention_heads`"),
        ("ffn", f.int("intermediate_size"), "`intermediate_size`"),
        # transformers' defaults: Olmo2Config's eps is 1e-5, the others' 1e-6
        ("norm_eps", f.number("rms_norm_eps", 1e-5 if olmo2 else 1e-6), "`rms_norm_eps`"),
        ("rope_theta", theta, "`rope_theta`"),
    ]
    if scaling is not None:
        settings += _rope_settings(f, scaling, positions, head_dim or hidden // heads)
    if arch == "Qwen2ForCausalLM":
        settings += [("attn_bias", True, "the architecture"), ("attn_out_bias", False, "the architecture")]
    elif f.flag("attention_bias", False):
        settings += [("attn_bias", True, "`attention_bias`")]
    if arch == "Qwen3ForCausalLM":  # q and k normalised per head, with rms_norm_eps
        settings += [("qk_norm", "head", "the architecture")]
    if window is not None:
        settings += [("window", window, "`sliding_window`")]
    settings += [("tie_embeddings", f.flag("tie_word_embeddings", False), "`tie_word_embeddings`"),
                 ("dtype", dtype, "`torch_dtype`")]
    # OLMo 2 is Llama's config with norms after the sublayers and q / k normalised over the whole
    # projection: both are the olmo2 family's block itself, so no setting says them.
    return family, settings, positions


# transformers' defaults for max_position_embeddings where a config leaves it out.
_DEFAULT_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32, "Qwen2ForCausalLM": 32768,
                      "Qwen3ForCausalLM": 32768, "Phi3ForCausalLM": 4096, "Olmo2ForCausalLM": 2048}


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
    if family == "gpt2" and seq > positions:
        raise ValueError(f"--seq {seq} is longer than the {positions} positions of the model's position table "
                         f"(`n_positions` in {cfg_path})")
    dir_name = d.resolve().name
    name = _identifier(dir_name)
    arch = _architecture(_Fields(cfg, str(cfg_path)))
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
