"""Long-term storage (book ch. 6): each stream copied from JetStream to Parquet, exactly once.

The book writes to long-term storage *indirectly*, from the message queue, so the analysis
tier is never tied to the store's speed. Here that is one Spark streaming query per
archived stream: the ``jetstream`` source into Spark's own file sink, Parquet partitioned
by the event's date (or hour) under the stream's directory (below). Spark's file sink keeps a
log of the files each committed batch wrote (``_spark_metadata`` in that directory) and
its checkpoint the offsets; a batch replayed after a crash writes new files under the same
batch id and the log lists only one attempt, so a reader that goes through the log
(`read_archive`) sees every event exactly once. A plain directory listing of the same path
would also see a killed attempt's partial files: always read an archive through
`read_archive` (or Spark's `spark.read.parquet(<directory>)`, which uses the log).

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

One directory, one writer. Two file sinks cannot share a log: the second one's batch ids
collide with the first's, the sink skips them as already committed, and retention then
purges from JetStream events no archive holds. So each stream of each copy has a directory
of its own: ``<root>/site=<domain>/stream=<name>`` on a site with a JetStream domain
(`copy_root`), so sites given the same config and one shared root (``s3a://bucket/x``)
never meet, and ``<root>/stream=<name>`` on a site without one (a single-site
deployment). And each directory records its writer (`OWNER_FILE`): the id its
checkpoint keeps (`WRITER_FILE`), its copy, and where the checkpoint is. The first writer
creates it (exclusively: of two simultaneous first starts, one wins); every start checks
it, and a checkpoint that does not own the directory it finds is refused before it writes
(`ArchiveOwnerError` names the directory, the owner and the fix). A directory without an
owner record is adopted by the checkpoint whose batches its log lists, and refused to any
other. Until its checkpoint owns its directory an archive is neither read
nor trimmed (`owned_root`). On a local disk and HDFS the exclusive create is atomic; on an
object store Hadoop's create-if-absent may be check-then-write, so two writers starting in
the same instant could both claim; any later start sees the owner.

The root may be any filesystem URI Spark's Hadoop layer accepts (``s3a://``, ``hdfs://``);
a local directory by default.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from jobs.checkpoints import committed
from jobs.copies import CopyId, current_copy, read_copy
from runtime.clock import now_ms
from runtime.config import Config
from runtime.errors import TierflowError
from runtime.nats.server import NatsEndpoint
from runtime.state.files import write_atomic

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

__all__ = [
    "expired_partitions",
    "purge_archive",
    "ARCHIVE_COLUMNS",
    "OWNER_FILE",
    "ArchiveFs",
    "HadoopFs",
    "LocalFs",
    "archive_fs",
    "WRITER_FILE",
    "ArchiveOwner",
    "ArchiveOwnerError",
    "ArchivePosition",
    "ArchiveSettings",
    "archive_dir",
    "claim_archive",
    "copy_root",
    "owned_root",
    "owner_problem",
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
OWNER_FILE = "_tierflow_owner.json"  # in the archive directory ('_': Spark's readers skip it)
WRITER_FILE = "tierflow-writer.json"  # in the archive's checkpoint: its writer id
SINK_LOG = "_spark_metadata"
SITE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class ArchiveOwnerError(TierflowError, RuntimeError):
    """The archive's directory is not its checkpoint's to write; the message names the
    directory, its owner, and what to do."""


class ArchiveOwner(msgspec.Struct, frozen=True, kw_only=True):
    """Who writes an archive directory: the writer id its checkpoint keeps, the copy it
    archives, where that checkpoint is (for the operator), and since when (epoch ms)."""

    writer: str
    copy: CopyId
    checkpoint: str
    since_ms: int = 0


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


def copy_root(root: str | Path, copy: CopyId | None) -> str:
    """The archive root of one copy's site: ``<root>/site=<domain>`` on a site with a
    JetStream domain, `root` itself on a site without one (and for `copy` None)."""
    if copy is None or not copy.domain:
        return str(root)
    if not SITE_NAME.match(copy.domain):
        raise ArchiveOwnerError(
            f"JetStream domain {copy.domain!r} cannot name an archive directory: use letters, "
            "digits, '-' and '_' in site names"
        )
    return f"{str(root).rstrip('/')}/site={copy.domain}"


def archive_dir(root: str | Path, stream: str) -> str:
    """The stream's directory under a copy's archive root (`copy_root`; a path or a Hadoop
    URI)."""
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
    copy: CopyId | None = None,
) -> StreamingQuery:
    """Start the stream's archive query (named `archive_query_name`), resuming from its
    checkpoint at ``<checkpoint_root>/archive-<stream>``, into the directory of `copy` (the
    copy `nats` reads; asked of NATS when not given) under `settings.path`.

    Raises ArchiveOwnerError, before anything is written, when the checkpoint does not own
    that directory (`claim_archive`). Aged-out sequences are skipped and counted, not
    fatal: the archive keeps going with what the stream still holds, and
    `archive_position` reports the gap.
    """
    name = archive_query_name(stream)
    copy = copy if copy is not None else current_copy(nats, stream)
    directory = archive_dir(copy_root(settings.path, copy), stream)
    claim_archive(directory, Path(checkpoint_root) / name, copy, archive_fs(directory, spark))
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
        .option("path", directory)
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


# ---- the directory's owner ------------------------------------------------------------


class ArchiveFs(Protocol):
    """The few file operations the owner record needs, on the archive's filesystem."""

    def read(self, path: str) -> bytes | None: ...

    def create(self, path: str, data: bytes) -> bool:
        """Write `path` only if it does not exist (False if it does): never replaces."""
        ...

    def names(self, directory: str) -> list[str] | None:
        """The entries of `directory`, None if there is no such directory."""
        ...


