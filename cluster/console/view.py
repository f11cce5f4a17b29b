"""What the operations console shows: the runtime's status as the pipeline's tiers, its
streams and its jobs, each with the figure that says whether it keeps up.

Pure: `console_view(status, streams, prev, now)` takes the launcher's status snapshot
(`cluster.launcher.Runtime.status`), one record per JetStream stream (`stream_record`) and
the view it made last time (for rates), and returns the view the gateways serve at
``/v1/console`` (cluster/console/feed.py puts it in the ``tierflow_status`` bucket). The
health rules are small functions of their figures, each tested alone: a tier is ``ok``,
``behind`` (keeping state but falling back: a backlog, 503s, lag) or ``down`` (a replica
not answering, a query failed), with ``why`` saying which number.

The contract with the gateway (actors/access/console.py), which filters the view by what a
token may read: ``streams[].name`` and ``jobs[].streams``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from runtime.config import RESERVED_STREAM_NAMES as INTERNAL

__all__ = [
    "BEHIND_LAG",
    "BEHIND_PENDING",
    "TIERS",
    "console_view",
    "jetstream_health",
    "job_health",
    "role_health",
    "stream_record",
]

# a logger holding more entries than this that JetStream does not hold yet is behind
BEHIND_PENDING = 10_000
# a job this many events short of its streams' ends, and not catching up, is behind
BEHIND_LAG = 50_000
# the boxes of the pipeline view, in the order data flows
TIERS = ("collector", "logger", "bridge", "jetstream", "analysis", "results", "gateway")


OK = ("ok", "")  # a health with nothing to say


def role_health(
    role: str, replicas: Sequence[Mapping[str, Any]], rates: Mapping[str, float]
) -> tuple[str, str]:
    """(state, why) of a role from its replicas' rows and its rates per second."""
    if not replicas:
        return "down", "no replica"
    silent = [r.get("name") or r.get("replica") or "?" for r in replicas if r.get("error")]
    if silent:
        names = ", ".join(str(n) for n in silent[:3])
        return "down", f"{len(silent)} of {len(replicas)} not answering ({names})"
    if role == "collector":
        refused = rates.get("overloaded") or 0.0
        if refused > 0:
            return "behind", f"{refused:,.1f} 503s and slow-downs/s"
    if role == "logger":
        pending = sum(int(r.get("pending") or 0) for r in replicas)
        parked = sum(int(r.get("parked") or 0) for r in replicas)
        if parked:
            return "behind", f"{parked:,} entries parked"
        if pending > BEHIND_PENDING:
            return "behind", f"{pending:,} entries not in JetStream yet"
    if role == "bridge" and (rates.get("failed") or 0.0) > 0:
        return "behind", f"{rates['failed']:,.1f} failed publishes/s"
    if role == "gateway":
        slow = (rates.get("lag_warnings") or 0.0) + (rates.get("dropped") or 0.0)
        if slow > 0:
            return "behind", f"{slow:,.1f} lag warnings and drops/s"
    return OK


def jetstream_health(
    status: Mapping[str, Any],
    streams: Sequence[Mapping[str, Any]],
    replication: Sequence[Mapping[str, Any]],
) -> tuple[str, str]:
    """NATS answering; every copy on another site answering and within `BEHIND_LAG` of its
    origin; every archive within `BEHIND_LAG` of its stream."""
    if ((status.get("services") or {}).get("nats") or {}).get("healthy") is False:
        return "down", "NATS does not answer"
    gone = [r for r in replication if not r.get("up")]
    if gone:
        return "down", f"copy of {gone[0].get('stream')} on {gone[0].get('site')} not answering"
    far = [r for r in replication if int(r.get("lag") or 0) > BEHIND_LAG]
    if far:
        r = far[0]
        return "behind", f"{r.get('stream')} on {r.get('site')}: {int(r['lag']):,} behind"
    for s in streams:
        lag = (s.get("archive") or {}).get("lag")
        if lag is not None and lag > BEHIND_LAG:
            return "behind", f"archive of {s['name']}: {lag:,} events behind"
    return OK


