from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshllm_dsl.runtime.pool import WorkerPool


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """Eight gloo ranks shared by the whole session (starting them costs seconds, a job ms)."""
    with WorkerPool(world_size=8, timeout=120.0) as p:
        yield p
