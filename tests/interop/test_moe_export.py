"""`meshc export` of a moe model whose routed experts are split by tensor parallelism: a tp_plan splits
transformers' stacked experts module (`packed_colwise` / `rowwise` on its parameters, `moe_tp_experts` on
it); DTensor refuses them (E1205 at the layout entry: torch's styles shard 2-D weights) instead of writing
entries for modules transformers does not have. tests/integration/test_export_families.py runs both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshllm_dsl.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_mixtral.mesh"


def _spec(tmp_path: Path) -> Path:
    text = EXAMPLE.read_text().replace("    layout { batch -> data,", "    optimizer adamw { zero 3 }\n    layout { batch -> data,") \
        .replace("    optimizer adamw {\n        lr = 0.001\n    }\n", "")
    spec = tmp_path / "m.mesh"
    spec.write_text(text)
    return spec


def test_split_experts_are_refused_by_dtensor_with_e1205(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path)
    assert main(["export", str(spec), "--to", "dtensor", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error[E1205]" in err and "the routed experts split by column(tensor)" in err and "Traceback" not in err
    assert "ffn -> tensor" in err and "^^^" in err  # the layout entry that splits them
    assert "--to hf-tp-plan" in err and "shard blocks.*.mlp.{gate,up,down} replicate" in err  # what exports
    assert not (tmp_path / "out").exists()


def test_split_experts_export_to_a_tp_plan_as_transformers_moe_styles(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert main(["export", str(spec), "--to", "hf-tp-plan", "-o", str(tmp_path / "tp.json")]) == 0
    plan = json.loads((tmp_path / "tp.json").read_text())
    assert plan["model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert plan["model.layers.*.mlp.experts.down_proj"] == "rowwise"
    assert plan["model.layers.*.mlp.experts"] == "moe_tp_experts"
