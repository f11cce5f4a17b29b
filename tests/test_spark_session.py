"""jobs/spark_session.py and the scheduler pools of jobs/running.py: the analysis driver's
latency settings sit under the config's own, and a query's jobs run in its own pool."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from cluster.demo.meetup import PANEL_TRIGGER_S, TOPN_TRIGGER_S, meetup_jobs
from jobs.running import (
    SHUFFLE_PARTITIONS,
    STAGGER_SPREAD,
    in_pool,
    processing_time,
    staggered,
    state_partitions,
)
from jobs.spark_session import LATENCY_DEFAULTS, POOL_PROPERTY, analysis_conf, query_pool
from runtime.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.mark.unit
def test_the_config_wins_over_the_latency_defaults() -> None:
    conf = analysis_conf({"spark.scheduler.mode": "FIFO", "spark.sql.shuffle.partitions": 4})
    assert conf["spark.scheduler.mode"] == "FIFO"
    assert conf["spark.sql.shuffle.partitions"] == 4
    # FileSystem stays the checksummed LocalFileSystem: RocksDB's snapshot upload casts
    # to it (test_analysis_driver checks that snapshots are made)
    assert "spark.hadoop.fs.file.impl" not in conf
    assert analysis_conf({}) == LATENCY_DEFAULTS


@pytest.mark.unit
def test_demo_top_n_runs_often_and_the_other_panels_less() -> None:
    jobs = {s.name: s.trigger_s for s in meetup_jobs()}
    assert jobs.pop("meetup_topn") == TOPN_TRIGGER_S
    assert set(jobs.values()) == {PANEL_TRIGGER_S}
    assert TOPN_TRIGGER_S < PANEL_TRIGGER_S
    assert {s.trigger_s for s in meetup_jobs(trigger_s=0.25)} == {0.25}
    assert [s.trigger_s for s in meetup_jobs(topn_trigger_s=2, panel_trigger_s=3)][:2] == [2, 3]


@pytest.mark.unit
def test_queries_sharing_an_interval_are_spread_apart_never_run_more_often() -> None:
    asked = {"d": 5.0, "a": 5.0, "c": 5.0, "b": 5.0, "top": 0.5, "fast": 0.0, "x": 2.0}
    every = staggered(asked)
    assert [every[n] for n in "abcd"] == [5.0, 5.312, 5.625, 5.938]  # by name, k/4 of 25%, in ms
    assert (every["top"], every["fast"], every["x"]) == (0.5, 0.0, 2.0)  # alone: as asked
    assert all(asked[n] <= every[n] <= asked[n] * (1 + STAGGER_SPREAD) for n in asked)
    assert len({every[n] for n in "abcd"}) == 4
    assert staggered({"one": 1.0, "two": 1.0}, spread=0.5) == {"one": 1.0, "two": 1.25}
    assert processing_time(every["b"]) == {"processingTime": "5312 milliseconds"}
    assert processing_time(0) == {}


def test_a_query_started_in_a_pool_runs_its_batches_there(spark: Any, tmp_path: Path) -> None:
    """The foreachBatch of a query started inside `in_pool` sees the query's pool (so its
    jobs are scheduled there), and the starting thread's own pool is back afterwards."""
    sc = spark.sparkContext
    seen: list[str | None] = []
    lock = threading.Lock()

    def record(df: Any, batch_id: int) -> None:
        df.count()  # a job, submitted from this batch's thread
        with lock:
            seen.append(df.sparkSession.sparkContext.getLocalProperty(POOL_PROPERTY))

    sc.setLocalProperty(POOL_PROPERTY, "caller")
    try:
        with in_pool(spark, "q1"):
            query = (
                spark.readStream.format("rate")
                .option("rowsPerSecond", 10)
                .load()
                .writeStream.foreachBatch(record)
                .option("checkpointLocation", str(tmp_path / "ckpt"))
                .trigger(processingTime="200 milliseconds")
                .start()
            )
        assert sc.getLocalProperty(POOL_PROPERTY) == "caller"
        try:
            wait_until(lambda: len(seen) >= 2, timeout=120, what="two micro-batches")
        finally:
            query.stop()
    finally:
        sc.setLocalProperty(POOL_PROPERTY, None)  # type: ignore[arg-type]
    with lock:
        assert set(seen) == {query_pool("q1")}, seen


