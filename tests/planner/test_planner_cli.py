"""`meshc plan`, `meshc explain`, `meshc suggest` through the command line entry point (no torch)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.cli.main import main
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.planner.suggest import _prelude_text, candidates, suggest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_text_prints_the_reference_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", str(EXAMPLES / "llama2_70b.mesh")], capsys)
    assert code == 0  # warnings (it does not fit) do not fail the command
    assert "68,976,648,192" in out
    assert "137.95 GB = 128.48 GiB" in out
    assert "327,680 bytes per token" in out
    assert "warning[W0801]" in out
    assert "bubble: 11.1%" in out


def test_plan_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", str(EXAMPLES / "llama2_7b.mesh"), "--format", "json"], capsys)
    assert code == 0
    data = json.loads(out)
    (plan,) = data["plans"]
    assert plan["parameters"] == 6_738_415_616
    assert plan["optimizer_bytes_per_param"] == 4  # bf16 AdamW moments: the plan has no `precision`
    assert plan["fits"] is True
    assert {c["axis"] for c in plan["communication"]} == {"tensor", "data"}
    assert plan["ranks"][0]["optimizer_bytes"] == 4 * -(-plan["ranks"][0]["params_per_device"] // 2)
    assert data["diagnostics"] == []


def test_plan_every_example(capsys: pytest.CaptureFixture[str]) -> None:
    for path in sorted(EXAMPLES.glob("*.mesh")):
        code, out, _ = run(["plan", str(path), "--format", "json"], capsys)
        assert code == 0, path
        assert json.loads(out)["plans"], path


def test_plan_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.mesh"
    bad.write_text((EXAMPLES / "llama2_70b.mesh").read_text().replace("tensor = 4", "tensor = 3"))
    code, _, err = run(["plan", str(bad)], capsys)
    assert code == 1 and "E0301" in err
    code, _, err = run(["plan", str(EXAMPLES / "llama2_70b.mesh"), "--plan", "nope"], capsys)
    assert code == 2 and "no plan `nope`" in err


def test_device_declaration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (EXAMPLES / "llama2_7b.mesh").read_text().replace("device = a100", "device = small")
    spec = tmp_path / "dev.mesh"
    spec.write_text("device small { like = a100, memory = 24, tflops = 100 }\n" + text)
    code, out, _ = run(["plan", str(spec), "--format", "json"], capsys)
    assert code == 0
    data = json.loads(out)
    dev = data["plans"][0]["device"]
    assert (dev["name"], dev["memory_gib"], dev["tflops"], dev["intra_gbps"]) == ("small", 24.0, 100.0, 300.0)
    assert data["plans"][0]["fits"] is False
    assert "W0801" in {d["code"] for d in data["diagnostics"]}
    spec.write_text("device small { memry = 24 }\n" + text)
    code, _, err = run(["plan", str(spec)], capsys)
    assert code == 1 and "unknown device setting `memry`" in err


def test_explain_seed_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", str(EXAMPLES / "seed_pipeline_12.mesh")], capsys)
    assert code == 0
    assert "embed, pos, blocks 0-3" in out
    assert "blocks 4-7" in out
    assert "blocks 8-11, norm, lm_head" in out
    assert "pipeline  [0, 1, 2]" in out
    assert "weight  tied to embed" in out


def test_explain_groups_shapes_and_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", str(EXAMPLES / "tiny_llama.mesh")], capsys)
    assert code == 0
    assert "data      [0, 4] [1, 5] [2, 6] [3, 7]" in out
    assert "pipeline  [0, 2] [1, 3] [4, 6] [5, 7]" in out
    assert "tensor    [0, 1] [2, 3] [4, 5] [6, 7]" in out
    assert "q.weight  (64, 64)  (32, 64)  column(tensor)" in out
    assert "o.weight  (64, 64)  (64, 32)  row(tensor)" in out
    assert "copy_to(tensor) at input: identity forward, all-reduce backward" in out
    # rank 5 = data 1, pipeline 0, tensor 1: stage 0, second tensor shard, second replica
    assert "     5     1         0       1  0      embed, blocks 0-1          1/2 over tensor  1/2" in out


def test_explain_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", str(EXAMPLES / "seed_mesh_2d.mesh"), "--format", "json"], capsys)
    assert code == 0
    (plan,) = json.loads(out)["plans"]
    assert plan["groups"]["tensor"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [s["layers"] for s in plan["stages"]] == ["embed, blocks 0-15", "blocks 16-31, norm, lm_head"]
    assert plan["ranks"][6]["coords"] == {"pipeline": 1, "tensor": 2}


def test_explain_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(["explain", str(EXAMPLES / "seed_pipeline_12.mesh"), "--svg", str(tmp_path)], capsys)
    assert code == 0
    mesh = tmp_path / "pipeline12_mesh.svg"
    sched = tmp_path / "pipeline12_schedule.svg"
    for f in (mesh, sched):
        root = ET.parse(f).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in ET.parse(mesh).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert "rank 2" in texts and "blocks 4-7" in texts
    sched_text = sched.read_text()
    # torch's GPipe order idles as the closed form says (backward = 2 x forward)
    assert "bubble in torch&#x27;s gpipe order (backward = 2 x forward): 25.0% = (p - 1) / (m + p - 1)" in sched_text
    # 3 ranks x 6 microbatches x (forward + backward) boxes
    assert sched_text.count("hsl(212") == 18 and sched_text.count("hsl(28") == 18


def test_suggest_returns_plans_that_check_clean(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(EXAMPLES / "tiny_llama.mesh")
    res = suggest(path, "tiny_llama", devices=8, device=PROFILES["cpu"], batch=8, seq=32, top=3)
    assert res.ranked
    prelude = _prelude_text(path, "tiny_llama")
    for r in res.ranked:
        result = check_text(prelude + "\n" + r.text, path)
        assert result.ok, (r.text, result.errors)
        assert result.plans["suggested"].mesh.devices == 8
        assert r.report.fits
    times = [r.report.step.total_s for r in res.ranked]
    assert times == sorted(times)
    assert res.ranked[0].reason.startswith("fastest")


def test_every_suggestion_checks_clean() -> None:
    """Not only the best: a suggestion `check` would refuse is never offered (ZeRO 2 / 3 included)."""
    path = str(EXAMPLES / "tiny_llama.mesh")
    res = suggest(path, "tiny_llama", devices=8, device=PROFILES["cpu"], batch=8, seq=32, top=10_000)
    prelude = _prelude_text(path, "tiny_llama")
    assert len(res.ranked) > 3
    for r in res.ranked:
        result = check_text(prelude + "\n" + r.text, path)
        assert result.ok, (r.text, [(d.code, d.message) for d in result.errors])
    # ... and every ZeRO stage the runtime runs is searched.
    model = check_text(prelude, path).models["tiny_llama"]
    zeros = {c.zero for c in candidates(model, 8, 8, 8)}
    assert zeros == {0, 1, 2, 3}, zeros


def test_suggest_searches_recomputation() -> None:
    """Every recompute region the model allows is a candidate; each suggested one checks clean and is
    estimated with the plan's own setting (the variant's PlanIR, not the structure's, is analysed)."""
    path = str(EXAMPLES / "tiny_llama.mesh")
    prelude = _prelude_text(path, "tiny_llama")
    model = check_text(prelude, path).models["tiny_llama"]
    assert {c.recompute for c in candidates(model, 8, 8, 8)} == {"none", "attention", "ops", "blocks every 2", "blocks"}
    res = suggest(path, "tiny_llama", devices=8, device=PROFILES["cpu"], batch=8, seq=32, top=10_000)
    remat = [r for r in res.ranked if r.candidate.recompute != "none"]
    assert {r.candidate.recompute for r in remat} == {"attention", "ops", "blocks every 2", "blocks"}
    for r in remat:
        result = check_text(prelude + "\n" + r.text, path)
        region, _, every = r.candidate.recompute.partition(" every ")
        setting = (region, int(every or 1))
        assert result.ok and (result.plans["suggested"].recompute, result.plans["suggested"].recompute_every) == setting
        assert (r.report.plan.recompute, r.report.plan.recompute_every) == setting
        assert f"recompute = {r.candidate.recompute}" in r.text


