"""jobs/driver.py: the AnalysisDriver actor under SIGKILL, with real Spark, nats-server and Ray.

One driver for the module (Spark in a Ray actor takes ~11 s to its first query). The
acceptance test publishes synthetic Meetup RSVPs (with Nats-Msg-Id) while the driver runs
the five Meetup queries, kills the driver's process three times (SIGKILL to the pid its
heartbeat names; Ray restarts it, `__init__` resumes every query from its checkpoint), and,
once the stream stops and the driver is idle, compares the results in KV with a plain-Python
recomputation over exactly the acknowledged RSVPs. Later tests reuse the same driver for
malformed events and for the `tierflow jobs` functions.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
from nats.js.api import AckPolicy, ConsumerConfig

from cluster.analysis import get_driver, jobs_list, jobs_start, jobs_stop, resolve_jobs
from cluster.demo.meetup import PANEL_TRIGGER_S, QUERIES, meetup_jobs, reference, topic_counts
from cluster.demo.rsvps import RsvpGenerator
from jobs.archive import queries_root
from jobs.driver import (
    DRIVER_NAME,
    AnalysisDriverError,
    backoff_s,
    committed,
    default_master,
    progress_summary,
    query_triggers,
)
from jobs.sink import MSG_ID_HEADER, SOURCE_SEQ_HEADER, results_by_query
from jobs.sketches import Distinct
from jobs.standby import standby_name
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.job_specs import deadletter_query_name
from runtime.waiting import wait_until
from tests.support import MEETUP_STREAMS, BackgroundLoad, NatsFactory, running_driver, with_nats

pytestmark = pytest.mark.timeout(900)

RATE_PER_S = 60
# kills of the driver, each this long after the last progress: three in `make chaos`, the
# short form in `make test` is the middle one (each kill costs a restarted JVM, ~40 s here)
KILL_DELAYS_S = (0.0, 0.7, 1.9)
SHORT_KILL_DELAYS_S = (0.7,)
MIN_PUBLISHED = 1000  # RSVPs the results are checked against after the kills
DL = deadletter_query_name("meetup")


# --------------------------------------------------------------------------- helpers


class Publisher(BackgroundLoad):
    """Publishes RSVPs at a steady rate on its own loop; `sent` holds the acknowledged ones.

    A publish that is not acknowledged is retried with the same Nats-Msg-Id (JetStream
    drops a repeat), a bounded number of times; a final failure fails the test.
    """

    def __init__(self, url: str, seed: int = 11) -> None:
        super().__init__(url)
        self.gen = RsvpGenerator(seed=seed)
        self.sent: list[dict[str, Any]] = []

    def stop(self) -> list[dict[str, Any]]:
        self.join()
        return self.sent

    async def main(self, nc: Any) -> None:
        js = nc.jetstream(timeout=10)
        per_tick = max(1, RATE_PER_S // 10)
        while not self.stopping:
            batch = [self.gen.next() for _ in range(per_tick)]
            await asyncio.gather(*(self._publish(js, r) for r in batch))
            self.sent.extend(batch)
            await asyncio.sleep(0.1)

    async def _publish(self, js: Any, rsvp: dict[str, Any]) -> None:
        body = json.dumps(rsvp).encode()
        headers = {MSG_ID_HEADER: f"rsvp-{rsvp['rsvp_id']}"}
        for attempt in range(5):
            try:
                await js.publish("raw.meetup", body, headers=headers)
                return
            except Exception:
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5)


def kv_by_query(url: str) -> dict[str, dict[str | None, Any]]:
    async def go(nc: Any) -> dict[str, dict[str | None, Any]]:
        return await results_by_query(nc.jetstream())

    return with_nats(go, url)


def stream_headers(url: str, stream: str) -> list[dict[str, str]]:
    """The headers of every message in `stream`, in order."""

    async def go(nc: Any) -> list[dict[str, str]]:
        js = nc.jetstream()
        total = (await js.stream_info(stream)).state.messages
        sub = await js.pull_subscribe(
            ">", stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        out: list[dict[str, str]] = []
        for _ in range(1000):
            if len(out) >= total:
                break
            out += [dict(m.headers or {}) for m in await sub.fetch(1000, timeout=5)]
        await sub.unsubscribe()
        return out

    return with_nats(go, url)


def java_children(pid: int) -> list[psutil.Process]:
    """The JVMs among a process's descendants (Spark's driver JVM for the actor)."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "java" in p.name():
                out.append(p)
        except psutil.NoSuchProcess:  # a short-lived child (a Python worker) went away
            continue
    return out


