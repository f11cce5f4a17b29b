"""Spark settings for the analysis driver's micro-batches: latency on a small machine.

`runtime.engines.services.spark_session` builds the session (partitions, RocksDB state); the
analysis driver adds these under the config's own ``[spark] conf`` (which wins on every key
it sets), measured with the Meetup queries on local[2] (docs/benchmarks.md):

- `FileContext` on local paths (``file:``) is Hadoop's raw local file system: no ``.crc``
  file next to what goes through it. The `FileSystem` API (``fs.file.impl``) keeps Hadoop's
  checksummed `LocalFileSystem`: RocksDB's state store uploads its snapshots with
  `FileSystem.copyFromLocalFile`, which casts the local file system to `LocalFileSystem`,
  so with the raw one every snapshot upload failed (a ClassCastException Spark logs and
  ignores): no snapshot was ever made, a restarted query rebuilt its state by replaying
  every changelog since its first batch, and none was ever cleaned up.
- Checkpoint and metadata files through Hadoop's `FileSystem` API
  (``FileSystemBasedCheckpointFileManager``) instead of `FileContext`: without Hadoop's
  native library, `FileContext` creates every file with a permission, which the raw local
  file system sets by forking ``chmod``: one process per offset, commit and state changelog
  file. A ~100-row top-N batch (local[4], load 2.7-4): ``walCommit`` 18 -> 6 ms,
  ``commitOffsets`` 24 -> 6, the state commit 62 -> 6, ``triggerExecution`` 336 -> 280. The
  same guarantees: a file appears by renaming a complete temp file (rename(2) is atomic),
  and a rename onto an existing name fails (both managers check first on a local disk;
  HDFS's rename refuses an existing target either way). Same files and names, so
  checkpoints move between the two managers both ways.
- The FAIR scheduler: each query runs its jobs in a pool of its own (`query_pool`), so a
  short top-N batch takes the next free core instead of queueing behind every task of
  another query's batch that was submitted first (FIFO, Spark's default).

Ad-hoc SQL (jobs/sql.py) runs in a session of its own (`sql_session`: the same SparkContext,
its own SQL settings and temp views) and in one FAIR pool, `SQL_POOL`, for all of it: however
many queries users send, together they get one streaming query's share of the cores. Its
settings (`SQL_SESSION_CONF`) are what Spark itself can enforce about a query's shape: no
`${...}` substitution, no broadcast joins (neither by size estimate nor by hint, since a
stream's estimate is a guess and a broadcast copies it whole into the driver and to every
task), no implicit cartesian product, a row limit on recursive CTEs, one task per shuffle
stage (FAIR pools do not preempt running tasks: a long join's tasks keep their slots until
they end, so each query may hold only one). None of it reaches the streaming queries'
session.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

RAW_LOCAL_FS = {
    "spark.hadoop.fs.AbstractFileSystem.file.impl": "org.apache.hadoop.fs.local.RawLocalFs",
}
CHECKPOINT_FILES = {
    "spark.sql.streaming.checkpointFileManagerClass": (
        "org.apache.spark.sql.execution.streaming.checkpointing."
        "FileSystemBasedCheckpointFileManager"
    ),
}
FAIR = {"spark.scheduler.mode": "FAIR"}
LATENCY_DEFAULTS: dict[str, str] = {**RAW_LOCAL_FS, **CHECKPOINT_FILES, **FAIR}
POOL_PROPERTY = "spark.scheduler.pool"
SQL_POOL = "adhoc-sql"
SQL_SESSION_CONF: dict[str, str] = {
    "spark.sql.variable.substitute": "false",
    "spark.sql.autoBroadcastJoinThreshold": "-1",
    "spark.sql.adaptive.autoBroadcastJoinThreshold": "-1",
    "spark.sql.optimizer.disableHints": "true",
    "spark.sql.maxBroadcastTableSize": "64m",
    "spark.sql.crossJoin.enabled": "false",
    "spark.sql.cteRecursionRowLimit": "100000",
    # one task per shuffle stage: a query's long joins and aggregations hold one task slot,
    # so the SQL slots together never take every slot from the streaming queries
    "spark.sql.shuffle.partitions": "1",
}


def analysis_conf(
    conf: Mapping[str, str | int | float | bool],
) -> dict[str, str | int | float | bool]:
    """The Spark conf the analysis driver starts with: `LATENCY_DEFAULTS` under `conf`."""
    return {**LATENCY_DEFAULTS, **conf}


def sql_session(spark: SparkSession) -> SparkSession:
    """A new session on `spark`'s SparkContext with `SQL_SESSION_CONF` (Python data sources
    are registered per session: register the ones its queries read)."""
    session = spark.newSession()
    for key, value in SQL_SESSION_CONF.items():
        session.conf.set(key, value)
    return session


def query_pool(name: str) -> str:
    """The FAIR scheduler pool of query `name` (one per query; ignored under FIFO)."""
    return f"query-{name}"


# --------------------------------------------------------------------------- worker Python

WORKER_PYTHON = Path(__file__).with_name("worker_python.sh")
WORKER_PYTHON_ENV = "TIERFLOW_WORKER_PYTHON"
WORKER_DROP_ENV = "TIERFLOW_WORKER_DROP_PATH"


@dataclass(frozen=True)
class WorkerPython:
    """What Spark runs as a Python source's worker: `exec` with `env` added."""

    exec: str
    env: dict[str, str]


def worker_python(
    python_exec: str,
    spark_python_path: str,
    *,
    local: bool,
    same_packages: bool,
    wrapper: Path = WORKER_PYTHON,
) -> WorkerPython:
    """The worker interpreter for a Python data source: `python_exec` itself, or, when the
    workers run on this machine (`local`) with the same pyspark and py4j as the zips Spark
    puts first on their path (`same_packages`), `python_exec` through `wrapper`, which
    takes those zips out of PYTHONPATH so the installed packages and their bytecode caches
    are imported (jobs/worker_python.sh). Anything else keeps Spark's own launch."""
    drop = [
        entry
        for entry in spark_python_path.split(os.pathsep)
        if entry.endswith(".zip") and Path(entry).name.startswith(("pyspark", "py4j"))
    ]
    usable = local and same_packages and drop and os.access(wrapper, os.X_OK)
    if not usable:
        return WorkerPython(python_exec, {})
    return WorkerPython(
        str(wrapper),
        {WORKER_PYTHON_ENV: python_exec, WORKER_DROP_ENV: os.pathsep.join(drop)},
    )


def installed_like_spark(python_exec: str, spark_version: str) -> bool:
    """Whether `python_exec` is this interpreter and imports pyspark (of Spark's version) and
    py4j from files, not zips: then a worker without the zips imports the same code."""
    import py4j
    import pyspark

    found = shutil.which(python_exec)
    if found is None or Path(found).absolute() != Path(sys.executable).absolute():
        return False
    from_files = all(m.__file__ is not None and Path(m.__file__).is_file() for m in (pyspark, py4j))
    return from_files and pyspark.__version__ == spark_version
