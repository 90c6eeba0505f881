"""Float8 training (`precision { matmul = R }`) on gloo, torchao emulating float8 on the CPU.

Each recipe trains a tiny Llama for 20 AdamW steps under a parallel layout and must stay within
FLOAT8_DRIFT of the same plan with float8 switched off (bf16 matmuls), at every step. Measured here
(2026-12-04, torch 2.13 CPU, torchao 0.18): the largest relative loss difference over the 20 steps
was 0.17 % (tensorwise), 0.18 % (rowwise) and 0.32 % (mxfp8); the bound leaves room for another
machine's rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchao")

from mesh_snippets import MEGATRON  # noqa: E402
from reference_jobs import float8_job  # noqa: E402

FLOAT8_DRIFT = 0.01  # relative: |loss_fp8 - loss_bf16| / loss_bf16 at every step

LLAMA = "model t = llama {{ vocab = 256, hidden = {hidden}, layers = 4, heads = 4, kv_heads = 2, ffn = {ffn}, dtype = {dtype} }}"
TP_RULES = MEGATRON

MASTER = "params = bf16, master = fp32, "
CASES = {
    # tensor parallel 2 x ZeRO 3 over data 2, FSDP2 gathering the float8 weights in float8
    "tensorwise_tp_zero3_gather": ("data = 2, tensor = 2", 64, 128, "fp32", MASTER + "matmul = fp8_tensorwise, all_gather = fp8",
                                   "layout { batch -> data }" + TP_RULES, "zero 3"),
    # two pipeline stages (1F1B) x tensor parallel 2, bf16 parameters
    "rowwise_pipeline_tp": ("pipeline = 2, tensor = 2", 64, 128, "bf16", "matmul = fp8_rowwise",
                            TP_RULES + "    stages over pipeline balanced\n    schedule 1f1b\n    microbatches = 2", ""),
    # MXFP8 (blocks of 32) under tensor parallelism and ZeRO 2: every local dim a multiple of 32
    "mxfp8_tp_zero2": ("data = 2, tensor = 2", 128, 256, "fp32", MASTER + "matmul = mxfp8",
                       "layout { batch -> data }" + TP_RULES, "zero 2"),
}


def _spec(axes: str, hidden: int, ffn: int, dtype: str, precision: str, body: str, zero: str) -> str:
    return f"""
mesh m {{
    axes {axes}
    device = cpu
}}
{LLAMA.format(hidden=hidden, ffn=ffn, dtype=dtype)}
plan p on m for t {{
    batch = 4
    seq = 32
{body}
    precision {{ {precision} }}
    optimizer adamw {{ {zero}
        lr = 0.001 }}
}}
"""


def _compiled(text: str, tmp_path: Path) -> tuple[Any, Path]:
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.emit import render_plan

    result = check_text(text, "float8.mesh")
    assert result.ok, [str(d.message) for d in result.errors]
    (plan,) = result.plans.values()
    path = tmp_path / "float8_plan.py"
    path.write_text(render_plan(plan, "float8.mesh", text))
    return plan, path


@pytest.mark.parametrize("case", CASES)
def test_float8_trains_within_drift_of_bf16(case: str, pool: Any, tmp_path: Path) -> None:
    plan, path = _compiled(_spec(*CASES[case]), tmp_path)
    assert plan.float8 is not None and not plan.float8.skipped[:0]
    fp8 = pool.run(float8_job, plan.mesh.devices, str(path), 20, False)
    bf16 = pool.run(float8_job, plan.mesh.devices, str(path), 20, True)
    # every rank converted what the plan says lives on it, and all ranks agree on the loss
    assert sum(r["float8_layers"] for r in fp8) > 0
    assert all(r["losses"] == fp8[0]["losses"] for r in fp8)
    drift = [abs(a - b) / b for a, b in zip(fp8[0]["losses"], bf16[0]["losses"])]
    print(f"{case}: max relative loss drift {max(drift):.2e}, last loss {fp8[0]['losses'][-1]:.4f} "
          f"vs {bf16[0]['losses'][-1]:.4f}")
    assert max(drift) <= FLOAT8_DRIFT, drift
    assert fp8[0]["losses"][-1] < fp8[0]["losses"][0]  # it trains


def test_float8_converts_exactly_the_planned_layers(pool: Any, tmp_path: Path) -> None:
    """Every layer of the plan's Float8Plan is a float8 layer on the rank holding it, nothing else."""
    plan, path = _compiled(_spec(*CASES["rowwise_pipeline_tp"]), tmp_path)
    per_rank = pool.run(float8_job, plan.mesh.devices, str(path), 1, False)
    # 4 blocks of 7 linears, 2 per pipeline rank, on each of the 2 tensor ranks
    assert [r["float8_layers"] for r in per_rank] == [14, 14, 14, 14]
    assert len(plan.float8.layers) == 28