def status(driver: Any) -> dict[str, Any]:
    return ray.get(driver.status.remote(), timeout=30)


def active_driver(driver: Any) -> dict[str, Any]:
    """Who is active of the driver's warm pair (the status answers for it), once running."""
    st = status(driver)
    assert st.get("role") == "active" and st["state"] == "running", st
    return st


def pair_roles(cfg: Config) -> list[dict[str, Any]]:
    """Each driver of the pair's own answer (its role, not the active one's status)."""
    names = (DRIVER_NAME, standby_name(DRIVER_NAME))
    handles = [ray.get_actor(n, namespace=cfg.ray.namespace) for n in names]
    return ray.get([h.role_info.remote() for h in handles], timeout=10)


def committed_seqs(driver: Any) -> dict[str, int]:
    """Committed end sequence per query; only when every query has committed a batch."""
    queries = status(driver)["queries"]
    seqs = {n: q.get("committed_seq") for n, q in queries.items()}
    if set(seqs) != {*QUERIES, DL} or any(s is None for s in seqs.values()):
        return {}
    return seqs  # type: ignore[return-value]


def await_idle(driver: Any, timeout: float = 300.0) -> None:
    idle = ray.get(driver.await_idle.remote(timeout), timeout=timeout + 30)
    assert idle["idle"], idle


def check_results(url: str, sent: list[dict[str, Any]]) -> None:
    got = kv_by_query(url)
    want = reference(sent)
    for name in ("meetup_topn", "meetup_topn_window", "meetup_city_minute", "meetup_responses"):
        assert got[name] == want[name], name
    top = got["meetup_topn"]["all"]
    counts = topic_counts(sent)
    assert top["events"] == len(sent)
    for t in top["top"]:  # Space-Saving bounds; exact here (capacity >= distinct topics)
        assert t["count"] - t["error"] <= counts[t["item"]] <= t["count"]
        assert t["error"] == 0
    members = got["meetup_members"]["all"]
    exact = want["meetup_members"]["all"]["distinct"]
    assert abs(members["distinct"] - exact) <= Distinct(12).relative_error(3) * exact, members


# --------------------------------------------------------------------------- pure parts


@pytest.mark.unit
def test_committed_reads_the_last_commit_and_its_offsets(tmp_path: Path) -> None:
    assert committed(tmp_path) is None
    (tmp_path / "commits").mkdir()
    (tmp_path / "offsets").mkdir()
    assert committed(tmp_path) is None
    for batch, seq in ((0, 11), (1, 42), (2, 99)):
        meta = '{"batchWatermarkMs":0}'
        (tmp_path / "offsets" / str(batch)).write_text(f'v1\n{meta}\n{{"seq": {seq}}}')
    for batch in (0, 1):  # batch 2 was planned, not committed
        (tmp_path / "commits" / str(batch)).write_text("v1\n{}")
    assert committed(tmp_path) == (1, {"seq": 42})


@pytest.mark.unit
def test_policy_helpers() -> None:
    assert [backoff_s(n) for n in (1, 2, 3, 6, 50)] == [1.0, 2.0, 4.0, 30.0, 30.0]
    cfg = load(environ={})
    assert default_master(cfg) == "local[4]"
    assert default_master(load(environ={}, overrides={"spark": {"master": "spark://h:7077"}}))
    assert progress_summary(None) == {}
    row = progress_summary(
        {
            "batchId": 3,
            "numInputRows": 10,
            "inputRowsPerSecond": 5.04,
            "processedRowsPerSecond": 20.0,
            "durationMs": {"triggerExecution": 500},
            "eventTime": {"watermark": "2016-09-06T10:52:00.000Z"},
        }
    )
    assert (row["batch_id"], row["latency_ms"], row["input_rows_per_s"]) == (3, 500, 5.0)