class LocalFs:
    """A local disk: the owner record is made whole, then linked into place (a link fails
    if the name exists, so of two simultaneous writers exactly one creates it)."""

    def read(self, path: str) -> bytes | None:
        try:
            return _disk(path).read_bytes()
        except FileNotFoundError:
            return None

    def create(self, path: str, data: bytes) -> bool:
        target = _disk(path)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        write_atomic(tmp, data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def names(self, directory: str) -> list[str] | None:
        try:
            return [p.name for p in _disk(directory).iterdir()]
        except (FileNotFoundError, NotADirectoryError):
            return None


def _disk(path: str) -> Path:
    """The local path of `path`, a plain path or a file: URI (never a relative ``file:``
    directory)."""
    local = _local_path(path)
    if local is None:
        raise ArchiveOwnerError(f"{path} is not on a local disk")
    return local


class HadoopFs:
    """Any filesystem Spark's Hadoop layer reaches (S3, HDFS), through the session's JVM."""

    def __init__(self, spark: SparkSession) -> None:
        self._jvm = spark._jvm  # type: ignore[attr-defined]
        self._conf = spark._jsc.hadoopConfiguration()  # type: ignore[attr-defined]

    def _at(self, path: str) -> tuple[Any, Any]:
        p = self._jvm.org.apache.hadoop.fs.Path(path)
        return p, p.getFileSystem(self._conf)

    def read(self, path: str) -> bytes | None:
        p, fs = self._at(path)
        if not fs.exists(p):
            return None
        stream = fs.open(p)
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def create(self, path: str, data: bytes) -> bool:
        from py4j.protocol import Py4JJavaError

        p, fs = self._at(path)
        try:
            out = fs.create(p, False)
        except Py4JJavaError as err:
            if "FileAlreadyExistsException" in str(err.java_exception.getClass().getName()):
                return False
            raise
        try:
            out.write(bytearray(data))
        finally:
            out.close()
        return True

    def names(self, directory: str) -> list[str] | None:
        p, fs = self._at(directory)
        if not fs.exists(p) or not fs.getFileStatus(p).isDirectory():
            return None
        return [str(st.getPath().getName()) for st in fs.listStatus(p)]


def archive_fs(path: str, spark: SparkSession | None = None) -> ArchiveFs:
    """The filesystem `path` is on: the local disk, or Hadoop's through `spark`."""
    if _local_path(path) is not None:
        return LocalFs()
    if spark is None:
        raise ArchiveOwnerError(f"{path}: a remote archive's owner is read through Spark")
    return HadoopFs(spark)


def _newest(names: Iterable[str] | None, suffix: str = "") -> int | None:
    """The highest batch id among log file names (``7``, ``9.compact``), None if none."""
    ids = [int(n.removesuffix(suffix)) for n in names or () if n.removesuffix(suffix).isdigit()]
    return max(ids) if ids else None


def _checkpoint_batches(checkpoint: Path, kind: str) -> int | None:
    try:
        return _newest(p.name for p in (checkpoint / kind).iterdir())
    except FileNotFoundError:
        return None


def _writer_id(checkpoint: Path) -> str | None:
    try:
        return str(msgspec.json.decode((checkpoint / WRITER_FILE).read_bytes())["writer"])
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, KeyError, TypeError) as err:
        raise ArchiveOwnerError(
            f"{checkpoint / WRITER_FILE} is unreadable ({err}): it names the archive "
            "directory's writer; restore it or move the checkpoint aside"
        ) from None


def _owner(fs: ArchiveFs, directory: str) -> ArchiveOwner | None:
    blob = fs.read(f"{directory}/{OWNER_FILE}")
    if blob is None:
        return None
    try:
        return msgspec.json.decode(blob, type=ArchiveOwner)
    except msgspec.DecodeError as err:
        raise ArchiveOwnerError(
            f"{directory}/{OWNER_FILE} is unreadable ({err}): it names the directory's "
            "writer; nothing writes there until it is restored"
        ) from None


