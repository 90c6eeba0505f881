"""`meshc export` refuses a moe model whose routed experts are split by tensor parallelism (E1205 at the
layout entry: transformers' experts are one stacked module no parallel style splits) instead of writing
tp_plan entries for modules transformers does not have; with the experts whole it exports
(tests/integration/test_export_families.py runs those)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm_dsl.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_mixtral.mesh"


@pytest.mark.parametrize("target", ["hf-tp-plan", "dtensor"])
def test_moe_models_with_split_experts_are_refused_with_e1205(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = EXAMPLE.read_text().replace("    layout { batch -> data,", "    optimizer adamw { zero 3 }\n    layout { batch -> data,") \
        .replace("    optimizer adamw {\n        lr = 0.001\n    }\n", "")
    spec = tmp_path / "m.mesh"
    spec.write_text(text)
    assert main(["export", str(spec), "--to", target, "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error[E1205]" in err and "the routed experts split by column(tensor)" in err and "Traceback" not in err
    assert "ffn -> tensor" in err and "^^^" in err  # the layout entry that splits them
    assert "shard blocks.*.mlp.{gate,up,down} replicate" in err  # how to keep them whole
    assert not (tmp_path / "out").exists()
