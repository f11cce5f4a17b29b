"""The analysis tier's driver: a supervised Ray actor hosting Spark and the streaming queries.

`AnalysisDriver` is a detached, named Ray actor (`max_restarts=-1`, `num_cpus=0`). Its
`__init__`, which Ray reruns after a crash, opens its LevelDB checkpoint, starts a thread that
creates the Spark session (``local[2]`` unless ``spark.master`` names another) and starts
every wanted query from its checkpoint under ``<state_dir>/spark/<query>`` (or
``spark.checkpoint_dir``). Source offsets are stream sequences and the sink is idempotent,
so a restart resumes exactly: nothing lost, no result published twice.

The wanted jobs are the configured ones (constructor) plus those `start`ed later, minus
those `stop`ped; both changes are kept in the checkpoint, so they survive restarts. One
thread owns every Spark control call and reconciles the running queries with the wanted set
once a second: it starts what is missing, stops what is no longer wanted, and restarts a
query that died (backoff 1 s doubling to 30 s). Ray methods only change the wanted set and
read state, so heartbeats never wait behind Spark (the actor is threaded). Each stream
with a job also gets a dead-letter query: malformed events go to ``deadletter.<stream>``
and are counted exactly (per batch id, in the checkpoint).

`recompute` makes a job's batch view (jobs/batch_view.py, jobs/recompute.py): it pauses the
job's streaming query, runs the spec as a batch job over the stream's history up to its last
sequence, saves and serves the view, and the reconcile thread starts the job's next
generation from there, merged with the view.

The CLI's side (``tierflow jobs list|start|stop|recompute``) is `cluster/analysis.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from jobs.archive import (
    ArchiveSettings,
    archive_position,
    archive_query_name,
    purge_archive,
    queries_root,
    start_archive,
)
from jobs.batch_view import (
    BatchView,
    check_mergeable,
    checkpoint_dir,
    load_view,
    retire_checkpoints,
    save_view,
)
from jobs.checkpoints import committed
from jobs.errors import JobError
from jobs.recompute import recompute as recompute_view
from jobs.recompute import serve_view
from jobs.retention import Purge, enforce
from jobs.running import start_deadletters, start_job
from jobs.sink import BatchReport
from jobs.specs import JobSpec, deadletter_query_name, decode_spec, encode_spec
from jobs.sql import SqlTimeout, StreamTable, json_result, run_sql, tables_for
from runtime.config import Config, validate
from runtime.nats import NatsEndpoint
from runtime.ray_supervisor import SupervisedActor
from runtime.roles import ANALYSIS_DRIVER
from runtime.services import spark_session
from runtime.sql_check import SqlRefused

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQuery

    from runtime.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

DRIVER_NAME = ANALYSIS_DRIVER
MAX_CONCURRENCY = 8
DEFAULT_MASTER = "local[2]"
RECONCILE_S = 1.0
BACKOFF_MAX_S = 30.0
RETENTION_S = 10.0  # how often archived streams are trimmed (jobs/retention.py)


class JobsError(RuntimeError):
    """The analysis driver cannot be reached or refused a request; the message says why."""


# --------------------------------------------------------------------------- pure helpers


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


def _epoch_s(timestamp: str | None) -> float:
    """A progress record's ISO timestamp (``2026-11-24T06:07:11.123Z``) as epoch seconds."""
    if not timestamp:
        return 0.0
    return dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def backoff_s(failures: int) -> float:
    """Delay before restarting a query that failed `failures` times in a row."""
    return min(BACKOFF_MAX_S, 2.0 ** max(0, failures - 1))


def default_master(cfg: Config) -> str:
    """``spark.master`` when configured; the config's default ``local[*]`` becomes local[2]
    (the driver shares its machine with Ray and NATS)."""
    return DEFAULT_MASTER if cfg.spark.master == "local[*]" else cfg.spark.master


# --------------------------------------------------------------------------- the actor


