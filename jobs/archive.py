"""Long-term storage (book ch. 6): each stream copied from JetStream to Parquet, exactly once.

The book writes to long-term storage *indirectly*, from the message queue, so the analysis
tier is never tied to the store's speed. Here that is one Spark streaming query per
archived stream: the ``jetstream`` source into Spark's own file sink, Parquet partitioned
by the event's date (or hour) under ``<root>/stream=<name>/``. Spark's file sink keeps a
log of the files each committed batch wrote (``_spark_metadata`` in that directory) and
its checkpoint the offsets; a batch replayed after a crash writes new files under the same
batch id and the log lists only one attempt, so a reader that goes through the log
(`read_archive`) sees every event exactly once. A plain directory listing of the same path
would also see a killed attempt's partial files: always read an archive through
`read_archive` (or Spark's `spark.read.parquet(<root>/stream=<name>)`, which uses the log).

Copies (geo replication, docs/geo.md): the archive's position is a sequence of the copy it
reads, and sequences differ between copies. The checkpoint records its copy
(jobs/copies.py), and the driver refuses to resume an archive on another copy (the query
fails to start with an error naming both copies and the fix) rather than apply A's position
to B. Why refuse rather than carry on: carrying on in the same directory needs a fresh
checkpoint, whose batch ids restart at 0 while the file sink's log already lists batches
up to N, and the sink silently skips the batches it believes committed (events lost); and
mapping the position by event id is not possible in general, because B interleaves its own
writes with A's and no single B sequence means "everything A had archived". Meanwhile the
stream is not purged for that archive (retention needs its position) and readers given the
current copy (`archive_position(..., copy=)`) read the copy's own retained events instead.

Each stream has its own directory (and so its own log) because two file sinks cannot share
one. The root may be any filesystem URI Spark's Hadoop layer accepts (``s3a://``,
``hdfs://``); a local directory by default.
"""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from jobs.checkpoints import committed
from jobs.copies import CopyId, read_copy
from runtime.config import Config
from runtime.nats import NatsEndpoint

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

__all__ = [
    "expired_partitions",
    "purge_archive",
    "ARCHIVE_COLUMNS",
    "ArchivePosition",
    "ArchiveSettings",
    "archive_dir",
    "archive_frame",
    "archive_position",
    "archive_query_name",
    "queries_root",
    "read_archive",
    "start_archive",
]

# what an archived event keeps: the source's columns (raw only for a malformed event)
ARCHIVE_COLUMNS = ("seq", "subject", "ts", "msg_id", "data", "valid", "error", "raw")
Partitioning = Literal["day", "hour"]


@dataclass(frozen=True)
class ArchiveSettings:
    """One stream's `[streams.X.archive]`: where, how its files are partitioned, and how
    often a batch of files is written (the archive's lag is about one interval)."""

    path: str
    partitioning: Partitioning = "day"
    flush_s: float = 5.0
    max_events_per_file: int = 1_000_000
    retention_days: float = 0.0


@dataclass(frozen=True)
class ArchivePosition:
    """How far a stream's archive has got, from its checkpoint: `next_seq` is the first
    sequence not archived yet; `skipped` counts sequences that aged out of the stream
    before the archive read them (lost to the archive: reported, never hidden)."""

    batch_id: int
    next_seq: int
    skipped: int


def queries_root(cfg: Config, state_dir: str | Path | None = None) -> Path:
    """Where the analysis driver keeps its queries' checkpoints (an archive's among them):
    `spark.checkpoint_dir`, else ``<state_dir>/spark``; readers of an archive's position
    (`tierflow archive status`, `tierflow sql`) look there too."""
    if cfg.spark.checkpoint_dir:
        return Path(cfg.spark.checkpoint_dir)
    return Path(state_dir if state_dir is not None else cfg.state_path) / "spark"


def archive_query_name(stream: str) -> str:
    return f"archive-{stream}"


def archive_dir(root: str | Path, stream: str) -> str:
    """The stream's directory under the archive root (a path or a Hadoop URI)."""
    return f"{str(root).rstrip('/')}/stream={stream}"


def archive_frame(source: DataFrame, partitioning: Partitioning = "day") -> DataFrame:
    """The source's rows as archived: every column, plus the partition columns (UTC)."""
    from pyspark.sql import functions as F

    df = source.select(*ARCHIVE_COLUMNS).withColumn("date", F.to_date("ts"))
    if partitioning == "hour":
        df = df.withColumn("hour", F.hour("ts"))
    return df


def _partition_columns(partitioning: Partitioning) -> list[str]:
    return ["date", "hour"] if partitioning == "hour" else ["date"]


