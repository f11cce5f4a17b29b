"""Spark settings for the analysis driver's micro-batches: latency on a small machine.

`runtime.services.spark_session` builds the session (partitions, RocksDB state); the
analysis driver adds these under the config's own ``[spark] conf`` (which wins on every key
it sets), measured with the Meetup queries on local[2] (docs/benchmarks.md):

- Local checkpoints (``file:``) go through Hadoop's raw local file system: no ``.crc``
  file next to every offset, commit and state file, and one rename less each. What Spark
  relies on stays: a metadata file appears by an atomic rename of a complete temp file,
  and a rename onto an existing name fails. Checksums guard against disk corruption, which
  these few small files are no better protected from by a CRC file on the same disk.
  HDFS, S3 and NFS paths other than ``file:`` are not affected.
- The FAIR scheduler: each query runs its jobs in a pool of its own (`query_pool`), so a
  short top-N batch takes the next free core instead of queueing behind every task of
  another query's batch that was submitted first (FIFO, Spark's default).
"""

from __future__ import annotations

from collections.abc import Mapping

RAW_LOCAL_FS = {
    "spark.hadoop.fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "spark.hadoop.fs.AbstractFileSystem.file.impl": "org.apache.hadoop.fs.local.RawLocalFs",
}
FAIR = {"spark.scheduler.mode": "FAIR"}
LATENCY_DEFAULTS: dict[str, str] = {**RAW_LOCAL_FS, **FAIR}
POOL_PROPERTY = "spark.scheduler.pool"


def analysis_conf(
    conf: Mapping[str, str | int | float | bool],
) -> dict[str, str | int | float | bool]:
    """The Spark conf the analysis driver starts with: `LATENCY_DEFAULTS` under `conf`."""
    return {**LATENCY_DEFAULTS, **conf}


def query_pool(name: str) -> str:
    """The FAIR scheduler pool of query `name` (one per query; ignored under FIFO)."""
    return f"query-{name}"
