"""The Nexmark answers by an independent engine: DuckDB over the same events, in batch.

Each query is written again for DuckDB from the query's definition (not translated from
the Spark text), and answers the same rows as the sql job's results once every window it
reports has closed: `rows(name)` gives them as tuples in the columns `COLUMNS` names, and
`spark_rows` reads the job's KV rows into the same tuples (times as epoch ms, decimals
rounded), so the two compare as multisets.

The loads end with `flush_events`: one event per stream two days after the last, that no
query matches with the real events. They move every stream's watermark past every real
window (a day window of q17 included), so every window of real events is closed in Spark
too. Rows at or after the flush (`FLUSH_FROM`) are left out on both sides.
"""

from __future__ import annotations

import datetime as dt
import decimal
from collections import Counter
from collections.abc import Iterable
from typing import Any

import duckdb

from cluster.nexmark.generator import Generator, Kind

DAY_MS = 86_400_000
FLUSH_GAP_MS = 2 * DAY_MS


def flush_events(last_ms: int) -> list[tuple[Kind, dict[str, Any]]]:
    """One event per stream, two days after `last_ms`, matching nothing real."""
    t = last_ms + FLUSH_GAP_MS
    return [
        (
            "person",
            {
                "id": -1,
                "name": "flush",
                "emailAddress": "",
                "creditCard": "",
                "city": "",
                "state": "XX",
                "dateTime": t,
                "extra": "",
            },
        ),
        (
            "auction",
            {
                "id": -2,
                "itemName": "flush",
                "description": "",
                "initialBid": 0,
                "reserve": 0,
                "dateTime": t,
                "expires": t,
                "seller": -3,
                "category": -1,
                "extra": "",
            },
        ),
        (
            "bid",
            {
                "auction": -1,
                "bidder": -1,
                "price": 0,
                "channel": "flush",
                "url": "",
                "dateTime": t,
                "extra": "",
            },
        ),
    ]


# per query: the columns compared, and the DuckDB text giving them (times as epoch ms)
COLUMNS: dict[str, tuple[str, ...]] = {
    "q0": ("auction", "bidder", "price", "dateTime"),
    "q1": ("auction", "bidder", "price", "dateTime"),
    "q2": ("auction", "price"),
    "q3": ("name", "city", "state", "id"),
    "q5": ("window_start", "hot.n", "hot.auction"),
    "q7": ("w.start", "top.price", "top.auction", "top.bidder"),
    "q8": ("id", "name", "w.start"),
    "q11": ("bidder", "s.start", "s.end", "bids"),
    "q14": ("auction", "bidder", "price", "bidTimeType", "dateTime", "c_counts"),
    "q17": (
        "auction",
        "day.start",
        "total_bids",
        "rank1_bids",
        "rank2_bids",
        "rank3_bids",
        "min_price",
        "max_price",
        "avg_price",
        "sum_price",
    ),
    "q18": ("auction", "bidder", "last.price", "last.dateTime"),
    "q20": ("auction", "bidder", "price", "channel", "dateTime", "itemName", "seller"),
    "q21": ("auction", "bidder", "price", "channel", "channel_id"),
    "q22": ("auction", "bidder", "price", "channel", "dir1", "dir2", "dir3"),
}

