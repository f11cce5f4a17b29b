"""One Ray instance and one run id for the whole benchmark session.

`ray.init` costs ~5 s and each bench module used to pay it; here the first bench that
needs Ray starts it and the session's end stops it. The run id labels every
reports/bench_*.json, so report.py can tell figures of one run from stale ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from runtime.engines.services import local_ray

NAMESPACE = "tierflow-bench"


@pytest.fixture(scope="session", autouse=True)
def bench_run() -> str:
    run = os.environ.setdefault("TIERFLOW_BENCH_RUN", time.strftime("%Y%m%dT%H%M%S"))
    return run


@pytest.fixture(scope="session")
def bench_ray() -> Iterator[Any]:
    """A local Ray for every bench (2 CPUs as on the target machine; actors ask for none)."""
    import ray

    local_ray(NAMESPACE)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Ray Serve's pydantic deprecation warnings would bury the printed tables."""
    for item in items:
        if "tests/bench/" in str(item.path):
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
