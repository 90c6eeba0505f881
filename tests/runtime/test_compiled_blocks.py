"""`compile = blocks`: torch.compile per block computes what the eager blocks do, and a block that
fails to compile is named (or, when asked, runs eagerly).

The plan test compiles with Inductor on the CPU (tens of seconds per rank on this project's 2 cores):
it is not in the quick tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reference_jobs import compiled_job
from torch import nn

from meshllm_dsl.runtime.train import compile as block_compile

SPEC = """
mesh m {
    axes tensor = 2
    device = cpu
}
model t = llama { vocab = 256, hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 128, dtype = fp32 }
plan p on m for t {
    batch = 2
    seq = 16
    compile = blocks
    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
    optimizer adamw { lr = 0.001 }
}
"""


def test_compiled_blocks_train_as_eager_blocks(pool: Any, tmp_path: Path) -> None:
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.emit import render_plan

    result = check_text(SPEC, "compiled.mesh")
    assert result.ok, [str(d.message) for d in result.errors]
    (plan,) = result.plans.values()
    assert plan.compile == "blocks"
    path = tmp_path / "compiled.py"
    path.write_text(render_plan(plan, "compiled.mesh", SPEC))
    assert "compile='blocks'," in path.read_text()
    eager = pool.run(compiled_job, 2, str(path), 3, "none")[0]
    compiled = pool.run(compiled_job, 2, str(path), 3, "blocks")[0]
    # Inductor fuses and reorders float32 sums: equal to rounding, not bit for bit
    for a, b in zip(compiled["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled["losses"], eager["losses"])
    # AdamW divides each gradient by its own running scale, so a gradient that is rounding noise in
    # both runs may step either way: such elements differ by at most 2 lr per step; all others agree.
    lr, steps = 1e-3, 3
    close = total = 0
    for name, p in eager["params"].items():
        diff = (compiled["params"][name] - p).abs()
        assert diff.max() <= 2 * lr * steps, name
        close += int((diff <= 1e-6 + 1e-4 * p.abs()).sum())
        total += p.numel()
    print(f"{total - close} of {total} parameters differ by more than rounding after {steps} steps")
    assert close >= 0.999 * total


class _Block(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _fake_compile(raises: list[BaseException]) -> Any:
    """torch.compile's stand-in: the first calls of the compiled function raise ``raises`` in order."""
    calls: list[bool] = []

    def compile_(fn: Any, fullgraph: bool = False) -> Any:
        calls.append(fullgraph)

        def run(*args: Any) -> Any:
            if raises:
                raise raises.pop(0)
            return fn(*args)
        return run
    compile_.calls = calls  # type: ignore[attr-defined]
    return compile_


PACKED = SPEC.replace("    compile = blocks\n", "    compile = blocks\n    pack = documents\n    positions = restart\n")


@pytest.mark.parametrize("spec", [PACKED, PACKED.replace("axes tensor = 2", "axes tensor = 2, cp = 2").replace(
    "vocab -> tensor }", "vocab -> tensor, seq -> cp }\n    context_balance = per_document")], ids=["tensor2", "tensor2_cp2"])
def test_compiled_blocks_train_on_packed_documents_as_eager_blocks(spec: str, pool: Any, tmp_path: Path) -> None:
    """Document masks inside compiled blocks: the same losses and parameters as the eager blocks (which
    tests/runtime/test_document_mask.py proves EQUAL to every document alone), and no new graph after
    the first step although every microbatch brings other rows (Dynamo takes them as inputs)."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.emit import render_plan

    result = check_text(spec, "packed.mesh")
    assert result.ok, [str(d.message) for d in result.errors]
    (plan,) = result.plans.values()
    path = tmp_path / "packed.py"
    path.write_text(render_plan(plan, "packed.mesh", spec))
    n = plan.mesh.devices
    eager = pool.run(compiled_job, n, str(path), 3, "none")[0]
    compiled = pool.run(compiled_job, n, str(path), 3, "blocks")[0]
    for a, b in zip(compiled["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled["losses"], eager["losses"])
    for name, p in eager["params"].items():
        assert (compiled["params"][name] - p).abs().max() <= 2 * 1e-3 * 3, name
    graphs = compiled["graphs"]
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs


def test_a_block_that_fails_to_compile_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.exc as exc

    fake = _fake_compile([exc.TorchDynamoException("inductor could not lower it")])
    monkeypatch.setattr(torch, "compile", fake)
    blocks = nn.ModuleDict({"0": _Block()})
    block_compile.compile_blocks(blocks, {"0": "blocks.7"}, fallback=False)
    with pytest.raises(block_compile.BlockCompileError, match=r"torch.compile failed on blocks.7: .*could not lower"):
        blocks["0"](torch.ones(2))


def test_fallback_runs_the_block_eagerly_when_asked(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    import torch._dynamo.exc as exc

    monkeypatch.setattr(torch, "compile", _fake_compile([exc.TorchDynamoException("boom")]))
    blocks = nn.ModuleDict({"0": _Block()})
    block_compile.compile_blocks(blocks, {"0": "blocks.0"}, fallback=True)
    assert torch.equal(blocks["0"](torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(blocks["0"](torch.ones(2)), torch.full((2,), 2.0))
    assert capsys.readouterr().err.count("runs eagerly") == 1


def test_a_graph_break_compiles_the_block_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.exc as exc

    fake = _fake_compile([exc.Unsupported("a collective Dynamo cannot trace")])
    monkeypatch.setattr(torch, "compile", fake)
    blocks = nn.ModuleDict({"0": _Block()})
    block_compile.compile_blocks(blocks, {"0": "blocks.0"}, fallback=False)
    assert torch.equal(blocks["0"](torch.ones(2)), torch.full((2,), 2.0))
    assert fake.calls == [True, False]