@pytest.mark.unit
def test_the_demo_panels_do_not_start_their_batches_together() -> None:
    jobs = {s.name: s for s in meetup_jobs()}
    every = query_triggers(jobs)
    assert set(every) == set(jobs)  # dead letters are a scan without Spark batches
    assert every["meetup_topn"] == jobs["meetup_topn"].trigger_s  # alone at its interval
    slow = [every[n] for n in QUERIES[1:]]
    assert len(set(slow)) == len(slow)  # four intervals: Spark aligns each to its multiples
    assert all(PANEL_TRIGGER_S <= t <= PANEL_TRIGGER_S * 1.25 for t in slow)


@pytest.mark.unit
def test_progress_timestamps_read_as_epoch_seconds() -> None:
    from jobs.driver_status import epoch_s as _epoch_s

    assert _epoch_s("2026-11-24T06:07:11.500Z") == 1795500431.5
    assert _epoch_s(None) == 0.0 and _epoch_s("") == 0.0


@pytest.mark.unit
def test_jobs_resolve_from_the_catalog_or_a_spec() -> None:
    cfg = load(environ={}, overrides={"streams": MEETUP_STREAMS})
    assert [s.name for s in resolve_jobs(cfg, "meetup")] == list(QUERIES)
    assert resolve_jobs(cfg, "meetup_topn")[0].capacity == 100_000
    (spec,) = resolve_jobs(cfg, "name=x kind=distinct stream=meetup field=member.member_id")
    assert spec.kind == "distinct"
    with pytest.raises(AnalysisDriverError, match="unknown job 'nope'"):
        resolve_jobs(cfg, "nope")


def test_meetup_entrypoint_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "python -m cluster.demo" in out.stdout and "--nats-url" in out.stdout


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    # Spark is what gets killed here, never NATS: fsync every 2 minutes is enough.
    return nats_factory(sync_interval="2m").url


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory, nats_url: str) -> Config:
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("driver-state")),
            "nats": {"url": nats_url},
            "streams": MEETUP_STREAMS,
            # not the test process's own namespace: the pair finds each other by the config
            "ray": {"namespace": "tierflow-tests-driver"},
            # a warm pair (jobs/standby.py): each SIGKILL of the active driver is a
            # takeover by the standby, and the killed one comes back as the standby
            "spark": {
                "master": "local[2]",
                "conf": {
                    "spark.sql.shuffle.partitions": 2,
                    # RocksDB snapshots within the module's run (defaults: every 10
                    # changelogs, maintenance each minute)
                    "spark.sql.streaming.stateStore.maintenanceInterval": "5s",
                    "spark.sql.streaming.stateStore.minDeltasForSnapshot": 3,
                },
                "standby": True,
            },
        },
    )
    with_nats(lambda nc: ensure_streams(nc, cfg), nats_url)
    return cfg


@pytest.fixture(scope="module")
def driver(ray_module: Any, cfg: Config, nats_url: str) -> Iterator[Any]:
    with running_driver(cfg, nats_url, meetup_jobs(trigger_s=0.5)) as handle:
        yield handle


@pytest.fixture(scope="module")
def published(nats_url: str) -> list[dict[str, Any]]:
    """Every RSVP acknowledged so far by the module's tests (the recomputation's input)."""
    return []


# --------------------------------------------------------------------------- tests


