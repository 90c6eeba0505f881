"""Property (b): every plan the checker accepts computes what the unsharded model computes.

Valid plans are drawn by `meshgen.plan_specs(valid_only=True)` (no deliberate mistakes, dims aligned
to the tensor axis), checked, compiled to a module and run on one long-lived pool of 8 gloo ranks
(a plan uses its first `devices` ranks). Forward logits, the loss, every gathered gradient and every
parameter after one AdamW step must match the reference within 1e-10 in float64 and 1e-5 in float32.

Default profile: a dozen plans, derandomized (the same plans every run) so the suite is
deterministic and fast. `pytest --hypothesis-profile=thorough` draws fresh plans, 250 by default
(`MESHLLM_PROP_PLANS=N` to change it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, note, settings

pytest.importorskip("torch")

from equiv import compare, over_tolerance, write_module
from meshgen import Spec, plan_specs, tied_head_in_embedding_stage

from meshllm_dsl.checker import check_text
from meshllm_dsl.runtime.jobs.pool import WorkerPool

THOROUGH = settings.get_current_profile_name() == "thorough"
N_PLANS = int(os.environ.get("MESHLLM_PROP_PLANS", "250" if THOROUGH else "12"))
EQUIVALENCE = settings(
    max_examples=N_PLANS,
    deadline=None,
    derandomize=not THOROUGH,
    database=None,  # a saved failing plan would otherwise be replayed first in every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plans")


def _features(spec: Spec) -> list[str]:
    out = [spec.family, f"{spec.n_devices} ranks"]
    out += [f"{role}={size}" for _, role, size in spec.axes if size > 1]
    if spec.stages:
        out.append("balanced" if spec.stages.get("balanced") else "stage map")
        if spec.stages["virtual"] > 1:
            out.append("virtual")
    if spec.schedule:
        out.append(spec.schedule)
    if spec.zero and spec.zero[0]:
        out.append(f"zero{spec.zero[0]}")
    if spec.precision:
        out.append("precision")
    if spec.layout:
        out.append("layout")
    if any(isinstance(r.block, int) for r in spec.rules):
        out.append("per-block rules")
    if spec.recompute not in (None, "none"):
        out.append(f"recompute {spec.recompute}")
    if "seq" in spec.layout:
        out.append("sequence parallel")
    return out


@EQUIVALENCE
@given(spec=plan_specs(valid_only=True))
def test_accepted_plans_match_the_unsharded_model(spec: Spec, pool: WorkerPool, module_dir: Path) -> None:
    text = spec.text()
    note(text)
    if tied_head_in_embedding_stage(spec):
        event("gpt2 head tied in the embedding stage")  # the first bug this property found
    for f in _features(spec):
        event(f)
    result = check_text(text, "generated.mesh")
    # valid_only draws are valid by construction; the checker property (a) says why if not.
    assert result.ok, [f"{d.code} {d.message}" for d in result.errors]
    assert spec.verdict().valid
    (plan,) = result.plans.values()
    path = write_module(plan, text, module_dir)
    per_rank = pool.run(compare, plan.mesh.devices, path)
    bad = over_tolerance(per_rank)
    assert not bad, f"sharded differs from unsharded: {bad}\n{text}"
