"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def fresh_ray(namespace: str) -> Iterator[None]:
    """A local Ray instance of its own for a module that needs its namespace as the
    driver's default: whatever instance an earlier module left up is shut down first
    (one driver connection per process)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        namespace=namespace,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