def job_health(job: Mapping[str, Any], lag_before: int | None) -> tuple[str, str]:
    """(state, why) of one query: failed or starting, or behind by `lag` events and not
    catching up (its lag no smaller than at the view before)."""
    state = job.get("state")
    if state == "failed":
        return "down", f"failed: {str(job.get('error') or '')[:200]}"
    if state not in ("running", None):
        return "behind", str(state)
    lag = job.get("lag")
    if lag is not None and lag > BEHIND_LAG and (lag_before is None or lag >= lag_before):
        return "behind", f"{lag:,} events behind"
    return OK


def stream_record(info: Any, cfg: Any = None) -> dict[str, Any]:
    """One stream's figures from nats-py's StreamInfo (and its `[streams.X]`, if any)."""
    c, s = info.config, info.state
    limits = {
        "max_age_s": c.max_age or 0,
        "max_bytes": c.max_bytes if (c.max_bytes or 0) > 0 else None,
        "max_msgs": c.max_msgs if (c.max_msgs or 0) > 0 else None,
        "max_msgs_per_subject": c.max_msgs_per_subject
        if (c.max_msgs_per_subject or 0) > 0
        else None,
    }
    compact = getattr(cfg, "compact", None) if cfg is not None else None
    archive = getattr(cfg, "archive", None) if cfg is not None else None
    return {
        "name": c.name,
        "subjects": list(c.subjects or []),
        "messages": s.messages,
        "bytes": s.bytes,
        "first_seq": s.first_seq,
        "last_seq": s.last_seq,
        "consumers": s.consumer_count,
        "replicas": c.num_replicas,
        "limits": limits,
        "compact": None if compact is None else {"key": compact.key, "keep": compact.keep},
        "archive": None if archive is None else {"partitioning": archive.partitioning},
    }


def _per_s(now: float, before: float, dt: float) -> float | None:
    if dt <= 0:
        return None
    return round(max(0.0, now - before) / dt, 2)


def _streams(
    streams: Sequence[Mapping[str, Any]],
    prev: Mapping[str, Any] | None,
    dt: float,
    analysis: Mapping[str, Any],
    replication: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Each stream with its rate, dead letters, its archive's lag (events not archived
    yet) and its copies' lag on other sites."""
    before = {s["name"]: s for s in (prev or {}).get("streams", [])}
    dead = analysis.get("dead_letters") or {}
    archives = {
        q.get("stream"): q.get("lag")
        for q in analysis.get("queries") or []
        if q.get("kind") == "archive"
    }
    out = []
    for s in sorted(streams, key=lambda s: s["name"]):
        was = before.get(s["name"])
        rate = _per_s(s["last_seq"], was["last_seq"], dt) if was else None
        row = {**s, "rate": rate, "dead_letters": int(dead.get(s["name"], 0))}
        if row.get("archive") is not None:
            row["archive"] = {**row["archive"], "lag": archives.get(s["name"])}
        copies = [
            {"site": r.get("site"), "from": r.get("from"), "lag": r.get("lag"), "up": r.get("up")}
            for r in replication
            if r.get("stream") == s["name"]
        ]
        if copies:
            row["copies"] = copies
        out.append(row)
    return out


def _jobs(analysis: Mapping[str, Any], prev: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    before = {j["name"]: j for j in (prev or {}).get("jobs", [])}
    out = []
    for q in analysis.get("queries") or []:
        if q.get("kind") in ("deadletter", "archive"):
            continue
        was = before.get(q["name"]) or {}
        state, why = job_health(q, was.get("lag"))
        streams = [s for s in str(q.get("stream") or "").split(",") if s]
        out.append(
            {
                "name": q["name"],
                "kind": q.get("kind"),
                "streams": streams,
                "state": q.get("state"),
                "health": state,
                "why": why,
                "lag": q.get("lag"),
                "batch_ms": q.get("latency_ms"),
                "input_rows_per_s": q.get("input_rows_per_s"),
                "processed_rows_per_s": q.get("processed_rows_per_s"),
                "late_events": q.get("late_events") or 0,
                "results": q.get("results") or 0,
                "restarts": q.get("restarts") or 0,
                "watermark": q.get("watermark"),
                "subject": f"results.{q['name']}",
            }
        )
    return sorted(out, key=lambda j: j["name"])


def _restarts(children: Sequence[Mapping[str, Any]], role: str) -> int:
    return sum(int(c.get("restarts") or 0) for c in children if role in str(c.get("name", "")))


def _analysis_health(
    analysis: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]]
) -> tuple[str, str]:
    """The driver's state first, then its worst job's."""
    if not analysis:
        return "ok", "no analysis jobs"
    driver = analysis.get("state")
    if driver not in (None, "running", "active"):
        return ("down" if driver in ("failed", "unreachable") else "behind"), f"driver {driver}"
    for health in ("down", "behind"):
        job = next((j for j in jobs if j["health"] == health), None)
        if job is not None:
            return health, f"{job['name']}: {job['why']}"
    return OK


