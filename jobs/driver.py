"""The analysis tier's driver: a supervised Ray actor hosting Spark and the streaming queries.

`AnalysisDriver` is a detached, named Ray actor (`max_restarts=-1`, `num_cpus=0`). Its
`__init__`, which Ray reruns after a crash, opens its LevelDB checkpoint, starts a thread that
creates the Spark session (``local[4]`` unless ``spark.master`` names another) and starts
every wanted query from its checkpoint under ``<state_dir>/spark/<query>`` (or
``spark.checkpoint_dir``). Source offsets are stream sequences and the sink is idempotent,
so a restart resumes exactly: nothing lost, no result published twice.

The wanted jobs are the configured ones (constructor) plus those `start`ed later, minus
those `stop`ped; both changes are kept in the checkpoint, so they survive restarts. One
thread owns every Spark control call and reconciles the running queries with the wanted set
once a second: it starts what is missing, stops what is no longer wanted, and restarts a
query that died (backoff 1 s doubling to 30 s); when every query keeps dying
(``spark.restart_after_failures`` times in a row) the fault is taken to be the driver's own,
and it exits so that Ray restarts it in a new process (jobs/escalation.py). Ray methods
only change the wanted set and read state, so heartbeats never wait behind Spark (the actor
is threaded); ad-hoc SQL and recompute, which do run Spark jobs, have Ray concurrency groups
of their own (jobs/sql_admission.py), so no query can occupy the threads `status`, `jobs`
and the standby's role check answer on. Each stream with a job also gets a dead-letter
scan (jobs/deadletter_scan.py, a reader without Spark, supervised like a query): malformed
events go to ``deadletter.<stream>``, and its position and exact count are kept in the
checkpoint.

`recompute` makes a job's batch view (jobs/batch_view.py, jobs/recompute.py): it pauses the
job's streaming query, runs the spec as a batch job over the stream's history up to its last
sequence, saves and serves the view, and the reconcile thread starts the job's next
generation from there, merged with the view.

Copies (geo replication, docs/geo.md): sequences are per copy of a stream, so every
checkpoint has the copy it reads recorded next to it (jobs/copies.py) when its query first
starts, and each start compares it with the copy the driver reads now. On another copy a
job never resumes its positions: a job that merges (count, topn, distinct) is recomputed as
a batch view over the new copy and continues as its next generation from there; a sample or
custom job starts a fresh generation from the new copy's first sequence; a dead-letter
scan starts over on the new copy; the archive refuses to start (`archive_copy_error` says
why and what to do) and nothing is purged or read from it meanwhile.

The CLI's side (``tierflow jobs list|start|stop|recompute``) is `cluster/analysis.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import ray

from jobs.archive import (
    ArchiveSettings,
    archive_position,
    archive_query_name,
    copy_root,
    owned_root,
    purge_archive,
    queries_root,
    start_archive,
)
from jobs.batch_view import (
    BatchView,
    check_mergeable,
    checkpoint_dir,
    fresh_generation,
    load_view,
    retire_checkpoints,
    save_view,
)
from jobs.checkpoints import committed
from jobs.copies import (
    MERGEABLE,
    Action,
    CopyError,
    CopyId,
    acurrent_copy,
    current_copy,
    read_copy,
    record_copy,
)
from jobs.copy_tracker import CopyTracker, archive_copy_error
from jobs.deadletter_scan import DeadLetterScan
from jobs.errors import JobError
from jobs.escalation import should_escalate
from jobs.read_lease import HistoryGap
from jobs.recompute import recompute as recompute_view
from jobs.recompute import serve_view
from jobs.retention import Purge
from jobs.retention_holds import trim as trim_stream
from jobs.running import staggered, start_job
from jobs.sink import BatchReport, close_sinks
from jobs.spark_session import SQL_POOL
from jobs.specs import JobSpec, deadletter_query_name, decode_spec, encode_spec
from jobs.sql import SqlTimeout, StreamTable, json_result, run_sql, tables_for
from jobs.sql_admission import SqlAdmission, sql_slots
from jobs.warm_pair import WarmPair, own_wait, warm_up
from runtime.clock import now_ms
from runtime.config import Config, validate
from runtime.nats import NatsEndpoint
from runtime.ray_supervisor import SupervisedActor
from runtime.roles import ANALYSIS_DRIVER
from runtime.services import spark_session
from runtime.sql_check import SqlRefused, check_select

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQuery

    from runtime.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

DRIVER_NAME = ANALYSIS_DRIVER
MAX_CONCURRENCY = 8  # the control methods' threads (Ray's default concurrency group)
# ad-hoc SQL and recomputes run on threads of their own (Ray concurrency groups, declared
# where the actor is made: cluster/deploy/analysis.py), never on the control methods'
SQL_GROUP, RECOMPUTE_GROUP = "sql", "recompute"
RECOMPUTE_THREADS = 2
_SQL_INIT = threading.Lock()
DEFAULT_MASTER = "local[4]"
RECONCILE_S = 1.0
PARTS_KEPT = 100  # batches whose foreachBatch parts `progress` shows (Spark keeps 100)
BACKOFF_MAX_S = 30.0
RETENTION_S = 10.0  # how often archived streams are trimmed (jobs/retention.py)
EXIT_ESCALATED = 70  # the driver's exit status when it restarts itself (jobs/escalation.py)


class JobsError(RuntimeError):
    """The analysis driver cannot be reached or refused a request; the message says why."""


F = TypeVar("F")


def on_active(method: F) -> F:
    """A Ray method that answers from the active driver: a standby (jobs/standby.py) hands
    the call to its peer, so callers may use either driver's name after a takeover."""

    @functools.wraps(method)  # type: ignore[arg-type]
    def call(self: AnalysisDriver, *args: Any, **kwargs: Any) -> Any:
        if self.role == "active":
            return method(self, *args, **kwargs)  # type: ignore[operator]
        return self._forward(method.__name__, args, kwargs)  # type: ignore[attr-defined]

    return call  # type: ignore[return-value]


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
    """``spark.master`` when configured; the config's default ``local[*]`` becomes local[4].

    Four task slots, whatever the cores: the driver shares its machine with Ray and NATS,
    and a short top-N task should not queue behind the panels' long tasks (FAIR pools never
    preempt a running task). On 2 cores, local[4] against local[2]: e2e top-N p99 at 1k
    events/s 1.8-2.0 against 2.2-3.2 s, demo 3.1-3.3 against 3.3-3.8 s (docs/benchmarks.md).
    """
    return DEFAULT_MASTER if cfg.spark.master == "local[*]" else cfg.spark.master