@dataclass
class _Query:
    """One running (or wanted) query as the reconcile thread sees it."""

    name: str
    stream: str
    kind: str
    checkpoint: Path
    query: StreamingQuery | None = None
    failures: int = 0
    restarts: int = 0
    next_try: float = 0.0
    error: str | None = None
    started_at: float | None = None
    last_batch: int | None = None
    results: int = 0
    duplicates: int = 0

    def count(self, batch_id: int, report: BatchReport) -> None:
        """A batch's results are durable (called from Spark's foreachBatch thread)."""
        self.last_batch = batch_id
        self.results += report.published
        self.duplicates += report.duplicates


class _DeadLetterCount(msgspec.Struct, array_like=True):
    last_batch: int
    total: int


@dataclass
class _Wanted:
    """The wanted set and what the reconcile thread reports back."""

    jobs: dict[str, JobSpec] = field(default_factory=dict)
    queries: dict[str, _Query] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)  # jobs being recomputed: not running


class AnalysisDriver(SupervisedActor):
    """Spark and the streaming queries in one supervised Ray actor.

    Args:
        state_dir: root of the actor's LevelDB checkpoint and (by default) Spark checkpoints.
        config: the tierflow config as a mapping (`Config.to_dict()`), validated here.
        nats_url: where the streams are (default ``nats.url`` of the config).
        jobs: the configured jobs (JobSpec mappings); each started unless `stop`ped.
        master: Spark master (default: see `default_master`).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        config: Mapping[str, Any] | None = None,
        *,
        nats_url: str = "",
        jobs: Sequence[Mapping[str, Any]] = (),
        name: str | None = None,
        master: str | None = None,
    ) -> None:
        self.cfg = validate(dict(config or {}))
        self._configured = {s.name: s for s in (decode_spec(j) for j in jobs)}
        self._lock = threading.Lock()
        self._w = _Wanted()
        super().__init__(state_dir, name=name)
        self.nats = NatsEndpoint.from_config(self.cfg, "analysis", url=nats_url)
        if not self.nats.url:
            raise JobsError("AnalysisDriver: no NATS URL (pass nats_url or set nats.url)")
        self.master = master or default_master(self.cfg)
        self.checkpoint_root = queries_root(self.cfg, state_dir)
        self.purges: dict[str, Purge] = {}
        self._views: dict[str, BatchView | None] = {}
        self._next_retention = 0.0
        self.spark: SparkSession | None = None
        self.late: Any = None
        self.state = "starting"
        self.error: str | None = None
        self._closing = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="analysis-driver", daemon=True)
        self._thread.start()

    # ---- checkpoint ---------------------------------------------------------------------

    def restore(self, store: CheckpointStore) -> None:
        self._jobs_ns = store.namespace("jobs")
        self._stopped_ns = store.namespace("stopped")
        self._dl_ns = store.namespace("deadletters")
        wanted = {
            n: s for n, s in self._configured.items() if self._stopped_ns.get(n.encode()) is None
        }
        for key, blob in self._jobs_ns.scan():
            try:
                spec = decode_spec(blob)
            except JobError as err:
                log.error("analysis driver: dropping stored job %r: %s", key, err)
                continue
            wanted[spec.name] = spec
        self._w.jobs = wanted

    def _count_deadletters(self, stream: str, batch_id: int, n: int) -> None:
        key = stream.encode()
        raw = self._dl_ns.get(key)
        seen = msgspec.msgpack.decode(raw, type=_DeadLetterCount) if raw else None
        if seen is not None and batch_id <= seen.last_batch:
            return  # a replayed batch: already counted
        total = (seen.total if seen else 0) + n
        self._dl_ns.put(key, msgspec.msgpack.encode(_DeadLetterCount(batch_id, total)))

    def _deadletter_totals(self) -> dict[str, int]:
        out = {}
        for key, raw in self._dl_ns.scan():
            out[key.decode()] = msgspec.msgpack.decode(raw, type=_DeadLetterCount).total
        return out

    # ---- the reconcile thread (the only one making Spark control calls) -----------------

    def _run(self) -> None:
        try:
            self.spark = self._start_spark()
        except Exception as err:  # reported by status(); a restart would fail the same way
            log.exception("analysis driver: Spark did not start")
            self.state, self.error = "failed", f"Spark did not start: {err!r}"
            return
        self.state = "running"
        while not self._closing.is_set():
            try:
                self._reconcile()
            except Exception:  # keep reconciling: one bad job must not stop the others
                log.exception("analysis driver: reconcile")
            self._wake.wait(RECONCILE_S)
            self._wake.clear()
        self._stop_all()

    def _start_spark(self) -> SparkSession:
        # pyspark loads here, in the actor: the CLI imports this module for its names only
        from jobs.jetstream import register
        from jobs.spark_session import analysis_conf
        from jobs.windows import LateEventCounter

        spark_cfg = msgspec.structs.replace(
            self.cfg.spark, master=self.master, conf=analysis_conf(self.cfg.spark.conf)
        )
        cfg = msgspec.structs.replace(self.cfg, spark=spark_cfg)
        spark = spark_session(cfg, app_name=f"tierflow-{self.name}")
        register(spark)
        self.late = LateEventCounter()
        spark.streams.addListener(self.late)
        return spark

    def _reconcile(self) -> None:
        with self._lock:
            wanted = dict(self._w.jobs)
            paused = set(self._w.paused)
        streams: dict[str, float] = {}
        for spec in wanted.values():
            t = spec.trigger_s
            streams[spec.stream] = min(streams.get(spec.stream, t), t)
            if spec.name in paused:
                continue
            self._ensure(
                spec.name,
                spec.stream,
                spec.kind,
                lambda s=spec: self._start_job(s),
                checkpoint_dir(self.checkpoint_root, spec.name, self._view(spec.name)),
            )
        for stream, trigger_s in streams.items():
            name = deadletter_query_name(stream)
            self._ensure(
                name, stream, "deadletter", lambda s=stream, t=trigger_s: self._start_dl(s, t)
            )
        keep = (set(wanted) - paused) | {deadletter_query_name(s) for s in streams}
        for stream, s in self.cfg.streams.items():
            if s.archive is not None:
                name = archive_query_name(stream)
                keep.add(name)
                self._ensure(name, stream, "archive", lambda st=stream: self._start_archive(st))
        for name in [n for n in self._w.queries if n not in keep]:
            self._stop_query(name)
        if time.monotonic() >= self._next_retention:
            self._next_retention = time.monotonic() + RETENTION_S
            self._retention()

    def _ensure(
        self, name: str, stream: str, kind: str, start: Any, checkpoint: Path | None = None
    ) -> None:
        q = self._w.queries.get(name)
        if q is None:
            where = checkpoint or self.checkpoint_root / name
            q = self._w.queries[name] = _Query(name, stream, kind, where)
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
            log.error("analysis driver: query %s died: %s", name, q.error)
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
            log.error("analysis driver: query %s could not start: %s", name, err)

    def _view(self, name: str) -> BatchView | None:
        """The job's current batch view (cached; `recompute` replaces it)."""
        if name not in self._views:
            self._views[name] = load_view(self.checkpoint_root, name)
        return self._views[name]

    def _start_job(self, spec: JobSpec) -> StreamingQuery:
        q = self._w.queries[spec.name]

        def on_batch(batch_id: int, report: BatchReport) -> None:
            q.count(batch_id, report)

        assert self.spark is not None
        view = self._view(spec.name)
        if view is not None:
            if view.spec != spec:
                raise JobError(
                    f"job {spec.name!r} has a batch view of another spec: recompute it, or "
                    "give the changed job a new name"
                )
            if not view.served:  # the driver died between saving and serving it
                self._serve(view)
        return start_job(
            self.spark, spec, self.nats, self.checkpoint_root, on_batch=on_batch, view=view
        )

    def _serve(self, view: BatchView) -> None:
        serve_view(self.nats, view)
        view.served = True
        save_view(self.checkpoint_root, view)
        self._views[view.name] = view

    def _start_dl(self, stream: str, trigger_s: float) -> StreamingQuery:
        q = self._w.queries[deadletter_query_name(stream)]

        def on_batch(batch_id: int, report: BatchReport) -> None:
            self._count_deadletters(stream, batch_id, report.published)
            q.count(batch_id, report)

        assert self.spark is not None
        return start_deadletters(
            self.spark,
            stream,
            self.nats,
            self.checkpoint_root,
            on_batch=on_batch,
            trigger_s=trigger_s,
        )

    def _start_archive(self, stream: str) -> StreamingQuery:
        archive = self.cfg.streams[stream].archive
        assert self.spark is not None and archive is not None
        settings = ArchiveSettings(
            path=self.cfg.archive_root(stream),
            partitioning=archive.partitioning,
            flush_s=archive.flush_s,
            retention_days=archive.retention_days,
        )
        return start_archive(self.spark, stream, self.nats, settings, self.checkpoint_root)

    def _retention(self) -> None:
        """Trim each archived stream to its limits, never past what is archived; a stream
        full because its archive lags is logged loudly (every pass until it is not). Drop
        archived days past `retention_days`."""
        for name, s in self.cfg.streams.items():
            if s.archive is not None and s.archive.retention_days > 0:
                now = dt.datetime.now(dt.UTC)
                root = self.cfg.archive_root(name)
                for gone in purge_archive(root, name, s.archive.retention_days, now):
                    log.info("analysis driver: archive of %s: dropped %s", name, gone)
        limited = {
            name: s
            for name, s in self.cfg.streams.items()
            if s.archive is not None and (s.max_age_s > 0 or s.max_bytes > 0)
        }
        if not limited:
            return

        async def trim() -> None:
            nc = await self.nats.connect(name="analysis-retention")
            try:
                js = nc.jetstream()
                for name, s in limited.items():
                    pos = archive_position(self.checkpoint_root, name)
                    done = await enforce(
                        js,
                        name,
                        pos.next_seq if pos else 1,
                        max_age_s=s.max_age_s,
                        max_bytes=s.max_bytes,
                    )
                    self.purges[name] = done
                    if done.warning:
                        log.warning("analysis driver: %s", done.warning)
            finally:
                await nc.close()

        try:
            asyncio.run(trim())
        except Exception as err:  # NATS may be restarting: the next pass tries again
            log.warning("analysis driver: retention: %r", err)

    def _stop_query(self, name: str) -> None:
        q = self._w.queries.pop(name, None)
        if q is not None and q.query is not None:
            try:
                q.query.stop()
            except Exception as err:
                log.warning("analysis driver: stopping %s: %r", name, err)

    def _stop_all(self) -> None:
        for name in list(self._w.queries):
            self._stop_query(name)
        if self.spark is not None:
            with contextlib.suppress(Exception):
                self.spark.stop()
            self.spark = None
        self.state = "stopped"

    # ---- Ray methods (quick; never a Spark control call) --------------------------------

    def status(self) -> dict[str, Any]:
        """State, and per query: last committed batch and offset, rates, latency, late
        events, results published and replayed results JetStream dropped as duplicates (both
        since this incarnation started), query restarts, the last error; dead letters per
        stream (exact, over all incarnations)."""
        queries = {}
        for name, q in list(self._w.queries.items()):
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
            done = committed(q.checkpoint)
            if done is not None:
                row["last_batch_id"] = done[0]
                row["committed_seq"] = (done[1] or {}).get("seq")
            view = self._views.get(name)
            if view is not None:
                row["view_high_water"] = view.high_water
                row["generation"] = view.generation
            if sq is not None:
                with contextlib.suppress(Exception):
                    row.update(progress_summary(sq.lastProgress))
                    row["late_events"] = self.late.count(sq.id) if self.late else 0
            queries[name] = row
        with self._lock:
            wanted = sorted(self._w.jobs)
        return {
            **self.heartbeat(),
            "state": self.state,
            "error": self.error,
            "master": self.master,
            "nats_url": self.nats.url,
            "jobs": wanted,
            "queries": queries,
            "dead_letters": self._deadletter_totals() if self.state != "stopped" else {},
        }

    def progress(self, since: float = 0.0) -> dict[str, list[dict[str, Any]]]:
        """Per query, its recent batches (Spark keeps the last 100) that started at or after
        `since` (epoch s): batch id, input rows and where the batch's time went
        (``durationMs``: latestOffset, queryPlanning, walCommit, addBatch, commitOffsets...)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for name, q in list(self._w.queries.items()):
            sq = q.query
            if sq is None:
                continue
            rows = []
            with contextlib.suppress(Exception):
                for p in sq.recentProgress:
                    d = json.loads(p.json) if hasattr(p, "json") else dict(p)
                    if _epoch_s(d.get("timestamp")) < since:
                        continue
                    rows.append(
                        {
                            "batch_id": d.get("batchId"),
                            "input_rows": d.get("numInputRows"),
                            "durations": d.get("durationMs") or {},
                        }
                    )
            out[name] = rows
        return out

    def sql(
        self,
        sql: str,
        limit: int = 1000,
        timeout_s: float = 30.0,
        allowed: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Run one ad-hoc query (jobs/sql.py) in this driver's Spark, for the gateway's
        `/v1/sql`: ``{"status": 200, "columns", "rows", "truncated", "tables"}``, or
        ``{"status": 400|503|504|500, "error"}``. `allowed`: the streams the caller may
        read (None: all)."""
        if self.spark is None or self.state != "running":
            return {"status": 503, "error": f"the analysis driver's Spark is {self.state}"}
        allow = set(allowed) if allowed is not None else None
        try:
            result = run_sql(
                self.spark,
                self.nats,
                sql,
                tables_for(self.cfg, self.checkpoint_root),
                limit=limit,
                timeout_s=timeout_s,
                allowed=lambda stream: allow is None or stream in allow,
            )
        except SqlRefused as err:
            return {"status": 400, "error": str(err)}
        except SqlTimeout as err:
            return {"status": 504, "error": str(err)}
        except Exception as err:
            log.exception("analysis driver: sql")
            return {"status": 500, "error": f"the query failed: {err}"[:1000]}
        return {"status": 200, **json_result(result)}

    def archives(self) -> dict[str, dict[str, Any]]:
        """Per archived stream: the archive's committed position and the last trim."""
        out: dict[str, dict[str, Any]] = {}
        for name, s in self.cfg.streams.items():
            if s.archive is None:
                continue
            pos = archive_position(self.checkpoint_root, name)
            purge = self.purges.get(name)
            out[name] = {
                "path": self.cfg.archive_root(name),
                "next_seq": pos.next_seq if pos else 1,
                "skipped": pos.skipped if pos else 0,
                "purged_below": purge.below if purge else None,
                "warning": purge.warning if purge else None,
            }
        return out

    def recompute(self, name: str, wait_s: float = 60.0) -> dict[str, Any]:
        """Recompute job `name` as a batch view over its stream's history (archive and
        tail) up to the stream's last sequence now, serve it, and run the job's next
        generation from there: its streaming query is paused meanwhile (events keep
        arriving in the stream and are read after). Returns the view's summary."""
        with self._lock:
            spec = self._w.jobs.get(name)
            if spec is None:
                raise JobsError(f"job {name!r} is not running in the driver: start it first")
            try:
                check_mergeable(spec)
            except JobError as err:
                raise JobsError(str(err)) from None
            if self.spark is None or self.state != "running":
                raise JobsError(f"the analysis driver's Spark is {self.state}")
            if name in self._w.paused:
                raise JobsError(f"job {name!r} is being recomputed already")
            self._w.paused.add(name)
        self._wake.set()
        try:
            if self._wait_for(name, lambda row: row is None, wait_s) is not None:
                raise JobsError(f"job {name!r}: its streaming query did not stop in {wait_s} s")
            high_water = _stream_end(self.nats, spec.stream) - 1
            table = tables_for(self.cfg, self.checkpoint_root).get(spec.stream)
            view = recompute_view(
                self.spark,
                self.nats,
                spec,
                table or StreamTable(spec.stream),
                high_water=high_water,
            )
            save_view(self.checkpoint_root, view)  # from here on, this generation is current
            self._views[name] = view
            self._serve(view)
            retire_checkpoints(
                self.checkpoint_root, name, checkpoint_dir(self.checkpoint_root, name, view)
            )
        finally:
            with self._lock:
                self._w.paused.discard(name)
            self._wake.set()
        row = self._wait_for(name, lambda r: r and r["state"] != "starting", wait_s)
        return {**view.summary(), "state": row["state"] if row else "starting"}

    def jobs(self) -> dict[str, dict[str, Any]]:
        """The wanted jobs' specs, by name."""
        with self._lock:
            return {n: msgspec.to_builtins(s) for n, s in self._w.jobs.items()}

    def start(self, job: Mapping[str, Any] | str, wait_s: float = 60.0) -> dict[str, Any]:
        """Want `job` (a JobSpec mapping or JSON) from now on, also after restarts; wait up
        to `wait_s` for its query to run (or fail) and return its status row."""
        spec = decode_spec(job if isinstance(job, str) else dict(job))
        with self._lock:
            running = self._w.jobs.get(spec.name)
            if running is not None and running != spec:
                raise JobsError(
                    f"job {spec.name!r} runs with another spec; stop it first (its checkpoint "
                    "holds the old query's state: a changed query needs a new name)"
                )
            self._w.jobs[spec.name] = spec
        self._jobs_ns.put(spec.name.encode(), encode_spec(spec))
        self._stopped_ns.delete(spec.name.encode())
        self._wake.set()
        return self._wait_for(spec.name, lambda row: row and row["state"] != "starting", wait_s)

    def stop(self, name: str, wait_s: float = 60.0) -> dict[str, Any]:
        """Stop wanting job `name` (also after restarts); wait up to `wait_s` for its query
        to stop. Its checkpoint stays, so starting it again resumes where it stopped."""
        with self._lock:
            known = self._w.jobs.pop(name, None) is not None
        self._jobs_ns.delete(name.encode())
        if name in self._configured:
            self._stopped_ns.put(name.encode(), b"1")
        self._wake.set()
        row = self._wait_for(name, lambda row: row is None, wait_s)
        return {"name": name, "was_running": known, "stopped": row is None}

    def _wait_for(self, name: str, done: Any, wait_s: float) -> Any:
        deadline = time.monotonic() + wait_s
        while True:
            row = self.status()["queries"].get(name)
            if done(row) or time.monotonic() >= deadline:
                return row
            time.sleep(0.1)

    def await_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait (at most `timeout` s) until every wanted query has committed all the input
        its stream held when this call began; ``{"idle": bool, "behind": {query: seq}}``."""
        deadline = time.monotonic() + timeout
        targets: dict[str, int] = {}
        behind: dict[str, Any] = {"driver": self.state}
        while time.monotonic() < deadline:
            try:
                streams = {q.stream for q in list(self._w.queries.values())}
                for s in streams - set(targets):
                    targets[s] = _stream_end(self.nats, s)
                behind = self._behind(targets)
            except Exception as err:
                behind = {"error": repr(err)}
            if not behind:
                return {"idle": True, "targets": targets}
            time.sleep(0.2)
        return {"idle": False, "targets": targets, "behind": behind}

    def _behind(self, targets: Mapping[str, int]) -> dict[str, Any]:
        if self.state != "running":
            return {"driver": self.state}
        out: dict[str, Any] = {}
        with self._lock:
            wanted = set(self._w.jobs)
        queries = dict(self._w.queries)
        for name in wanted - set(queries):
            out[name] = "not started"
        for name, q in queries.items():
            if q.query is None or not q.query.isActive:
                out[name] = "not running"
                continue
            done = committed(q.checkpoint)
            seq = int((done[1] or {}).get("seq", 1)) if done else 1
            if seq < targets.get(q.stream, 1):
                out[name] = seq
        return out

    def shutdown(self, timeout: float = 60.0) -> dict[str, Any]:
        """Stop every query and Spark (the wanted set is kept for the next start)."""
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        stopped = not self._thread.is_alive()
        if stopped:
            self.state = "stopped"
            self.store.close()
        return {"stopped": stopped, "state": self.state}


def _stream_end(nats: NatsEndpoint, stream: str) -> int:
    """The next sequence `stream` will write (its committed-input target)."""
    from jobs.jetstream_read import stream_bounds  # loads pyspark: only in the actor (above)

    async def go() -> int:
        nc = await nats.connect(name="analysis-driver-idle")
        try:
            return (await stream_bounds(nc, stream)).latest
        finally:
            await nc.close()

    return asyncio.run(go())


__all__ = [
    "DRIVER_NAME",
    "AnalysisDriver",
    "JobsError",
    "backoff_s",
    "committed",
    "default_master",
    "progress_summary",
]
