"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from runtime.config import Config, load
from runtime.engines.services import local_ray, start_nats
from runtime.nats.server import NatsServer


class NatsFactory:
    """Starts real nats-servers (JetStream, free ports, a fresh store dir each unless one is
    given) and stops exactly the ones it started: the one way a test gets a server.

    `factory(**opts)` takes NatsServer's fields (sync_interval, user/password, users, TLS,
    max_payload...); `factory.from_config(cfg)` starts one the way `tierflow up` does
    (runtime.engines.services.start_nats). A server is returned started; a test that wants it gone
    before the module ends uses it as a context manager (`with factory() as server:`).
    """

    def __init__(self, new_dir: Callable[[], Path]) -> None:
        self._new_dir = new_dir
        self.started: list[NatsServer] = []

    def __call__(self, **opts: Any) -> NatsServer:
        opts.setdefault("store_dir", self._new_dir())
        server = NatsServer(**opts)
        self.started.append(server)  # before start: a failed start is still stopped
        return server.start()

    def from_config(self, cfg: Config) -> NatsServer:
        """The embedded server `cfg` describes (its TLS, role users, encryption key)."""
        server = start_nats(cfg)
        assert server is not None, "cfg names an external nats.url: nothing to start"
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        """Stop every server this factory started (stop is a no-op for stopped ones)."""
        for server in reversed(self.started):
            server.stop()
        self.started.clear()