ORACLE: dict[str, str] = {
    "q0": "SELECT auction, bidder, price, t FROM bid",
    "q1": "SELECT auction, bidder, 0.908 * price, t FROM bid",
    "q2": "SELECT auction, price FROM bid WHERE auction % 123 = 0",
    "q3": "SELECT p.name, p.city, p.state, a.id FROM auction a, person p "
    "WHERE a.seller = p.id AND a.category = 10 AND p.state IN ('OR', 'ID', 'CA')",
    # every sliding window a bid is in: starts at the 2 s marks in (t - 10 s, t]
    "q5": "WITH w AS (SELECT (t // 2000) * 2000 - k * 2000 AS ws, auction FROM bid, "
    "range(0, 5) r(k)), c AS (SELECT ws, auction, count(*) AS n FROM w GROUP BY ws, auction) "
    "SELECT ws, max(n), arg_max(auction, n * 1000000000 + auction) FROM c GROUP BY ws",
    "q7": "SELECT (t // 10000) * 10000 AS ws, max(price), "
    "first(auction ORDER BY price DESC, auction DESC, bidder DESC), "
    "first(bidder ORDER BY price DESC, auction DESC, bidder DESC) FROM bid GROUP BY ws",
    "q8": "SELECT DISTINCT p.id, p.name, (p.t // 10000) * 10000 FROM person p, auction a "
    "WHERE p.id = a.seller AND p.t // 10000 = a.t // 10000",
    "q11": "WITH o AS (SELECT bidder, t, CASE WHEN t - lag(t) OVER (PARTITION BY bidder "
    "ORDER BY t) < 10000 THEN 0 ELSE 1 END AS fresh FROM bid), s AS (SELECT bidder, t, "
    "sum(fresh) OVER (PARTITION BY bidder ORDER BY t ROWS UNBOUNDED PRECEDING) AS sid FROM o) "
    "SELECT bidder, min(t), max(t) + 10000, count(*) FROM s GROUP BY bidder, sid",
    "q14": "SELECT auction, bidder, 0.908 * price, CASE WHEN hour(ts) BETWEEN 8 AND 18 THEN "
    "'dayTime' WHEN hour(ts) <= 6 OR hour(ts) >= 20 THEN 'nightTime' ELSE 'otherTime' END, "
    "t, length(url) - length(replace(url, 'c', '')) FROM bid "
    "WHERE 0.908 * price > 100000 AND 0.908 * price < 50000000",
    "q17": f"SELECT auction, (t // {DAY_MS}) * {DAY_MS} AS d, count(*), "
    "count(*) FILTER (WHERE price < 10000), "
    "count(*) FILTER (WHERE price >= 10000 AND price < 1000000), "
    "count(*) FILTER (WHERE price >= 1000000), min(price), max(price), avg(price), "
    "sum(price) FROM bid GROUP BY auction, d",
    "q18": "SELECT auction, bidder, first(price ORDER BY t DESC, price DESC), max(t) "
    "FROM bid GROUP BY auction, bidder",
    "q20": "SELECT b.auction, b.bidder, b.price, b.channel, b.t, a.itemName, a.seller "
    "FROM bid b, auction a WHERE b.auction = a.id AND b.t BETWEEN a.t AND a.t + 20000 "
    "AND b.t <= a.expires AND a.category = 10",
    "q21": "SELECT auction, bidder, price, channel, CASE lower(channel) WHEN 'apple' THEN '0' "
    "WHEN 'google' THEN '1' WHEN 'facebook' THEN '2' WHEN 'baidu' THEN '3' ELSE "
    "regexp_extract(url, '(&|^)channel_id=([^&]*)', 2) END FROM bid "
    "WHERE lower(channel) IN ('apple', 'google', 'facebook', 'baidu') "
    "OR regexp_extract(url, '(&|^)channel_id=([^&]*)', 2) <> ''",
    "q22": "SELECT auction, bidder, price, channel, split_part(url, '/', 4), "
    "split_part(url, '/', 5), split_part(url, '/', 6) FROM bid",
}

# the column whose value (epoch ms) places a row before or after the flush
TIME_OF: dict[str, int] = {
    "q0": 3,
    "q1": 3,
    "q5": 0,
    "q7": 0,
    "q8": 2,
    "q11": 1,
    "q14": 4,
    "q17": 1,
    "q18": 3,
    "q20": 4,
}


class Oracle:
    """The events of one load in DuckDB; `rows(query)` its answer."""

    def __init__(self, events: Iterable[tuple[Kind, dict[str, Any]]], flush_from: int) -> None:
        self.flush_from = flush_from
        self.db = duckdb.connect()
        self.db.execute("SET TimeZone = 'UTC'")
        tables: dict[str, list[dict[str, Any]]] = {"person": [], "auction": [], "bid": []}
        for kind, fields in events:
            tables[kind].append(fields)
        import pandas as pd

        for name, rows in tables.items():
            frame = pd.DataFrame(rows)  # noqa: F841 (DuckDB reads it by name)
            self.db.execute(
                f'CREATE TABLE {name} AS SELECT *, "dateTime" AS t, '
                f'make_timestamp("dateTime" * 1000) AS ts FROM frame'
            )

    def rows(self, query: str) -> Counter[tuple[Any, ...]]:
        out: Counter[tuple[Any, ...]] = Counter()
        for row in self.db.execute(ORACLE[query]).fetchall():
            values = tuple(norm(v) for v in row)
            if kept(query, values, self.flush_from):
                out[values] += 1
        return out


def kept(query: str, values: tuple[Any, ...], flush_from: int) -> bool:
    """A row of real events: not at or after the flush, not the flush's own."""
    i = TIME_OF.get(query)
    if i is not None and values[i] is not None and values[i] >= flush_from:
        return False
    return not any(v in (-1, -2, -3, "flush") for v in values if not isinstance(v, bool))


def spark_rows(query: str, kv_rows: Iterable[dict[str, Any]], flush_from: int) -> Counter:
    """The job's KV rows as the oracle's tuples (see the module doc)."""
    out: Counter[tuple[Any, ...]] = Counter()
    for row in kv_rows:
        values = tuple(norm(_get(row, c)) for c in COLUMNS[query])
        if kept(query, values, flush_from):
            out[values] += 1
    return out


def _get(row: dict[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        value = value[part] if isinstance(value, dict) else None
    return value


def norm(value: Any) -> Any:
    """One form for both engines: times as epoch ms, numbers rounded to 6 places."""
    if isinstance(value, str) and len(value) >= 20 and value[4] == "-" and value.endswith("Z"):
        t = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        return round(t.timestamp() * 1000)
    if isinstance(value, dt.datetime):
        t = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        return round(t.timestamp() * 1000)
    if isinstance(value, decimal.Decimal | float):
        f = round(float(value), 6)
        return int(f) if f.is_integer() else f
    return value


def load_events(gen: Generator, count: int) -> list[tuple[Kind, dict[str, Any]]]:
    """The events of a load of `count` from 0, in emission order, then the flush."""
    events = [(kind, fields) for _n, kind, fields in gen.events(0, count)]
    return events + flush_events(gen.time_ms(count - 1))
