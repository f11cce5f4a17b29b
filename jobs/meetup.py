"""The Meetup RSVP analyses of docs/contracts.md, as job specs, plus their plain-Python oracle.

=====================  =======================================================================
query                  built from
=====================  =======================================================================
meetup_topn            library `topn` of ``group.group_topics[].topic_name`` over all time,
                       Space-Saving with the book's capacity (100000), top 10 in the book's
                       ``[{"item","count","error"}]`` format, plus ``events``
meetup_topn_window     library `topn` per 5-minute window sliding every 10 s (event time =
                       the RSVP's ``mtime``)
meetup_city_minute     library `count` by ``group.group_city`` per tumbling minute of
                       ``mtime``: ``{"key": "<city>|<minute>", "city", "minute", "rsvps"}``
meetup_members         library `distinct` of ``member.member_id`` (HLL, lg_k 12)
meetup_responses       custom job `responses`: ``{"key": "all", "yes", "no", "ratio"}`` with
                       ratio = yes / no (null while there is no "no")
=====================  =======================================================================

Times in keys and rows are ISO 8601 UTC (``2016-09-06T10:52:00Z``). `reference` recomputes
every query exactly from the RSVPs (the test oracle). ``python -m jobs.meetup`` starts (or
finds) the analysis driver running these queries on the runtime's Ray and NATS.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from jobs.library import JobSpec, WindowSpec, iso_ms

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

STREAM = "meetup"
TOPICS = "group.group_topics[].topic_name"
TOP_N = 10
BOOK_CAPACITY = 100_000  # the book's Space-Saving summary size (ch. 9)
WINDOW_CAPACITY = 1024
WINDOW_MS, SLIDE_MS, MINUTE_MS = 300_000, 10_000, 60_000
QUERIES = (
    "meetup_topn",
    "meetup_topn_window",
    "meetup_city_minute",
    "meetup_members",
    "meetup_responses",
)


def meetup_jobs(
    stream: str = STREAM,
    *,
    trigger_s: float = 1.0,
    watermark: str = "1 minute",
    capacity: int = BOOK_CAPACITY,
    max_events_per_trigger: int = 0,
) -> list[JobSpec]:
    """The five Meetup queries of docs/contracts.md over `stream`."""
    common: dict[str, Any] = {
        "stream": stream,
        "trigger_s": trigger_s,
        "max_events_per_trigger": max_events_per_trigger,
    }
    return [
        JobSpec(
            name="meetup_topn", kind="topn", field=TOPICS, n=TOP_N, capacity=capacity, **common
        ),
        JobSpec(
            name="meetup_topn_window",
            kind="topn",
            field=TOPICS,
            n=TOP_N,
            capacity=WINDOW_CAPACITY,
            window=WindowSpec(length="5 minutes", slide="10 seconds", watermark=watermark),
            time_field="mtime",
            **common,
        ),
        JobSpec(
            name="meetup_city_minute",
            kind="count",
            by=["group.group_city"],
            by_as=["city"],
            count_as="rsvps",
            window=WindowSpec(length="1 minute", watermark=watermark),
            window_as="minute",
            time_field="mtime",
            **common,
        ),
        JobSpec(name="meetup_members", kind="distinct", field="member.member_id", **common),
        JobSpec(name="meetup_responses", kind="custom", function="jobs.meetup:responses", **common),
    ]


def responses(events: DataFrame) -> DataFrame:
    """Custom job: yes and no RSVPs over all time, and their ratio (yes / no)."""
    from pyspark.sql import functions as F

    r = F.get_json_object("data", "$.response")
    counts = events.groupBy(F.lit("all").alias("key")).agg(
        F.sum(F.when(r == "yes", 1).otherwise(0)).alias("yes"),
        F.sum(F.when(r == "no", 1).otherwise(0)).alias("no"),
    )
    return counts.withColumn(
        "ratio", F.when(F.col("no") > 0, F.col("yes") / F.col("no")).otherwise(F.lit(None))
    )


# --------------------------------------------------------------------------- oracle


def _top(counts: Counter[str], n: int) -> list[dict[str, Any]]:
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return [{"item": item, "count": c, "error": 0} for item, c in ranked]


def reference(rsvps: Iterable[dict[str, Any]], n: int = TOP_N) -> dict[str, Any]:
    """Every query's exact answer, keyed like the results: {query: {key: row}}.

    Top lists are exact (error 0) and ordered as `TopN.top` orders them; ``meetup_members``
    holds the exact distinct count under ``"distinct"`` (the job's HLL estimates it).
    """
    topics: Counter[str] = Counter()
    windows: dict[int, Counter[str]] = defaultdict(Counter)
    cities: Counter[tuple[str, int]] = Counter()
    members: set[str] = set()
    answers: Counter[str] = Counter()
    events = 0
    for r in rsvps:
        events += 1
        names = [t["topic_name"] for t in r["group"]["group_topics"]]
        topics.update(names)
        t = int(r["mtime"])
        last = t - t % SLIDE_MS
        for start in range(last, t - WINDOW_MS, -SLIDE_MS):
            windows[start].update(names)
        cities[(r["group"]["group_city"], t - t % MINUTE_MS)] += 1
        members.add(str(r["member"]["member_id"]))
        answers[r["response"]] += 1
    yes, no = answers["yes"], answers["no"]
    return {
        "meetup_topn": {"all": {"key": "all", "top": _top(topics, n), "events": events}},
        "meetup_topn_window": {
            iso_ms(s): {
                "key": iso_ms(s),
                "window_start": iso_ms(s),
                "window_end": iso_ms(s + WINDOW_MS),
                "top": _top(c, n),
            }
            for s, c in windows.items()
        },
        "meetup_city_minute": {
            f"{city}|{iso_ms(m)}": {
                "key": f"{city}|{iso_ms(m)}",
                "city": city,
                "minute": iso_ms(m),
                "rsvps": c,
            }
            for (city, m), c in cities.items()
        },
        "meetup_members": {"all": {"key": "all", "distinct": len(members)}},
        "meetup_responses": {
            "all": {"key": "all", "yes": yes, "no": no, "ratio": yes / no if no else None}
        },
    }


def topic_counts(rsvps: Iterable[dict[str, Any]]) -> Counter[str]:
    """Exact count of every group topic (to check Space-Saving bounds against)."""
    return Counter(t["topic_name"] for r in rsvps for t in r["group"]["group_topics"])


# --------------------------------------------------------------------------- entrypoint


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jobs.meetup``: the whole Meetup pipeline (collectors, loggers, bridges,
    gateways and these analyses) on the configured Ray, NATS and Spark, until SIGTERM.

    This is what ``ray job submit -- python -m jobs.meetup --config ...`` and ``ray submit
    cluster/ray-cluster.yaml jobs/meetup.py -- --config ...`` run; ``ray job stop`` sends
    SIGTERM, on which collectors drain, loggers hand over and every actor is removed.
    ``--attach`` instead adds only the analyses to an already running tierflow.
    """
    parser = argparse.ArgumentParser(prog="python -m jobs.meetup", description=main.__doc__)
    parser.add_argument("--config", "-c", help="tierflow.toml (default: ./tierflow.toml)")
    parser.add_argument("--attach", action="store_true", help="analyses only, in a running one")
    parser.add_argument("--nats-url", default="", help="--attach: default the running one's")
    parser.add_argument("--wait", type=float, default=120.0, help="--attach: seconds for Spark")
    parser.add_argument("--demo-rate", type=float, default=0.0, help="synthetic RSVPs per s")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after N s (0: never)")
    args = parser.parse_args(argv)
    from runtime.config import load

    cfg = load(args.config)
    if args.attach:
        return _attach(cfg, args.nats_url, args.wait)
    return run_pipeline(cfg, demo_rate=args.demo_rate, duration=args.duration)


def run_pipeline(cfg: Any, *, demo_rate: float = 0.0, duration: float = 0.0) -> int:
    """Run every tier until SIGTERM/SIGINT (or `duration`); joins ``RAY_ADDRESS`` when set
    (a Ray job's driver), else `ray.address`, else starts a local Ray."""
    import asyncio
    import os

    import msgspec

    from runtime.launcher import serve_forever

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        cfg = msgspec.structs.replace(cfg, ray=msgspec.structs.replace(cfg.ray, address=address))

    def ready(rt: Any, stop: asyncio.Event) -> None:
        print(json.dumps({"tierflow": "ready", **rt.describe()}, default=str), flush=True)
        if duration:
            asyncio.get_running_loop().call_later(duration, stop.set)

    asyncio.run(serve_forever(cfg, on_ready=ready, demo_rate=demo_rate, analysis=True))
    print(json.dumps({"tierflow": "stopped"}), flush=True)
    return 0


def _attach(cfg: Any, nats_url: str, wait: float) -> int:
    from jobs.driver import connect_ray, runtime_nats_url, start_driver, wait_running

    connect_ray(cfg)
    driver = start_driver(cfg, nats_url or runtime_nats_url(cfg), jobs=meetup_jobs())
    status = wait_running(driver, wait) if wait else {}
    print(json.dumps(status, indent=2, default=str))
    return 0 if not wait or status.get("state") == "running" else 1


if __name__ == "__main__":
    sys.exit(main())
