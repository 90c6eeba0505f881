"""Shared pytest options."""

from __future__ import annotations

import pytest


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
