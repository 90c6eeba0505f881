"""MkDocs hook (mkdocs.yml `hooks:`): draw the pictures the pages embed before each build, from the
bundled examples, with the same code `meshc plan --svg` and `meshc suggest --svg` run; written to
docs/images/generated/ (not committed: the build makes them, so they always match the code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "docs" / "images" / "generated"


def on_pre_build(config: Any, **_: Any) -> None:
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.parallel.devices import PROFILES
    from meshllm_dsl.planner.analyze import analyze
    from meshllm_dsl.planner.suggest import suggest
    from meshllm_dsl.progress import StatusLine
    from meshllm_dsl.views.charts import memory_svg, suggest_svg
    from meshllm_dsl.views.svg import mesh_svg, schedule_svg

    OUT.mkdir(parents=True, exist_ok=True)
    for example, plan_name in (("llama2_70b_zbv", "zbv_64"), ("tiny_llama_zbv", "train"), ("llama2_70b_train", "train_64")):
        plan = check_file(ROOT / "examples" / f"{example}.mesh").plans[plan_name]
        (OUT / f"{example}_schedule.svg").write_text(schedule_svg(plan))
        (OUT / f"{example}_memory.svg").write_text(memory_svg(analyze(plan)))
        (OUT / f"{example}_mesh.svg").write_text(mesh_svg(plan))
    device = PROFILES["a100"]
    res = suggest(str(ROOT / "examples" / "llama2_7b.mesh"), "llama2_7b", devices=8, device=device, batch=16,
                  seq=4096, top=3, status=StatusLine("docs", tty=False))
    (OUT / "llama2_7b_suggest.svg").write_text(suggest_svg(
        list(res.points), [r.candidate.key() for r in res.ranked], device.memory_bytes - res.headroom_bytes,
        "meshc suggest: llama2_7b on 8 x a100, batch 16 x seq 4096"))