def query_triggers(jobs: Mapping[str, JobSpec]) -> dict[str, float]:
    """The interval (s) each job's query runs at, `staggered` so that queries sharing an
    interval do not all start their batches at the same instant."""
    return staggered({name: spec.trigger_s for name, spec in jobs.items()})


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
    copy: CopyId | None = None  # the copy this query reads (recorded in its checkpoint)
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


class _DeadLetterCount(msgspec.Struct, array_like=True):
    """A stream's dead letters in the checkpoint: `next_seq` is the scan's position (0 in
    a record written by the Spark dead-letter query before it, whose checkpoint then has
    the position); `last_batch` is that query's last counted batch, kept for the record."""

    last_batch: int
    total: int
    next_seq: int = 0


def deadletter_position(record: _DeadLetterCount | None, spark_checkpoint: Path) -> int:
    """Where a stream's dead-letter scan starts: its recorded position; after the Spark
    dead-letter query it replaces (a record without one), the end of that query's last
    committed batch, so an upgrade neither skips nor resends; else 0, the stream's first."""
    if record is not None and record.next_seq:
        return record.next_seq
    done = committed(spark_checkpoint)
    if done is not None and done[1] is not None:
        return int(done[1].get("seq", 0))
    return 0


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
        peer: the Ray name of the other driver of a warm pair (jobs/standby.py): this one
            starts as a standby and runs the queries only once it holds the store's lock
            and the pair's lease.
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
        peer: str | None = None,
    ) -> None:
        self.cfg = validate(dict(config or {}))
        self._configured = {s.name: s for s in (decode_spec(j) for j in jobs)}
        self._lock = threading.Lock()
        self._w = _Wanted()
        # with a peer (jobs/standby.py) the checkpoint store is opened by whichever driver
        # takes it over; a driver alone opens it here
        self.phases: dict[str, float] = {}  # seconds from __init__ to each start-up phase
        super().__init__(state_dir, name=name, open_store=peer is None)
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
        self._copies = CopyTracker(self.nats)
        self._pair = WarmPair(
            name=self.name,
            peer=peer,
            namespace=self.cfg.ray.namespace,
            nats=self.nats,
            incarnation=self.incarnation,
            store_path=self.store_path,
            closing=self._closing,
            adopt=self.adopt_store,
            jvm_pid=self._jvm_pid,
            error=JobsError,
        )
        self._thread = threading.Thread(target=self._run, name="analysis-driver", daemon=True)
        self._thread.start()

    @property
    def role(self) -> str:
        """``active`` (runs the queries) or ``standby`` (jobs/warm_pair.py)."""
        return self._pair.role

    @property
    def peer(self) -> str | None:
        return self._pair.peer

    # ---- checkpoint ---------------------------------------------------------------------

    def restore(self, store: CheckpointStore) -> None:
        self._jobs_ns = store.namespace("jobs")
        self._stopped_ns = store.namespace("stopped")
        self._dl_ns = store.namespace("deadletters")
        self._escalation_ns = store.namespace("escalation")
        last = self._escalation_ns.get(b"last")
        self._last_escalation = float(last) if last else None
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

    def _deadletter_record(self, stream: str) -> _DeadLetterCount | None:
        raw = self._dl_ns.get(stream.encode())
        return msgspec.msgpack.decode(raw, type=_DeadLetterCount) if raw else None

    def _count_deadletters(self, stream: str, next_seq: int, report: BatchReport) -> None:
        """A scan's pass is durable: its position and the dead letters JetStream newly
        stored (a pass resent after a crash finds its ids there already), in one put."""
        seen = self._deadletter_record(stream)
        last_batch, total = (seen.last_batch, seen.total) if seen else (-1, 0)
        total += report.published - report.duplicates
        record = _DeadLetterCount(last_batch, total, next_seq)
        self._dl_ns.put(stream.encode(), msgspec.msgpack.encode(record))

    def _committed_seq(self, q: _Query) -> int | None:
        """The next sequence `q` reads, all before it durably done (a dead-letter scan's
        recorded position, a query's last committed end offset); None before its first."""
        if q.kind == "deadletter":
            return deadletter_position(self._deadletter_record(q.stream), q.checkpoint) or None
        done = committed(q.checkpoint)
        seq = (done[1] or {}).get("seq") if done else None
        return int(seq) if seq is not None else None

    def _deadletter_totals(self) -> dict[str, int]:
        out = {}
        for key, raw in self._dl_ns.scan():
            out[key.decode()] = msgspec.msgpack.decode(raw, type=_DeadLetterCount).total
        return out

    # ---- the reconcile thread (the only one making Spark control calls) -----------------

    def _run(self) -> None:
        began = time.monotonic()
        if self.role == "standby":
            self._pair.yield_to_peer()
            if self._closing.is_set():  # shut down while it waited: no JVM to start
                self.state = "stopped"
                return
        self.phases["yielded_s"] = round(time.monotonic() - began, 1)
        try:
            self.spark = self._start_spark()
            self.phases["spark_s"] = round(time.monotonic() - began, 1)
        except Exception as err:  # reported by status(); a restart would fail the same way
            log.exception("analysis driver: Spark did not start")
            self.state, self.error = "failed", f"Spark did not start: {err!r}"
            return
        if self.role == "standby":
            self._pair.stand_by(self._warm_up, self._set_state)
            if self.role != "active" and not self._pair.take_over():
                self._stop_all()
                return
        self._pair.record_jvm(self._jvm_pid())
        self.state = "running"
        while not self._closing.is_set():
            try:
                self._reconcile()
            except Exception:  # keep reconciling: one bad job must not stop the others
                log.exception("analysis driver: reconcile")
            self._wake.wait(RECONCILE_S)
            self._wake.clear()
        self._stop_all()
        self._pair.release_lease()

    def _set_state(self, state: str) -> None:
        self.state = state

    def _jvm_pid(self) -> int | None:
        gateway = getattr(getattr(self.spark, "sparkContext", None), "_gateway", None)
        proc = getattr(gateway, "proc", None)
        return proc.pid if proc is not None else None

    def _warm_up(self, abort: Callable[[], bool]) -> None:
        """A standby's warm-up in this JVM (jobs/warm_pair.py `warm_up`); `abort` ends it."""
        assert self.spark is not None
        started = time.monotonic()
        work = self.state_dir / f"warm-up-{self.incarnation}"
        if warm_up(self.spark, work, abort, self._streams, self.nats, self.name):
            self.phases["warmed_s"] = round(time.monotonic() - started, 1)

    def _streams(self) -> list[str]:
        """The streams the jobs read (else every configured one), for the warm-up's read."""
        with self._lock:
            jobs = [*self._configured.values(), *self._w.jobs.values()]
        return sorted({spec.stream for spec in jobs}) or sorted(self.cfg.streams)

    def _forward(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.peer is None:
            raise JobsError(f"analysis driver {self.name!r} is {self.state}")
        wait = own_wait(getattr(type(self), method), args, kwargs)
        return self._pair.forward(method, args, kwargs, wait)

    def from_standby(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """A call a standby handed over; never handed on, so two standbys cannot loop."""
        if self.role != "active":
            raise JobsError(
                "no analysis driver is active yet (both stand by: starting or taking over)"
            )
        return getattr(self, method)(*args, **kwargs)

    def role_info(self) -> dict[str, Any]:
        """This driver's own role (``active`` or ``standby``), answered without its peer;
        `caught_up`: active, and every query has finished a batch in this process."""
        queries = [q for q in list(self._w.queries.values()) if q.kind != "archive"]
        return {
            **self.heartbeat(),
            "role": self.role,
            "state": self.state,
            "caught_up": self.role == "active"
            and self.state == "running"
            and bool(queries)
            and all(q.last_batch is not None for q in queries),
            "peer": self.peer,
            "namespace": self.cfg.ray.namespace,
            "phases": self.phases,
            "took_over": self._pair.took_over,
            "lease": self._pair.lease_info(),
        }

    def _start_spark(self) -> SparkSession:
        # pyspark loads here, in the actor: the CLI imports this module for its names only
        from jobs.jetstream import register
        from jobs.source_zygote import prestart
        from jobs.spark_session import analysis_conf
        from jobs.windows import LateEventCounter

        spark_cfg = msgspec.structs.replace(
            self.cfg.spark, master=self.master, conf=analysis_conf(self.cfg.spark.conf)
        )
        cfg = msgspec.structs.replace(self.cfg, spark=spark_cfg)
        prestart(self.master)  # the source zygote's imports while the JVM starts
        spark = spark_session(cfg, app_name=f"tierflow-{self.name}")
        register(spark)
        self.late = LateEventCounter()
        spark.streams.addListener(self.late)
        return spark

    def _reconcile(self) -> None:
        with self._lock:
            wanted = dict(self._w.jobs)
            paused = set(self._w.paused)
        streams = {spec.stream for spec in wanted.values()}
        every = query_triggers(wanted)
        for spec in wanted.values():
            if spec.name in paused:
                continue
            self._ensure(
                spec.name,
                spec.stream,
                spec.kind,
                lambda s=spec, t=every[spec.name]: self._start_job(s, t),
                checkpoint_dir(self.checkpoint_root, spec.name, self._view(spec.name)),
            )
        for stream in streams:
            name = deadletter_query_name(stream)
            self._ensure(name, stream, "deadletter", lambda s=stream: self._start_dl(s))
        keep = (set(wanted) - paused) | {deadletter_query_name(s) for s in streams}
        for stream, s in self.cfg.streams.items():
            if s.archive is not None:
                name = archive_query_name(stream)
                keep.add(name)
                self._ensure(name, stream, "archive", lambda st=stream: self._start_archive(st))
        for name in [n for n in self._w.queries if n not in keep]:
            self._stop_query(name)
        failing = {n: q.failures for n, q in self._w.queries.items() if n in keep}
        after = self.cfg.spark.restart_after_failures
        if should_escalate(failing, self._last_escalation, time.time(), after=after):
            self._escalate(failing)
        if self._copies.due():  # a stream made again under a running query: restart it
            for name in self._copies.stale(list(self._w.queries.values())):
                self._stop_query(name)
        if time.monotonic() >= self._next_retention:
            self._next_retention = time.monotonic() + RETENTION_S
            self._retention()

    def _escalate(self, failing: Mapping[str, int]) -> None:
        """Every query keeps dying: exit so that Ray restarts the driver in a new process and
        JVM (jobs/escalation.py); the checkpoints make that restart exact."""
        errors = {n: (self._w.queries[n].error or "")[:300] for n in failing}
        log.error(
            "analysis driver: every query failed %d+ times in a row, restarting the driver "
            "in a new process: %s",
            min(failing.values()),
            errors,
        )
        self._escalation_ns.put(b"last", str(time.time()).encode())
        logging.shutdown()
        os._exit(EXIT_ESCALATED)

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
            close_sinks(name)
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

    def _start_job(self, spec: JobSpec, trigger_s: float) -> StreamingQuery:
        q = self._w.queries[spec.name]

        def on_batch(batch_id: int, report: BatchReport) -> None:
            q.count(batch_id, report)

        assert self.spark is not None
        view = self._view(spec.name)
        if view is not None and view.spec != spec:
            raise JobError(
                f"job {spec.name!r} has a batch view of another spec: recompute it, or "
                "give the changed job a new name"
            )
        q.checkpoint = checkpoint_dir(self.checkpoint_root, spec.name, view)
        copy = self._copies.begin(q, fallback=view.copy if view is not None else None)
        if copy.moved:  # positions of another copy: a new generation over this one
            view = self._new_generation(spec, copy.action, copy.here)
            q.checkpoint = checkpoint_dir(self.checkpoint_root, spec.name, view)
            self._copies.moved(
                copy, q.checkpoint, generation=view.generation, high_water=view.high_water
            )
        if view is not None and not view.served:  # the driver died between saving and serving
            self._serve(view)
        if view is not None and spec.kind not in MERGEABLE:
            return self._start_fresh(spec, view, on_batch, trigger_s)
        return start_job(
            self.spark,
            spec,
            self.nats,
            self.checkpoint_root,
            on_batch=on_batch,
            view=view,
            trigger_s=trigger_s,
        )

    def _new_generation(self, spec: JobSpec, action: Action, here: CopyId) -> BatchView:
        """The job's new generation over copy `here` after its positions were found to be
        of another copy: recomputed for kinds that merge, started over for the others.
        Older generations' checkpoints are retired; the caller records the copy."""
        if action is Action.RECOMPUTE:
            new = self._rebuild(spec, here)
        else:
            new = fresh_generation(spec, now_ms(), here)
            save_view(self.checkpoint_root, new)
            self._views[spec.name] = new
            self._serve(new)  # no rows: the old copy's results are retired
        keep = checkpoint_dir(self.checkpoint_root, spec.name, new)
        retire_checkpoints(self.checkpoint_root, spec.name, keep)
        return new

    def _rebuild(self, spec: JobSpec, here: CopyId) -> BatchView:
        """Recompute `spec` over copy `here` up to its last sequence now; saved and served:
        from here on it is the job's current generation."""
        assert self.spark is not None
        view = recompute_view(
            self.spark,
            self.nats,
            spec,
            self._table(spec.stream, here),
            high_water=_stream_end(self.nats, spec.stream) - 1,
            copy=here,
        )
        save_view(self.checkpoint_root, view)
        self._views[spec.name] = view
        self._serve(view)
        return view

    def _table(self, stream: str, here: CopyId) -> StreamTable:
        """The stream's table on copy `here`: with the archive in `here`'s own directory,
        and only if the archive is of this copy (an archive's position is a sequence of the
        copy it archived) and its checkpoint owns that directory (jobs/archive.py)."""
        table = tables_for(self.cfg, self.checkpoint_root).get(stream) or StreamTable(stream)
        if table.archive_root is None:
            return table
        at = owned_root(table.archive_root, stream, self.checkpoint_root, here, self.spark)
        if at is None:
            return StreamTable(stream, schema=table.schema)
        return StreamTable(stream, at, table.checkpoint_root, table.schema)

    def _archive_of(self, stream: str, here: CopyId) -> bool:
        """Whether the stream's archive positions are of copy `here` and its checkpoint owns
        the copy's archive directory: else nothing is read or purged for them."""
        root = self.cfg.archive_root(stream)
        return owned_root(root, stream, self.checkpoint_root, here, self.spark) is not None

    def _start_fresh(
        self, spec: JobSpec, view: BatchView, on_batch: Any, trigger_s: float
    ) -> StreamingQuery:
        """A generation of a job that does not merge: its query under the generation's
        checkpoint and result ids, from the stream's first sequence, nothing merged."""
        from jobs.plans import build_plan
        from jobs.running import processing_time, read_stream, start_plan
        from jobs.sink import ResultSink

        assert self.spark is not None
        source = read_stream(
            self.spark, self.nats, spec.stream, spec.subject, spec.max_events_per_trigger
        )
        plan = build_plan(spec, source)
        ckpt = checkpoint_dir(self.checkpoint_root, spec.name, view)
        sink = ResultSink.for_query(self.nats, spec.name, generation=view.generation)
        return start_plan(self.spark, spec, plan, sink, ckpt, on_batch, processing_time(trigger_s))

    def _serve(self, view: BatchView) -> None:
        serve_view(self.nats, view)
        view.served = True
        save_view(self.checkpoint_root, view)
        self._views[view.name] = view

    def _start_dl(self, stream: str) -> DeadLetterScan:
        """The stream's dead-letter scan from its recorded position; on another copy it
        starts over there (its positions, and its dead letters' ids, are sequences)."""
        q = self._w.queries[deadletter_query_name(stream)]
        copy = self._copies.begin(q)
        if copy.moved:
            shutil.rmtree(q.checkpoint, ignore_errors=True)
            self._dl_ns.delete(stream.encode())  # its position and count start over too
            self._copies.moved(copy, q.checkpoint)

        def on_pass(next_seq: int, report: BatchReport) -> None:
            self._count_deadletters(stream, next_seq, report)
            q.count(next_seq, report)

        start = deadletter_position(self._deadletter_record(stream), q.checkpoint)
        return DeadLetterScan(self.nats, stream, start, on_pass).start()

    def _start_archive(self, stream: str) -> StreamingQuery:
        """The stream's archive query; refused on another copy (`archive_copy_error`)."""
        archive = self.cfg.streams[stream].archive
        assert self.spark is not None and archive is not None
        copy = self._copies.begin(self._w.queries[archive_query_name(stream)])
        if copy.moved:
            assert copy.recorded is not None
            old = copy_root(self.cfg.archive_root(stream), copy.recorded)
            raise CopyError(archive_copy_error(stream, copy.recorded, copy.here, old))
        settings = ArchiveSettings(
            path=self.cfg.archive_root(stream),
            partitioning=archive.partitioning,
            flush_s=archive.flush_s,
            retention_days=archive.retention_days,
        )
        return start_archive(
            self.spark, stream, self.nats, settings, self.checkpoint_root, copy=copy.here
        )

    def _retention(self) -> None:
        """Trim each archived stream to its limits, never past what is archived, what a
        copy on another site has not sourced, or what a reader is reading
        (jobs/retention_holds.py); a stream full because one of those lags is logged
        loudly, naming it (every pass until it is not). Drop archived days past
        `retention_days` from the copy's own archive directory (jobs/archive.py `copy_root`)."""
        archived_streams = {n: s for n, s in self.cfg.streams.items() if s.archive is not None}
        if not archived_streams:
            return
        now = dt.datetime.now(dt.UTC)

        async def trim() -> None:
            nc = await self.nats.connect(name="analysis-retention")
            try:
                for name, s in archived_streams.items():
                    here = await acurrent_copy(nc, name)
                    if not self._archive_of(name, here):
                        continue  # its positions are another copy's: purge nothing here
                    assert s.archive is not None
                    if s.archive.retention_days > 0:
                        root = copy_root(self.cfg.archive_root(name), here)
                        for gone in purge_archive(root, name, s.archive.retention_days, now):
                            log.info("analysis driver: archive of %s: dropped %s", name, gone)
                    if not (s.max_age_s > 0 or s.max_bytes > 0):
                        continue

                    def archived(name: str = name) -> int:
                        pos = archive_position(self.checkpoint_root, name)
                        return pos.next_seq if pos else 1

                    done = await trim_stream(nc, name, s, self.checkpoint_root, here, archived)
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
        close_sinks(name)  # the stopped query's kept NATS connection

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
        """The active driver's `local_status`; a standby's own (no queries) while no
        driver is active."""
        if self.role == "active":
            return self.local_status()
        try:
            return self._forward("local_status", (), {})
        except JobsError:
            return {**self.role_info(), "error": self.error, "jobs": [], "queries": {}}

    def local_status(self) -> dict[str, Any]:
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
            if q.kind != "deadletter" and (done := committed(q.checkpoint)):
                row["last_batch_id"] = done[0]
            if (seq := self._committed_seq(q)) is not None:
                row["committed_seq"] = seq
            view = self._views.get(name)
            if view is not None:
                row["view_high_water"] = view.high_water
                row["generation"] = view.generation
            if q.copy is not None:
                row["copy"] = q.copy.describe()
            if name in self._copies.changes:
                row["copy_change"] = self._copies.changes[name]
            if sq is not None:
                with contextlib.suppress(Exception):
                    row.update(progress_summary(sq.lastProgress))
                    row["late_events"] = self.late.count(sq.id) if self.late else 0
            queries[name] = row
        with self._lock:
            wanted = sorted(self._w.jobs)
        return {
            **self.heartbeat(),
            "role": self.role,
            "peer": self.peer,
            "took_over": self._pair.took_over,
            "state": self.state,
            "error": self.error,
            "master": self.master,
            "nats_url": self.nats.url,
            "jobs": wanted,
            "queries": queries,
            "dead_letters": self._deadletter_totals() if self.state != "stopped" else {},
            "escalated_at": self._last_escalation,
        }

    @on_active
    def progress(self, since: float = 0.0) -> dict[str, list[dict[str, Any]]]:
        """Per query, its recent batches (Spark keeps the last 100) that started at or after
        `since` (epoch s): batch id, when it started (``at``, epoch s), input rows and where
        its time went (``durationMs``: latestOffset, queryPlanning, walCommit, addBatch,
        commitOffsets..., and triggerExecution, the whole batch; and within addBatch, the
        foreachBatch's parts: ``fb_collect``, the Spark job and its rows to Python,
        ``fb_shape``, the plan's rows, ``fb_publish``, results and KV)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for name, q in list(self._w.queries.items()):
            sq = q.query
            if sq is None:
                continue
            rows = []
            with contextlib.suppress(Exception):
                for p in sq.recentProgress:
                    d = json.loads(p.json) if hasattr(p, "json") else dict(p)
                    at = _epoch_s(d.get("timestamp"))
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

    @ray.method(concurrency_group=SQL_GROUP, max_task_retries=0)
    def sql(
        self,
        sql: str,
        limit: int = 1000,
        timeout_s: float = 30.0,
        allowed: Sequence[str] | None = None,
        forwarded: bool = False,
    ) -> dict[str, Any]:
        """Run one ad-hoc query (jobs/sql.py) in this driver's Spark, for the gateway's
        `/v1/sql`: ``{"status": 200, "columns", "rows", "truncated", "tables"}``, or
        ``{"status": 400|503|504|500, "error"}``, or ``{"status": 429, "retry_after_s"}``
        while `sql_slots` queries run already. `allowed`: the streams the caller may read
        (None: all; a query naming no table needs all).

        It runs on the actor's `SQL_GROUP` threads, so the control methods (status, jobs,
        start, stop, heartbeats, the standby's role checks) always have threads of their
        own; in `sql_session` (its own SQL settings) and the `SQL_POOL` scheduler pool, so
        the streaming queries keep their share of the cores. Ray does not retry it when
        the driver dies under it: the same query would kill the restarted driver too. A
        standby hands it to the active driver's SQL threads (`forwarded` says so there:
        never handed on again)."""
        if self.role != "active":
            return self._pair.forward_sql(sql, limit, timeout_s, allowed, forwarded)
        spark = self.spark
        if spark is None or self.state != "running":
            return {"status": 503, "error": f"the analysis driver's Spark is {self.state}"}
        gate = self._sql_gate()
        allow = set(allowed) if allowed is not None else None
        ticket: int | None = None
        try:
            tables = tables_for(self.cfg, self.checkpoint_root)
            readable = sorted(t for t in tables if allow is None or t in allow)
            check_select(sql, tables, listed=readable)  # a refusal is a 400 whatever the load
            ticket = gate.enter(timeout_s)
            if ticket is None:
                wait = gate.retry_after_s()
                return {
                    "status": 429,
                    "retry_after_s": wait,
                    "error": f"{gate.slots} SQL queries run already: retry after {wait} s",
                }
            for stream, table in tables.items():  # an archive of another copy is left out
                if table.archive_root is not None:
                    tables[stream] = self._table(stream, current_copy(self.nats, stream))
            result = run_sql(
                self._sql_spark(spark),
                self.nats,
                sql,
                tables,
                limit=limit,
                timeout_s=timeout_s,
                allowed=lambda stream: allow is None or stream in allow,
                pool=SQL_POOL,
            )
        except SqlRefused as err:
            return {"status": 400, "error": str(err)}
        except SqlTimeout as err:
            return {"status": 504, "error": str(err)}
        except HistoryGap as err:  # retention got past the read: the same query answers next
            return {"status": 503, "error": str(err), "retry_after_s": 1}
        except Exception as err:
            log.exception("analysis driver: sql")
            return {"status": 500, "error": f"the query failed: {err}"[:1000]}
        finally:
            if ticket is not None:
                gate.leave(ticket)
        return {"status": 200, **json_result(result)}

    def _sql_gate(self) -> SqlAdmission:
        """This driver's SQL admission (made on first use, by whichever SQL thread)."""
        with _SQL_INIT:
            gate = self.__dict__.get("_sql_admission")
            if gate is None:
                gate = self._sql_admission = SqlAdmission(sql_slots(self.cfg))
            return gate

    def _sql_spark(self, spark: SparkSession) -> SparkSession:
        """The session ad-hoc SQL runs in: `sql_session` of `spark`, one per Spark session."""
        with _SQL_INIT:
            made = self.__dict__.get("_sql_sessions")
            if made is None or made[0] is not spark:
                from jobs.jetstream import register
                from jobs.spark_session import sql_session

                own = sql_session(spark)
                register(own)
                made = self._sql_sessions = (spark, own)
            return made[1]

    @on_active
    def archives(self) -> dict[str, dict[str, Any]]:
        """Per archived stream: the archive's committed position and the last trim."""
        out: dict[str, dict[str, Any]] = {}
        for name, s in self.cfg.streams.items():
            if s.archive is None:
                continue
            pos = archive_position(self.checkpoint_root, name)
            purge = self.purges.get(name)
            copy = read_copy(self.checkpoint_root / archive_query_name(name))
            q = self._w.queries.get(archive_query_name(name))
            error = q.error if q and q.error else None
            out[name] = {
                # the directory of the copy this checkpoint archives (jobs/archive.py)
                "path": copy_root(self.cfg.archive_root(name), copy),
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

    @ray.method(concurrency_group=RECOMPUTE_GROUP)
    @on_active
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
            here = current_copy(self.nats, spec.stream)
            high_water = _stream_end(self.nats, spec.stream) - 1
            view = recompute_view(
                self.spark,
                self.nats,
                spec,
                self._table(spec.stream, here),
                high_water=high_water,
                copy=here,
            )
            save_view(self.checkpoint_root, view)  # from here on, this generation is current
            self._views[name] = view
            self._serve(view)
            keep = checkpoint_dir(self.checkpoint_root, name, view)
            retire_checkpoints(self.checkpoint_root, name, keep)
            record_copy(keep, here)
        finally:
            with self._lock:
                self._w.paused.discard(name)
            self._wake.set()
        row = self._wait_for(name, lambda r: r and r["state"] != "starting", wait_s)
        return {**view.summary(), "state": row["state"] if row else "starting"}

    @on_active
    def jobs(self) -> dict[str, dict[str, Any]]:
        """The wanted jobs' specs, by name."""
        with self._lock:
            return {n: msgspec.to_builtins(s) for n, s in self._w.jobs.items()}

    @on_active
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

    @on_active
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
            row = self.local_status()["queries"].get(name)
            if done(row) or time.monotonic() >= deadline:
                return row
            time.sleep(0.1)

    @on_active
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
            seq = self._committed_seq(q) or 1
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
            if self.role == "active":  # a standby never opened it
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