def _move_aside(checkpoint: Path, directory: str) -> str:
    return (
        f"Give each writer its own directory: a JetStream domain per site (each site then "
        f"archives under <root>/site=<domain>), or another [streams.X.archive] path; or, to "
        f"archive the stream's retained events again here, move aside both the checkpoint "
        f"{checkpoint} and the directory {directory}"
    )


def owner_problem(
    directory: str, checkpoint: str | Path, copy: CopyId, fs: ArchiveFs
) -> str | None:
    """Why the archive checkpoint `checkpoint` (of `copy`) may not write `directory`; None
    if it may: its writer is the directory's owner, or nobody owns it and the directory's
    log is this checkpoint's (the batches it lists are the checkpoint's: a directory from
    before owner records) or there is no log and the checkpoint has committed nothing."""
    ckpt = Path(checkpoint)
    owner = _owner(fs, directory)
    if owner is not None:
        mine = _writer_id(ckpt)
        if owner.writer == mine and owner.copy == copy:
            return None
        if owner.writer == mine:
            return (
                f"archive directory {directory} holds copy {owner.copy.describe()}, the "
                f"checkpoint {ckpt} now reads copy {copy.describe()}. "
                + _move_aside(ckpt, directory)
            )
        return (
            f"archive directory {directory} is owned by another writer: checkpoint "
            f"{owner.checkpoint} (writer {owner.writer}, copy {owner.copy.describe()}), not "
            f"this one, {ckpt} (copy {copy.describe()}); two writers in one directory skip "
            f"each other's batches. {_move_aside(ckpt, directory)}"
        )
    logged = _newest(fs.names(f"{directory}/{SINK_LOG}"), ".compact")
    done = _checkpoint_batches(ckpt, "commits")
    planned = _checkpoint_batches(ckpt, "offsets")
    if logged is None:
        if done is None:
            return None
        return (
            f"the archive checkpoint {ckpt} has committed batches up to {done}, but "
            f"{directory} holds no archive log ({SINK_LOG}): the archive was moved, deleted or "
            "written under another directory (on a site with a JetStream domain, perhaps "
            "<root>/stream=<name>). Move it to this directory, or move the checkpoint aside "
            "to archive the stream's retained events again"
        )
    # the sink logs a batch after the checkpoint plans it and before it commits it
    if (done if done is not None else -1) <= logged <= (planned if planned is not None else -1):
        return None
    return (
        f"archive directory {directory} has no owner record and its log ({SINK_LOG}) lists "
        f"batches up to {logged}, which the checkpoint {ckpt} (committed: "
        f"{done if done is not None else 'none'}) did not write: another writer's archive. "
        f"{_move_aside(ckpt, directory)}"
    )


def claim_archive(
    directory: str, checkpoint: str | Path, copy: CopyId, fs: ArchiveFs
) -> ArchiveOwner:
    """Make sure the checkpoint owns `directory` before its query writes there: check the
    owner record (`owner_problem`) and, if there is none yet, create it, exclusively.
    Raises ArchiveOwnerError, naming the directory and its owner, when it does not."""
    ckpt = Path(checkpoint)
    problem = owner_problem(directory, ckpt, copy, fs)
    if problem is not None:
        raise ArchiveOwnerError(problem)
    writer = _writer_id(ckpt)
    if writer is None:
        writer = uuid.uuid4().hex
        write_atomic(ckpt / WRITER_FILE, msgspec.json.encode({"writer": writer}))
    current = _owner(fs, directory)
    if current is not None:  # owned already (owner_problem said: by this writer)
        return current
    owner = ArchiveOwner(writer=writer, copy=copy, checkpoint=str(ckpt), since_ms=now_ms())
    if not fs.create(f"{directory}/{OWNER_FILE}", msgspec.json.encode(owner)):
        problem = owner_problem(directory, ckpt, copy, fs)  # another writer was first
        if problem is not None:
            raise ArchiveOwnerError(problem)
    return owner


def owned_root(
    root: str,
    stream: str,
    checkpoint_root: str | Path,
    copy: CopyId,
    spark: SparkSession | None = None,
) -> str | None:
    """The root to read `stream`'s archive of `copy` from (`copy_root`), if the archive's
    checkpoint under `checkpoint_root` is of that copy and owns its directory; None if not,
    or if that cannot be told: then nothing of it is read or trimmed (its positions may
    stand for batches a directory's log skipped)."""
    ckpt = Path(checkpoint_root) / archive_query_name(stream)
    try:
        recorded = read_copy(ckpt)
        if recorded is not None and recorded != copy:
            return None
        at = copy_root(root, copy)
        directory = archive_dir(at, stream)
        return (
            at
            if owner_problem(directory, ckpt, copy, archive_fs(directory, spark)) is None
            else None
        )
    except Exception:  # an unreadable record or an unreachable store: not this archive's
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
