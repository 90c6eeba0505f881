"""Shared pytest options, and the pool of gloo ranks the distributed tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from meshllm_dsl.runtime.jobs.pool import WorkerPool


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", help="rewrite golden files from current output")


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