@pytest.mark.chaos
def test_results_survive_sigkills_of_the_driver(
    driver: Any,
    cfg: Config,
    nats_url: str,
    published: list[dict[str, Any]],
    request: pytest.FixtureRequest,
) -> None:
    full = "chaos" in (request.config.getoption("markexpr") or "")
    publisher = Publisher(nats_url).start()
    try:
        wait_until(lambda: committed_seqs(driver), 240, 0.5, what="every query's first batch")
        for kill, delay in enumerate(KILL_DELAYS_S if full else SHORT_KILL_DELAYS_S):
            time.sleep(delay)  # kill at different points of a micro-batch
            before = wait_until(lambda: committed_seqs(driver), 60, 0.2, what="positions")
            beat = active_driver(driver)  # either of the pair's names answers for the active
            jvms = java_children(beat["pid"])
            assert jvms, "Spark's JVM runs as a child of the driver's process"
            killed_at = time.time()
            os.kill(beat["pid"], signal.SIGKILL)
            # the JVM dies with its actor: no orphan keeps running the old queries
            gone, alive = psutil.wait_procs(jvms, timeout=30)
            assert not alive, f"kill {kill + 1}: orphan JVM {alive}"
            took = wait_until(
                lambda b=beat: (a := active_driver(driver))["pid"] != b["pid"] and a,
                120,
                0.5,
                what=f"the standby's takeover after kill {kill + 1}",
                swallow=True,
            )
            # the standby, up before the kill, took over (Ray did not start it for this),
            # after the killed driver's JVM had gone
            assert took["started_at"] < killed_at < took["took_over"]["at"], took
            assert took["took_over"]["old_jvm"] in ("none", "killed"), took
            print(f"kill {kill + 1}: took over {took['took_over']}, killed at {killed_at:.3f}")
            wait_until(
                lambda b=before: (s := committed_seqs(driver)) and all(s[n] > b[n] for n in b),
                240,
                0.5,
                what=f"every query's progress after kill {kill + 1}",
                swallow=True,
            )
        # the killed driver came back (Ray restarted it) as the standby: one active (its
        # Spark starts once the active one has run its first batches: not waited for here)
        wait_until(
            lambda: sorted(r["role"] for r in pair_roles(cfg)) == ["active", "standby"],
            180,
            0.5,
            what="the killed driver back as the standby",
            swallow=True,
        )
        # a quick takeover ends the kills before much was sent: the load goes on until the
        # check below has over 1,000 RSVPs to count (it failed at ~850 on a fast, idle box)
        wait_until(
            lambda: len(published) + len(publisher.sent) > MIN_PUBLISHED,
            120,
            0.2,
            what=f"over {MIN_PUBLISHED} RSVPs published across the kills",
        )
    finally:
        published.extend(publisher.stop())
    assert len(published) > MIN_PUBLISHED
    await_idle(driver)
    st = status(driver)
    assert st["incarnation"] != beat["incarnation"] and st["state"] == "running"
    assert all(q["state"] == "running" for q in st["queries"].values()), st["queries"]
    check_results(nats_url, published)
    # the results stream holds each (query, batch, key) once: messages == distinct ids
    ids = [h[MSG_ID_HEADER] for h in stream_headers(nats_url, "results")]
    assert ids and len(ids) == len(set(ids))
    assert {i.split(":")[0] for i in ids} == set(QUERIES)


def test_the_queries_state_stores_make_snapshots(driver: Any, cfg: Config) -> None:
    """Spark's RocksDB state store uploads a snapshot every few changelogs, so a restarted
    or taken-over query loads a snapshot and a few changelogs, not every changelog since its
    first batch. (With the raw local file system as `fs.file.impl`, every upload failed
    on a cast Spark logs and ignores: no snapshot, ever.)"""
    state = queries_root(cfg) / "meetup_topn" / "state"
    assert state.is_dir()
    snapshots = wait_until(
        lambda: list(state.rglob("*.zip")),
        90,
        0.5,
        what="a RocksDB snapshot in the top-N's state checkpoint",
    )
    assert all(p.stat().st_size > 0 for p in snapshots)


def test_progress_splits_each_batchs_foreach_batch_time(driver: Any) -> None:
    """Spark's progress counts the whole foreachBatch as addBatch; the driver's `progress`
    adds its parts (the Spark job and rows to Python, the plan's shaping, publishing), so a
    slow batch says whether Spark or the sink took the time."""
    rows = wait_until(
        lambda: [
            r
            for r in ray.get(driver.progress.remote(0.0), timeout=30).get("meetup_topn", [])
            if r["input_rows"] and "fb_collect" in r["durations"]
        ],
        60,
        0.5,
        what="a top-N batch with its foreachBatch parts",
    )
    for r in rows:
        d = r["durations"]
        parts = [d["fb_collect"], d["fb_shape"], d["fb_publish"]]
        assert all(p >= 0 for p in parts) and d["fb_collect"] > 0, d
        assert sum(parts) <= d["addBatch"] + 1, d  # within addBatch (ms rounding)


