"""`meshc export` refuses a model with moe layers (E1204: no export of one is proven yet; its split
experts are a stacked weight no parallel style splits) instead of writing tp_plan entries for
modules transformers does not have."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm_dsl.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_mixtral.mesh"


@pytest.mark.parametrize("target", ["hf-tp-plan", "dtensor"])
def test_moe_models_are_refused_with_e1204(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = EXAMPLE.read_text().replace("    layout { batch -> data,", "    optimizer adamw { zero 3 }\n    layout { batch -> data,") \
        .replace("    optimizer adamw {\n        lr = 0.001\n    }\n", "")
    spec = tmp_path / "m.mesh"
    spec.write_text(text)
    assert main(["export", str(spec), "--to", target, "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error[E1204]" in err and "(mixture-of-experts layers) is not exported" in err and "Traceback" not in err
    assert "--to hf-ep-plan" in err  # where the experts do export
    assert not (tmp_path / "out").exists()
