"""How the analysis driver's Spark starts (`start_spark`), and each kind of its queries: a
job from its current generation, a stream's dead-letter scan from its recorded position, a
stream's archive; each on the copy of its stream the driver reads now.

Exists so that the reconcile loop (jobs/driver.py) only decides which queries should run,
and what a start involves per kind lives in one place: the copy decision
(jobs/copy_tracker.py) is made the same way for the three kinds, and here each kind acts on
a change of copy its own way (a job gets a new generation, jobs/generations.py; a
dead-letter scan starts over; the archive refuses, `archive_copy_error`). These are Spark
control calls: only the driver's reconcile thread calls them.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from jobs.archive import ArchiveSettings, copy_root, start_archive
from jobs.copies import MERGEABLE, CopyError
from jobs.copy_tracker import CopyTracker, archive_copy_error
from jobs.deadletter_scan import DeadLetterScan
from jobs.running import job_plan, start_job
from runtime.engines.services import spark_session
from runtime.errors import JobError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQuery

    from jobs.batch_view import BatchView
    from jobs.deadletter_book import DeadLetterBook
    from jobs.generations import Generations
    from jobs.queries import Query
    from jobs.sink import BatchReport
    from runtime.config import Config
    from runtime.job_specs import JobSpec
    from runtime.nats.server import NatsEndpoint

__all__ = ["QueryStarts", "start_spark"]


def start_spark(cfg: Config, master: str, name: str) -> tuple[SparkSession, Any]:
    """The driver's Spark session on `master` with the analysis settings, the jetstream
    source registered, and the listener counting late events (also returned)."""
    # pyspark loads here, in the actor: the CLI imports the driver for its names only
    from jobs.jetstream import register
    from jobs.source_zygote import prestart
    from jobs.spark_session import analysis_conf
    from jobs.windows import LateEventCounter

    spark_cfg = msgspec.structs.replace(
        cfg.spark, master=master, conf=analysis_conf(cfg.spark.conf)
    )
    prestart(master)  # the source zygote's imports while the JVM starts
    spark = spark_session(
        msgspec.structs.replace(cfg, spark=spark_cfg), app_name=f"tierflow-{name}"
    )
    register(spark)
    late = LateEventCounter()
    spark.streams.addListener(late)
    return spark, late


class QueryStarts:
    """Starts one query of each kind for the reconcile thread (`job`, `deadletters`,
    `archive`); each returns the running query (a StreamingQuery, or a dead-letter scan).

    Args:
        cfg: the streams and their archives' settings.
        nats: where the streams are.
        checkpoint_root: where the queries' checkpoints are.
        spark: the driver's Spark session (None before it is up).
        copies: the copy decision (jobs/copy_tracker.py).
        generations: the jobs' batch views (jobs/generations.py).
        deadletters: the dead-letter scans' book, once the driver holds its store.
    """

    def __init__(
        self,
        cfg: Config,
        nats: NatsEndpoint,
        checkpoint_root: Path,
        spark: Callable[[], SparkSession | None],
        copies: CopyTracker,
        generations: Generations,
        deadletters: Callable[[], DeadLetterBook],
    ) -> None:
        self.cfg, self.nats, self.checkpoint_root = cfg, nats, checkpoint_root
        self._spark, self.copies, self.generations = spark, copies, generations
        self._deadletters = deadletters

    def _session(self) -> SparkSession:
        spark = self._spark()
        assert spark is not None
        return spark

    def job(self, q: Query, spec: JobSpec, trigger_s: float) -> StreamingQuery:
        """The job's query from its current generation, on the copy the driver reads now:
        positions of another copy are never resumed; the job gets a new generation over
        this copy instead (recomputed for kinds that merge, started over for the others)."""
        spark = self._session()
        view = self.generations.view(spec.name)
        if view is not None and view.spec != spec:
            raise JobError(
                f"job {spec.name!r} has a batch view of another spec: recompute it, or "
                "give the changed job a new name"
            )
        q.checkpoint = self.generations.checkpoint(spec.name, view)
        copy = self.copies.begin(q, fallback=view.copy if view is not None else None)
        if copy.moved:
            view = self.generations.on_copy(spec, copy.action, copy.here)
            q.checkpoint = self.generations.checkpoint(spec.name, view)
            self.copies.moved(
                copy, q.checkpoint, generation=view.generation, high_water=view.high_water
            )
        if view is not None and not view.served:  # the driver died between saving and serving
            self.generations.serve(view)
        if view is not None and spec.kind not in MERGEABLE:
            return self._fresh(spark, spec, view, q.count, trigger_s)
        start = view.high_water + 1 if view is not None else 0
        plan = job_plan(spark, spec, self.nats, self.cfg.sql_tables(), start, view=view)
        q.streams = plan.streams
        return start_job(
            spark,
            spec,
            self.nats,
            self.checkpoint_root,
            on_batch=q.count,
            view=view,
            trigger_s=trigger_s,
            plan=plan,
        )

    def _fresh(
        self,
        spark: SparkSession,
        spec: JobSpec,
        view: BatchView,
        on_batch: Callable[[int, BatchReport], Any],
        trigger_s: float,
    ) -> StreamingQuery:
        """A generation of a job that does not merge: its query under the generation's
        checkpoint and result ids, from the stream's first sequence, nothing merged."""
        from jobs.running import processing_time, start_plan
        from jobs.sink import ResultSink

        plan = job_plan(spark, spec, self.nats, self.cfg.sql_tables())
        ckpt = self.generations.checkpoint(spec.name, view)
        sink = ResultSink.for_query(self.nats, spec.name, generation=view.generation)
        return start_plan(spark, spec, plan, sink, ckpt, on_batch, processing_time(trigger_s))

    def deadletters(self, q: Query) -> DeadLetterScan:
        """The stream's dead-letter scan from its recorded position; on another copy it
        starts over there (its positions, and its dead letters' ids, are sequences)."""
        book = self._deadletters()
        copy = self.copies.begin(q)
        if copy.moved:
            shutil.rmtree(q.checkpoint, ignore_errors=True)
            book.forget(q.stream)  # its position and count start over too
            self.copies.moved(copy, q.checkpoint)

        def on_pass(next_seq: int, report: BatchReport) -> None:
            book.count(q.stream, next_seq, report)
            q.count(next_seq, report)

        start = book.position(q.stream, q.checkpoint)
        return DeadLetterScan(self.nats, q.stream, start, on_pass).start()

    def archive(self, q: Query) -> StreamingQuery:
        """The stream's archive query; refused on another copy (`archive_copy_error`)."""
        stream = q.stream
        archive = self.cfg.streams[stream].archive
        assert archive is not None
        spark = self._session()
        copy = self.copies.begin(q)
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
            spark, stream, self.nats, settings, self.checkpoint_root, copy=copy.here
        )
