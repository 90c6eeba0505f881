"""Generated code: golden files, determinism, validity (compiles, ruff-clean), no injection."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.codegen.emit import render_plan

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"

# tensor only (data x tensor with a tied head), pipeline only, and 3-D data x pipeline x tensor
# (also with ZeRO-3 and mixed precision, under the V schedule ZBV, and with float8), and tensor x context with
# sequence parallelism
CASES = ["gpt2_small", "seed_pipeline_12", "tiny_llama", "tiny_gpt2", "tiny_llama_fsdp", "tiny_llama_context", "tiny_llama_zbv",
         "tiny_llama_fp8", "tiny_dense_moe"]


def _render(name: str) -> str:
    rel = f"examples/{name}.mesh"
    result = check_file(ROOT / rel)
    assert result.ok, result.diagnostics
    (plan,) = result.plans.values()
    return render_plan(plan, rel, (ROOT / rel).read_text())


@pytest.mark.parametrize("name", CASES)
def test_generated_code_matches_golden(name: str, request: pytest.FixtureRequest) -> None:
    text = _render(name)
    golden = GOLDEN / f"{name}.py.txt"
    if request.config.getoption("--update-goldens"):
        golden.write_text(text)
    assert golden.exists(), f"missing golden {golden}; run pytest --update-goldens"
    assert text == golden.read_text()


@pytest.mark.parametrize("name", CASES)
def test_generation_is_deterministic(name: str) -> None:
    assert _render(name) == _render(name)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is a test dependency (pip install .[test])")
def test_generated_code_is_ruff_clean(tmp_path: Path) -> None:
    for path in sorted((ROOT / "examples").glob("*.mesh")):
        result = check_file(path)
        for name, plan in result.plans.items():
            (tmp_path / f"{path.stem}_{name}.py").write_text(render_plan(plan, path.name, path.read_text()))
    # A moe plan without tensor parallelism calls no torch.nn.functional: it must not import it.
    moe = ("mesh m { axes data = 2 }\nmodel m = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, "
           "kv_heads = 2, ffn = 48, experts = 4, top_k = 2 }\nplan p on m for m {\n    batch = 8\n    seq = 8\n"
           "    layout { batch -> data, experts -> data }\n}\n")
    (plan,) = check_text(moe, "moe.mesh").plans.values()
    (tmp_path / "moe_data.py").write_text(render_plan(plan, "moe.mesh", moe))
    proc = subprocess.run(["ruff", "check", "--isolated", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_example_generates_valid_python() -> None:
    for path in sorted((ROOT / "examples").glob("*.mesh")):
        result = check_file(path)
        for plan in result.plans.values():
            compile(render_plan(plan, path.name, path.read_text()), path.name, "exec")


HOSTILE = """
mesh m {{ axes {axis} = 2 }}
model t {{
    hidden = 8
    {layer} = embedding(16, hidden)
    head = linear(hidden, 16)
}}
plan {plan} on m for t {{
    layout {{ batch -> {axis} }}
}}
"""


@pytest.mark.parametrize(
    ("axis", "layer", "plan", "code"),
    [
        ("data", "__import__", "p", "E0204"),
        ("data", "class", "p", "E0204"),
        ("forward", "embed", "p", "E0204"),
        ("data", "embed", "__init__", "E0204"),
        ("data", "self", "p", "E0204"),
    ],
)
def test_names_that_would_inject_code_are_rejected(axis: str, layer: str, plan: str, code: str) -> None:
    result = check_text(HOSTILE.format(axis=axis, layer=layer, plan=plan))
    assert not result.ok
    assert code in {d.code for d in result.errors}
    assert not result.plans


def test_unusual_but_valid_names_generate_code_that_compiles() -> None:
    result = check_text(HOSTILE.format(axis="Tensor_0", layer="emb0", plan="p_1"))
    assert result.ok, result.diagnostics
    compile(render_plan(result.plans["p_1"], "x.mesh", ""), "x", "exec")


def test_reserved_layer_names_cover_nn_module() -> None:
    """Every public attribute of the installed torch.nn.Module is reserved for layers (E0204)."""
    from torch import nn

    from meshllm_dsl.front.names import identifier_problem

    missing = [n for n in dir(nn.Module) if not n.startswith("_") and identifier_problem(n, attribute=True) is None]
    assert not missing, missing


def test_suggested_names_are_valid() -> None:
    from meshllm_dsl.front.names import identifier_problem, safe_variant

    for name in ("self", "params", "g_tensor", "forward", "__import__", "_modules", "x" * 300, "torch", "os"):
        for flags in ({"attribute": True}, {"module": True}, {}):
            suggestion = safe_variant(name, **flags)
            assert identifier_problem(suggestion, **flags) is None, (name, flags, suggestion)


def test_layernorm_without_bias_reaches_the_model_description() -> None:
    """`layernorm(bias = false)` is honoured end to end: the stages and the reference model agree."""
    from meshllm_dsl.codegen.lower import model_description
    from meshllm_dsl.runtime.model.reference import build_reference

    result = check_text(
        "mesh m { axes data = 1 }\n"
        "model t { hidden = 8  embed = embedding(16, hidden)  norm = layernorm(hidden, bias = false)"
        "  head = linear(hidden, 16) }\n"
        "plan p on m for t { }\n"
    )
    assert result.ok, result.diagnostics
    desc = model_description(result.plans["p"])
    norm = next(layer for layer in desc["layers"] if layer["name"] == "norm")
    assert norm["bias"] is False
    ref = build_reference(desc)
    assert "norm.bias" not in dict(ref.named_parameters())


def test_hosts_reach_the_program_only_when_declared() -> None:
    # The runtime checks that groups kept in a host are on one node; without `hosts` nothing changes.
    assert "    hosts=2,\n" in _render("llama2_70b_2x8")
    assert "hosts=" not in _render("tiny_llama")
