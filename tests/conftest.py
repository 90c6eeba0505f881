"""Shared pytest options, and the pool of gloo ranks the distributed tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from meshllm_dsl.runtime.jobs.pool import WorkerPool


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", help="rewrite golden files from current output")


# The quick tier (`pytest -m quick`, about 2 minutes on 2 idle cores): every stage once, for an
# engineer's own loop. The full suite (`pytest -q`) stays the README's and CI's test command.
QUICK = (
    "tests/front/test_parser.py",  # parse
    "tests/checker/test_goldens.py",  # check: every diagnostic golden, every example checks clean
    "tests/front/test_families.py",  # the families' .mesh declarations
    "tests/planner/test_planner_numbers.py",  # plan: memory, communication, bubble
    "tests/codegen/test_codegen.py::test_generated_code_matches_golden",  # one golden per example
    "tests/integration/test_compiled_plans.py::test_compiled_plan_matches_unsharded_reference[data2_pipeline2_tensor2]",  # gloo
    "tests/integration/test_hf_weights.py::test_export_round_trip_is_exact_and_loads_in_transformers[llama-pipeline2_tensor2]",
    "tests/runtime/test_rt_resume.py::test_resume_on_the_same_layout_is_bit_for_bit[llama-data2xtensor2-zero3]",
    # a V schedule with its split backward, tied weights on one rank and tensor parallelism (gloo)
    "tests/integration/test_zero_bubble.py::test_schedule_matches_unsharded_reference[zbv_gpt2_tied_pipeline2_tensor2]",
    "tests/planner/test_schedule_zero_bubble.py::test_idle_per_rank_is_deepseek_v3_table_2",  # bubble = the table
    "tests/moe/test_moe_planner.py",  # mixture-of-experts through the planner
    "tests/cli/test_cli.py",  # meshc's commands and exit codes
    "tests/lsp/test_lsp_analysis.py",  # the language server's answers
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "quick: the quick tier, every stage once (`pytest -m quick`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    matched = set()
    for item in items:
        for entry in QUICK:
            if item.nodeid.startswith(entry):
                item.add_marker(pytest.mark.quick)
                matched.add(entry)
    # An entry that names no test (a renamed test or parameter) would shrink the tier silently.
    collected = {item.nodeid.split("::")[0] for item in items}
    stale = [e for e in QUICK if e.split("::")[0] in collected and e not in matched]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py QUICK names no collected test: {', '.join(stale)}")


def _register_hypothesis_profiles() -> None:
    # Registered here, before pytest configures the hypothesis plugin, so that
    # `pytest --hypothesis-profile=thorough` can select it: many more examples for the property tests.
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
        return
    settings.register_profile(
        "thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


_register_hypothesis_profiles()


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """Eight gloo ranks shared by the whole session: starting them costs seconds, a job milliseconds.
    A module that plants faults in its workers keeps a pool of its own (tests/properties)."""
    pytest.importorskip("torch")
    from meshllm_dsl.runtime.jobs.pool import WorkerPool

    with WorkerPool(world_size=8, timeout=180.0) as p:
        yield p