def test_malformed_events_are_counted_and_dead_lettered_and_queries_go_on(
    driver: Any, nats_url: str, published: list[dict[str, Any]]
) -> None:
    gen = RsvpGenerator(seed=99, start_ms=published[-1]["mtime"] + 1)
    more = [gen.next() for _ in range(40)]

    async def go(nc: Any) -> list[int]:
        js = nc.jetstream()
        seqs = []
        for i, bad in enumerate((b"\xff\xfe not utf-8", b'{"venue": ')):
            ack = await js.publish("raw.meetup", bad, headers={MSG_ID_HEADER: f"bad-{i}"})
            seqs.append(ack.seq)
        for r in more:
            headers = {MSG_ID_HEADER: f"late-rsvp-{r['rsvp_id']}"}
            await js.publish("raw.meetup", json.dumps(r).encode(), headers=headers)
        return seqs

    bad_seqs = with_nats(go, nats_url)
    published.extend(more)
    await_idle(driver)
    st = status(driver)
    assert st["dead_letters"] == {"meetup": 2}
    assert all(q["state"] == "running" for q in st["queries"].values()), st["queries"]
    dead = stream_headers(nats_url, "deadletter")
    assert [h[MSG_ID_HEADER] for h in dead] == [f"dl:meetup:{s}" for s in bad_seqs]
    assert [h[SOURCE_SEQ_HEADER] for h in dead] == [str(s) for s in bad_seqs]
    check_results(nats_url, published)


def test_jobs_list_start_stop_through_the_cli_functions(
    driver: Any, cfg: Config, nats_url: str, published: list[dict[str, Any]]
) -> None:
    assert get_driver(cfg) is not None and DRIVER_NAME == "tierflow-analysis"
    rows = {r["name"]: r for r in jobs_list(cfg)}
    assert {*QUERIES, DL} <= set(rows) and rows["meetup_topn"]["state"] == "running"

    (stopped,) = jobs_stop(cfg, "meetup_members")
    assert stopped == {"name": "meetup_members", "was_running": True, "stopped": True}
    assert {r["name"]: r for r in jobs_list(cfg)}["meetup_members"]["state"] == "available"

    (started,) = jobs_start(cfg, "name=by_response kind=count stream=meetup by=response")
    assert started["state"] == "running", started
    again = jobs_start(cfg, "meetup_members")[0]  # resumes from its checkpoint
    assert again["state"] == "running", again
    await_idle(driver)
    yes = sum(1 for r in published if r["response"] == "yes")
    assert kv_by_query(nats_url)["by_response"]["yes"] == {
        "key": "yes",
        "response": "yes",
        "count": yes,
    }
    check_results(nats_url, published)
    assert ray.get(driver.stop.remote("by_response"), timeout=90)["stopped"]
    assert "by_response" not in status(driver)["queries"]


def test_a_driver_whose_every_query_keeps_dying_restarts_its_process(
    ray_module: Any, tmp_path: Path, nats_url: str
) -> None:
    """Faults that live in the driver's JVM (Spark's streaming source runner once corrupted
    a map every task carries) outlast any number of query restarts: when every query has
    died `spark.restart_after_failures` times in a row the driver exits and Ray starts it in
    a new process, once, and records when (jobs/escalation.py)."""
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path / "state"),
            "nats": {"url": nats_url},
            # a namespace of its own: start_driver returns the module's driver by its name
            "ray": {"namespace": "tierflow-tests-escalation"},
            "streams": {"nowhere": {"subjects": ["raw.nowhere"]}},  # never created in NATS
            "spark": {"master": "local[1]", "restart_after_failures": 1},
        },
    )
    job = {"name": "count_nowhere", "stream": "nowhere", "kind": "count", "by": ["k"]}
    with running_driver(cfg, nats_url, [job]) as handle:
        # the first process dies as soon as both queries have died once
        escalated = wait_until(
            lambda: status(handle)["escalated_at"],
            120,
            0.5,
            what="the driver's escalation",
            swallow=True,
        )
        beat = ray.get(handle.heartbeat.remote(), timeout=30)
        assert beat["started_at"] >= escalated, "the answering process started after it"
        # the new process read the time back from its checkpoint: it will not escalate
        # again within the interval (jobs/escalation.py, tests/test_escalation.py)
        assert status(handle)["escalated_at"] == escalated
