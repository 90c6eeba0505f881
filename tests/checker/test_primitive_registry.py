"""The layer-kind registry (meshllm_dsl/primitives): complete at import, the one place lowering
dispatches on a kind, and in step with the runtime's own table (runtime/ never imports the compiler)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

import attrs
import pytest
import torch

from meshllm_dsl import primitives
from meshllm_dsl.checker import check_file
from meshllm_dsl.codegen.lower import model_description
from meshllm_dsl.ir import Unit
from meshllm_dsl.primitives import REGISTRY, Primitive, UnitKind, _registry
from meshllm_dsl.runtime.hf import weights as hf
from meshllm_dsl.runtime.model import reference

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_registry_holds_exactly_the_declared_kinds() -> None:
    assert set(REGISTRY) == set(get_args(UnitKind))
    assert all(REGISTRY[k].kind == k for k in REGISTRY)


def test_registry_refuses_a_missing_or_doubled_record() -> None:
    records = tuple(REGISTRY.values())
    with pytest.raises(ValueError, match=r"no record for \['mlp'\]"):
        _registry(tuple(r for r in records if r.kind != "mlp"))
    with pytest.raises(ValueError, match=r"named twice \['linear'\]"):
        _registry((*records, REGISTRY["linear"]))


def test_registry_refuses_a_record_that_leaves_a_part_to_the_default() -> None:
    @attrs.frozen
    class Bare(Primitive):  # a kind that would fall through: it says nothing of its costs, flow, ...
        def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
            return {}

    records = tuple(r for r in REGISTRY.values() if r.kind != "mlp")
    with pytest.raises(ValueError, match=r"records without their own \{'mlp': \['build', 'flow', 'saved_bytes', "
                                         r"'backward_bytes', 'kernels', 'work', 'core_lines'\]\}"):
        _registry((*records, Bare("mlp", sublayer=True)))


def test_runtime_reference_builds_exactly_the_registry_kinds() -> None:
    assert reference.LAYER_KINDS == set(REGISTRY)
    # Norms and sublayers are what a block body alternates; the runtime's split agrees.
    assert set(reference._SUBLAYERS) == {k for k, p in REGISTRY.items() if p.sublayer}
    assert set(reference._NORMS) == {k for k, p in REGISTRY.items() if p.norm}


# Kinds no family pack stores yet: a model using one is refused by the weights adapter, by name.
# mla's checkpoint layout comes with the DeepSeek-V3 pack (issue 38), which needs dense-first blocks.
NO_CHECKPOINT_LAYOUT: set[str] = set()


def test_hugging_face_adapters_hold_every_registry_kind() -> None:
    # A kind no family's checkpoint layout names could not be loaded from or exported to HF.
    assert hf.ADAPTER_KINDS == set(REGISTRY) - NO_CHECKPOINT_LAYOUT
    # mla's layout is DeepSeek-V3's, whose config.json holds dense blocks followed by moe blocks only
    assert hf.model_arch(_description("tiny_mla.mesh")) == "deepseek_v3"
    with pytest.raises(hf.WeightsError, match=r"DeepseekV3ForCausalLM has dense blocks then mixture-of-experts blocks"):
        hf.hf_config(_description("tiny_mla.mesh"), torch.float32)


def _description(example: str) -> dict[str, Any]:
    result = check_file(EXAMPLES / example)
    return copy.deepcopy(model_description(next(iter(result.plans.values()))))


def test_the_adapter_is_chosen_by_the_models_layers_and_a_misfit_is_named() -> None:
    assert hf.model_arch(_description("tiny_llama.mesh")) == "llama"
    assert hf.model_arch(_description("tiny_gpt2.mesh")) == "gpt2"
    gelu_llama = _description("tiny_llama.mesh")
    block = next(x for x in gelu_llama["layers"] if x["kind"] == "repeat")["body"]
    block[3]["act"] = "gelu"
    with pytest.raises(hf.WeightsError, match=r"mixes conventions \(attention, positions False, fused qkv False, rmsnorm attn_pre/mlp_pre with offset 0.0, gelu\)"):
        hf.model_arch(gelu_llama)
    block[1], block[3] = block[3], block[1]
    with pytest.raises(hf.WeightsError, match="is rmsnorm, mlp, rmsnorm, attention; Hugging Face layouts need norm"):
        hf.model_arch(gelu_llama)
    headless = _description("tiny_gpt2.mesh")
    headless["layers"].pop()
    with pytest.raises(hf.WeightsError, match=r"\(embedding, positional, repeat, layernorm\) has no Hugging Face layout"):
        hf.model_arch(headless)


def test_an_unregistered_kind_is_refused_by_name_not_lowered_as_another() -> None:
    # Lowering once sent every block sublayer that was not attention down the mlp's code.
    with pytest.raises(KeyError, match="'mamba' has no record in meshllm_dsl/primitives"):
        primitives.of(Unit("mixer", "mamba", (), ()))  # type: ignore[arg-type]


def test_every_kind_of_the_examples_reaches_the_reference_model() -> None:
    """The MODEL description codegen writes (each kind's `describe`) is what the runtime builds the
    unsharded model from: every kind of the registry appears in an example and builds there."""
    seen: set[str] = set()
    for path in sorted(EXAMPLES.glob("*.mesh")):
        result = check_file(path)
        for plan in list(result.plans.values())[:1]:
            desc = model_description(plan)
            with torch.device("meta"):  # the examples' real sizes: shapes only, no memory
                reference.ReferenceModel(desc)
            for layer in desc["layers"]:
                for x in layer.get("body", [layer]):
                    seen.add(x["kind"])
    assert seen - {"repeat"} == set(REGISTRY)
