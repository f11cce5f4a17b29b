"""Build the Spark driver's class-data-sharing archive (runtime/engines/class_archive.py).

The archive holds the classes one run loaded, so the run has to be the analysis tier's
own: a SparkSession with the driver's settings (RocksDB state, the checkpoint file
manager, FAIR pools), the jetstream source registered, and each kind of job's plan
(top-N, windowed top-N, count, distinct, sample) running micro-batches over a Python
streaming source shaped like jetstream's. It runs in a process of its own
(``python -m jobs.class_training OUT``), because the JVM writes the archive only as it
exits. The archive is written under a temporary name, checked by a JVM that must map it
(``-Xshare:on`` fails on a file that is partial or made for another class path), and then
renamed into place, so a reader never sees half a file. A lock keeps two builds on one
machine from racing; the second finds the first's archive.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.jetstream_options import SCHEMA_DDL
from runtime.engines.class_archive import (
    DRIVER_OPTIONS,
    archive_path,
    dump_options,
    spark_java,
    use_option,
)
from runtime.job_specs import JobSpec, WindowSpec

SOURCE = "tierflow_training"
BATCHES = 3
EVENTS_PER_BATCH = 200
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Built:
    path: Path
    seconds: float
    fresh: bool  # False: it was there already


def training_jobs(stream: str = "training") -> list[JobSpec]:
    """One job of each kind the driver plans, windowed and not."""
    topics = "group.group_topics[].topic_name"
    window = WindowSpec(length="1 minute", slide="10 seconds", watermark="1 minute")
    common: dict[str, Any] = {"stream": stream, "trigger_s": 0.0}
    return [
        JobSpec(name="t_topn", kind="topn", field=topics, n=5, **common),
        JobSpec(
            name="t_topn_window",
            kind="topn",
            field=topics,
            window=window,
            time_field="mtime",
            **common,
        ),
        JobSpec(
            name="t_count",
            kind="count",
            by=["group.group_city"],
            window=WindowSpec(length="1 minute"),
            time_field="mtime",
            **common,
        ),
        JobSpec(name="t_distinct", kind="distinct", field="member.member_id", **common),
        JobSpec(name="t_sample", kind="sample", field="member.member_id", n=5, **common),
    ]


def _event(i: int) -> str:
    return json.dumps(
        {
            "mtime": 1_700_000_000_000 + i * 37,
            "member": {"member_id": i % 97},
            "group": {
                "group_city": f"city{i % 7}",
                "group_topics": [{"topic_name": f"topic{i % 13}"}, {"topic_name": "all"}],
            },
        }
    )


def register_source(spark: Any) -> None:
    """A Python streaming source with jetstream's schema, rows made in memory: the JVM
    side of a Python source (planning, offsets, Arrow reads) is the same as jetstream's.
    Option ``batches``: how many micro-batches it holds (`BATCHES`)."""
    import datetime as dt

    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

    class Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
        def __init__(self, batches: int) -> None:
            self.batches = batches

        def initialOffset(self) -> dict[str, int]:
            return {"batch": 0}

        def prepareForTriggerAvailableNow(self) -> None:
            return None

        def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
            # one batch further each time: each a micro-batch of its own, as a live stream's
            return {"batch": min(self.batches, int(start["batch"]) + 1)}

        def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[Any]:
            return [InputPartition(b) for b in range(start["batch"], end["batch"])]

        def read(self, partition: Any) -> Iterator[tuple[Any, ...]]:
            base = partition.value * EVENTS_PER_BATCH
            ts = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
            for i in range(base, base + EVENTS_PER_BATCH):
                yield (i + 1, "raw.training", ts, f"m{i}", _event(i), True, None, None)

        def commit(self, end: dict[str, int]) -> None:
            return None

    class Source(DataSource):
        @classmethod
        def name(cls) -> str:
            return SOURCE

        def schema(self) -> str:
            return SCHEMA_DDL

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            return Reader(int(self.options.get("batches", BATCHES)))

    spark.dataSource.register(Source)


def train(out: Path, work: Path) -> None:
    """The training run (in the process that exits to write `out`)."""
    from jobs.jetstream import register
    from jobs.spark_session import analysis_conf
    from runtime.config import load
    from runtime.engines.services import spark_session

    conf = analysis_conf({DRIVER_OPTIONS: dump_options(out), "spark.ui.showConsoleProgress": False})
    spark_cfg = {"conf": conf, "class_archive": False}
    cfg = load(environ={}, overrides={"state_dir": str(work / "state"), "spark": spark_cfg})
    spark = spark_session(cfg, app_name="tierflow-class-training")
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    _classpath_file(out).write_text(jvm.System.getProperty("java.class.path"))
    register(spark)
    register_source(spark)
    # All five at once: the same classes load, in 39 s instead of 47 one after another (two
    # cores); the session's 20 s and the archive's dump at exit, 26 s, stay.
    run_jobs(spark, training_jobs(), work / "ckpt")
    spark.stop()


def run_jobs(
    spark: Any,
    specs: list[JobSpec],
    checkpoints: Path,
    batches: int = BATCHES,
    abort: Callable[[], bool] | None = None,
) -> bool:
    """Run `specs`' plans at once over the in-memory source (`register_source`), each for
    `batches` micro-batches into a sink that shapes its rows as the driver's does, and
    wait for them; also a warm standby's warm-up (jobs/standby.py), which `abort` (asked
    every 0.2 s) stops early. False if aborted."""
    from jobs.plans import build_plan

    queries = []
    for spec in specs:
        source = spark.readStream.format(SOURCE).option("batches", batches).load()
        plan = build_plan(spec, source)
        shape = plan.batch_rows(checkpoints / spec.name)

        def write(df: Any, batch_id: int, shape: Any = shape) -> None:
            shape([r.asDict(recursive=True) for r in df.collect()], batch_id)

        queries.append(
            plan.df.writeStream.queryName(f"{spec.name}-{checkpoints.name}")
            .outputMode(plan.output_mode)
            .foreachBatch(write)
            .option("checkpointLocation", str(checkpoints / spec.name))
            .trigger(availableNow=True)
            .start()
        )
    deadline = time.monotonic() + TIMEOUT_S
    for query in queries:
        while not query.awaitTermination(0.2 if abort else TIMEOUT_S):
            if (abort is not None and abort()) or time.monotonic() > deadline:
                for q in queries:
                    q.stop()
                return False
        if query.exception() is not None:
            raise RuntimeError(f"training query {query.name} failed: {query.exception()}")
    return True


def _classpath_file(archive: Path) -> Path:
    return archive.with_name(archive.name + ".classpath")


def maps(java: str, archive: Path, classpath: str) -> bool:
    """Whether a JVM on the driver's class path maps `archive` (``-Xshare:on`` refuses to
    start otherwise)."""
    result = subprocess.run(
        [java, "-Xshare:on", use_option(archive), "-cp", classpath, "-version"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    return result.returncode == 0


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(directory: Path | None = None, *, force: bool = False) -> Built:
    """This venv's archive, built unless it is there already; raises RuntimeError with
    the training's output when it cannot be built."""
    path = archive_path(directory)
    java = spark_java()
    if path is None or java is None:
        raise RuntimeError("no java on PATH (or JAVA_HOME): nothing to archive")
    t0 = time.monotonic()
    with _locked(path):
        if path.is_file() and not force:
            return Built(path, time.monotonic() - t0, fresh=False)
        with tempfile.TemporaryDirectory(prefix="tierflow-training-") as tmp:
            partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            paths = [_project_root(), os.environ.get("PYTHONPATH", "")]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
            result = subprocess.run(
                [sys.executable, "-m", "jobs.class_training", str(partial), tmp],
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                env=env,
                check=False,
            )
            try:
                if result.returncode != 0 or not partial.is_file():
                    tail = (result.stderr or result.stdout)[-2000:]
                    raise RuntimeError(f"the class archive training run failed:\n{tail}")
                if not maps(java, partial, _classpath_file(partial).read_text()):
                    raise RuntimeError(f"a JVM would not map the archive just built ({partial})")
                os.replace(_classpath_file(partial), _classpath_file(path))
                os.replace(partial, path)
            finally:
                partial.unlink(missing_ok=True)
                _classpath_file(partial).unlink(missing_ok=True)
    prune(path.parent)
    return Built(path, time.monotonic() - t0, fresh=True)


