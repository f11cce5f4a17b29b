"""jobs/sql.py against a real nats-server and Spark: a stream's table is its archive plus the
live tail, each event once; answers match the same question asked of the source data."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from jobs.archive import ArchiveSettings
from jobs.sql import SqlResult, SqlTimeout, StreamTable, run_sql
from runtime.data.sql_check import SqlRefused
from runtime.nats.server import NatsEndpoint
from tests.support import with_nats
from tests.test_archive import run_once
from tests.test_jetstream_source import add_stream, nats_url, publish, sp

# nats_url and sp are test_jetstream_source's module fixtures, imported so pytest finds them
__all__ = ["nats_url", "sp"]

pytestmark = pytest.mark.timeout(300)

CLICKS = "my-clicks"  # a stranger's name, with a hyphen: quoted in SQL as `my-clicks`
USERS = "users"


def click(i: int) -> dict[str, Any]:
    return {"user": f"u{i % 17}", "page": f"/p{i % 5}", "ms": i % 1000, "n": i}


@pytest.fixture(scope="module")
def world(sp: Any, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`my-clicks`: 2,000 archived events and 700 more only in JetStream (plus a malformed
    one); `users`: 17 users with a country each, not archived."""
    tmp = tmp_path_factory.mktemp("sql")
    add_stream(nats_url, CLICKS, [f"raw.{CLICKS}"])
    add_stream(nats_url, USERS, [f"raw.{USERS}"])
    clicks = [click(i) for i in range(2700)]
    msgs = [(f"raw.{CLICKS}", json.dumps(c).encode(), f"c-{c['n']}") for c in clicks[:2000]]
    with_nats(lambda nc: publish(nc, msgs), nats_url)
    root, ckpt = tmp / "archive", tmp / "ckpt"
    # small files (8 of 250 events): the timeout test's cancelled cross join cannot be
    # interrupted inside a running task (the vectorized parquet reader checks for a kill once
    # per columnar batch, here a whole file), and each task joins one file of each side, so
    # what the running tasks still do after the cancel grows with the cube of a file's size
    archive = ArchiveSettings(path=str(root), max_events_per_file=250)
    run_once(sp, nats_url, archive, ckpt, CLICKS)
    tail = [(f"raw.{CLICKS}", json.dumps(c).encode(), f"c-{c['n']}") for c in clicks[2000:]]
    tail.append((f"raw.{CLICKS}", b'{"user": ', "c-broken"))
    with_nats(lambda nc: publish(nc, tail), nats_url)
    users = [{"user": f"u{i}", "country": ["fr", "de", "jp"][i % 3]} for i in range(17)]
    umsgs = [(f"raw.{USERS}", json.dumps(u).encode(), u["user"]) for u in users]
    with_nats(lambda nc: publish(nc, umsgs), nats_url)
    tables = {
        CLICKS: StreamTable(CLICKS, str(root), ckpt),
        USERS: StreamTable(USERS, schema="user STRING, country STRING"),
    }
    return {"clicks": clicks, "users": users, "tables": tables, "root": root}


def sql(sp: Any, url: str, world: dict[str, Any], text: str, **kw: Any) -> SqlResult:
    return run_sql(sp, NatsEndpoint(url), text, world["tables"], **kw)


def test_the_table_is_archive_plus_tail_each_event_once(
    sp: Any, nats_url: str, world: dict[str, Any]
) -> None:
    assert list(Path(world["root"]).glob(f"stream={CLICKS}/date=*")), "part of it is archived"
    r = sql(
        sp,
        nats_url,
        world,
        f"SELECT count(*) AS n, count(DISTINCT _id) AS ids, "
        f"min(_seq) AS lo, max(_seq) AS hi FROM `{CLICKS}`",
    )
    assert r.rows == [(2700, 2700, 1, 2700)]  # the malformed event (seq 2701) is left out
    assert r.tables == [CLICKS]


def test_a_group_by_matches_the_source(sp: Any, nats_url: str, world: dict[str, Any]) -> None:
    r = sql(
        sp,
        nats_url,
        world,
        f"SELECT page, count(*) AS n, sum(ms) AS ms FROM `{CLICKS}` GROUP BY page ORDER BY page",
    )
    pages = Counter(c["page"] for c in world["clicks"])
    ms = Counter()
    for c in world["clicks"]:
        ms[c["page"]] += c["ms"]
    assert r.columns == ["page", "n", "ms"]
    assert r.rows == [(p, pages[p], ms[p]) for p in sorted(pages)]


