"""Sql jobs in the analysis driver (a real Ray actor, Spark and nats-server): a refused query
fails `start` with Spark's reason and is never wanted; a started one runs, is explained, and
counts its late events in the driver's status and the admin's /metrics."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.admin import StatusMetrics
from jobs.sink import MSG_ID_HEADER
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.errors import JobError
from runtime.waiting import wait_until
from tests.support import NatsFactory, kv_results, running_driver, with_nats

pytestmark = pytest.mark.timeout(600)

T0 = 1_700_000_000_000
EVENTS = [{"user": f"u{i % 4}", "n": i, "t": T0 + i * 100} for i in range(400)]
LATE = {"user": "u0", "n": -1, "t": T0}  # 40 s behind the newest: past a 5 s watermark
TOTALS = "SELECT user, count(*) AS events, sum(n) AS total FROM clicks GROUP BY user"
WINDOWED = (
    "SELECT window(t, '10 seconds') AS w, count(*) AS events FROM clicks "
    "GROUP BY window(t, '10 seconds')"
)


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    return nats_factory(sync_interval="2m").url


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory, nats_url: str) -> Config:
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("sql-driver")),
            "nats": {"url": nats_url},
            "ray": {"namespace": "tierflow-tests-sql-driver"},
            "streams": {
                "clicks": {
                    "subjects": ["raw.clicks"],
                    "schema": "user STRING, n BIGINT, t BIGINT",
                    "event_time": "t",
                    "watermark": "5 seconds",
                }
            },
            "spark": {"master": "local[2]"},
        },
    )
    with_nats(lambda nc: ensure_streams(nc, cfg), nats_url)
    return cfg


async def publish(nc: Any, events: list[dict[str, Any]], tag: str) -> None:
    js = nc.jetstream()
    for i, ev in enumerate(events):
        await js.publish(
            "raw.clicks", json.dumps(ev).encode(), headers={MSG_ID_HEADER: f"{tag}{i}"}
        )


def test_the_driver_refuses_runs_and_explains_sql_jobs(
    ray_module: Any, cfg: Config, nats_url: str, tmp_path: Path
) -> None:
    with running_driver(cfg, nats_url) as driver:
        # refused at start, with Spark's reason and the fix; never wanted
        sorted_job = {"name": "sorted", "kind": "sql", "sql": "SELECT n FROM clicks ORDER BY n"}
        with pytest.raises(JobError, match="Sorting is not supported") as err:
            ray.get(driver.start.remote(sorted_job, 60.0), timeout=120)
        assert "ORDER BY only over an aggregation" in str(err.value)
        secret = {"name": "secret", "kind": "sql", "sql": "SELECT * FROM json.`/etc/passwd`"}
        with pytest.raises(JobError, match="without a qualifier"):
            ray.get(driver.start.remote(secret, 60.0), timeout=120)
        assert set(ray.get(driver.jobs.remote(), timeout=30)) == set()

        with_nats(lambda nc: publish(nc, EVENTS, "e"), nats_url)
        for name, sql in (("totals", TOTALS), ("per_window", WINDOWED)):
            job = {"name": name, "kind": "sql", "sql": sql, "trigger_s": 0.5}
            row = ray.get(driver.start.remote(job, 120.0), timeout=180)
            assert row["state"] == "running", row
        want = Counter(e["user"] for e in EVENTS)
        wait_until(
            lambda: {k: v["events"] for k, v in kv_results(nats_url, "totals").items()} == want,
            120,
            0.5,
            what="the totals job's answer",
            swallow=True,  # the results bucket is made with the first result
        )
        totals = kv_results(nats_url, "totals")
        assert {k: v["total"] for k, v in totals.items()} == {
            u: sum(e["n"] for e in EVENTS if e["user"] == u) for u in want
        }
        # once the windowed job has counted every event, its watermark is past LATE's time:
        # published now, LATE is dropped and counted
        wait_until(
            lambda: (
                sum(v["events"] for v in kv_results(nats_url, "per_window").values()) == len(EVENTS)
            ),
            120,
            0.5,
            what="the windowed job's answer",
            swallow=True,
        )
        with_nats(lambda nc: publish(nc, [LATE], "late"), nats_url)

        def late() -> int:
            queries = ray.get(driver.status.remote(), timeout=30)["queries"]
            return int(queries["per_window"].get("late_events") or 0)

        wait_until(lambda: late() == 1, 120, 0.5, what="the late event counted")
        metrics = StatusMetrics()
        rows = [{"name": n, **q} for n, q in ray.get(driver.status.remote())["queries"].items()]
        metrics.update({"analysis": {"queries": rows}})
        text = metrics.render().decode()
        assert 'tierflow_analysis_late_events{query="per_window"} 1.0' in text

        explained = ray.get(driver.explain.remote("per_window"), timeout=120)
        assert explained["output_mode"] == "update"
        assert explained["streams"]["clicks"] == {"event_time": "t", "watermark": "5 seconds"}
        assert explained["key"] == "w" and explained["late_events"] == 1
        operators = {s["operator"] for s in explained["state"]}
        assert "dedupeWithinWatermark" in operators and explained["watermark"]
        assert "clicks" in explained["sql"] and explained["plan"]
