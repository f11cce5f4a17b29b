"""The Nexmark queries as tierflow sql jobs, and the ones Spark cannot run incrementally.

Each query reads the streams `person`, `auction` and `bid` (`nexmark_streams`), whose
``dateTime`` is the event time with a watermark. The texts follow the `nexmark/nexmark`
Flink SQL suite; where Spark's streaming SQL needs another form for the same answer, the
note says what differs:

- q7's highest bid per window is one aggregation, the max of (price, auction, bidder): a
  window's row is its highest bid, ties broken by the larger auction, then bidder (Nexmark
  joins the bids back to the max and emits every tied bid);
- q8 joins persons and auctions of the same 10 s window by an interval join bounded by the
  window (Spark keeps state only for time-bounded stream-stream joins);
- q5 reports the top auction of each sliding window under a second, tumbling window (the
  way Spark chains windowed aggregations, by `window_time`), with the sliding window's
  start as ``window_start``; ties go to the larger auction id;
- q18 keeps the last bid per (bidder, auction) as the max of (dateTime, price), in update
  mode (Nexmark's ROW_NUMBER() OVER, which Spark does not run over a stream); ties in
  time go to the higher price;
- counts of distinct values (q15, q16) have no exact incremental form in Spark.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NOT_RUN", "QUERIES", "nexmark_streams"]

SCHEMAS = {
    "person": "id BIGINT, name STRING, emailAddress STRING, creditCard STRING, city STRING, "
    "state STRING, dateTime BIGINT, extra STRING",
    "auction": "id BIGINT, itemName STRING, description STRING, initialBid BIGINT, "
    "reserve BIGINT, dateTime BIGINT, expires BIGINT, seller BIGINT, category BIGINT, "
    "extra STRING",
    "bid": "auction BIGINT, bidder BIGINT, price BIGINT, channel STRING, url STRING, "
    "dateTime BIGINT, extra STRING",
}


def nexmark_streams(watermark: str = "5 seconds", replicas: int = 1) -> dict[str, Any]:
    """The `[streams]` of the three Nexmark streams (subjects ``nexmark.<kind>``)."""
    return {
        name: {
            "subjects": [f"nexmark.{name}"],
            "schema": schema,
            "event_time": "dateTime",
            "event_time_format": "epoch_ms",
            "watermark": watermark,
            "replicas": replicas,
        }
        for name, schema in SCHEMAS.items()
    }


QUERIES: dict[str, str] = {
    # pass-through
    "q0": "SELECT auction, bidder, price, dateTime, extra FROM bid",
    # currency conversion
    "q1": "SELECT auction, bidder, 0.908 * price AS price, dateTime, extra FROM bid",
    # selection
    "q2": "SELECT auction, price FROM bid WHERE auction % 123 = 0",
    # local item suggestion: a stream-stream join (no time bound: Nexmark's semantics)
    "q3": "SELECT p.name, p.city, p.state, a.id FROM auction a JOIN person p "
    "ON a.seller = p.id WHERE a.category = 10 AND p.state IN ('OR', 'ID', 'CA')",
    # hot items: bids per auction in sliding windows (10 s every 2 s), the top per window
    "q5": "SELECT min(win.start) AS window_start, max(struct(n, auction)) AS hot FROM "
    "(SELECT window(dateTime, '10 seconds', '2 seconds') "
    "AS win, auction, count(*) AS n FROM bid GROUP BY window(dateTime, '10 seconds', "
    "'2 seconds'), auction) GROUP BY window(window_time(win), '2 seconds')",
    # highest bid per tumbling 10 s window
    "q7": "SELECT window(dateTime, '10 seconds') AS w, max(struct(price, auction, bidder)) "
    "AS top FROM bid GROUP BY window(dateTime, '10 seconds')",
    # new users: persons who opened an auction in the same 10 s window
    "q8": "SELECT p.id, p.name, window(p.dateTime, '10 seconds') AS w FROM person p "
    "JOIN auction a ON p.id = a.seller AND a.dateTime BETWEEN p.dateTime - INTERVAL 10 SECONDS "
    "AND p.dateTime + INTERVAL 10 SECONDS AND unix_millis(p.dateTime) DIV 10000 = "
    "unix_millis(a.dateTime) DIV 10000 GROUP BY p.id, p.name, window(p.dateTime, '10 seconds')",
    # user sessions: bids per bidder in sessions with a 10 s gap
    "q11": "SELECT bidder, session_window(dateTime, '10 seconds') AS s, count(*) AS bids "
    "FROM bid GROUP BY bidder, session_window(dateTime, '10 seconds')",
    # calculation: conversions, a case on the hour, a character count
    "q14": "SELECT auction, bidder, 0.908 * price AS price, CASE WHEN hour(dateTime) BETWEEN 8 "
    "AND 18 THEN 'dayTime' WHEN hour(dateTime) <= 6 OR hour(dateTime) >= 20 THEN 'nightTime' "
    "ELSE 'otherTime' END AS bidTimeType, dateTime, length(url) - length(replace(url, 'c', '')) "
    "AS c_counts FROM bid WHERE 0.908 * price > 100000 AND 0.908 * price < 50000000",
    # bid statistics per auction per day
    "q17": "SELECT auction, window(dateTime, '1 day') AS day, count(*) AS total_bids, "
    "count_if(price < 10000) AS rank1_bids, count_if(price >= 10000 AND price < 1000000) AS "
    "rank2_bids, count_if(price >= 1000000) AS rank3_bids, min(price) AS min_price, "
    "max(price) AS max_price, avg(price) AS avg_price, sum(price) AS sum_price FROM bid "
    "GROUP BY auction, window(dateTime, '1 day')",
    # the last bid per bidder and auction
    "q18": "SELECT auction, bidder, max(struct(dateTime, price)) AS last FROM bid "
    "GROUP BY auction, bidder",
    # bids of category 10 with their auction's item, bids while the auction is open
    "q20": "SELECT b.auction, b.bidder, b.price, b.channel, b.dateTime, a.itemName, a.seller "
    "FROM bid b JOIN auction a ON b.auction = a.id AND b.dateTime BETWEEN a.dateTime AND "
    "a.dateTime + INTERVAL 20 SECONDS AND b.dateTime <= timestamp_millis(a.expires) "
    "WHERE a.category = 10",
    # channel ids: a case on the channel, else the url's channel_id
    "q21": "SELECT auction, bidder, price, channel, CASE lower(channel) WHEN 'apple' THEN '0' "
    "WHEN 'google' THEN '1' WHEN 'facebook' THEN '2' WHEN 'baidu' THEN '3' ELSE "
    "regexp_extract(url, '(&|^)channel_id=([^&]*)', 2) END AS channel_id FROM bid "
    "WHERE lower(channel) IN ('apple', 'google', 'facebook', 'baidu') OR "
    "regexp_extract(url, '(&|^)channel_id=([^&]*)', 2) <> ''",
    # url directories
    "q22": "SELECT auction, bidder, price, channel, split_part(url, '/', 4) AS dir1, "
    "split_part(url, '/', 5) AS dir2, split_part(url, '/', 6) AS dir3 FROM bid",
}

NOT_RUN: dict[str, str] = {
    "q4": "the average of each category's winning prices aggregates an aggregate over a "
    "join (max per auction, then avg per category) with no time window to close either: "
    "Spark runs one non-windowed aggregation per streaming query, and none after a "
    "stream-stream join",
    "q6": "the average selling price over each seller's last 10 auctions needs a "
    "ROWS window (OVER ... ROWS 10 PRECEDING), which Spark does not run over a stream",
    "q9": "the winning bid per auction is an aggregation after a stream-stream join that "
    "closes when the auction expires, not at a window of the watermarked time: Spark "
    "allows no aggregation after a join but a windowed one in append mode",
    "q10": "writes every bid to files partitioned by time: a sink, not a query (tierflow's "
    "archive does it for any stream, jobs/archive.py)",
    "q12": "processing-time windows: their answer depends on when events arrive, so no "
    "oracle can check it, and Spark windows only over a column",
    "q13": "joins bids with a side input read from a file: tierflow jobs read streams only",
    "q15": "exact counts of distinct bidders and auctions per day: Spark streams no distinct "
    "aggregation (approx_count_distinct is not exact)",
    "q16": "the same distinct counts per channel and day as q15",
    "q19": "the top 10 bids per auction need ROW_NUMBER() OVER, which Spark does not run "
    "over a stream",
}
