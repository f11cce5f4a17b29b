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
query that died (backoff 1 s doubling to 30 s, jobs/queries.py); when every query keeps
dying (``spark.restart_after_failures`` times in a row) the fault is taken to be the
driver's own, and it exits so that Ray restarts it in a new process (jobs/escalation.py).
Ray methods only change the wanted set and read state, so heartbeats never wait behind
Spark (the actor is threaded); ad-hoc SQL and recompute, which do run Spark jobs, have Ray
concurrency groups of their own (jobs/sql_admission.py), so no query can occupy the threads
`status`, `jobs` and the standby's role check answer on. Each stream with a job also gets a
dead-letter scan (jobs/deadletter_scan.py, a reader without Spark, supervised like a query):
malformed events go to ``deadletter.<stream>``, and its position and exact count are kept in
the checkpoint (jobs/deadletter_book.py).

The reconcile loop is this module's own; the actor is a thin Ray front over the parts it
hands the rest to, each given what it needs (the Spark session getter, a checkpoint
namespace, the config) and testable without the others:

- jobs/warm_pair.py: the warm standby (jobs/standby.py): role, the pair's lease, yielding,
  warming up and taking over, and handing calls to the active peer;
- jobs/copy_tracker.py: which copy of its stream each query reads (below), decided once
  for jobs, dead-letter scans and the archive;
- jobs/generations.py: jobs' batch views: `recompute`, serving, a new generation;
- jobs/adhoc_sql.py: ad-hoc SQL (`sql`) and the table a stream's history is read from;
- jobs/retention_runner.py: trimming archived streams, on its own schedule and event loop;
- jobs/driver_status.py: what `status`, `progress`, `archives` and `await_idle` report.

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

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import ray

from jobs.adhoc_sql import AdhocSql
from jobs.archive import queries_root
from jobs.batch_view import check_mergeable
from jobs.checkpoints import committed
from jobs.copy_tracker import CopyTracker
from jobs.deadletter_book import DeadLetterBook
from jobs.driver_status import archive_rows, behind, progress_rows, progress_summary, query_rows
from jobs.escalation import should_escalate
from jobs.generations import Generations, stream_end
from jobs.queries import QuerySet, backoff_s, query_triggers
from jobs.query_starts import QueryStarts, start_spark
from jobs.retention_runner import RetentionRunner
from jobs.wanted import WantedJobs
from jobs.warm_pair import WarmPair, own_wait, warm_up
from runtime.config import Config, validate
from runtime.data.sql_jobs import job_streams
from runtime.errors import JobError, TierflowError
from runtime.job_specs import decode_spec
from runtime.nats.server import NatsEndpoint
from runtime.roles import ANALYSIS_DRIVER
from runtime.supervision.ray_actors import SupervisedActor

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from jobs.sql_jobs import SqlJobPlan
    from runtime.job_specs import JobSpec
    from runtime.state.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

DRIVER_NAME = ANALYSIS_DRIVER
MAX_CONCURRENCY = 8  # the control methods' threads (Ray's default concurrency group)
# ad-hoc SQL and recomputes run on threads of their own (Ray concurrency groups, declared
# where the actor is made: cluster/deploy/analysis.py), never on the control methods'
SQL_GROUP, RECOMPUTE_GROUP = "sql", "recompute"
RECOMPUTE_THREADS = 2
DEFAULT_MASTER = "local[4]"
RECONCILE_S = 1.0
EXIT_ESCALATED = 70  # the driver's exit status when it restarts itself (jobs/escalation.py)


class AnalysisDriverError(TierflowError, RuntimeError):
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


def default_master(cfg: Config) -> str:
    """``spark.master`` when configured; the config's default ``local[*]`` becomes local[4].

    Four task slots, whatever the cores: the driver shares its machine with Ray and NATS,
    and a short top-N task should not queue behind the panels' long tasks (FAIR pools never
    preempt a running task). On 2 cores, local[4] against local[2]: e2e top-N p99 at 1k
    events/s 1.8-2.0 against 2.2-3.2 s, demo 3.1-3.3 against 3.3-3.8 s (docs/benchmarks.md).
    """
    return DEFAULT_MASTER if cfg.spark.master == "local[*]" else cfg.spark.master


