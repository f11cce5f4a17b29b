"""What the analysis driver reports of its queries: the rows of `status`, the batches of
`progress`, the archives of `archives`, and how far each query is behind for `await_idle`.

Exists so that reading a query's state for the CLI, the gateway and the tests (its Spark
progress, its committed position from the checkpoint, its view, its copy) is one part,
apart from the parts that change that state, and can be tested with plain records. Every
function here only reads: it runs on the driver's control threads, beside the reconcile
thread, and makes no Spark control call (a StreamingQuery's progress is a read).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.archive import archive_position, archive_query_name, copy_root
from jobs.checkpoints import committed, committed_offsets
from jobs.copies import read_copy

if TYPE_CHECKING:
    from jobs.batch_view import BatchView
    from jobs.deadletter_book import DeadLetterBook
    from jobs.queries import Query
    from jobs.retention import Purge
    from runtime.config import Config

__all__ = [
    "archive_rows",
    "behind",
    "committed_seq",
    "epoch_s",
    "progress_rows",
    "progress_summary",
    "query_rows",
]


def progress_summary(progress: Any) -> dict[str, Any]:
    """The numbers `status()` shows from a StreamingQueryProgress (or its dict)."""
    if progress is None:
        return {}
    p = json.loads(progress.json) if hasattr(progress, "json") else dict(progress)
    durations = p.get("durationMs") or {}
    return {
        "batch_id": p.get("batchId"),
        "input_rows": p.get("numInputRows"),
        "input_rows_per_s": round(float(p.get("inputRowsPerSecond") or 0.0), 1),
        "processed_rows_per_s": round(float(p.get("processedRowsPerSecond") or 0.0), 1),
        "latency_ms": durations.get("triggerExecution"),
        "watermark": (p.get("eventTime") or {}).get("watermark"),
        "at": p.get("timestamp"),
    }


def epoch_s(timestamp: str | None) -> float:
    """A progress record's ISO timestamp (``2026-11-24T06:07:11.123Z``) as epoch seconds."""
    if not timestamp:
        return 0.0
    return dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def committed_seq(q: Query, deadletters: DeadLetterBook) -> int | None:
    """The next sequence `q` reads, all before it durably done (a dead-letter scan's
    recorded position, a query's last committed end offset); None before its first."""
    if q.kind == "deadletter":
        return deadletters.position(q.stream, q.checkpoint) or None
    done = committed(q.checkpoint)
    seq = (done[1] or {}).get("seq") if done else None
    return int(seq) if seq is not None else None


def query_rows(
    queries: Mapping[str, Query],
    *,
    views: Mapping[str, BatchView | None],
    changes: Mapping[str, dict[str, Any]],
    late: Any,
    deadletters: DeadLetterBook,
) -> dict[str, dict[str, Any]]:
    """Per query: state, last committed batch and offset, rates, latency, late events,
    results published and replayed results JetStream dropped as duplicates (both since
    this incarnation started), restarts, the last error, its view and its copy."""
    out = {}
    for name, q in list(queries.items()):
        sq = q.query
        active = bool(sq is not None and sq.isActive)
        row: dict[str, Any] = {
            "kind": q.kind,
            "stream": q.stream,
            "state": "running" if active else ("failed" if q.error else "starting"),
            "restarts": q.restarts,
            "error": q.error,
            "results": q.results,
            "duplicates": q.duplicates,
        }
        if q.kind != "deadletter" and (done := committed(q.checkpoint)):
            row["last_batch_id"] = done[0]
        if (seq := committed_seq(q, deadletters)) is not None:
            row["committed_seq"] = seq
        view = views.get(name)
        if view is not None:
            row["view_high_water"] = view.high_water
            row["generation"] = view.generation
        if q.copy is not None:
            row["copy"] = q.copy.describe()
        if name in changes:
            row["copy_change"] = changes[name]
        if sq is not None:
            with contextlib.suppress(Exception):
                row.update(progress_summary(sq.lastProgress))
                row["late_events"] = late.count(sq.id) if late else 0
        out[name] = row
    return out


def progress_rows(queries: Mapping[str, Query], since: float) -> dict[str, list[dict[str, Any]]]:
    """Per running query, its recent batches (Spark keeps the last 100) that started at or
    after `since` (epoch s): batch id, start (``at``), input rows and ``durations`` (Spark's
    ``durationMs`` and the foreachBatch's parts the sink measured)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, q in list(queries.items()):
        sq = q.query
        if sq is None:
            continue
        rows = []
        with contextlib.suppress(Exception):
            for p in sq.recentProgress:
                d = json.loads(p.json) if hasattr(p, "json") else dict(p)
                at = epoch_s(d.get("timestamp"))
                if at < since:
                    continue
                rows.append(
                    {
                        "batch_id": d.get("batchId"),
                        "at": at,
                        "input_rows": d.get("numInputRows"),
                        "durations": {
                            **(d.get("durationMs") or {}),
                            **q.parts_ms.get(d.get("batchId"), {}),
                        },
                    }
                )
        out[name] = rows
    return out


def archive_rows(
    cfg: Config,
    checkpoint_root: Path,
    purges: Mapping[str, Purge],
    queries: Mapping[str, Query],
) -> dict[str, dict[str, Any]]:
    """Per archived stream: the archive's committed position and the last trim."""
    out: dict[str, dict[str, Any]] = {}
    for name, s in cfg.streams.items():
        if s.archive is None:
            continue
        pos = archive_position(checkpoint_root, name)
        purge = purges.get(name)
        copy = read_copy(checkpoint_root / archive_query_name(name))
        q = queries.get(archive_query_name(name))
        error = q.error if q and q.error else None
        out[name] = {
            # the directory of the copy this checkpoint archives (jobs/archive.py)
            "path": copy_root(cfg.archive_root(name), copy),
            "next_seq": pos.next_seq if pos else 1,
            "skipped": pos.skipped if pos else 0,
            "purged_below": purge.below if purge else None,
            "warning": purge.warning if purge else None,
            # who kept the stream from being trimmed further: the archive, a site, a reader
            "held_by": [h.holder for h in purge.held_by] if purge else [],
            "copy": copy.describe() if copy else None,
            # a position of another copy: not resumed (the error says what to do)
            "copy_error": error if error and "sequences of copy" in error else None,
            # a directory this checkpoint does not own: refused at start
            "owner_error": error
            if error and ("archive directory" in error or "archive checkpoint" in error)
            else None,
        }
    return out


def behind(
    wanted: Iterable[str],
    queries: Mapping[str, Query],
    targets: Mapping[str, int],
    deadletters: DeadLetterBook,
) -> dict[str, Any]:
    """The queries that have not committed their stream's input up to `targets` (the
    next sequence per stream): a wanted job not started, a query not running, or the
    sequence it reads next."""
    out: dict[str, Any] = {}
    queries = dict(queries)
    for name in set(wanted) - set(queries):
        out[name] = "not started"
    for name, q in queries.items():
        if q.query is None or not q.query.isActive:
            out[name] = "not running"
            continue
        if q.streams:  # a sql job: each stream by its source's committed offset
            offsets = committed_offsets(q.checkpoint)
            for i, stream in enumerate(q.streams):
                offset = offsets[i] if i < len(offsets) else None
                seq = int((offset or {}).get("seq") or 1)
                if seq < targets.get(stream, 1):
                    out[name] = {**(out.get(name) or {}), stream: seq}
            continue
        seq = committed_seq(q, deadletters) or 1
        if seq < targets.get(q.stream, 1):
            out[name] = seq
    return out