def test_suggest_cli_70b(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["suggest", str(EXAMPLES / "llama2_70b.mesh"), "--devices", "32", "--device", "h100",
                        "--batch", "64", "--seq", "4096", "--format", "json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["suggestions"]
    for s in data["suggestions"]:
        assert s["data"] * s["pipeline"] * s["tensor"] == 32
        assert s["tensor"] <= 8  # within a host
        assert s["peak_training_bytes"] <= 80 * 2**30


def test_suggest_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["suggest", str(EXAMPLES / "llama2_70b.mesh"), "--devices", "2", "--device", "h100"], capsys)
    assert code == 1
    assert "no candidate checks clean and fits" in out


def test_planner_does_not_import_torch() -> None:
    import subprocess

    code = ("import sys, meshllm_dsl.cli.plan, meshllm_dsl.planner.analyze, meshllm_dsl.planner.suggest, "
            "meshllm_dsl.views.explain, meshllm_dsl.views.svg; from meshllm_dsl.cli.main import main; "
            f"main(['plan', {str(EXAMPLES / 'tiny_llama.mesh')!r}]); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_explain_shows_node_and_local_rank_with_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", str(EXAMPLES / "llama2_70b_2x8.mesh")], capsys)
    assert code == 0
    assert "  rank  node  local  data  pipeline  tensor  stage" in out
    # rank 9: the second node's local rank 1 (ranks node-major, 8 per host)
    assert "     9     1      1     1         0       1  0" in out
    assert "tensor    [0, 1, 2, 3] [4, 5, 6, 7] [8, 9, 10, 11] [12, 13, 14, 15]  (in host)" in out
    assert "(across nodes)" in out.split("  data      ")[1].splitlines()[0]
    code, out, _ = run(["explain", str(EXAMPLES / "llama2_70b_2x8.mesh"), "--format", "json"], capsys)
    (plan,) = json.loads(out)["plans"]
    assert {k: plan["ranks"][9][k] for k in ("rank", "node", "local_rank")} == {"rank": 9, "node": 1, "local_rank": 1}


