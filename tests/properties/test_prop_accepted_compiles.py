"""Property (c): whatever `check` accepts compiles, imports and (small plans) runs as it says.

Models here are built from primitives by a loose generator: layers in any order, widths that may or
may not chain, every primitive argument the grammar admits (norm kinds and eps, layernorm bias,
attention heads / kv_heads / rope / biases / fused qkv, mlp activations and bias, learned positions,
tied heads), plans with drawn seq / batch / microbatches, optimizer settings and ZeRO. Many draws
are rejected; the property is about the ones the checker accepts: each must render to Python that
compiles and imports, and must compute what its unsharded reference computes on the shared pool of
gloo ranks (the machinery of property (b)). The checker, not this generator, decides validity; a
draw the checker accepts and the runtime cannot run is a checker bug.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from equiv import compare, over_tolerance, write_module

from meshllm_dsl.checker import check_text
from meshllm_dsl.runtime.pool import WorkerPool

THOROUGH = settings.get_current_profile_name() == "thorough"
ACCEPTED = settings(
    max_examples=300 if THOROUGH else 40,
    deadline=None,
    derandomize=not THOROUGH,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


# Each variant is one choice, so every one is drawn about as often as the others.
_NORM_VARIANTS = ["rmsnorm({w})", "rmsnorm({w}, eps = 1e-6)", "layernorm({w})", "layernorm({w}, eps = 0.001)",
                  "layernorm({w}, bias = false)", "layernorm({w}, bias = true)", "layernorm({w}, eps = 1e-6, bias = false)"]


@st.composite
def _norm(draw: st.DrawFn, name: str, width: int) -> str:
    return f"{name} = " + draw(st.sampled_from(_NORM_VARIANTS)).format(w=width)


@st.composite
def _sublayer(draw: st.DrawFn, name: str, width: int) -> str:
    if draw(st.booleans()):
        heads = draw(st.sampled_from([1, 2, 4]))
        args = [str(width), str(heads)]
        if draw(st.booleans()):
            args.append(f"kv_heads = {draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))}")
        if draw(st.booleans()):
            args.append(f"rope_theta = {draw(st.sampled_from(['10000.0', '500000.0']))}")
        for flag in ("bias", "fused_qkv"):
            if draw(st.booleans()):
                args.append(f"{flag} = {draw(st.sampled_from(['true', 'false']))}")
        return f"{name} = attention({', '.join(args)})"
    act = draw(st.sampled_from(["swiglu", "gelu_tanh", "gelu", "relu", "silu"]))
    bias = draw(st.sampled_from(["", ", bias = true", ", bias = false"]))
    return f"{name} = mlp({width}, {draw(st.sampled_from([16, 24]))}, act = {act}{bias})"


@st.composite
def specs(draw: st.DrawFn) -> str:
    hidden, vocab = 8, 32
    # Most draws chain; in some, one layer (drawn by its position) has the wrong width.
    wrong = draw(st.sampled_from(range(61)))  # uniform: hypothesis favours small integers
    widths = iter(range(1, 100))
    width = lambda: 12 if next(widths) == wrong else hidden  # noqa: E731
    lines = [f"embed = embedding({vocab}, {width()})"]
    positions = 0
    if draw(st.booleans()):
        positions = draw(st.sampled_from([8, 16]))
        lines.append(f"pos = positional({positions}, {width()})")
    if draw(st.integers(0, 4)) != 4:
        body = []
        for k in range(draw(st.integers(1, 2))):
            body.append(draw(_norm(f"n{k}", width())))
            if draw(st.integers(0, 9)) != 9:
                body.append(draw(_sublayer(f"s{k}", width())))
        lines.append(f"blocks = repeat({draw(st.integers(1, 3))}) {{ " + "  ".join(body) + " }")
    if draw(st.booleans()):
        lines.append(draw(_norm("norm", width())))
    if draw(st.integers(0, 9)) != 9:
        tie = draw(st.booleans()) and lines[0] == f"embed = embedding({vocab}, {hidden})"
        lines.append(f"lm_head = linear({width()}, {vocab}" + (", tie = embed" if tie else "") + ")")
    if draw(st.integers(0, 11)) == 11:  # a layer in a place the chain does not allow
        lines.insert(draw(st.integers(1, len(lines))), draw(_norm("extra", width())))
    plan = []
    if draw(st.booleans()):
        plan.append(f"seq = {draw(st.sampled_from([4, 8, 16, 32]))}")
    if draw(st.booleans()):
        plan.append(f"batch = {draw(st.sampled_from([2, 4]))}")
    opt = []
    for key, values in (("lr", ["0.01", "0.001"]), ("weight_decay", ["0.0", "0.1"]), ("beta1", ["0.8", "0.9"]),
                        ("beta2", ["0.99", "0.999"]), ("eps", ["1e-8", "1e-6"])):
        if draw(st.integers(0, 3)) == 0:
            opt.append(f"{key} = {draw(st.sampled_from(values))}")
    if draw(st.booleans()):
        opt.append(f"zero {draw(st.sampled_from([0, 1]))}")
    if opt or draw(st.booleans()):
        plan.append("optimizer adamw { " + "  ".join(opt) + " }")
    data = draw(st.sampled_from([1, 2]))
    if data > 1:
        plan.append("layout { batch -> data }")
        plan.append("batch = 4") if not any(p.startswith("batch") for p in plan) else None
    return (f"mesh m {{ axes data = {data}  device = cpu }}\n"
            "model t {\n    " + "\n    ".join(lines) + "\n}\n"
            "plan p on m for t {\n    " + "\n    ".join(plan) + "\n}\n")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(world_size=2, timeout=180.0) as p:
        yield p


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accepted")


# Explicit cases, drawn or not: settings that were once accepted and then not honoured.
_LAYERNORM_NO_BIAS = """mesh m { axes data = 2  device = cpu }
model t {
    embed = embedding(32, 8)
    pos = positional(16, 8)
    blocks = repeat(2) { n0 = layernorm(8, bias = false)  s0 = attention(8, 2, bias = true)  n1 = layernorm(8, eps = 1e-6, bias = false)  s1 = mlp(8, 16, act = gelu_tanh, bias = true) }
    norm = layernorm(8, bias = false)
    lm_head = linear(8, 32, tie = embed)
}
plan p on m for t {
    seq = 16
    batch = 4
    layout { batch -> data }
    optimizer adamw { lr = 0.01  beta1 = 0.8  zero 1 }
}
"""


@ACCEPTED
@example(text=_LAYERNORM_NO_BIAS)
@given(text=specs())
def test_accepted_specs_compile_import_and_match(text: str, pool: WorkerPool, module_dir: Path) -> None:
    note(text)
    result = check_text(text, "generated.mesh")
    event("accepted" if result.ok else "rejected")
    if not result.ok:
        for d in result.errors:  # a rejection is located and helpful, never a crash
            assert d.span is not None and d.help, (d.code, d.message)
        return
    (plan,) = result.plans.values()
    path = write_module(plan, text, module_dir)
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # compiles and imports
    assert module.PROGRAM.seq == plan.seq
    bad = over_tolerance(pool.run(compare, plan.mesh.devices, path))
    assert not bad, f"sharded differs from unsharded: {bad}\n{text}"