@contextlib.contextmanager
def fresh_ray(namespace: str) -> Iterator[None]:
    """A local Ray instance of its own for a module that needs its namespace as the
    driver's default: whatever instance an earlier module left up is shut down first
    (one driver connection per process)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    local_ray(namespace)
    try:
        yield
    finally:
        ray.shutdown()


def write_batches(directory: Path, batches: list[list[dict]]) -> str:
    """One JSON-lines file per micro-batch; mtimes fix the order the file source reads."""
    directory.mkdir(parents=True)
    base = time.time() - 10_000
    for i, rows in enumerate(batches):
        path = directory / f"batch-{i:04d}.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(path, (base + i, base + i))
    return str(directory)


def run_stream(df: Any, checkpoint: Path, mode: str) -> tuple[list[tuple[int, list]], Any]:
    """Run to completion (availableNow, a file per batch); non-empty batches' rows by id."""
    emitted: list[tuple[int, list]] = []

    def collect(batch: Any, batch_id: int) -> None:
        rows = batch.collect()
        if rows:
            emitted.append((batch_id, rows))

    q = (
        df.writeStream.foreachBatch(collect)
        .outputMode(mode)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(120), "stream did not finish in 120 s"
    assert q.exception() is None
    return emitted, q


def with_nats(fn: Any, url: str) -> Any:
    """Run `await fn(nc)` on a fresh NATS connection in a fresh loop (for sync tests that
    drive Spark, where no event loop is running)."""
    import asyncio

    from runtime.nats.server import connect

    async def main() -> Any:
        nc = await connect(url)
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(main())


def kv_results(url: str, query: str) -> dict[Any, dict[str, Any]]:
    """The results KV's rows of one query, by result key (KV keys are <query>.<key>)."""
    from jobs.sink import results_by_query

    async def go(nc: Any) -> dict[Any, dict[str, Any]]:
        return (await results_by_query(nc.jetstream())).get(query, {})

    return with_nats(go, url)


async def acked_publish(
    js: Any, subject: str, payload: bytes, msg_id: str, timeout: float | None = None
) -> bool:
    """One JetStream publish acknowledged; False when nothing answered (yet): a new stream
    whose subjects or leader the server does not know yet gives no responders, a slow one a
    timeout. A resend keeps `msg_id`, so the stream still holds the message once."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import NoStreamResponseError

    try:
        await js.publish(subject, payload, timeout=timeout, headers={"Nats-Msg-Id": msg_id})
    except (NoStreamResponseError, NatsTimeout):
        return False
    return True


class BackgroundLoad:
    """A producer on its own thread, event loop and NATS connection, for tests that kill
    something while load runs: `main(nc)` runs until `stopping`; `stop()` joins it and
    re-raises what it failed with (a producer that fails silently proves nothing)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> Any:
        self._thread.start()
        return self

    def join(self) -> None:
        self._stop.set()
        self.finish(60)

    def finish(self, timeout: float = 120.0) -> None:
        """Wait for a producer that ends by itself (a fixed number of events)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{type(self).__name__} did not stop"
        assert self.error is None, f"{type(self).__name__} failed: {self.error!r}"

    def _run(self) -> None:
        try:
            with_nats(self.main, self.url)
        except BaseException as err:
            self.error = err

    async def main(self, nc: Any) -> None:
        raise NotImplementedError


async def under_load(
    t: Any,
    prefix: str,
    resize: Callable[[], Awaitable[None]],
    rate: float = 800,
    *,
    after: int = 10,
    after_timeout_s: float = 60.0,
) -> Any:
    """A steady load of known ids on collection tier `t` from before `resize` starts until
    `after` more batches were accepted after it ended; returns the `LoadReport` (every
    batch started was acknowledged, no refusal left unretried)."""
    from cluster.loadgen import drive, known_events
    from runtime.waiting import await_until

    acked = [0]
    flowing, stop = asyncio.Event(), asyncio.Event()

    def on_batch(_: int) -> None:
        acked[0] += 1
        if acked[0] >= 10:
            flowing.set()

    load = asyncio.ensure_future(
        drive(
            t.url,
            "meetup",
            known_events(500_000, prefix),
            batch=100,
            concurrency=4,
            rate=rate,
            deadline_s=900,
            on_batch=on_batch,
            until=stop,
        )
    )
    await asyncio.wait_for(flowing.wait(), 60)  # resize only once the load is accepted
    await resize()
    assert not load.done(), "the resizing must happen under load"
    mark = acked[0]
    await await_until(
        lambda: acked[0] >= mark + after, after_timeout_s, what="the load accepted afterwards"
    )
    stop.set()
    report = await load
    assert not report.rejected, report.rejected
    assert len(report.acknowledged) == acked[0] * 100  # every batch started was accepted
    return report


async def assert_all_landed(t: Any, server: Any, report: Any) -> None:
    """Once the loggers hold nothing JetStream lacks, every acknowledged id is in the
    `meetup` stream exactly once."""
    from cluster.verify import judge, stream_ids
    from runtime.nats.server import connect
    from runtime.waiting import await_until

    async def drained() -> bool:
        for logger in t.loggers:
            c = await logger.counts()
            if c["transient"] or c["failed"]:
                return False
        return True

    await await_until(drained, timeout=120, interval=0.5, what="log drained", swallow=True)
    nc = await connect(server.url)
    try:
        verdict = judge(report.acknowledged, await stream_ids(nc, "meetup"))
    finally:
        await nc.close()
    assert verdict.ok, str(verdict)


MEETUP_ONLY = {"meetup": {"subjects": ["raw.meetup"]}}


def tier_config(
    state: Path,
    namespace: str,
    streams: dict[str, Any] | None = None,
    roles: dict[str, Any] | None = None,
    **overrides: Any,
) -> Config:
    """A collection tier's config for a test module: its own state dir and Ray namespace,
    logger k=1, the given streams (meetup alone by default) and any other keys."""
    return load(
        environ={},
        overrides={
            "state_dir": str(state),
            "ray": {"namespace": namespace},
            "roles": {"logger": {"k": 1}, **(roles or {})},
            "streams": streams if streams is not None else MEETUP_ONLY,
            **overrides,
        },
    )


@contextlib.contextmanager
def running_driver(cfg: Config, nats_url: str, jobs: Any = ()) -> Iterator[Any]:
    """An AnalysisDriver actor with `jobs`, once its Spark runs; stopped and removed after
    (cluster.deploy.analysis: imports Ray, so only when a test asks for a driver)."""
    from cluster.deploy.analysis import start_driver, stop_driver, wait_running

    handle = start_driver(cfg, nats_url, jobs)
    try:
        status = wait_running(handle, 180)
        assert status.get("state") == "running", status
        yield handle
    finally:
        stop_driver(handle)


def start_on_free_port(
    name: str,
    namespace: str,
    start: Callable[[int], Any],
    *,
    ready: str = "endpoints",
    timeout_s: float = 120.0,
) -> tuple[Any, int]:
    """A server actor `name` (`start(port)` starts it and returns its handle) on a port
    chosen free, once its `ready` method answers; (handle, port). A port another process
    took before the actor bound it (its creation failed with PortTakenError) is chosen
    again, at most PORT_ATTEMPTS starts, as `deploy_on_port` does for a role's replicas."""
    import ray  # seconds of import time: only the modules that start actors pay it

    from cluster.deploy.deployer import wait_gone, wait_ready
    from runtime.binding import PortTakenError
    from runtime.nats.server import PORT_ATTEMPTS, choose_ports

    tried: list[int] = []
    for _ in range(PORT_ATTEMPTS):
        port = choose_ports(1, "127.0.0.1", tried)[0]
        handle = start(port)
        try:
            wait_ready(namespace, name, ready, timeout_s)
            return handle, port
        except PortTakenError:
            tried.append(port)
            ray.kill(handle, no_restart=True)
            wait_gone(namespace, [name])
    raise PortTakenError(f"{name}: chosen ports {tried} were all taken", tried[-1])


# Debian's Chromium, driven by Playwright (never `playwright install`)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# the demo's stream, for tests that feed it Meetup RSVPs (a config names it: none has it
# by default; cluster/demo adds it to the demo's)
MEETUP_STREAMS = {"meetup": {"subjects": ["raw.meetup"]}}


def delete_consumers(url: str, stream: str) -> int:
    """Delete every consumer of `stream` (as a server restart loses in-memory ones); how many."""

    async def go(nc: Any) -> int:
        js = nc.jetstream()
        names = [c.name for c in await js.consumers_info(stream)]
        for name in names:
            await js.delete_consumer(stream, name)
        return len(names)

    return int(with_nats(go, url))