class AnalysisDriver(SupervisedActor):
    """Spark and the streaming queries in one supervised Ray actor: the reconcile loop,
    and a thin Ray front over its parts (the module's docstring names them). One concept
    at some length: the loop and the Ray methods it answers, each a few lines over a part.

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
        self._wanted = WantedJobs({s.name: s for s in (decode_spec(j) for j in jobs)})
        self.phases: dict[str, float] = {}  # seconds from __init__ to each start-up phase
        # with a peer (jobs/standby.py) the checkpoint store is opened by whichever driver
        # takes it over; a driver alone opens it here
        super().__init__(state_dir, name=name, open_store=peer is None)
        self.nats = NatsEndpoint.from_config(self.cfg, "analysis", url=nats_url)
        if not self.nats.url:
            raise AnalysisDriverError("AnalysisDriver: no NATS URL (pass nats_url or set nats.url)")
        self.master = master or default_master(self.cfg)
        self.checkpoint_root = queries_root(self.cfg, state_dir)
        self.spark: SparkSession | None = None
        self.late: Any = None
        self.state = "starting"
        self.error: str | None = None
        self._closing = threading.Event()
        self._wake = threading.Event()
        # the parts, each given what it needs (none reaches into the actor)
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
            error=AnalysisDriverError,
        )
        self._copies = CopyTracker(self.nats)
        self._sql = AdhocSql(self.cfg, self.nats, self.checkpoint_root, self._copies.copy_of)
        self._generations = Generations(
            self.nats,
            self.checkpoint_root,
            lambda: self.spark,
            lambda stream, here: self._sql.table(stream, here, self.spark),
        )
        self._retention = RetentionRunner(
            self.cfg, self.nats, self.checkpoint_root, lambda: self.spark
        )
        self._starts = QueryStarts(
            self.cfg,
            self.nats,
            self.checkpoint_root,
            lambda: self.spark,
            self._copies,
            self._generations,
            lambda: self._deadletters,
        )
        self._queries = QuerySet(
            self._starts,
            self.checkpoint_root,
            lambda name: self._generations.checkpoint(name, self._generations.view(name)),
            [stream for stream, s in self.cfg.streams.items() if s.archive is not None],
            self.cfg.tables,
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
        self._wanted.restore(store)
        self._deadletters = DeadLetterBook(store.namespace("deadletters"))
        self._escalation_ns = store.namespace("escalation")
        last = self._escalation_ns.get(b"last")
        self._last_escalation = float(last) if last else None

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
            self.spark, self.late = start_spark(self.cfg, self.master, self.name)
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
        with self._wanted.lock:
            jobs = [*self._wanted.configured.values(), *self._wanted.jobs.values()]
        kv = self.cfg.tables
        return sorted({s for spec in jobs for s in job_streams(spec, kv)}) or sorted(
            self.cfg.streams
        )

    def _reconcile(self) -> None:
        """One pass over the parts (Ray Serve's control loop over its state managers)."""
        wanted, paused = self._wanted.snapshot()
        failing = self._queries.reconcile(wanted, paused)
        after = self.cfg.spark.restart_after_failures
        if should_escalate(failing, self._last_escalation, time.time(), after=after):
            self._escalate(failing)
        if self._copies.due():  # a stream made again under a running query: restart it
            for name in self._copies.stale(list(self._queries.queries.values())):
                self._queries.stop(name)
        self._retention.tick()

    def _escalate(self, failing: Mapping[str, int]) -> None:
        """Every query keeps dying: exit so that Ray restarts the driver in a new process and
        JVM (jobs/escalation.py); the checkpoints make that restart exact."""
        errors = {n: (self._queries.queries[n].error or "")[:300] for n in failing}
        log.error(
            "analysis driver: every query failed %d+ times in a row, restarting the driver "
            "in a new process: %s",
            min(failing.values()),
            errors,
        )
        self._escalation_ns.put(b"last", str(time.time()).encode())
        logging.shutdown()
        os._exit(EXIT_ESCALATED)

    def _stop_all(self) -> None:
        self._queries.stop_all()
        if self.spark is not None:
            with contextlib.suppress(Exception):
                self.spark.stop()
            self.spark = None
        self.state = "stopped"

    # ---- the warm pair's Ray methods (jobs/warm_pair.py) --------------------------------

    def _forward(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.peer is None:
            raise AnalysisDriverError(f"analysis driver {self.name!r} is {self.state}")
        wait = own_wait(getattr(type(self), method), args, kwargs)
        return self._pair.forward(method, args, kwargs, wait)

    def from_standby(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """A call a standby handed over; never handed on, so two standbys cannot loop."""
        if self.role != "active":
            raise AnalysisDriverError(
                "no analysis driver is active yet (both stand by: starting or taking over)"
            )
        return getattr(self, method)(*args, **kwargs)

    def role_info(self) -> dict[str, Any]:
        """This driver's own role (``active`` or ``standby``), answered without its peer;
        `caught_up`: active, and every query has finished a batch in this process."""
        return {
            **self.heartbeat(),
            "role": self.role,
            "state": self.state,
            "caught_up": self.role == "active"
            and self.state == "running"
            and self._queries.caught_up(),
            "peer": self.peer,
            "namespace": self.cfg.ray.namespace,
            "phases": self.phases,
            "took_over": self._pair.took_over,
            "lease": self._pair.lease_info(),
        }

    # ---- Ray methods (quick; never a Spark control call) --------------------------------

    def status(self) -> dict[str, Any]:
        """The active driver's `local_status`; a standby's own (no queries) while no
        driver is active."""
        if self.role == "active":
            return self.local_status()
        try:
            return self._forward("local_status", (), {})
        except AnalysisDriverError:
            return {**self.role_info(), "error": self.error, "jobs": [], "queries": {}}

    def local_status(self) -> dict[str, Any]:
        """State, and per query its row (jobs/driver_status.py `query_rows`); dead letters
        per stream (exact, over all incarnations)."""
        queries = query_rows(
            self._queries.queries,
            views=self._generations.views,
            changes=self._copies.changes,
            late=self.late,
            deadletters=self._deadletters,
        )
        with self._wanted.lock:
            wanted = sorted(self._wanted.jobs)
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
            "dead_letters": self._deadletters.totals() if self.state != "stopped" else {},
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
        return progress_rows(self._queries.queries, since)

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
        the streaming queries keep their share of the cores (jobs/adhoc_sql.py). Ray does
        not retry it when the driver dies under it: the same query would kill the
        restarted driver too. A standby hands it to the active driver's SQL threads
        (`forwarded` says so there: never handed on again)."""
        if self.role != "active":
            return self._pair.forward_sql(sql, limit, timeout_s, allowed, forwarded)
        spark = self.spark
        if spark is None or self.state != "running":
            return {"status": 503, "error": f"the analysis driver's Spark is {self.state}"}
        return self._sql.answer(spark, sql, limit, timeout_s, allowed)

    @on_active
    def archives(self) -> dict[str, dict[str, Any]]:
        """Per archived stream: the archive's committed position and the last trim."""
        return archive_rows(
            self.cfg, self.checkpoint_root, self._retention.purges, self._queries.queries
        )

    @ray.method(concurrency_group=RECOMPUTE_GROUP)
    @on_active
    def recompute(self, name: str, wait_s: float = 60.0) -> dict[str, Any]:
        """Recompute job `name` as a batch view over its stream's history (archive and
        tail) up to the stream's last sequence now, serve it, and run the job's next
        generation from there: its streaming query is paused meanwhile (events keep
        arriving in the stream and are read after). Returns the view's summary."""
        with self._wanted.lock:
            spec = self._wanted.jobs.get(name)
            if spec is None:
                raise AnalysisDriverError(
                    f"job {name!r} is not running in the driver: start it first"
                )
            try:
                check_mergeable(spec)
            except JobError as err:
                raise AnalysisDriverError(str(err)) from None
            if self.spark is None or self.state != "running":
                raise AnalysisDriverError(f"the analysis driver's Spark is {self.state}")
            if name in self._wanted.paused:
                raise AnalysisDriverError(f"job {name!r} is being recomputed already")
            self._wanted.paused.add(name)
        self._wake.set()
        try:
            if self._wait_for(name, lambda row: row is None, wait_s) is not None:
                raise AnalysisDriverError(
                    f"job {name!r}: its streaming query did not stop in {wait_s} s"
                )
            view = self._generations.recompute(spec, self._copies.copy_of(spec.stream))
        finally:
            self._wanted.resume(name)
            self._wake.set()
        row = self._wait_for(name, lambda r: r and r["state"] != "starting", wait_s)
        return {**view.summary(), "state": row["state"] if row else "starting"}

    @on_active
    def jobs(self) -> dict[str, dict[str, Any]]:
        """The wanted jobs' specs, by name."""
        with self._wanted.lock:
            return {n: msgspec.to_builtins(s) for n, s in self._wanted.jobs.items()}

    @on_active
    def start(self, job: Mapping[str, Any] | str, wait_s: float = 60.0) -> dict[str, Any]:
        """Want `job` (a JobSpec mapping or JSON) from now on, also after restarts; wait up
        to `wait_s` for its query to run (or fail) and return its status row."""
        spec = decode_spec(job if isinstance(job, str) else dict(job))
        if spec.kind == "sql":  # refused now, never a query that dies later
            self._plan_sql(spec, wait_s)
        if self._wanted.want(spec) is not None:
            raise AnalysisDriverError(
                f"job {spec.name!r} runs with another spec; stop it first (its checkpoint "
                "holds the old query's state: a changed query needs a new name)"
            )
        self._wake.set()
        return self._wait_for(spec.name, lambda row: row and row["state"] != "starting", wait_s)

    def _plan_sql(self, spec: JobSpec, wait_s: float) -> SqlJobPlan:
        """Plan a sql job in this driver's Spark (jobs/sql_jobs.py): JobError says why Spark
        could not run it. Planning reads no event and starts no query."""
        from jobs.running import sql_sources
        from jobs.sql_jobs import plan_sql_job, sql_streams

        sql_streams(spec, self.cfg.sql_tables())  # a refused query fails before any wait
        deadline = time.monotonic() + wait_s
        while self.spark is None and self.state == "starting" and time.monotonic() < deadline:
            time.sleep(0.1)
        spark = self.spark
        if spark is None:
            raise AnalysisDriverError(f"the analysis driver's Spark is {self.state}")
        catalog = self.cfg.sql_tables()
        sources = sql_sources(spark, self.nats, spec, catalog)
        return plan_sql_job(spark, spec, catalog, sources)

    @on_active
    def explain(self, name: str) -> dict[str, Any]:
        """A sql job's plan, output mode, key, event times and watermarks, and while it
        runs its state per operator, watermark and late events (jobs/sql_jobs.py)."""
        from jobs.sql_jobs import explain

        with self._wanted.lock:
            spec = self._wanted.jobs.get(name)
        if spec is None:
            raise AnalysisDriverError(f"no job {name!r} runs; start it first")
        if spec.kind != "sql":
            raise AnalysisDriverError(f"job {name!r} is a {spec.kind} job; explain is for sql")
        q = self._queries.queries.get(name)
        running = q.query if q is not None and q.query is not None else None
        active = running is not None and running.isActive
        out = {"name": name, **explain(self._plan_sql(spec, 30.0), running if active else None)}
        if active and self.late is not None:
            out["late_events"] = self.late.count(running.id)
        return out

    @on_active
    def stop(self, name: str, wait_s: float = 60.0) -> dict[str, Any]:
        """Stop wanting job `name` (also after restarts); wait up to `wait_s` for its query
        to stop. Its checkpoint stays, so starting it again resumes where it stopped."""
        known = self._wanted.unwant(name)
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
        late: dict[str, Any] = {"driver": self.state}
        while time.monotonic() < deadline:
            try:
                queries = list(self._queries.queries.values())
                streams = {s for q in queries for s in (q.streams or (q.stream,))}
                for s in streams - set(targets):
                    targets[s] = stream_end(self.nats, s)
                late = self._behind(targets)
            except Exception as err:
                late = {"error": repr(err)}
            if not late:
                return {"idle": True, "targets": targets}
            time.sleep(0.2)
        return {"idle": False, "targets": targets, "behind": late}

    def _behind(self, targets: Mapping[str, int]) -> dict[str, Any]:
        if self.state != "running":
            return {"driver": self.state}
        with self._wanted.lock:
            wanted = set(self._wanted.jobs)
        return behind(wanted, self._queries.queries, targets, self._deadletters)

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


__all__ = [
    "DRIVER_NAME",
    "AnalysisDriver",
    "AnalysisDriverError",
    "backoff_s",
    "committed",
    "default_master",
    "progress_summary",
    "query_triggers",
]
