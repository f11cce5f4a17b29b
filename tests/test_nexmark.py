"""Nexmark on tierflow: the generator's model, and every query as a sql job whose final
answer equals DuckDB's over the same events (tests/nexmark_oracle.py).

The short form runs here: 3,000 events with out-of-order event times, read in several
micro-batches; `make bench` runs 1,000,000 (tests/bench/bench_nexmark.py).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import msgspec
import pytest

from cluster.nexmark.generator import TOTAL, Generator, event_kind
from cluster.nexmark.load import ensure_streams, load, subjects
from cluster.nexmark.queries import NOT_RUN, QUERIES, nexmark_streams
from jobs.jetstream import register
from jobs.running import start_job
from jobs.sink import results_by_query
from runtime.config import StreamConfig
from runtime.data.sql_jobs import sql_job_query
from runtime.job_specs import decode_spec
from runtime.nats.publisher import JetStreamPublisher, Outgoing
from runtime.nats.server import NatsEndpoint
from tests.nexmark_oracle import FLUSH_GAP_MS, Oracle, load_events, spark_rows
from tests.support import NatsFactory, with_nats

pytestmark = pytest.mark.timeout(600)

N = int(os.environ.get("TIERFLOW_TEST_NEXMARK_EVENTS", "3000"))
GEN = Generator(seed=7, rate=60, disorder=12)  # 50 s of event time, 200 ms out of order


@pytest.mark.unit
def test_the_generator_keeps_nexmarks_proportions_and_is_a_function_of_seed_and_number() -> None:
    kinds = Counter(event_kind(n) for n in range(5 * TOTAL))
    assert kinds == {"person": 5, "auction": 15, "bid": 230}
    assert GEN.event(1234) == GEN.event(1234) != Generator(seed=8).event(1234)
    order = GEN.order(0, 1000)
    assert sorted(order) == list(range(1000)) and order != list(range(1000))
    newest = 0
    for n in order:  # every event is behind the newest seen by less than a group's time
        newest = max(newest, GEN.time_ms(n))
        assert newest - GEN.time_ms(n) < GEN.disorder * 1000 / GEN.rate


@pytest.mark.unit
def test_auctions_and_bids_refer_to_persons_and_auctions_that_exist_or_are_about_to() -> None:
    events = [GEN.event(n) for n in range(20_000)]
    persons = [f["id"] for k, f in events if k == "person"]
    auctions = [f for k, f in events if k == "auction"]
    assert persons == list(range(1000, 1000 + len(persons)))  # ids count up
    assert [a["id"] for a in auctions] == list(range(1000, 1000 + len(auctions)))
    for n, (kind, f) in enumerate(events):
        if kind == "auction":
            assert f["seller"] <= 1000 + n // TOTAL + 10 and 10 <= f["category"] <= 14
            assert f["dateTime"] < f["expires"] <= f["dateTime"] + 20_000
        elif kind == "bid":
            assert f["auction"] <= 1000 + 3 * (n // TOTAL) + 2 + 10
            assert 1 <= f["price"] <= 100_000_000
    hot = Counter(f["auction"] for k, f in events if k == "bid").most_common(1)[0][1]
    assert hot > 100  # hot auctions take a large share, as Nexmark's do


@pytest.mark.unit
def test_queries_that_do_not_run_say_why_and_the_rest_are_checked_sql_jobs() -> None:
    assert {"q4", "q6", "q9", "q12", "q13", "q15", "q16", "q19"} <= set(NOT_RUN)
    assert not set(NOT_RUN) & set(QUERIES)
    for name, sql in QUERIES.items():
        query = sql_job_query(sql, ["person", "auction", "bid"])
        assert query.streams, name


@pytest.fixture(scope="module")
def nexmark(nats_factory: NatsFactory) -> tuple[str, Oracle]:
    server = nats_factory(sync_interval="2m")
    events = load_events(GEN, N)
    flush = events[N:]

    async def setup(nc: Any) -> None:
        await ensure_streams(nc, nexmark_streams())
        from nats.js.api import StreamConfig as JsStream

        await nc.jetstream().add_stream(JsStream(name="results", subjects=["results.>"]))
        report = await load(nc, GEN, 0, N)
        assert report.events == N and report.duplicates == 0
        topics = subjects()
        acked, failed = await JetStreamPublisher(nc).publish_batch(
            [
                Outgoing(f"flush:{kind}", topics[kind], msgspec.json.encode(fields))
                for kind, fields in flush
            ]
        )
        assert len(acked) == len(flush) and not failed

    with_nats(setup, server.url)
    flush_from = GEN.time_ms(N - 1) + FLUSH_GAP_MS
    return server.url, Oracle(events, flush_from)


STREAMS = {k: msgspec.convert(v, StreamConfig) for k, v in nexmark_streams().items()}


@pytest.fixture(scope="module")
def finished(
    spark: Any, nexmark: tuple[str, Oracle], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Every query run to its end at once (availableNow), in several micro-batches per
    stream (the person stream has one event in 50), and the results KV read once."""
    register(spark)
    url, _ = nexmark
    root = tmp_path_factory.mktemp("nexmark")
    running = {}
    for name, sql in QUERIES.items():
        per = 700 if "bid" in sql_job_query(sql, list(STREAMS)).streams else 40
        spec = decode_spec({"name": name, "kind": "sql", "sql": sql, "max_events_per_trigger": per})
        running[name] = start_job(
            spark, spec, NatsEndpoint(url), root, trigger={"availableNow": True}, streams=STREAMS
        )
    for name, query in running.items():
        assert query.awaitTermination(500), f"{name} did not finish"

    async def rows(nc: Any) -> dict[str, Any]:
        return await results_by_query(nc.jetstream())

    return {"queries": running, "kv": with_nats(rows, url)}


@pytest.mark.parametrize("query", sorted(QUERIES, key=lambda q: int(q[1:])))
def test_each_nexmark_query_answers_as_duckdb_does_over_the_same_events(
    nexmark: tuple[str, Oracle], finished: dict[str, Any], query: str
) -> None:
    _, oracle = nexmark
    running = finished["queries"][query]
    assert running.exception() is None
    batches = [p for p in running.recentProgress if p["numInputRows"]]
    assert len(batches) >= 2  # state carried across micro-batches

    got = spark_rows(query, finished["kv"].get(query, {}).values(), oracle.flush_from)
    want = oracle.rows(query)
    assert want, f"{query}: the oracle has no rows; the test's events do not exercise it"
    missing, extra = want - got, got - want
    assert not missing and not extra, (
        f"{query}: {sum(missing.values())} rows missing, e.g. {list(missing)[:3]}; "
        f"{sum(extra.values())} extra, e.g. {list(extra)[:3]}"
    )
