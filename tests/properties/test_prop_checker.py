"""Property (a): the checker accepts exactly the plans an independent oracle calls valid.

Plans are whole .mesh files drawn by `meshgen.plan_specs` (meshes of 1 to 3 axes with drawn roles
and names, llama / gpt2 dims, shard rules and layout entries, stage maps, schedules, ZeRO), about half
of them with a deliberate mistake. `Spec.verdict()` re-derives validity from the language's rules
without calling the checker; the checker must agree on accept / reject, and for a rejected plan its
diagnostics must include the code of every violation the oracle is sure the checker reports.

Pure Python: 300 examples in the default profile (derandomized: the same plans every run), 2000
fresh ones with `--hypothesis-profile=thorough`.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from meshgen import Rule, Spec, plan_specs

from meshllm_dsl.checker import check_text

THOROUGH = settings.get_current_profile_name() == "thorough"
CHECKER = settings(
    max_examples=2000 if THOROUGH else 300,
    deadline=None,
    derandomize=not THOROUGH,  # the same 300 plans every default run; thorough draws fresh ones
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _explain(spec: Spec, codes: list[str], messages: list[str]) -> str:
    return (
        f"oracle: {spec.verdict()}\nchecker: {codes}\n" + "\n".join(messages) + "\n--- plan ---\n" + spec.text()
    )


@CHECKER
@given(plan_specs())
def test_checker_accepts_exactly_the_valid_plans(spec: Spec) -> None:
    verdict = spec.verdict()
    result = check_text(spec.text(), "generated.mesh")
    codes = sorted({d.code for d in result.errors})
    messages = [f"{d.code} {d.message}" for d in result.errors]
    event(f"hint={spec.hint}")
    event("valid" if verdict.valid else "invalid")
    assert result.ok == verdict.valid, _explain(spec, codes, messages)
    if not verdict.valid:
        # Every invalid draw names at least one violation the checker is sure to report ...
        assert verdict.required, _explain(spec, codes, messages)
        # ... and the checker reports each of them with the right code.
        missing = verdict.required - set(codes)
        assert not missing, f"missing {sorted(missing)}\n" + _explain(spec, codes, messages)
    else:
        # Accepted plans come out as a PlanIR with the drawn mesh and batch.
        (plan,) = result.plans.values()
        assert plan.mesh.devices == spec.n_devices
        assert plan.batch == spec.batch
        assert plan.roles == verdict.roles, _explain(spec, codes, messages)


# ---------------------------------------------------------------- the oracle itself, on known cases
# Guards against an oracle that agrees with the checker by being vacuous: fixed plans with a known
# verdict, including each mistake kind once.


def _base(**kw: object) -> Spec:
    spec = Spec(
        family="llama",
        axes=[("tp", "tensor", 2)],
        dims={"vocab": 32, "hidden": 16, "heads": 4, "kv_heads": 2, "ffn": 32, "layers": 2},
        batch=2,
        seq=4,
    )
    for k, v in kw.items():
        setattr(spec, k, v)
    return spec


MEGATRON = [
    Rule("*", "attn", ("q", "k", "v"), "column", ("tp",)),
    Rule("*", "attn", ("o",), "row", ("tp",)),
    Rule("*", "mlp", ("gate", "up"), "column", ("tp",)),
    Rule("*", "mlp", ("down",), "row", ("tp",)),
    Rule(None, None, ("embed",), "vocab_parallel", ("tp",)),
    Rule(None, None, ("lm_head",), "column", ("tp",)),
]

KNOWN: dict[str, tuple[Spec, set[str]]] = {
    "megatron": (_base(rules=list(MEGATRON)), set()),
    "layout": (_base(layout={"heads": ("tp",), "kv_heads": ("tp",), "ffn": ("tp",), "vocab": ("tp",)}), set()),
    "heads_not_divisible": (
        _base(rules=list(MEGATRON), dims={"vocab": 32, "hidden": 18, "heads": 3, "kv_heads": 3, "ffn": 32, "layers": 2}),
        {"E0301"},
    ),
    "column_column": (_base(rules=[*MEGATRON[:1], Rule("*", "attn", ("o",), "column", ("tp",)), *MEGATRON[2:]]), {"E0402"}),
    "row_lm_head": (_base(rules=[*MEGATRON[:5], Rule(None, None, ("lm_head",), "row", ("tp",))]), {"E0404"}),
    "missing_rule": (_base(rules=MEGATRON[:-1]), {"E0501"}),
    "batch": (_base(rules=list(MEGATRON), batch=3, microbatches=2), {"E0305"}),
    "sequence_parallel": (_base(rules=list(MEGATRON), layout={"seq": ("tp",)}), set()),
    "sequence_parallel_seq_indivisible": (_base(rules=list(MEGATRON), layout={"seq": ("tp",)}, seq=3), {"E0301"}),
    # Over an axis that splits no weight, `seq -> tp` is context parallelism: seq into 2 x 2 chunks.
    "context_parallel": (_base(layout={"seq": ("tp",)}), set()),
    "context_parallel_seq_indivisible": (_base(layout={"seq": ("tp",)}, seq=6), {"E0301"}),
    "few_microbatches": (
        _base(axes=[("pp", "pipeline", 2)], dims={"vocab": 32, "hidden": 16, "heads": 4, "kv_heads": 2, "ffn": 32, "layers": 2},
              stages={"axis": "pp", "virtual": 1, "balanced": True}, schedule="1f1b", microbatches=1),
        {"E0606"},
    ),
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_oracle_on_known_plans(name: str) -> None:
    spec, expected = KNOWN[name]
    verdict = spec.verdict()
    assert verdict.required == expected, str(verdict)
    assert verdict.valid == (not expected)
    result = check_text(spec.text(), f"{name}.mesh")
    assert result.ok == (not expected)
    assert expected <= {d.code for d in result.errors}