def test_a_join_of_two_streams_with_a_declared_schema(
    sp: Any, nats_url: str, world: dict[str, Any]
) -> None:
    r = sql(
        sp,
        nats_url,
        world,
        f"SELECT u.country, count(*) AS n FROM `{CLICKS}` c JOIN users u ON c.user = u.user "
        "GROUP BY u.country ORDER BY u.country",
    )
    country = {u["user"]: u["country"] for u in world["users"]}
    want = Counter(country[c["user"]] for c in world["clicks"])
    assert r.rows == sorted(want.items())


def test_row_limit_refusals_and_the_timeout(sp: Any, nats_url: str, world: dict[str, Any]) -> None:
    r = sql(sp, nats_url, world, f"SELECT n FROM `{CLICKS}` ORDER BY n", limit=10)
    assert r.rows == [(i,) for i in range(10)] and r.truncated
    with pytest.raises(SqlRefused, match="unknown table 'nope'"):
        sql(sp, nats_url, world, "SELECT * FROM nope")
    with pytest.raises(SqlRefused, match="not allowed to read stream 'users'"):
        sql(sp, nats_url, world, "SELECT * FROM users", allowed=lambda s: s != USERS)
    with pytest.raises(SqlRefused, match="(?i)cannot be resolved|unresolved|not exist"):
        sql(sp, nats_url, world, f"SELECT no_such_field FROM `{CLICKS}`")
    # A cancelled query's tasks may run to their end: Spark's cartesian product never
    # checks for the kill (thread dumps: CartesianProductExec feeding the count, interrupted,
    # on for 150 s after a 3-s timeout over all 2,700 rows under make test's load). So the
    # work is bounded: 7e8 pairs, about 3 s on 2 idle cores (C2), well past a 1-s timeout.
    with pytest.raises(SqlTimeout, match="timeout of 1 s"):
        sql(
            sp,
            nats_url,
            world,
            f"SELECT count(*) FROM `{CLICKS}` a, `{CLICKS}` b, `{CLICKS}` c"
            " WHERE a.n < 100 AND a.n + b.n > c.n",
            timeout_s=1,
        )
    # the session still answers after a cancelled query
    # (a generous timeout: the point is that it answers, and the cancelled tasks may
    # still be winding down on a loaded machine)
    assert sql(sp, nats_url, world, "SELECT count(*) FROM users", timeout_s=300).rows == [(17,)]


def test_ids_repeated_across_two_archived_streams_and_an_event_at_the_size_limit(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    """A stranger's two archived streams share one archive root and reuse the same ids
    (ids are per stream); one event is as large as the server takes (its max_payload less
    room for headers). Each stream's table holds its own events, each once, the big one
    byte for byte."""
    a, b = "shop-eu", "shop-us"
    for name in (a, b):
        add_stream(nats_url, name, [f"in.{name}"])
    limit = with_nats(lambda nc: _max_payload(nc), nats_url)
    pad = "x" * (limit - 4096)
    big = json.dumps({"order": "big", "pad": pad}).encode()
    for name in (a, b):
        msgs = [
            (f"in.{name}", json.dumps({"order": f"o{i}", "site": name}).encode(), f"o-{i}")
            for i in range(300)
        ]
        if name == b:
            msgs.append((f"in.{name}", big, "o-big"))
        with_nats(lambda nc, m=msgs: publish(nc, m), nats_url)
    root, ckpt = tmp_path / "archive", tmp_path / "ckpt"
    for name in (a, b):
        run_once(sp, nats_url, ArchiveSettings(path=str(root)), ckpt, name)
    tables = {name: StreamTable(name, str(root), ckpt) for name in (a, b)}
    world = {"tables": tables}
    for name, n in ((a, 300), (b, 301)):
        r = sql(sp, nats_url, world, f"SELECT count(*), count(DISTINCT _id) FROM `{name}`")
        assert r.rows == [(n, n)], name
    r = sql(
        sp,
        nats_url,
        world,
        f"SELECT e.site, u.site FROM `{a}` e JOIN `{b}` u ON e._id = u._id WHERE e._id = 'o-7'",
    )
    assert r.rows == [(a, b)]
    r = sql(sp, nats_url, world, f"SELECT length(pad) FROM `{b}` WHERE `order` = 'big'")
    assert r.rows == [(len(pad),)]


async def _max_payload(nc: Any) -> int:
    return int(nc.max_payload)