def is_stale(classpath: str, built_at: float | None = None) -> bool:
    """An archive whose class path names jars none of which exist any more (its venv is
    gone), or, given when it was built, with a jar changed since (its venv was reinstalled
    at the same path and the JVM refuses it): 180 MB no JVM can use."""
    jars = [p for p in classpath.split(os.pathsep) if p.endswith(".jar")]
    if not jars:
        return False
    present = [Path(j) for j in jars if Path(j).exists()]
    if not present:
        return True
    return built_at is not None and any(j.stat().st_mtime > built_at for j in present)


def prune(directory: Path) -> list[Path]:
    """Delete the archives of venvs that are gone or reinstalled (each archive keeps its
    class path next to it); archives without one are left alone."""
    gone = []
    for cp in directory.glob("spark-driver-*.jsa.classpath"):
        archive = cp.with_suffix("")
        try:
            built_at = archive.stat().st_mtime
        except OSError:
            built_at = None
        if is_stale(cp.read_text(), built_at):
            for f in (archive, cp, archive.with_suffix(".lock")):
                f.unlink(missing_ok=True)
            gone.append(archive)
    return gone


def _project_root() -> str:
    """This checkout's root, so the child imports the same code (an editable install puts
    it on sys.path too; this also covers a plain ``python -m`` from the checkout)."""
    return str(Path(__file__).resolve().parent.parent)


if __name__ == "__main__":
    train(Path(sys.argv[1]), Path(sys.argv[2]))
