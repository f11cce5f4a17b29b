"""Chaos for the archive: the analysis driver, which runs the archive job, is
SIGKILLed (with its Spark JVM) while the archive writes, under a steady load; afterwards the
archive holds every acknowledged event exactly once, read back with Spark and compared by
id and payload hash.

Real parts: nats-server, a local Ray, the AnalysisDriver actor with Spark local[2], the
archive's Parquet on the local filesystem.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import ray

from jobs.archive import read_archive
from jobs.jetstream import register
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.waiting import wait_until
from tests.support import BackgroundLoad, NatsFactory, running_driver, with_nats
from tests.test_analysis_driver import java_children

pytestmark = pytest.mark.timeout(900)
STREAM = "ledger"
KILLS = 2


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    return nats_factory(sync_interval="2m").url  # the driver is killed here, never NATS


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory, nats_url: str) -> Config:
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("archive-chaos")),
            "nats": {"url": nats_url},
            "ray": {"namespace": "tf-archive-chaos"},
            "spark": {"master": "local[2]"},
            "streams": {STREAM: {"subjects": [f"raw.{STREAM}"], "archive": {"flush_s": 0.5}}},
        },
    )
    with_nats(lambda nc: ensure_streams(nc, cfg), nats_url)
    return cfg


@pytest.fixture(scope="module")
def driver(ray_module: Any, cfg: Config, nats_url: str) -> Iterator[Any]:
    with running_driver(cfg, nats_url) as handle:
        yield handle


class Load(BackgroundLoad):
    """Publishes 40 events every 0.1 s with ids; `acked` holds (id, payload) of every one
    JetStream acknowledged (a publish is retried with its id until acknowledged)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.acked: list[tuple[str, bytes]] = []

    def stop(self) -> list[tuple[str, bytes]]:
        self.join()
        return self.acked

    async def main(self, nc: Any) -> None:
        js = nc.jetstream(timeout=10)
        n = 0
        for _ in range(100_000):  # bounded: stopped long before
            if self.stopping:
                return
            batch = []
            for _ in range(40):
                body = json.dumps({"n": n, "amount": n % 113, "note": "x" * (n % 64)}).encode()
                batch.append((f"l-{n}", body))
                n += 1
            for _ in range(20):  # bounded retries of the whole batch, same ids
                futs = [
                    await js.publish_async(f"raw.{STREAM}", b, headers={"Nats-Msg-Id": i})
                    for i, b in batch
                ]
                try:
                    await asyncio.gather(*futs)
                    break
                except Exception:  # noqa: BLE001 - resent with the same ids; JetStream dedups
                    await asyncio.sleep(0.2)
            else:
                raise AssertionError("a batch was never acknowledged")
            self.acked.extend(batch)
            await asyncio.sleep(0.1)


def archived_next(driver: Any) -> int:
    return int(ray.get(driver.archives.remote(), timeout=30)[STREAM]["next_seq"])


def test_the_archive_holds_every_acknowledged_event_once_after_driver_kills(
    driver: Any, cfg: Config, nats_url: str, spark: Any
) -> None:
    load = Load(nats_url).start()
    try:
        for kill in range(KILLS):
            first = archived_next(driver)
            wait_until(lambda f=first: archived_next(driver) > f + 100, 180, 0.2, what="archiving")
            beat = ray.get(driver.heartbeat.remote(), timeout=30)
            jvms = java_children(beat["pid"])
            assert jvms, "Spark's JVM runs as a child of the driver's process"
            os.kill(beat["pid"], signal.SIGKILL)  # mid-write: the archive flushes every 0.5 s
            gone, alive = psutil.wait_procs(jvms, timeout=30)
            assert not alive, f"kill {kill + 1}: orphan JVM {alive}"
            wait_until(
                lambda b=beat: ray.get(driver.heartbeat.remote(), timeout=5)["pid"] != b["pid"],
                120,
                0.5,
                what=f"restart after kill {kill + 1}",
                swallow=True,
            )
    finally:
        acked = load.stop()
    assert len(acked) > 1000

    def last_seq(nc: Any) -> Any:
        async def go() -> int:
            return int((await nc.jetstream().stream_info(STREAM)).state.last_seq)

        return go()

    end = with_nats(last_seq, nats_url) + 1
    wait_until(
        lambda: archived_next(driver) == end, 300, 0.5, what="archive caught up", swallow=True
    )
    register(spark)
    rows = read_archive(spark, cfg.archive_root(STREAM), STREAM).select("msg_id", "data").collect()
    got = Counter((r.msg_id, hashlib.sha256(r.data.encode()).hexdigest()) for r in rows)
    want = Counter((i, hashlib.sha256(b).hexdigest()) for i, b in acked)
    repeated = {k: n for k, n in got.items() if n > 1}
    assert not repeated, f"archived more than once: {list(repeated)[:5]}"
    missing = want - got
    assert not missing, f"{len(missing)} acknowledged events not archived: {list(missing)[:5]}"
    assert sum(got.values()) == end - 1  # nothing else in the archive either
