"""cluster/demo/meetup.py: the five Meetup queries of docs/contracts.md on real Spark and
nats-server.

Synthetic RSVPs (seeded `RsvpGenerator`) and one malformed event go to the `meetup` stream;
all five queries run at once, in several micro-batches each, and their KV results must
equal `reference` (plain Python over the same RSVPs): exact top-N, windows, per-city counts
and yes/no; distinct members within the HLL bounds.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from cluster.demo.meetup import QUERIES, Recount, meetup_jobs, reference, topic_counts
from cluster.demo.rsvps import RsvpGenerator
from jobs.jetstream import register
from jobs.running import start_job
from jobs.sink import MSG_ID_HEADER, results_by_query
from jobs.sketches import Distinct
from runtime.nats.server import NatsEndpoint
from tests.support import NatsFactory, with_nats

pytestmark = pytest.mark.timeout(300)

N_RSVPS = 1500
_GEN = RsvpGenerator(seed=5)
RSVPS = [_GEN.next() for _ in range(N_RSVPS)]


def kv_by_query(url: str) -> dict[str, dict[str | None, Any]]:
    async def go(nc: Any) -> dict[str, dict[str | None, Any]]:
        return await results_by_query(nc.jetstream())

    return with_nats(go, url)


def result_ids(url: str) -> list[str]:
    """Nats-Msg-Id of every message in the results stream."""

    async def go(nc: Any) -> list[str]:
        js = nc.jetstream()
        total = (await js.stream_info("results")).state.messages
        sub = await js.pull_subscribe(
            "results.>", stream="results", config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        ids: list[str] = []
        for _ in range(1000):
            if len(ids) >= total:
                break
            for m in await sub.fetch(500, timeout=5):
                ids.append(m.headers[MSG_ID_HEADER])
        await sub.unsubscribe()
        return ids

    return with_nats(go, url)


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    server = nats_factory(sync_interval="2m")

    async def setup(nc: Any) -> None:
        js = nc.jetstream()
        for name, subjects in (
            ("meetup", ["raw.meetup"]),
            ("results", ["results.>"]),
            ("deadletter", ["deadletter.>"]),
        ):
            await js.add_stream(StreamConfig(name=name, subjects=subjects, duplicate_window=600))
        acks = []
        for i, r in enumerate(RSVPS):
            if i == 700:
                acks.append(await js.publish_async("raw.meetup", b"\xff not utf-8"))
            body = json.dumps(r).encode()
            headers = {MSG_ID_HEADER: f"rsvp-{r['rsvp_id']}"}
            acks.append(await js.publish_async("raw.meetup", body, headers=headers))
        await asyncio.gather(*acks)

    with_nats(setup, server.url)
    return server.url


@pytest.mark.unit
def test_specs_follow_the_contract() -> None:
    specs = meetup_jobs()
    assert tuple(s.name for s in specs) == QUERIES
    topn = specs[0]
    assert (topn.field, topn.n, topn.capacity) == ("group.group_topics[].topic_name", 10, 100_000)
    window = specs[1].window
    assert window is not None and (window.length, window.slide) == ("5 minutes", "10 seconds")
    assert [s.state_partitions for s in specs] == [0, 1, 1, 1, 1]  # the top-N: the session's


@pytest.mark.unit
def test_reference_puts_each_rsvp_in_thirty_sliding_windows() -> None:
    rsvps = RSVPS[:200]
    full = reference(rsvps, n=10_000)["meetup_topn_window"]
    per_rsvp_topics = sum(len(r["group"]["group_topics"]) for r in rsvps)
    assert sum(t["count"] for w in full.values() for t in w["top"]) == 30 * per_rsvp_topics
    ref = reference(rsvps)
    assert all(w["top"] and len(w["top"]) <= 10 for w in ref["meetup_topn_window"].values())
    assert sum(r["rsvps"] for r in ref["meetup_city_minute"].values()) == 200


@pytest.mark.unit
def test_a_running_recount_answers_at_every_point_as_a_recount_from_scratch() -> None:
    recount = Recount()
    for i, r in enumerate(RSVPS[:400]):
        recount.add(r)
        if i in (0, 199, 399):  # answering leaves the counts as they were
            assert recount.answers() == reference(RSVPS[: i + 1])
            assert recount.answers() == reference(RSVPS[: i + 1])


def test_meetup_queries_equal_the_plain_python_answer(
    spark: Any, nats_url: str, tmp_path: Path
) -> None:
    register(spark)
    nats = NatsEndpoint(nats_url)
    specs = meetup_jobs(max_events_per_trigger=600)  # 1501 sequences: 3 micro-batches
    queries = [start_job(spark, s, nats, tmp_path, trigger={"availableNow": True}) for s in specs]
    for q in queries:
        assert q.awaitTermination(240), f"{q.name} did not finish"
        assert q.exception() is None, q.exception()
    assert min(len(q.recentProgress) for q in queries) >= 3
    session = int(spark.conf.get("spark.sql.shuffle.partitions"))
    for q, s in zip(queries, specs, strict=True):  # the panels' state in one partition
        parts = {int(o["numShufflePartitions"]) for o in q.lastProgress["stateOperators"]}
        assert parts == {s.state_partitions or session}, (s.name, parts)

    got = kv_by_query(nats_url)
    want = reference(RSVPS)
    for name in ("meetup_topn", "meetup_topn_window", "meetup_city_minute", "meetup_responses"):
        assert got[name] == want[name], name
    members = got["meetup_members"]["all"]
    exact = want["meetup_members"]["all"]["distinct"]
    assert members["lower"] <= exact <= members["upper"]
    assert abs(members["distinct"] - exact) <= Distinct(12).relative_error(3) * exact

    # the book's format, exact because the 100000 counters exceed the topics
    top = got["meetup_topn"]["all"]["top"]
    counts = topic_counts(RSVPS)
    assert [t["item"] for t in top] == [t for t, _ in counts.most_common(10)]
    assert all(t["count"] == counts[t["item"]] and t["error"] == 0 for t in top)

    # one result per (query, batch, key): no id repeats, and every id names its query
    ids = result_ids(nats_url)
    assert len(ids) == len(set(ids))
    assert {i.split(":")[0] for i in ids} == set(QUERIES)


def test_space_saving_bounds_hold_with_fewer_counters_than_topics(
    spark: Any, nats_url: str, tmp_path: Path
) -> None:
    register(spark)
    small = msgspec.structs.replace(
        meetup_jobs(max_events_per_trigger=500)[0], name="meetup_topn_small", capacity=64
    )
    q = start_job(spark, small, NatsEndpoint(nats_url), tmp_path, trigger={"availableNow": True})
    assert q.awaitTermination(240) and q.exception() is None
    row = kv_by_query(nats_url)["meetup_topn_small"]["all"]
    counts = topic_counts(RSVPS)
    assert len(counts) > 64 and row["events"] == N_RSVPS
    assert len(row["top"]) == 10
    for t in row["top"]:
        assert t["count"] - t["error"] <= counts[t["item"]] <= t["count"], t
    offset = max(t["error"] for t in row["top"])
    heavy = [t for t, c in counts.most_common(10) if c > offset]
    assert heavy and set(heavy) <= {t["item"] for t in row["top"]}
