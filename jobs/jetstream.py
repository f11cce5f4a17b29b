"""JetStream as a PySpark data source (format ``"jetstream"``): offsets are stream sequences.

A streaming query's offset is ``{"seq": N, "skipped": K}``: N is the next stream sequence to
read, K how many sequences were skipped because they had aged out (``onAgedOut=skip``). Spark
writes each micro-batch's (start, end) to its checkpoint before running it, so a restarted
query re-reads exactly its uncommitted range; end-to-end exactly-once also needs an
idempotent sink (jobs/sink.py). The same source reads in batch mode (``spark.read``) over
whatever the stream retains.

Partitions are sequence ranges, each read on an executor through its own pull consumer on
a connection its Python worker keeps across tasks (jobs/jetstream_read.py); the options, the
schema and the offset policy, all decided without I/O, are jobs/jetstream_options.py.
Every event becomes a row (only the malformed ones with ``invalidOnly``); a malformed one
has ``valid`` false, ``error`` saying why and ``raw`` its bytes.

Options (names are case-insensitive):

==================== ==========================================================================
url                  NATS URL, or several comma-joined (required)
user, password       credentials; or ``token``; or ``creds`` (a .creds file); ``tlsCa`` a CA file
tlsCert, tlsKey      the client certificate and key (for a server that verifies clients)
                     (these are `runtime.nats.server.NatsEndpoint.to_options`)
stream               the JetStream stream (required)
subject              subject filter; several comma-joined (default: every subject)
startingOffset       ``earliest`` (default), ``latest``, or a stream sequence; a new query only
endingOffset         batch reads: ``latest`` (default) or a sequence, exclusive
maxEventsPerTrigger  cap on the sequences one micro-batch spans (with a subject filter a batch
                     may hold fewer events than that)
onAgedOut            ``fail`` (default): a start sequence below the stream's first sequence is
                     an error naming both; ``skip``: continue from the first sequence and add
                     the gap to the offset's ``skipped`` count (and log it). On a compacted
                     stream with no other limit (`only_compaction`) gaps are superseded
                     events, never aged out: sequences have gaps there by design
validate             ``json`` (default), ``utf8``, or ``none``
invalidOnly          ``true``: only the malformed events become rows (``false``, default: every
                     event); the worker drops valid ones before they become Arrow, so a
                     dead-letter query converts and hands over only what it keeps
partitionSize        sequences per partition at most (default 20000)
minPartitions        partitions a range is cut into at least, each of 5000 sequences or more,
                     so Spark's cores read a big micro-batch together (default 2)
fetchBatch           messages per pull request, and rows per Arrow batch (default 5000)
fetchMaxBytes        bytes per pull request at most (default 16777216, 16 MiB), so big events
                     cannot pile up in a worker; raised to the server's max_payload (plus 16
                     KiB for subject and reply) so one event of any allowed size still fits
timeout              seconds for a NATS request (default 10)
==================== ==========================================================================

Credentials given as options are visible in the query plan, as with Spark's Kafka source.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from jobs.jetstream_options import (
    SCHEMA_DDL,
    AgedOutError,
    Bounds,
    JetStreamSourceError,
    SeqRange,
    SourceOptions,
    make_offset,
    next_offset,
    schema,
    split_range,
    starting_sequence,
)
from jobs.jetstream_read import StreamControl, read_range

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

FORMAT = "jetstream"


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("jetstream")`` and ``readStream.format("jetstream")`` work.

    As `spark.dataSource.register` does, but with the worker interpreter of
    `jobs.spark_session.worker_python`: Spark starts a new Python process for every query's
    offsets (and one to plan each read), and importing pyspark from the installed package
    instead of Spark's zip halves that start (docs/benchmarks.md). A query's offsets process
    is forked from this process's source zygote, which has its imports done
    (jobs/source_zygote.py; ``TIERFLOW_SOURCE_ZYGOTE_OFF=1`` starts it as Spark would)."""
    from pyspark.core.rdd import _prepare_for_python_RDD

    from jobs.source_zygote import ZYGOTE_ENV, enabled, ensure_started
    from jobs.spark_session import installed_like_spark, worker_python

    sc = spark.sparkContext
    jvm = sc._jvm
    assert jvm is not None
    worker = worker_python(
        sc.pythonExec,
        jvm.PythonUtils.sparkPythonPath(),
        local=sc.master.startswith("local"),
        same_packages=installed_like_spark(sc.pythonExec, sc.version),
    )
    command, broadcasts, env, includes = _prepare_for_python_RDD(sc, JetStreamDataSource)
    zygote = {}
    if worker.env and enabled(sc.master):  # local, through the wrapper
        zygote = {ZYGOTE_ENV: ensure_started(sc.pythonExec)}
    function = jvm.SimplePythonFunction(
        bytearray(command),
        {**env, **worker.env, **streaming_runner_env(spark), **zygote},
        includes,
        worker.exec,
        sc.pythonVer,
        broadcasts,
        sc._javaAccumulator,
    )
    source = getattr(
        jvm, "org.apache.spark.sql.execution.datasources.v2.python.UserDefinedPythonDataSource"
    )(function)
    spark._jsparkSession.dataSource().registerPython(FORMAT, source)


