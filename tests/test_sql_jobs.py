"""Continuous SQL jobs (kind sql): windows, joins, late events and refusals, on real Spark
and a real nats-server; each answer compared with a plain-Python recount of the events.

Two streams of a small auction: 20 auctions, one a second, and 300 bids, one every 200 ms,
each bid on auction i % 20. Jobs read them with `availableNow` in micro-batches of 50
events (`max_events_per_trigger`), so state carried across batches and the watermark
moving between them are exercised.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.api import StreamConfig as JsStream

from jobs.jetstream import register
from jobs.running import start_job
from jobs.sink import MSG_ID_HEADER
from jobs.windows import late_count
from runtime.config import StreamConfig, load
from runtime.data.sql_check import SqlRefused
from runtime.data.sql_jobs import job_streams, sql_job_query
from runtime.errors import ConfigError, JobError
from runtime.job_specs import decode_spec, parse_job
from runtime.nats.server import NatsEndpoint
from tests.support import NatsFactory, kv_results, with_nats

pytestmark = pytest.mark.timeout(300)

T0 = 1_700_000_000_000  # ms, a multiple of 10 s
AUCTIONS = [
    {"id": i, "seller": i % 3, "category": i % 4, "dateTime": T0 + i * 1000} for i in range(20)
]
BIDS = [
    {"auction": i % 20, "bidder": i % 7, "price": round(i * 1.5, 1), "dateTime": T0 + i * 200}
    for i in range(300)
]
# bidder 100's bids in three bursts, gaps of 8 s between (sessions with a 5 s gap)
BURSTS = [T0 + s for s in (0, 1000, 2000, 10_000, 11_000, 19_000)]
SESSION_BIDS = [{"auction": 0, "bidder": 100, "price": 1.0, "dateTime": t} for t in BURSTS] + [
    {"auction": 0, "bidder": 101, "price": 1.0, "dateTime": T0 + 120_000}
]  # moves time on
SCHEMAS = {
    "bid": "auction BIGINT, bidder BIGINT, price DOUBLE, dateTime BIGINT",
    "auction": "id BIGINT, seller BIGINT, category BIGINT, dateTime BIGINT",
}


def streams(watermark: str = "5 seconds") -> dict[str, StreamConfig]:
    out = {
        name: StreamConfig(
            subjects=[f"raw.{name}"], schema=schema, event_time="dateTime", watermark=watermark
        )
        for name, schema in SCHEMAS.items()
    }
    out["sbid"] = msgspec.structs.replace(out["bid"], subjects=["raw.sbid"])
    out["lbid"] = msgspec.structs.replace(out["bid"], subjects=["raw.lbid"])
    return out


LATE = {"auction": 1, "bidder": 1, "price": 999.0, "dateTime": T0 + 1000}


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    server = nats_factory(sync_interval="2m")

    async def setup(nc: Any) -> None:
        js = nc.jetstream()
        for name in (*SCHEMAS, "sbid", "lbid"):
            await js.add_stream(JsStream(name=name, subjects=[f"raw.{name}"]))
        await js.add_stream(JsStream(name="results", subjects=["results.>"]))

        async def put(stream: str, events: list[dict[str, Any]], tag: str) -> None:
            for i, ev in enumerate(events):
                await js.publish(
                    f"raw.{stream}", json.dumps(ev).encode(), headers={MSG_ID_HEADER: f"{tag}{i}"}
                )

        await put("auction", AUCTIONS, "a")
        await put("bid", BIDS, "b")
        await put("sbid", SESSION_BIDS, "s")
        # the late bid comes after the watermark passed 60 s: it is 59 s behind it
        await put("lbid", [*BIDS, LATE], "l")
        await js.publish("raw.bid", b'{"auction": ', headers={MSG_ID_HEADER: "broken"})

    with_nats(setup, server.url)
    return server.url


@pytest.fixture(scope="module")
def sp(spark: Any) -> Any:
    register(spark)
    return spark


def run(sp: Any, url: str, ckpt: Path, **spec: Any) -> Any:
    job = decode_spec({"kind": "sql", "max_events_per_trigger": 50, **spec})
    query = start_job(
        sp, job, NatsEndpoint(url), ckpt, trigger={"availableNow": True}, streams=streams()
    )
    assert query.awaitTermination(240), f"{job.name} did not finish"
    assert query.exception() is None
    return query


def iso(ms: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_tumbling_window_per_auction_equals_a_recount(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    run(
        sp,
        nats_url,
        tmp_path,
        name="per_auction",
        sql="SELECT window(dateTime, '10 seconds') AS w, auction, count(*) AS n, "
        "max(price) AS top FROM bid GROUP BY window(dateTime, '10 seconds'), auction",
    )
    want: dict[str, tuple[int, float]] = {}
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for b in BIDS:
        groups[(b["dateTime"] // 10_000 * 10_000, b["auction"])].append(b["price"])
    for (start, auction), prices in groups.items():
        want[f"{iso(start)}|{auction}"] = (len(prices), max(prices))
    got = kv_results(nats_url, "per_auction")
    assert {k: (v["n"], v["top"]) for k, v in got.items()} == want
    some = next(iter(got.values()))
    assert set(some["w"]) == {"start", "end"} and some["key"].startswith(some["w"]["start"])


def test_an_interval_join_of_two_streams_emits_each_matching_pair_once(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    query = run(
        sp,
        nats_url,
        tmp_path,
        name="joined",
        sql="SELECT b.auction, b.price, a.seller FROM bid b JOIN auction a ON b.auction = a.id "
        "AND b.dateTime BETWEEN a.dateTime AND a.dateTime + INTERVAL 10 SECONDS",
    )
    by_id = {a["id"]: a for a in AUCTIONS}
    want = Counter(
        (b["auction"], b["price"], by_id[b["auction"]]["seller"])
        for b in BIDS
        if by_id[b["auction"]]["dateTime"]
        <= b["dateTime"]
        <= by_id[b["auction"]]["dateTime"] + 10_000
    )
    got = Counter(
        (r["auction"], r["price"], r["seller"]) for r in kv_results(nats_url, "joined").values()
    )
    assert sum(want.values()) > 20 and got == want
    ops = {op["operatorName"] for p in query.recentProgress for op in p["stateOperators"]}
    assert "symmetricHashJoin" in ops  # a stream-stream join, state kept on both sides


def test_a_join_then_a_window_aggregates_the_joined_rows_per_window(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    run(
        sp,
        nats_url,
        tmp_path,
        name="by_category",
        sql="SELECT window(b.dateTime, '10 seconds') AS w, a.category, count(*) AS n "
        "FROM bid b JOIN auction a ON b.auction = a.id AND b.dateTime BETWEEN a.dateTime "
        "AND a.dateTime + INTERVAL 10 SECONDS GROUP BY window(b.dateTime, '10 seconds'), "
        "a.category",
    )
    by_id = {a["id"]: a for a in AUCTIONS}
    counts: Counter[str] = Counter()
    last = max(b["dateTime"] for b in BIDS)
    for b in BIDS:
        a = by_id[b["auction"]]
        start = b["dateTime"] // 10_000 * 10_000
        # append mode: a window is out once the watermark (last time - 5 s) passes its end
        if (
            a["dateTime"] <= b["dateTime"] <= a["dateTime"] + 10_000
            and start + 10_000 <= last - 5000
        ):
            counts[f"{iso(start)}|{a['category']}"] += 1
    got = {k: v["n"] for k, v in kv_results(nats_url, "by_category").items()}
    assert counts and got == dict(counts)


def test_session_windows_close_after_their_gap(sp: Any, nats_url: str, tmp_path: Path) -> None:
    run(
        sp,
        nats_url,
        tmp_path,
        name="sessions",
        sql="SELECT session_window(dateTime, '5 seconds') AS s, bidder, count(*) AS n "
        "FROM sbid GROUP BY session_window(dateTime, '5 seconds'), bidder",
    )
    got = {
        (v["bidder"], v["s"]["start"], v["s"]["end"], v["n"])
        for v in kv_results(nats_url, "sessions").values()
    }
    # bursts 0-2 s, 10-11 s and 19 s; each session ends 5 s after its last bid. Bidder
    # 101's session is still open: the watermark has not passed its end
    assert got == {
        (100, iso(T0), iso(T0 + 7000), 3),
        (100, iso(T0 + 10_000), iso(T0 + 16_000), 2),
        (100, iso(T0 + 19_000), iso(T0 + 24_000), 1),
    }


def test_events_later_than_the_watermark_are_counted_and_left_out(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    query = run(
        sp,
        nats_url,
        tmp_path,
        name="late_counted",
        sql="SELECT window(dateTime, '10 seconds') AS w, count(*) AS n, sum(price) AS total "
        "FROM lbid GROUP BY window(dateTime, '10 seconds')",
    )
    assert late_count(query.recentProgress) == 1
    got = {k: (v["n"], v["total"]) for k, v in kv_results(nats_url, "late_counted").items()}
    want: dict[str, list[float]] = defaultdict(list)
    for b in BIDS:  # the late bid is in none of them
        want[iso(b["dateTime"] // 10_000 * 10_000)].append(b["price"])
    assert got == {k: (len(v), pytest.approx(sum(v))) for k, v in want.items()}


def test_a_projection_keeps_every_event_once_with_its_event_time(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    run(
        sp,
        nats_url,
        tmp_path,
        name="euros",
        sql="SELECT auction, bidder, price * 0.908 AS euros, dateTime, _seq FROM bid "
        "WHERE price > 100",
    )
    got = sorted(
        (r["_seq"], r["auction"], r["dateTime"]) for r in kv_results(nats_url, "euros").values()
    )
    want = [(i + 1, b["auction"], iso(b["dateTime"]).replace("Z", "")) for i, b in enumerate(BIDS)]
    want = [(s, a, t) for (s, a, t), b in zip(want, BIDS, strict=True) if b["price"] > 100]
    assert [(s, a) for s, a, _ in got] == [(s, a) for s, a, _ in want]
    assert all(t.startswith(w) for (_, _, t), (_, _, w) in zip(got, want, strict=True))


@pytest.mark.parametrize(
    ("sql", "mode", "words"),
    [
        ("SELECT auction, price FROM bid ORDER BY price", "update", "Sorting is not supported"),
        ("SELECT auction, count(*) AS n FROM bid GROUP BY auction", "append", "watermark"),
        ("SELECT count(DISTINCT bidder) AS n FROM bid", "update", "Distinct aggregations"),
    ],
)
def test_a_query_spark_cannot_run_incrementally_is_refused_with_the_fix(
    sp: Any, nats_url: str, tmp_path: Path, sql: str, mode: str, words: str
) -> None:
    from jobs.running import read_stream
    from jobs.sql_jobs import plan_sql_job

    cfg = streams(watermark="") if mode == "append" else streams()
    spec = decode_spec({"name": "refused", "kind": "sql", "sql": sql, "output_mode": mode})
    source = {"bid": read_stream(sp, NatsEndpoint(nats_url), "bid")}
    with pytest.raises(JobError, match=words) as err:
        plan_sql_job(sp, spec, cfg, source)
    assert "cannot run this query incrementally" in str(err.value)
    assert "tf_sqljob_" not in str(err.value)  # the stream's own name, not the view's
    if mode == "append":
        assert "[streams.X] event_time and watermark" in str(err.value)
    if "DISTINCT" in sql:
        assert "approx_count_distinct" in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("sql", "words"),
    [
        ("SELECT * FROM json.`/etc/passwd`", "without a qualifier"),
        ("SELECT reflect('java.lang.System', 'getenv', 'HOME') FROM bid", "reflect"),
        ("SELECT '${env:HOME}' AS h FROM bid", r"\$\{"),
        ("SELECT * FROM bid b, auction a", "no condition"),
        ("SELECT * FROM secrets", "unknown table 'secrets'"),
        ("INSERT INTO bid SELECT * FROM bid", "only a SELECT"),
        ("SELECT 1 AS one", "at least one stream"),
        ("SELECT * FROM bid; SELECT * FROM auction", "one statement"),
    ],
)
def test_hostile_sql_is_refused_before_spark_sees_it(sql: str, words: str) -> None:
    with pytest.raises(SqlRefused, match=words):
        sql_job_query(sql, ["bid", "auction"])


@pytest.mark.unit
def test_sql_specs_name_their_streams_by_the_query_and_nothing_else() -> None:
    spec = parse_job(
        'name=hot kind=sql sql="SELECT auction, count(*) AS n FROM bid GROUP BY auction" '
        "watermark=10s"
    )
    assert (spec.kind, spec.watermark, job_streams(spec)) == ("sql", "10s", ["bid"])
    with pytest.raises(JobError, match="sql needs `sql`"):
        decode_spec({"name": "x", "kind": "sql"})
    with pytest.raises(JobError, match="drop stream"):
        decode_spec({"name": "x", "kind": "sql", "sql": "SELECT 1", "stream": "bid"})
    with pytest.raises(JobError, match="for kind sql"):
        decode_spec({"name": "x", "kind": "count", "stream": "s", "by": ["a"], "sql": "x"})
    with pytest.raises(JobError, match="must name a stream"):
        decode_spec({"name": "x", "kind": "count", "by": ["a"]})
    grouped = sql_job_query(
        "SELECT window(t, '1 minute') AS w, a, b, count(*) AS n, max(p) FROM s "
        "GROUP BY window(t, '1 minute'), a, b",
        ["s"],
    )
    assert grouped.key_positions == (0, 1, 2) and grouped.stateful
    keyed = sql_job_query("SELECT a AS key, p FROM s", ["s"])
    assert keyed.has_key and not keyed.stateful


@pytest.mark.unit
def test_a_config_refuses_a_sql_job_over_a_stream_without_a_schema_or_unknown(
    tmp_path: Path,
) -> None:
    def cfg(streams: dict[str, Any], sql: str) -> Any:
        return load(
            environ={},
            overrides={
                "state_dir": str(tmp_path),
                "streams": streams,
                "jobs": [{"name": "j", "kind": "sql", "sql": sql}],
            },
        )

    plain = {"bid": {"subjects": ["raw.bid"]}}
    with pytest.raises(
        ConfigError, match=r"jobs\[0\]\.sql: stream 'bid' needs \[streams.bid\] schema"
    ):
        cfg(plain, "SELECT * FROM bid")
    with pytest.raises(ConfigError, match="unknown table 'auction'"):
        cfg(plain, "SELECT * FROM auction")
    with pytest.raises(ConfigError, match="event_time: needs"):
        cfg({"bid": {"subjects": ["raw.bid"], "event_time": "t"}}, "SELECT * FROM bid")
    with pytest.raises(ConfigError, match="watermark"):
        cfg(
            {"bid": {"subjects": ["raw.bid"], "schema": "t BIGINT", "watermark": "soon"}},
            "SELECT * FROM bid",
        )
    ok = cfg(
        {"bid": {"subjects": ["raw.bid"], "schema": "t BIGINT", "event_time": "t"}},
        "SELECT t FROM bid",
    )
    assert ok.streams["bid"].event_time == "t"


def test_a_stream_table_join_reads_each_keys_latest_value_as_of_each_batch(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    from runtime.data.compaction import CompactConfig

    cfg = {
        "tbid": StreamConfig(subjects=["raw.tbid"], schema=SCHEMAS["bid"]),
        "cperson": StreamConfig(
            subjects=["raw.cperson.*"],
            schema="id BIGINT, city STRING",
            compact=CompactConfig(key="id"),
        ),
    }
    bids = [
        {"auction": 0, "bidder": i % 5, "price": float(i), "dateTime": T0 + i} for i in range(200)
    ]

    async def publish(nc: Any, persons: dict[int, str], first: int, last: int) -> None:
        js = nc.jetstream()
        for pid, city in persons.items():
            await js.publish(f"raw.cperson.={pid}", json.dumps({"id": pid, "city": city}).encode())
        for i in range(first, last):
            body = json.dumps(bids[i]).encode()
            await js.publish("raw.tbid", body, headers={MSG_ID_HEADER: f"t{i}"})

    async def setup(nc: Any) -> None:
        js = nc.jetstream()
        await js.add_stream(JsStream(name="tbid", subjects=["raw.tbid"]))
        await js.add_stream(
            JsStream(name="cperson", subjects=["raw.cperson.*"], max_msgs_per_subject=1)
        )
        await publish(nc, {p: f"first-{p}" for p in range(5)}, 0, 100)

    with_nats(setup, nats_url)
    spec = decode_spec(
        {
            "name": "enriched",
            "kind": "sql",
            "sql": "SELECT b.price, b.bidder, p.city FROM tbid b JOIN cperson p ON b.bidder = p.id",
            "tables": ["cperson"],
            "max_events_per_trigger": 50,
        }
    )

    def run_once() -> None:
        query = start_job(
            sp, spec, NatsEndpoint(nats_url), tmp_path, trigger={"availableNow": True}, streams=cfg
        )
        assert query.awaitTermination(240) and query.exception() is None

    run_once()
    with_nats(lambda nc: publish(nc, {3: "second-3"}, 100, 200), nats_url)
    run_once()  # the same checkpoint: only the new bids, against the table as it is now
    got = {int(r["price"]): r["city"] for r in kv_results(nats_url, "enriched").values()}
    want = {i: ("second-3" if i >= 100 and i % 5 == 3 else f"first-{i % 5}") for i in range(200)}
    assert got == want


def test_a_table_must_be_a_compacted_stream_the_query_reads() -> None:
    with pytest.raises(SqlRefused, match="not read by the query"):
        from runtime.data.sql_jobs import check_tables

        spec = decode_spec(
            {"name": "x", "kind": "sql", "sql": "SELECT * FROM bid", "tables": ["p"]}
        )
        check_tables(spec, sql_job_query(spec.sql, ["bid", "p"]))
    with pytest.raises(JobError, match="for kind sql"):
        decode_spec({"name": "x", "kind": "count", "stream": "s", "by": ["a"], "tables": ["p"]})


def test_a_kv_table_join_reads_each_keys_latest_value_and_forgets_deleted_keys(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    """A KV bucket joined as a table: the latest value per key under the table's prefix, as
    of each micro-batch; a deleted key is gone, never back at an older value (the bucket
    keeps 5 values per key)."""
    from nats.js.api import KeyValueConfig

    from runtime.config import KvTableConfig

    catalog = {
        "kbid": StreamConfig(subjects=["raw.kbid"], schema=SCHEMAS["bid"]),
        "people": KvTableConfig(bucket="people", prefix="person", schema="city STRING"),
    }
    bids = [
        {"auction": 0, "bidder": i % 5, "price": float(i), "dateTime": T0 + i} for i in range(200)
    ]

    async def publish(nc: Any, first: int, last: int) -> None:
        js = nc.jetstream()
        for i in range(first, last):
            body = json.dumps(bids[i]).encode()
            await js.publish("raw.kbid", body, headers={MSG_ID_HEADER: f"k{i}"})

    async def setup(nc: Any) -> None:
        js = nc.jetstream()
        await js.add_stream(JsStream(name="kbid", subjects=["raw.kbid"]))
        kv = await js.create_key_value(KeyValueConfig(bucket="people", history=5))
        for p in range(5):
            await kv.put(f"person.{p}", json.dumps({"city": f"old-{p}"}).encode())
            await kv.put(f"person.{p}", json.dumps({"city": f"first-{p}"}).encode())
        await kv.put("other.3", json.dumps({"city": "not-a-person"}).encode())
        await publish(nc, 0, 100)

    async def change(nc: Any) -> None:
        kv = await nc.jetstream().key_value("people")
        await kv.put("person.3", json.dumps({"city": "second-3"}).encode())
        await kv.delete("person.4")
        await kv.put("person.2", b"not json")  # the latest value is malformed: no row
        await publish(nc, 100, 200)

    with_nats(setup, nats_url)
    spec = decode_spec(
        {
            "name": "kvenriched",
            "kind": "sql",
            "sql": "SELECT b.price, p.key AS who, p.city FROM kbid b "
            "JOIN people p ON p.key = CAST(b.bidder AS STRING)",
            "max_events_per_trigger": 50,
        }
    )
    assert job_streams(spec, {"people"}) == ["kbid"]

    def run_once() -> None:
        query = start_job(
            sp,
            spec,
            NatsEndpoint(nats_url),
            tmp_path,
            trigger={"availableNow": True},
            streams=catalog,
        )
        assert query.awaitTermination(240) and query.exception() is None

    run_once()
    with_nats(change, nats_url)
    run_once()  # the same checkpoint: only the new bids, against the bucket as it is now
    got = {
        int(r["price"]): (r["who"], r["city"]) for r in kv_results(nats_url, "kvenriched").values()
    }
    want = {i: (str(i % 5), f"first-{i % 5}") for i in range(100)}
    for i in range(100, 200):
        if i % 5 == 3:
            want[i] = ("3", "second-3")
        elif i % 5 in (0, 1):
            want[i] = (str(i % 5), f"first-{i % 5}")
    assert got == want
    # another job's results as a table: the `results` bucket under that job's name
    catalog["done"] = KvTableConfig(
        bucket="results", prefix="kvenriched", schema="price DOUBLE, who STRING, city STRING"
    )
    spec = decode_spec(
        {
            "name": "rejoined",
            "kind": "sql",
            "sql": "SELECT b.price, d.city FROM kbid b JOIN done d ON d.price = b.price",
        }
    )
    run_once()
    rejoined = kv_results(nats_url, "rejoined").values()
    assert {int(r["price"]): r["city"] for r in rejoined} == {i: c for i, (_w, c) in want.items()}


def test_a_config_checks_kv_tables_and_sql_jobs_over_them(tmp_path: Path) -> None:
    def cfg(kv: dict[str, Any], sql: str = "SELECT b.t FROM bid b", **job: Any) -> Any:
        return load(
            environ={},
            overrides={
                "state_dir": str(tmp_path),
                "streams": {"bid": {"subjects": ["raw.bid"], "schema": "t BIGINT, k STRING"}},
                "tables": kv,
                "jobs": [{"name": "j", "kind": "sql", "sql": sql, **job}],
            },
        )

    good = {"bucket": "prices", "prefix": "item", "schema": "price DOUBLE"}
    join = "SELECT b.t, p.price FROM bid b JOIN prices p ON p.key = b.k"
    ok = cfg({"prices": good}, join)
    assert ok.tables["prices"].bucket == "prices"
    assert {"bid", "prices"} <= set(ok.sql_tables()) and "prices" not in ok.streams
    for kv, words in (
        ({"bid": good}, "also a stream"),
        ({"prices": {**good, "bucket": "a.b"}}, "not a KV bucket name"),
        ({"prices": {**good, "prefix": "item..x"}}, "not a key prefix"),
        ({"prices": {**good, "schema": " "}}, "Spark DDL"),
        ({"prices": {"bucket": "prices"}}, "schema"),
        ({"my-table": good}, "SQL name"),
    ):
        with pytest.raises(ConfigError, match=words):
            cfg(kv, join)
    with pytest.raises(ConfigError, match="KV tables, always read as tables"):
        cfg({"prices": good}, join, tables=["prices"])
    with pytest.raises(ConfigError, match="at least one stream as a stream"):
        cfg({"prices": good}, "SELECT key, price FROM prices")
