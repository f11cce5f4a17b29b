"""Shared fixtures: the engines are expensive (ray.init ~5 s, Spark ~6 s), so share them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.config import Config, load


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tierflow")


@pytest.fixture(scope="session")
def session_cfg(session_dir: Path) -> Config:
    """A config whose state lives in a temp dir, independent of the developer's env."""
    return load(environ={}, overrides={"state_dir": str(session_dir / "state")})


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real embedded nats-server (JetStream, `sync_interval: always`) per test module."""
    from runtime.nats import NatsServer

    with NatsServer(store_dir=tmp_path_factory.mktemp("nats")).start() as server:
        yield server


@pytest.fixture(scope="session")
def spark(session_cfg: Config) -> Iterator[object]:
    from runtime.services import spark_session

    session = spark_session(session_cfg, app_name="tierflow-tests")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def ray_module() -> Iterator[object]:
    """A local Ray instance for this module (reused if one is up; other modules' fixtures
    may shut it down, so each module asks again rather than holding a session handle)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            namespace="tierflow-tests",
            include_dashboard=False,
            log_to_driver=False,
        )
    yield ray
