"""Float8 training of linear layers with torchao (`precision { matmul = R }` in a plan).

The checker decides which layers convert (meshllm_dsl/checker/matmul.py: the plan's Float8Plan);
the generated module passes that as ``Program.float8`` (full leaf path -> recipe) and this module
converts exactly those, as torchtitan's Float8 converter does:

- ``fp8_tensorwise`` / ``fp8_rowwise``: ``convert_to_float8_training`` with
  ``Float8LinearConfig.from_recipe_name("tensorwise" | "rowwise")``: each ``nn.Linear`` becomes a
  ``Float8Linear``, whose forward, input-gradient and weight-gradient matmuls cast their operands to
  float8 with dynamic scales. ``all_gather = fp8`` sets ``enable_fsdp_float8_all_gather``: FSDP2
  then all-gathers the tensorwise weights in float8, with scales ``precompute_scales`` computes once
  after each optimizer step (torchao's ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce
  of every weight's amax instead of one per layer per gather).
- ``mxfp8``: ``quantize_`` with ``MXFP8TrainingOpConfig`` (recipe ``mxfp8_rceil``): the weight
  becomes a tensor subclass whose linear ops run in MXFP8 (32-element blocks, power-of-two scales).

Without CUDA the same recipes run emulated (torchao's ``emulate=True``, ``mxfp8_emulated_rceil``):
float8 rounding, matmuls in the high-precision dtype, which is what the CPU tests prove.

torchao is an optional dependency (``pip install -e ".[fp8]"``), imported only by plans that use it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

# torchao versions this module is written against (the APIs named above); another one is refused
# with a line naming these, rather than failing somewhere inside a converted layer.
KNOWN_TORCHAO = ("0.18",)


class Float8Unavailable(RuntimeError):
    """torchao is missing or of a version this runtime does not know."""


def torchao_version() -> str:
    """The installed torchao's version, imported quietly; Float8Unavailable when it is missing or
    not one of KNOWN_TORCHAO."""
    # torchao logs a warning per CUDA kernel library it cannot load (all of them on a CPU build),
    # and registers enums with torch's pytree, which torch 2.13 warns is no longer needed: the
    # recipes run emulated there, so neither says anything a user can act on.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao
        import torchao.float8  # noqa: F401 - the registrations happen on import
        import torchao.prototype.moe_training.config  # noqa: F401 - the MXFP8 recipe's
    except ImportError as e:
        raise Float8Unavailable(
            'this plan trains in float8 (`precision { matmul = ... }`), which needs torchao: '
            'pip install -e ".[fp8]" (or pip install torchao==0.18.*)') from e
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    version = str(getattr(torchao, "__version__", "unknown"))
    if not any(version == v or version.startswith(v + ".") for v in KNOWN_TORCHAO):
        raise Float8Unavailable(f"torchao {version} is not one this runtime knows: it runs float8 with torchao "
                                f"{' or '.join(KNOWN_TORCHAO)}; pip install torchao==0.18.*")
    return version


def convert(module: nn.Module, layers: Mapping[str, str], gather: bool, emulate: bool) -> list[str]:
    """Convert the linear layers of ``module`` named in ``layers`` (module path -> recipe, one of
    meshllm_dsl.ir.MATMULS) in place; the converted paths, in module order.

    Parameters a layer holds beyond weight and bias (attention's q / k norm scales on the projection)
    are carried over: torchao's swap builds a new module from weight and bias only."""
    if not layers:
        return []
    torchao_version()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    modules = dict(module.named_modules())
    missing = sorted(p for p in layers if not isinstance(modules.get(p), nn.Linear))
    if missing:
        raise ValueError(f"float8: no nn.Linear at {', '.join(missing)} (the plan and the generated module disagree)")
    extras = {p: [(n, t) for n, t in modules[p].named_parameters(recurse=False) if n not in ("weight", "bias")]
              for p in layers}
    for recipe in dict.fromkeys(layers.values()):
        chosen = {p for p, r in layers.items() if r == recipe}
        if recipe == "mxfp8":
            from torchao.prototype.moe_training.config import (
                MXFP8TrainingOpConfig,
                MXFP8TrainingRecipe,
            )
            from torchao.quantization import quantize_

            name = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if emulate else MXFP8TrainingRecipe.MXFP8_RCEIL
            quantize_(module, MXFP8TrainingOpConfig.from_recipe(name), filter_fn=lambda _m, fqn, chosen=chosen: fqn in chosen)
            continue
        config = Float8LinearConfig.from_recipe_name(recipe.removeprefix("fp8_"))
        config = dataclasses.replace(config, emulate=emulate,
                                     enable_fsdp_float8_all_gather=gather and recipe == "fp8_tensorwise")
        convert_to_float8_training(module, config=config, module_filter_fn=lambda _m, fqn, chosen=chosen: fqn in chosen)
    converted = dict(module.named_modules())
    for path, params in extras.items():
        for name, t in params:
            if not hasattr(converted[path], name):
                converted[path].register_parameter(name, t)
    return [p for p in converted if p in layers]


def precompute_scales(modules: Iterable[nn.Module]) -> None:
    """After an optimizer step: every float8-gathered weight's scale at once (one all-reduce of the
    amaxes per module) for the next step's FSDP2 all-gathers."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for m in modules:
        precompute_float8_dynamic_scale_for_fsdp(m)


def describe(module: nn.Module) -> dict[str, Any]:
    """What was converted, for the run's summary: layer count per recipe."""
    out: dict[str, int] = {}
    for m in module.modules():
        kind = type(m).__name__
        if kind == "Float8Linear":
            out[kind] = out.get(kind, 0) + 1
        elif isinstance(m, nn.Linear) and type(m.weight).__name__.startswith("MXFP8"):
            out["MXFP8Linear"] = out.get("MXFP8Linear", 0) + 1
    return out