def test_explain_without_hosts_has_no_node_columns(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", str(EXAMPLES / "tiny_llama.mesh")], capsys)
    assert code == 0 and " node " not in out and "(in host)" not in out


def test_plan_without_pipeline_names_no_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    # The schedule is a pipeline's; a plan without one has none to print (it said `schedule gpipe`).
    code, out, _ = run(["plan", str(EXAMPLES / "errors" / "W0708_hosts_omitted.mesh")], capsys)
    assert code == 0
    second = out.splitlines()[1]
    assert "no pipeline" in second and "schedule" not in second
    code, out, _ = run(["plan", str(EXAMPLES / "tiny_llama.mesh")], capsys)
    assert "; schedule 1f1b;" in out.splitlines()[1]


def test_mesh_svg_of_64_ranks_shows_every_cell_text_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Interleaved stages give each rank two block ranges, and long axis names long coordinates:
    # both were cut off with an ellipsis at 30 characters; they now wrap inside a taller cell.
    spec = tmp_path / "r64.mesh"
    spec.write_text("""\
mesh cluster {
    axes data_parallel = 2, pipeline_stage = 4, tensor_parallel = 8
    hosts = 8
}
model m = llama { vocab = 32000, hidden = 8192, layers = 80, heads = 64, kv_heads = 8, ffn = 28672 }
plan train on cluster for m {
    batch = 16
    microbatches = 8
    layout { batch -> data_parallel, heads -> tensor_parallel, kv_heads -> tensor_parallel, ffn -> tensor_parallel,
             vocab -> tensor_parallel }
    stages over pipeline_stage virtual 2 balanced
    schedule interleaved_1f1b
}
""")
    code, _, _ = run(["explain", str(spec), "--svg", str(tmp_path / "svg")], capsys)
    assert code == 0
    svg = (tmp_path / "svg" / "train_mesh.svg").read_text()
    assert "\u2026" not in svg
    texts = [t.text or "" for t in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text")]
    assert texts.count("data_parallel=1") == 32 and texts.count("pipeline_stage=3") == 16
    assert texts.count("tensor_parallel=7") == 8
    assert texts.count("embed, blocks 0-9;") == 16 and texts.count("blocks 40-49") == 16
    assert texts.count("blocks 70-79, norm, lm_head") == 16
    assert max(len(t) for t in texts if not t.startswith(("plan ", "stage ", "\u2193", "data_parallel 2"))) <= 28


def test_commands_act_on_the_plans_of_the_file_not_of_its_includes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # llama2_70b_train.mesh includes llama2_70b.mesh and its plan `train`, which sorts before the
    # file's own `train_64`: planning the file showed `train` (which does not fit) first, and
    # `meshc run` / `verify` without --plan took it.
    from meshllm_dsl.cli.compile import _checked

    path = str(EXAMPLES / "llama2_70b_train.mesh")
    code, out, _ = run(["plan", path, "--format", "json"], capsys)
    assert code == 0 and [p["plan"] for p in json.loads(out)["plans"]] == ["train_64"]
    code, out, _ = run(["plan", path, "--plan", "train", "--format", "json"], capsys)
    assert code == 0 and [p["plan"] for p in json.loads(out)["plans"]] == ["train"]
    assert _checked(path)[1] == "train_64"
    # A file that declares no plan of its own acts on the plans it includes.
    (tmp_path / "model.mesh").write_text((EXAMPLES / "llama2_70b.mesh").read_text())
    only = tmp_path / "only.mesh"
    only.write_text('include "model.mesh"\n')
    code, out, _ = run(["plan", str(only), "--format", "json"], capsys)
    assert code == 0 and [p["plan"] for p in json.loads(out)["plans"]] == ["train"]
    assert _checked(str(only))[1] == "train"
