"""The analysis driver's queries: a record of each (`Query`), the rule that keeps one
running (`keep_running`), and the set the reconcile thread keeps in line with the wanted
jobs (`QuerySet`).

Exists so that what the reconcile thread knows of a query (its Spark handle or dead-letter
scan, its failures and backoff, its counts and the copy it reads) is one plain record that
the driver's parts share (jobs/copy_tracker.py compares copies, jobs/driver_status.py
reports), and so that which queries run (every wanted job, a dead-letter scan per stream of
one, an archive per archived stream) and the restart rule (a query that died is restarted
with backoff, 1 s doubling to 30 s) can be tested without Spark: the starts are passed in
(jobs/query_starts.py). Its calls are Spark control calls: only the driver's reconcile
thread (jobs/driver.py) makes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jobs.archive import archive_query_name
from jobs.running import staggered
from jobs.sink import BatchReport, close_sinks
from runtime.data.sql_jobs import job_streams
from runtime.job_specs import deadletter_query_name

if TYPE_CHECKING:
    from jobs.copies import CopyId
    from runtime.job_specs import JobSpec

log = logging.getLogger(__name__)

__all__ = [
    "BACKOFF_MAX_S",
    "PARTS_KEPT",
    "Query",
    "QuerySet",
    "Starts",
    "backoff_s",
    "keep_running",
    "query_triggers",
]

PARTS_KEPT = 100  # batches whose foreachBatch parts `progress` shows (Spark keeps 100)
BACKOFF_MAX_S = 30.0


def backoff_s(failures: int) -> float:
    """Delay before restarting a query that failed `failures` times in a row."""
    return min(BACKOFF_MAX_S, 2.0 ** max(0, failures - 1))


@dataclass
class Query:
    """One running (or wanted) query as the reconcile thread sees it. `query` is a Spark
    StreamingQuery, or a dead-letter scan (jobs/deadletter_scan.py) that acts like one."""

    name: str
    stream: str
    kind: str
    checkpoint: Path
    query: Any = None
    failures: int = 0
    restarts: int = 0
    next_try: float = 0.0
    error: str | None = None
    started_at: float | None = None
    last_batch: int | None = None
    results: int = 0
    duplicates: int = 0
    copy: CopyId | None = None  # the copy this query reads (recorded in its checkpoint)
    # a sql job's streams in the order of its sources; () for a query of `stream` alone
    streams: tuple[str, ...] = ()
    # per recent batch id, where its foreachBatch's time went (`progress`)
    parts_ms: dict[int, dict[str, float]] = field(default_factory=dict)

    def count(self, batch_id: int, report: BatchReport) -> None:
        """A batch's results are durable (called from Spark's foreachBatch thread)."""
        self.last_batch = batch_id
        self.results += report.published
        self.duplicates += report.duplicates
        if report.parts_ms:
            self.parts_ms[batch_id] = report.parts_ms
            while len(self.parts_ms) > PARTS_KEPT:
                self.parts_ms.pop(next(iter(self.parts_ms)))


def keep_running(q: Query, start: Callable[[], Any]) -> None:
    """One reconcile step for `q` (a Spark control call: the reconcile thread's only): a
    query running steadily again (over `BACKOFF_MAX_S`) has its failures forgotten; one that
    died is counted and backed off (`backoff_s`); one not running is started once its
    backoff is over, and a start that raises counts as a failure too."""
    if q.query is not None and q.query.isActive:
        if q.failures and q.started_at and time.time() - q.started_at > BACKOFF_MAX_S:
            q.failures = 0  # running steadily again
        return
    if q.query is not None:  # it died: why, and when to try again
        exc = q.query.exception()
        q.error = str(exc) if exc is not None else "stopped"
        q.failures += 1
        q.next_try = time.monotonic() + backoff_s(q.failures)
        q.query = None
        close_sinks(q.name)
        log.error("analysis driver: query %s died: %s", q.name, q.error)
    if time.monotonic() < q.next_try:
        return
    try:
        q.query = start()
        q.started_at = time.time()
        if q.failures:
            q.restarts += 1
    except Exception as err:
        q.error = f"could not start: {err}"
        q.failures += 1
        q.next_try = time.monotonic() + backoff_s(q.failures)
        log.error("analysis driver: query %s could not start: %s", q.name, err)


def query_triggers(jobs: Mapping[str, JobSpec]) -> dict[str, float]:
    """The interval (s) each job's query runs at, `staggered` so that queries sharing an
    interval do not all start their batches at the same instant."""
    return staggered({name: spec.trigger_s for name, spec in jobs.items()})


class Starts(Protocol):
    """How each kind of query starts (jobs/query_starts.py `QueryStarts`)."""

    def job(self, q: Query, spec: JobSpec, trigger_s: float) -> Any: ...

    def deadletters(self, q: Query) -> Any: ...

    def archive(self, q: Query) -> Any: ...


class QuerySet:
    """The driver's queries, by name (`queries`): the reconcile thread's alone to change;
    other threads read a copy (`list(queries.values())`).

    Args:
        starts: how each kind starts.
        checkpoint_root: where a query's checkpoint is (by its name).
        job_checkpoint: a job's checkpoint, of its current generation (jobs/generations.py).
        archived: the streams with an archive (each gets an archive query).
        kv_tables: the KV tables sql jobs may read (no stream, so no dead-letter scan).
    """

    def __init__(
        self,
        starts: Starts,
        checkpoint_root: Path,
        job_checkpoint: Callable[[str], Path],
        archived: Sequence[str],
        kv_tables: Collection[str] = (),
    ) -> None:
        self.starts, self.checkpoint_root = starts, checkpoint_root
        self.kv_tables = frozenset(kv_tables)
        self._job_checkpoint, self.archived = job_checkpoint, list(archived)
        self.queries: dict[str, Query] = {}

    def reconcile(self, wanted: Mapping[str, JobSpec], paused: Set[str]) -> dict[str, int]:
        """One pass: keep every wanted job not `paused` running, a dead-letter scan per
        stream of a wanted job and an archive per archived stream; stop the rest. Returns
        the kept queries' failures in a row (jobs/escalation.py decides on them)."""
        streams = {s for spec in wanted.values() for s in job_streams(spec, self.kv_tables)}
        every = query_triggers(wanted)
        for spec in wanted.values():
            if spec.name in paused:
                continue
            self._ensure(
                spec.name,
                job_streams(spec, self.kv_tables)[0],
                spec.kind,
                lambda q, s=spec, t=every[spec.name]: self.starts.job(q, s, t),
                self._job_checkpoint(spec.name),
            )
        for stream in streams:
            name = deadletter_query_name(stream)
            self._ensure(name, stream, "deadletter", self.starts.deadletters)
        keep = (set(wanted) - paused) | {deadletter_query_name(s) for s in streams}
        for stream in self.archived:
            name = archive_query_name(stream)
            keep.add(name)
            self._ensure(name, stream, "archive", self.starts.archive)
        for name in [n for n in self.queries if n not in keep]:
            self.stop(name)
        return {n: q.failures for n, q in self.queries.items() if n in keep}

    def _ensure(
        self,
        name: str,
        stream: str,
        kind: str,
        start: Callable[[Query], Any],
        checkpoint: Path | None = None,
    ) -> None:
        q = self.queries.get(name)
        if q is None:
            where = checkpoint or self.checkpoint_root / name
            q = self.queries[name] = Query(name, stream, kind, where)
        keep_running(q, lambda: start(q))

    def stop(self, name: str) -> None:
        """Stop query `name` and forget it (its checkpoint stays)."""
        q = self.queries.pop(name, None)
        if q is not None and q.query is not None:
            try:
                q.query.stop()
            except Exception as err:
                log.warning("analysis driver: stopping %s: %r", name, err)
        close_sinks(name)  # the stopped query's kept NATS connection

    def stop_all(self) -> None:
        for name in list(self.queries):
            self.stop(name)

    def caught_up(self) -> bool:
        """Every query (the archive aside) has finished a batch in this process."""
        queries = [q for q in list(self.queries.values()) if q.kind != "archive"]
        return bool(queries) and all(q.last_batch is not None for q in queries)
