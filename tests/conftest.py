"""Shared fixtures: the engines are expensive (ray.init ~5 s, Spark ~6 s), so share them.

Every nats-server a test needs comes from `nats_factory` (or the plain `nats_server` it
makes). Tests marked `unit` (`make test-fast`) may start no engine: the hooks at the bottom
fail one that asks for an engine fixture or starts any process (nats-server, Ray, Spark's JVM,
Chromium and the tierflow CLI all are processes).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.config import Config, load
from runtime.engines.services import local_ray, spark_session
from runtime.nats.server import PORT_SLICE_ENV, NatsServer, quiet_ports
from tests.ordering import costliest_first, load_costs, module_of
from tests.support import CHROMIUM, CHROMIUM_ARGS, NatsFactory


def _port_slice(environ: dict[str, str], ports: range | None = None) -> str | None:
    """This pytest-xdist worker's share of the free-port range (runtime/nats/server.py
    `quiet_ports` unless `ports`) as `$TIERFLOW_PORT_SLICE` takes it, "LOW-HIGH": the i-th
    of n equal parts for gw<i> of n, so two workers never choose the same port in the
    moment between choosing and binding it. None outside xdist, or with no room to share."""
    worker, count = environ.get("PYTEST_XDIST_WORKER", ""), environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker.startswith("gw") or not count:
        return None
    i, n = int(worker[2:]), int(count)
    ports = quiet_ports() if ports is None else ports
    if not 0 <= i < n or len(ports) < n:
        return None
    step = len(ports) // n
    low = ports.start + i * step
    return f"{low}-{low + step - 1}"


# Set at import, before any fixture picks a port: every process a test starts (Ray, the
# CLI, `tierflow up`) inherits it.
if (_slice := _port_slice(dict(os.environ))) is not None:
    os.environ.setdefault(PORT_SLICE_ENV, _slice)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tierflow")


@pytest.fixture(scope="session")
def session_cfg(session_dir: Path) -> Config:
    """A config whose state lives in a temp dir, independent of the developer's env."""
    return load(environ={}, overrides={"state_dir": str(session_dir / "state")})


@pytest.fixture(scope="module")
def nats_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsFactory]:
    """Starts nats-servers with any NatsServer options for this module; at its end, stops
    exactly the ones it started."""
    factory = NatsFactory(lambda: tmp_path_factory.mktemp("nats"))
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def nats_server(nats_factory: NatsFactory) -> NatsServer:
    """A real nats-server (JetStream, `sync_interval: always`) per test module."""
    return nats_factory()


@pytest.fixture(scope="session")
def spark(session_cfg: Config) -> Iterator[object]:
    session = spark_session(session_cfg, app_name="tierflow-tests")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def ray_module() -> Iterator[object]:
    """A local Ray instance for this module (reused if one is up; other modules' fixtures
    may shut it down, so each module asks again rather than holding a session handle)."""
    import ray  # seconds of import time: only the modules that use Ray pay it

    local_ray("tierflow-tests")
    yield ray


# --------------------------------------------------------------------------- the unit marker

ENGINE_FIXTURES = frozenset({"nats_factory", "nats_server", "spark", "ray_module"})


def _refuse_processes(item: pytest.Item) -> pytest.MonkeyPatch:
    """While a unit test sets up and runs, starting any child process fails it."""

    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        command = args if isinstance(args, (str, bytes)) else " ".join(map(str, args))
        raise AssertionError(
            f"{item.nodeid} is marked unit but starts a process ({str(command)[:200]}): "
            "nats-server, Ray, Spark, Chromium and tierflow belong in integration tests"
        )

    patch = pytest.MonkeyPatch()
    # Every child (subprocess.run, asyncio's subprocess transport, Ray's and pyspark's
    # launchers) goes through Popen._execute_child, however Popen itself was imported.
    patch.setattr(subprocess.Popen, "_execute_child", refuse)
    return patch


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if item.get_closest_marker("unit") is None:
        return (yield)
    engines = ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if engines:
        pytest.fail(
            f"{item.nodeid} is marked unit but uses engine fixtures {sorted(engines)}",
            pytrace=False,
        )
    patch = _refuse_processes(item)
    try:
        return (yield)
    finally:
        patch.undo()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    if item.get_closest_marker("unit") is None:
        return (yield)
    patch = _refuse_processes(item)
    try:
        return (yield)
    finally:
        patch.undo()


# --------------------------------------------------------------------------- module order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Costliest modules first (tests/ordering.py says why): make test's two workers then
    end together instead of one finishing a long module alone."""
    items[:] = costliest_first(items, lambda item: module_of(item.nodeid), load_costs())


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    """Debian's Chromium through Playwright, one per module (the console's and the demo
    page's tests)."""
    from playwright.async_api import async_playwright

    if not os.access(CHROMIUM, os.X_OK):  # fail, not skip: an untested page is a bug
        pytest.fail(f"{CHROMIUM} missing: apt-get install -y chromium (make test does it)")
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        await chromium.close()