def streaming_runner_env(spark: SparkSession) -> dict[str, str]:
    """The variables Spark's streaming source runner puts into the source's shared env map.

    Every streaming query's `PythonStreamingSourceRunner.init` puts these four keys into the
    registered source's one `java.util.HashMap`, unsynchronized. Two queries starting at once
    in a fresh driver (a restart brings every query back together) can then insert the same
    new keys concurrently and corrupt the map: its size no longer matches its entries, and
    every task that carries it fails to deserialize (`java.io.OptionalDataException`) until
    the JVM exits, so no query of that driver commits a batch again. With the keys already
    present, init only replaces values, which does not change the map's structure. The values
    are the ones init puts, but for the local directories (Spark's block manager names them,
    and py4j cannot reflect `SparkEnv`): every runner, this one included, puts its own before
    it starts a worker, so the placeholder is never used."""
    conf = spark.sparkContext._jsc.sc().conf()
    return {
        "SPARK_LOCAL_DIRS": str(conf.get("spark.local.dir", tempfile.gettempdir())),
        "SPARK_AUTH_SOCKET_TIMEOUT": str(
            conf.getTimeAsSeconds("spark.python.authenticate.socketTimeout", "15s")
        ),
        "SPARK_BUFFER_SIZE": str(conf.getInt("spark.buffer.size", 65536)),
        "SPARK_PYTHON_RUNTIME": "PYTHON_WORKER",
    }


# --------------------------------------------------------------------------- Spark API


class JetStreamBatchReader(DataSourceReader):
    """``spark.read.format("jetstream")``: the retained events in [startingOffset, endingOffset)."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> list[InputPartition]:
        control = StreamControl(self.opts)
        try:
            bounds = control.bounds()
        finally:
            control.close()
        start = starting_sequence(self.opts.starting, bounds)
        end = bounds.latest if self.opts.ending == "latest" else int(self.opts.ending)
        if bounds.compacted:  # below `first` is compacted away: no partitions for nothing
            start = max(start, min(bounds.first, end))
        if bounds.aged_out(start) and start < end:
            if self.opts.on_aged_out != "skip":
                raise AgedOutError(self.opts.stream, start, bounds.first)
            log.warning(
                "jetstream stream %r: %d requested sequences aged out; reading from %d",
                self.opts.stream,
                bounds.first - start,
                bounds.first,
            )
            start = bounds.first
        parts = split_range(start, end, self.opts.partition_size, self.opts.min_partitions)
        return list(parts) or [SeqRange(start, start)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(self.opts, partition)  # type: ignore[arg-type]


class JetStreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("jetstream")``: micro-batches over stream sequence ranges."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._control: StreamControl | None = None
        self._target: int | None = None
        self._latest: Bounds | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_control"] = None
        return state

    def _bounds(self) -> Bounds:
        if self._control is None:
            self._control = StreamControl(self.opts)
        self._latest = self._control.bounds()
        return self._latest

    def initialOffset(self) -> dict:
        return make_offset(starting_sequence(self.opts.starting, self._bounds()))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_events:
            return ReadMaxRows(self.opts.max_events)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._bounds().latest

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        return next_offset(
            start,
            self._bounds(),
            stream=self.opts.stream,
            on_aged_out=self.opts.on_aged_out,
            limit=limit,
            target=self._target,
        )

    def reportLatestOffset(self) -> dict | None:
        return make_offset(self._latest.latest) if self._latest else None

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        # A skip recorded in `end` moved the batch's first sequence past the aged-out gap.
        first = int(start["seq"]) + int(end.get("skipped", 0)) - int(start.get("skipped", 0))
        latest = self._latest
        if latest is not None and latest.compacted:
            # sequences below the stream's first never come back: on a compacted stream they
            # were superseded, so the batch starts at `first` (no empty partitions for them)
            first = max(first, min(latest.first, int(end["seq"])))
        opts = self.opts
        return list(split_range(first, int(end["seq"]), opts.partition_size, opts.min_partitions))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(self.opts, partition)  # type: ignore[arg-type]

    def commit(self, end: dict) -> None:
        """Nothing to release: the stream keeps events by its own limits, not by our reads."""

    def stop(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None


class JetStreamDataSource(DataSource):
    """The ``jetstream`` format; options are described in this module's docstring."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA_DDL

    def _opts(self, given: StructType) -> SourceOptions:
        if given != schema():
            raise JetStreamSourceError(
                f"jetstream source: the schema is fixed ({SCHEMA_DDL}); do not pass another"
            )
        return SourceOptions.parse(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        return JetStreamBatchReader(self._opts(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return JetStreamStreamReader(self._opts(schema))


def skipped_total(progress: Any) -> int:
    """The aged-out sequences a query skipped so far, from a progress report's end offsets."""
    if progress is None:
        return 0
    # StreamingQueryProgress is a dict subclass whose nested parts are objects: use its JSON
    data = json.loads(progress.json) if hasattr(progress, "json") else progress
    total = 0
    for source in data.get("sources", []):
        end = source.get("endOffset")
        if isinstance(end, str):
            end = json.loads(end)
        if isinstance(end, Mapping):
            total += int(end.get("skipped", 0))
    return total


__all__ = [
    "FORMAT",
    "JetStreamBatchReader",
    "JetStreamDataSource",
    "JetStreamStreamReader",
    "register",
    "skipped_total",
]