def console_view(
    status: Mapping[str, Any],
    streams: Sequence[Mapping[str, Any]],
    prev: Mapping[str, Any] | None,
    now: float,
) -> dict[str, Any]:
    """The console's view (see the module doc); `prev` is the view returned last time."""
    dt = now - float((prev or {}).get("at") or 0.0) if prev else 0.0
    roles = status.get("roles") or {}
    children = status.get("children") or []
    analysis = status.get("analysis") or {}
    dead = analysis.get("dead_letters") or {}
    replication = status.get("replication") or []
    stream_rows = _streams(streams, prev, dt, analysis, replication)
    jobs = _jobs(analysis, prev)
    tiers: list[dict[str, Any]] = []
    for role in ("collector", "logger", "bridge"):
        info = roles.get(role) or {}
        rows = info.get("replicas") or []
        rates = info.get("rates") or {}
        state, why = role_health(role, rows, rates)
        tiers.append(
            {
                "tier": role,
                "replicas": len(rows),
                "nodes": info.get("nodes") or [],
                "load": info.get("load"),
                "rates": rates,
                "restarts": _restarts(children, role),
                "state": state,
                "why": why,
            }
        )
    # the streams events are stored in: not the system ones, not the stream pattern's buffer
    user = [s for s in stream_rows if s["name"] not in ("results", "deadletter", *INTERNAL)]
    j_state, j_why = jetstream_health(status, user, replication)
    tiers.append(
        {
            "tier": "jetstream",
            "replicas": len(user),
            "rates": {"stored": round(sum(s["rate"] or 0 for s in user), 2)},
            "messages": sum(s["messages"] for s in user),
            "archive_lag": sum(int((s.get("archive") or {}).get("lag") or 0) for s in user),
            "replication_lag": max((int(r.get("lag") or 0) for r in replication), default=None),
            "state": j_state,
            "why": j_why,
        }
    )
    a_state, a_why = _analysis_health(analysis, jobs)
    tiers.append(
        {
            "tier": "analysis",
            "replicas": len(jobs),
            "rates": {"processed": round(sum(j["processed_rows_per_s"] or 0 for j in jobs), 2)},
            "lag": sum(j["lag"] or 0 for j in jobs),
            "late_events": sum(j["late_events"] for j in jobs),
            "state": a_state,
            "why": a_why,
        }
    )
    results = next((s for s in stream_rows if s["name"] == "results"), None)
    tiers.append(
        {
            "tier": "results",
            "replicas": len(jobs),
            "rates": {"published": (results or {}).get("rate") or 0.0},
            "messages": (results or {}).get("messages", 0),
            "state": "ok",
            "why": "",
        }
    )
    g = roles.get("gateway") or {}
    g_rows = g.get("replicas") or []
    g_state, g_why = role_health("gateway", g_rows, g.get("rates") or {})
    tiers.append(
        {
            "tier": "gateway",
            "replicas": len(g_rows),
            "nodes": g.get("nodes") or [],
            "load": g.get("load"),
            "rates": g.get("rates") or {},
            "restarts": _restarts(children, "gateway"),
            "state": g_state,
            "why": g_why,
        }
    )
    return {
        "at": now,
        "uptime_s": status.get("uptime_s"),
        "tiers": tiers,
        "streams": stream_rows,
        "jobs": jobs,
        "dead_letters": sum(int(v) for v in dead.values()),
        "escalated": status.get("escalated"),
        "escalations": (status.get("escalations") or [])[-5:],
        "nodes": ((status.get("services") or {}).get("ray") or {}).get("nodes") or [],
        "verifier": status.get("verifier"),
    }
