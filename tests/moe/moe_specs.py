"""The tiny moe models and the plan text the tests/moe modules build their specs from, and the
compiled module of a spec (one copy for every module that runs or reads a moe plan)."""

from __future__ import annotations

from pathlib import Path

from meshllm_dsl.checker import check_text
from meshllm_dsl.codegen.emit import render_plan

MODELS = {
    "mixtral": "model m = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 48,"
               " experts = 4, top_k = 2, dtype = fp32 }",
    "qwen2_moe": "model m = qwen2_moe { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 24,"
                 " shared_ffn = 40, experts = 6, top_k = 3, dtype = fp32 }",
    "qwen3_moe": "model m = qwen3_moe { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 24,"
                 " experts = 4, top_k = 2, dtype = fp32 }",
}
# Tensor parallelism everywhere it applies (the shared expert's rule only where the model has one).
TP = "heads -> tensor, kv_heads -> tensor, ffn -> tensor, shared_ffn -> tensor, vocab -> tensor"


def layout_lines(model: str, layout: str, replicate_routers: bool) -> str:
    """The plan's `layout` line for `model`, and with `replicate_routers` the rule that keeps its
    routers whole (a `-> tensor` layout would otherwise split them; the checker refuses that)."""
    if model != "qwen2_moe":
        layout = layout.replace("shared_ffn -> tensor, ", "")
    lines = f"    layout {{ {layout} }}\n"
    if replicate_routers:
        routers = "blocks.*.mlp.{router,shared_router}" if model == "qwen2_moe" else "blocks.*.mlp.router"
        lines += f"    shard {routers} replicate\n"
    return lines


def plan_spec(axes: str, model_decl: str, body: str, batch: int) -> str:
    """A spec of one mesh `m` (`axes`), the model `model_decl` and one plan `p` at seq 8."""
    return f"mesh m {{ axes {axes} }}\n{model_decl}\nplan p on m for m {{\n    batch = {batch}\n    seq = 8\n{body}}}\n"


def compile_spec(text: str, name: str, tmp_path: Path) -> tuple[str, int, str]:
    """(the generated module's path, the plan's ranks, its code) of a spec with one plan."""
    result = check_text(text, f"{name}.mesh")
    assert result.ok, [d.render() if hasattr(d, "render") else d.message for d in result.diagnostics]
    (p,) = result.plans.values()
    code = render_plan(p, f"{name}.mesh", text)
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    return str(path), p.mesh.devices, code