def test_rows_with_bias_keep_one_bias_under_float8(pool: Any, tmp_path: Path) -> None:
    """A row-parallel layer with a bias (GPT-2's attention output) runs its float8 matmul without the
    bias (rt.row_matmul), which is added once after the all-reduce: the loss matches bf16's."""
    text = """
mesh m {
    axes tensor = 2
    device = cpu
}
model g = gpt2 { vocab = 256, hidden = 64, layers = 2, heads = 4, positions = 64, dtype = bf16 }
plan p on m for g {
    batch = 4
    seq = 32
    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }
    shard pos replicate
    precision { matmul = fp8_tensorwise }
    optimizer adamw { lr = 0.001 }
}
"""
    plan, path = _compiled(text, tmp_path)
    assert "rt.row_matmul(" in path.read_text()
    fp8 = pool.run(float8_job, plan.mesh.devices, str(path), 10, False)
    bf16 = pool.run(float8_job, plan.mesh.devices, str(path), 10, True)
    drift = max(abs(a - b) / b for a, b in zip(fp8[0]["losses"], bf16[0]["losses"]))
    assert drift <= FLOAT8_DRIFT, drift


def test_the_bundled_float8_example_converts_what_explain_says(pool: Any, tmp_path: Path) -> None:
    """examples/tiny_llama_fp8.mesh: block 0 kept in bf16 by `precision blocks.0 matmul = bf16`, the
    other blocks in fp8_tensorwise on every rank that holds them (data 2 x pipeline 2 x tensor 2)."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "examples" / "tiny_llama_fp8.mesh").read_text()
    plan, path = _compiled(text, tmp_path)
    assert plan.float8 is not None and len(plan.float8.layers) == 21
    per_rank = pool.run(float8_job, plan.mesh.devices, str(path), 2, False)
    # rank = data * 4 + pipeline * 2 + tensor: stage 0 holds blocks 0-1 (block 1 converted), stage 1 blocks 2-3
    assert [r["float8_layers"] for r in per_rank] == [7, 7, 14, 14, 7, 7, 14, 14]


@pytest.mark.parametrize("gather", ["fp8", "bf16"])
def test_fsdp_all_gather_bytes_are_the_planned(gather: str, pool: Any, tmp_path: Path) -> None:
    """ZeRO 3 over data 2 x tensor 2: the bytes FSDP2's all-gathers bring to each rank in one step,
    counted at torch.distributed.all_gather_into_tensor, equal planner.comm.fsdp_all_gather_bytes:
    float8 weights at one byte an element with `all_gather = fp8`, bf16 without."""
    from meshllm_dsl.parallel.devices import PROFILES
    from meshllm_dsl.planner.comm import fsdp_all_gather_bytes

    axes, hidden, ffn, dtype, precision, body, zero = CASES["tensorwise_tp_zero3_gather"]
    if gather == "bf16":
        precision = precision.replace(", all_gather = fp8", "")
    plan, path = _compiled(_spec(axes, hidden, ffn, dtype, precision, body, zero), tmp_path)
    assert plan.float8 is not None and plan.float8.gather == (gather == "fp8")
    measured = [r["gathered"] for r in pool.run(float8_job, plan.mesh.devices, str(path), 2, False)]
    planned = fsdp_all_gather_bytes(plan, PROFILES["cpu"])
    print(f"all_gather = {gather}: planned {planned:,} bytes per rank per step, measured {measured}")
    assert measured == [planned] * plan.mesh.devices


def test_an_unknown_torchao_is_one_line_naming_the_known(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchao

    from meshllm_dsl.runtime.train import float8

    monkeypatch.setattr(torchao, "__version__", "0.99.0")
    with pytest.raises(float8.Float8Unavailable) as err:
        float8.torchao_version()
    assert str(err.value) == ("torchao 0.99.0 is not one this runtime knows: it runs float8 with torchao 0.18; "
                              "pip install torchao==0.18.*")


def test_a_float8_plan_without_torchao_stops_before_launch(tmp_path: Path) -> None:
    """`meshc run` of a float8 plan where torchao cannot be imported: exit 2 and one line saying what to install."""
    import os
    import subprocess
    import sys

    spec = tmp_path / "f8.mesh"
    spec.write_text(_spec(*CASES["rowwise_pipeline_tp"]))
    blocker = tmp_path / "no_torchao"
    blocker.mkdir()
    (blocker / "torchao.py").write_text("raise ImportError('torchao is hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "meshllm_dsl", "run", str(spec), "--steps", "1", "--timeout", "60"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ('meshc: error: this plan trains in float8 (`precision { matmul = ... }`), which needs '
                           'torchao: pip install -e ".[fp8]" (or pip install torchao==0.18.*)\n'), proc.stderr


def test_a_float8_run_resumes_exactly(tmp_path: Path) -> None:
    """Float8 with FSDP2 float8 all-gathers (tensorwise, TP 2 x ZeRO 3): stopped after step 2 and
    resumed from its checkpoint, steps 3-4 lose exactly what the uninterrupted run loses."""
    import json
    import os
    import subprocess
    import sys

    spec = tmp_path / "f8.mesh"
    spec.write_text(_spec(*CASES["tensorwise_tp_zero3_gather"]))
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(steps: int, name: str, *flags: str) -> list[float]:
        metrics = tmp_path / f"{name}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "meshllm_dsl", "run", str(spec), "--steps", str(steps),
                               "--timeout", "120", "--metrics", str(metrics), *flags],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(x)["loss"] for x in metrics.read_text().splitlines()]

    whole = run(4, "whole")
    run(2, "first", "--save", str(tmp_path / "ckpt"))
    resumed = run(4, "resumed", "--save", str(tmp_path / "ckpt"), "--resume", "latest")
    assert resumed[-2:] == whole[2:], (resumed, whole)
