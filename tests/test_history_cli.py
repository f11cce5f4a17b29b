"""`tierflow sql` and `tierflow archive status` as a user runs them: the console script in its
own process, a config file of a stranger's streams, a real nats-server, Spark and an
archive written by the archive job."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from jobs.archive import ArchiveSettings, queries_root, start_archive
from jobs.jetstream import register
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsEndpoint
from tests.support import NatsFactory, with_nats
from tests.test_jetstream_source import publish

pytestmark = pytest.mark.timeout(300)
TIERFLOW = str(Path(sys.executable).with_name("tierflow"))


def trip(i: int) -> dict[str, Any]:
    return {"zone": f"z{i % 7}", "fare": round(3 + (i % 40) * 0.25, 2), "n": i}


@pytest.fixture(scope="module")
def setup(
    spark: Any, nats_factory: NatsFactory, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    server = nats_factory(sync_interval="2m")
    tmp = tmp_path_factory.mktemp("history-cli")
    toml = tmp / "tierflow.toml"
    toml.write_text(
        f'state_dir = "{tmp / "state"}"\n'
        f'[nats]\nurl = "{server.url}"\n'
        "[streams.trips]\nsubjects = ['in.trips']\n[streams.trips.archive]\n"
        "[streams.zones]\nschema = 'zone STRING, borough STRING'\n"
    )
    cfg: Config = load(toml, environ={})
    with_nats(lambda nc: ensure_streams(nc, cfg), server.url)
    trips = [trip(i) for i in range(1200)]
    msgs = [("in.trips", json.dumps(t).encode(), f"t{t['n']}") for t in trips]
    with_nats(lambda nc: publish(nc, msgs[:800]), server.url)
    register(spark)
    q = start_archive(
        spark,
        "trips",
        NatsEndpoint(server.url),
        ArchiveSettings(path=cfg.archive_root("trips")),
        queries_root(cfg),
        trigger={"availableNow": True},
    )
    q.awaitTermination(240)
    with_nats(lambda nc: publish(nc, msgs[800:]), server.url)  # the live tail
    zones = [{"zone": f"z{i}", "borough": ["north", "south"][i % 2]} for i in range(7)]
    zmsgs = [("raw.zones", json.dumps(z).encode(), z["zone"]) for z in zones]
    with_nats(lambda nc: publish(nc, zmsgs), server.url)
    return {"toml": toml, "trips": trips, "zones": zones}


def tierflow(setup: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TIERFLOW, *args, "--config", str(setup["toml"])],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_sql_json_over_archive_and_tail(setup: dict[str, Any]) -> None:
    done = tierflow(
        setup,
        "sql",
        "SELECT zone, count(*) AS n, round(sum(fare), 2) AS fares FROM trips "
        "GROUP BY zone ORDER BY zone",
        "--json",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    n = Counter(t["zone"] for t in setup["trips"])
    fares: Counter[str] = Counter()
    for t in setup["trips"]:
        fares[t["zone"]] += t["fare"]
    assert rows == [{"zone": z, "n": n[z], "fares": round(fares[z], 2)} for z in sorted(n)]


def test_sql_csv_join_with_a_limit(setup: dict[str, Any]) -> None:
    done = tierflow(
        setup,
        "sql",
        "SELECT z.borough, count(*) AS n FROM trips t JOIN zones z ON t.zone = z.zone "
        "GROUP BY z.borough ORDER BY n DESC",
        "--csv",
        "--limit",
        "1",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    borough = {z["zone"]: z["borough"] for z in setup["zones"]}
    want = Counter(borough[t["zone"]] for t in setup["trips"]).most_common()
    assert list(csv.reader(io.StringIO(done.stdout))) == [
        ["borough", "n"],
        [want[0][0], str(want[0][1])],
    ]
    assert "more rows than --limit 1" in done.stderr


def test_a_refused_query_exits_1_with_the_reason(setup: dict[str, Any]) -> None:
    done = tierflow(setup, "sql", "SELECT * FROM json.`/etc/passwd`")
    assert done.returncode == 1 and "without a qualifier" in done.stderr
    done = tierflow(setup, "sql", "DELETE FROM trips")
    assert done.returncode == 1 and "only a SELECT" in done.stderr


def test_archive_status_shows_position_and_lag(setup: dict[str, Any]) -> None:
    done = tierflow(setup, "archive", "status", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(done.stdout)  # zones has no archive
    assert row["stream"] == "trips"
    assert (row["archived_to_seq"], row["stream_last_seq"], row["lag_events"]) == (800, 1200, 400)
    assert row["lag_s"] >= 0 and row["lost_before_archive"] == 0
    table = tierflow(setup, "archive", "status")
    assert table.returncode == 0 and "trips" in table.stdout and "400" in table.stdout