CHECKPOINT_MANAGER = "spark.sql.streaming.checkpointFileManagerClass"


def add_keys(inbox: Path, keys: str) -> None:
    """One more JSON file of `{"k": ...}` rows in `inbox`, one row per character."""
    (inbox / f"{len(list(inbox.iterdir()))}.json").write_text(
        "".join(f'{{"k": "{k}"}}\n' for k in keys)
    )


def start_key_count(spark: Any, inbox: Path, ckpt: Path, record: Any) -> Any:
    """A stateful count per `k` over `inbox`, every batch to `record`, until caught up."""
    return (
        spark.readStream.schema("k string")
        .json(str(inbox))
        .groupBy("k")
        .count()
        .writeStream.outputMode("update")
        .foreachBatch(record)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )


def test_a_stateful_checkpoint_resumes_across_the_checkpoint_file_managers(
    spark: Any, tmp_path: Path
) -> None:
    """`LATENCY_DEFAULTS`' checkpoint file manager is the one a query starts with (a class
    that does not exist fails the start), and a RocksDB-state checkpoint written by Spark's
    default manager resumes exactly under it and back: batch ids go on, counts accumulate."""
    inbox, ckpt = tmp_path / "in", tmp_path / "ckpt"
    inbox.mkdir()
    seen: list[tuple[int, dict[str, int]]] = []

    def record(df: Any, batch_id: int) -> None:
        seen.append((batch_id, {r["k"]: r["count"] for r in df.collect()}))

    def run(manager: str | None, keys: str, where: Path = ckpt) -> None:
        add_keys(inbox, keys)
        if manager is None:
            spark.conf.unset(CHECKPOINT_MANAGER)
        else:
            spark.conf.set(CHECKPOINT_MANAGER, manager)
        try:
            query = start_key_count(spark, inbox, where, record)
            query.awaitTermination(120)
            assert not query.isActive
            assert query.exception() is None
        finally:
            spark.conf.unset(CHECKPOINT_MANAGER)

    ours = LATENCY_DEFAULTS[CHECKPOINT_MANAGER]
    with pytest.raises(Exception, match="NoSuchManager"):
        run(ours.rsplit(".", 1)[0] + ".NoSuchManager", "z", tmp_path / "other")
    (inbox / "0.json").unlink()
    run(None, "aab")
    run(ours, "ac")
    run(None, "b")
    assert seen == [(0, {"a": 2, "b": 1}), (1, {"a": 3, "c": 1}), (2, {"b": 2})]


def test_a_query_keeps_its_state_in_the_partitions_it_was_started_with(
    spark: Any, tmp_path: Path
) -> None:
    """`state_partitions` sets the partitions of a query started inside (the session's own
    setting is back right after), and a restart outside resumes that checkpoint with the
    count it was made with and its counts; a new checkpoint outside takes the session's."""
    inbox = tmp_path / "in"
    inbox.mkdir()
    session_partitions = spark.conf.get(SHUFFLE_PARTITIONS)
    assert session_partitions != "1"
    seen: list[tuple[int, dict[str, int]]] = []

    def record(df: Any, batch_id: int) -> None:
        seen.append((batch_id, {r["k"]: r["count"] for r in df.collect()}))

    def run(keys: str, ckpt: Path, partitions: int) -> int:
        add_keys(inbox, keys)
        with state_partitions(spark, partitions):
            query = start_key_count(spark, inbox, ckpt, record)
        assert spark.conf.get(SHUFFLE_PARTITIONS) == session_partitions
        query.awaitTermination(120)
        assert query.exception() is None
        (state,) = query.lastProgress["stateOperators"]
        return int(state["numShufflePartitions"])

    assert run("aab", tmp_path / "ckpt", 1) == 1
    assert run("ac", tmp_path / "ckpt", 0) == 1  # the checkpoint's count, not the session's
    assert seen == [(0, {"a": 2, "b": 1}), (1, {"a": 3, "c": 1})]
    assert run("", tmp_path / "other", 0) == int(session_partitions)