def start_archive(
    spark: SparkSession,
    stream: str,
    nats: NatsEndpoint,
    settings: ArchiveSettings,
    checkpoint_root: str | Path,
    *,
    trigger: dict[str, Any] | None = None,
) -> StreamingQuery:
    """Start the stream's archive query (named `archive_query_name`), resuming from its
    checkpoint at ``<checkpoint_root>/archive-<stream>``.

    Aged-out sequences are skipped and counted, not fatal: the archive keeps going with
    what the stream still holds, and `archive_position` reports the gap.
    """
    name = archive_query_name(stream)
    source = (
        spark.readStream.format("jetstream")
        .options(**nats.to_options())
        .option("stream", stream)
        .option("onAgedOut", "skip")
        .load()
    )
    when = trigger if trigger is not None else {"processingTime": f"{settings.flush_s} seconds"}
    writer = (
        archive_frame(source, settings.partitioning)
        .writeStream.queryName(name)
        .format("parquet")
        .partitionBy(*_partition_columns(settings.partitioning))
        .option("path", archive_dir(settings.path, stream))
        .option("checkpointLocation", str(Path(checkpoint_root) / name))
        .option("maxRecordsPerFile", str(settings.max_events_per_file))
    )
    if settings.retention_days > 0:  # the sink's log forgets files past it (any filesystem)
        writer = writer.option("retention", f"{round(settings.retention_days * 86400)}s")
    return writer.trigger(**when).start()


def expired_partitions(names: Iterable[str], now: dt.datetime, days: float) -> list[str]:
    """The ``date=YYYY-MM-DD`` partition names whose whole day (UTC) is older than `days`
    before `now`: nothing in them is younger than the retention."""
    cutoff = now.astimezone(dt.UTC) - dt.timedelta(days=days)
    out = []
    for name in names:
        if not name.startswith("date="):
            continue
        try:
            day = dt.datetime.strptime(name.removeprefix("date="), "%Y-%m-%d")
        except ValueError:
            continue
        if day.replace(tzinfo=dt.UTC) + dt.timedelta(days=1) <= cutoff:
            out.append(name)
    return sorted(out)


def purge_archive(root: str | Path, stream: str, days: float, now: dt.datetime) -> list[str]:
    """Delete the stream's archived date partitions past `days` (`retention_days`); returns
    their names. Only on a local filesystem: on a remote one the file sink's own
    ``retention`` (set by `start_archive`) drops them from what readers see, and the
    store's lifecycle rules (S3, HDFS) delete the files. Readers skip files the sink's log
    still lists but that are gone (`read_archive` reads with ignoreMissingFiles)."""
    local = _local_path(archive_dir(root, stream))
    if days <= 0 or local is None or not local.is_dir():
        return []
    gone = expired_partitions((p.name for p in local.iterdir() if p.is_dir()), now, days)
    for name in gone:
        shutil.rmtree(local / name, ignore_errors=True)
    return gone


def read_archive(spark: SparkSession, root: str | Path, stream: str) -> DataFrame:
    """Every archived event of `stream`, each once (through the file sink's log), with the
    partition columns; an empty frame of the archive's schema when nothing is archived."""
    path = archive_dir(root, stream)
    local = _local_path(path)
    if local is not None and not (local / "_spark_metadata").is_dir():
        return spark.createDataFrame([], _empty_schema())
    from jobs.jetstream_options import SCHEMA_DDL

    # the schema is known: inferring it reads a file's footer, and that file may be one
    # retention deleted (the partition columns still come from the paths)
    return spark.read.schema(SCHEMA_DDL).option("ignoreMissingFiles", "true").parquet(path)


def _local_path(path: str) -> Path | None:
    """The local directory `path` names (a plain path or a file: URI); None for a remote
    filesystem, where Spark itself says whether anything is there."""
    if "://" not in path:
        return Path(path)
    if path.startswith("file://"):
        return Path(path.removeprefix("file://"))
    return None


def _empty_schema() -> str:
    from jobs.jetstream_options import SCHEMA_DDL

    return f"{SCHEMA_DDL}, date DATE"


def archive_position(
    checkpoint_root: str | Path, stream: str, copy: CopyId | None = None
) -> ArchivePosition | None:
    """The archive's committed position from its checkpoint; None before the first
    committed batch, and None when `copy` (the copy the caller reads) is given and the
    archive's positions are of another copy (nothing of it is a position on this one)."""
    ckpt = Path(checkpoint_root) / archive_query_name(stream)
    if copy is not None:
        recorded = read_copy(ckpt)
        if recorded is not None and recorded != copy:
            return None
    done = committed(ckpt)
    if done is None or done[1] is None:
        return None
    batch, offset = done
    return ArchivePosition(batch, int(offset["seq"]), int(offset.get("skipped", 0)))
