"""The JVM jetstream source (``jobs/jvm``): building its jar, and which source reads a stream.

The Python source (jobs/jetstream.py) runs its reads in Python workers: on the stateless
Nexmark queries those workers spend as much CPU per event as Spark's whole query over files,
and Spark's JVM spends more again taking Arrow batches from them (docs/benchmarks.md). The
JVM source reads the same ranges, with the same options, offsets and rows, on Spark's own
task threads. Its NATS client is written for it (jobs/jvm/src/.../NatsConnection.java): the
Java NATS client is not among Spark's jars nor on the registries tierflow installs from.

Streaming reads use it when the session has its jar (`runtime.engines.source_jar`) and the
endpoint is one it speaks (plain or TLS, token or user and password); a credentials file or
a WebSocket URL, batch reads, and a session whose ``spark.tierflow.jetstreamSource`` is
``python`` use the Python source.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.class_training import Built
from runtime.engines.class_archive import spark_jars, spark_java
from runtime.engines.source_jar import source_jar

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from runtime.nats.endpoint import NatsEndpoint

JVM_FORMAT = "io.tierflow.jetstream.JetStreamProvider"
PYTHON_FORMAT = "jetstream"
CHOICE_KEY = "spark.tierflow.jetstreamSource"  # auto (default), jvm or python
SOURCES = Path(__file__).resolve().parent / "jvm" / "src"
JAVAC_TIMEOUT_S = 300


def sources() -> list[Path]:
    return sorted(SOURCES.rglob("*.java"))


def build(dest: Path | None = None, *, force: bool = False) -> Built:
    """The jar at `dest` (default: `source_jar()`), compiled unless it is newer than every
    source; RuntimeError with javac's output when it cannot be."""
    path = dest or source_jar()
    files = sources()
    t0 = time.monotonic()
    if (
        not force
        and path.is_file()
        and path.stat().st_mtime >= max(f.stat().st_mtime for f in files)
    ):
        return Built(path, 0.0, fresh=False)
    java = spark_java()
    javac = Path(java).with_name("javac") if java else None
    if javac is None or not javac.is_file():
        raise RuntimeError(
            f"javac (a JDK 17+) beside the java Spark runs ({java}) is needed to build the JVM "
            "jetstream source"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tierflow-jvm-source-") as tmp:
        classes = Path(tmp, "classes")
        result = subprocess.run(
            [
                str(javac),
                "--release",
                "17",
                "-nowarn",
                "-d",
                str(classes),
                "-cp",
                os.pathsep.join(spark_jars()),
                *map(str, files),
            ],
            capture_output=True,
            text=True,
            timeout=JAVAC_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"javac failed:\n{(result.stderr or result.stdout)[-3000:]}")
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\n\r\n")
            for f in sorted(classes.rglob("*.class")):
                jar.write(f, f.relative_to(classes).as_posix())
        os.replace(partial, path)
    return Built(path, time.monotonic() - t0, fresh=True)


def jvm_loaded(spark: SparkSession) -> bool:
    """Whether the Spark session's JVM can load the JVM source (its jar was on ``spark.jars``)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    return bool(jvm.org.apache.spark.util.Utils.classIsLoadable(JVM_FORMAT))


def speaks(nats: NatsEndpoint) -> bool:
    """Whether the JVM source's client reaches `nats` (no creds file, no WebSocket URL)."""
    urls = [u.strip().lower() for u in nats.url.split(",")]
    return not nats.creds and not any(u.startswith(("ws://", "wss://")) for u in urls)


# the JVM source's column saying it read the row's `fields` itself (JetStreamProvider.PARSED)
PARSED = "_tf_parsed"


def stream_format(spark: SparkSession, nats: NatsEndpoint) -> str:
    """The format a streaming read of `nats` uses in `spark` (the module's docstring)."""
    choice = (spark.conf.get(CHOICE_KEY, "auto") or "auto").lower()
    if choice == "python":
        return PYTHON_FORMAT
    if choice not in ("auto", "jvm"):
        raise ValueError(f"{CHOICE_KEY} must be auto, jvm or python, not {choice!r}")
    usable = speaks(nats) and jvm_loaded(spark)
    if choice == "jvm" and not usable:
        raise RuntimeError(
            f"{CHOICE_KEY}=jvm, but the JVM source cannot read {nats.url}: its jar is not "
            "loaded (`tierflow check` builds it) or the endpoint needs a creds file or WebSocket"
        )
    return JVM_FORMAT if usable else PYTHON_FORMAT


__all__ = [
    "CHOICE_KEY",
    "JVM_FORMAT",
    "PARSED",
    "PYTHON_FORMAT",
    "build",
    "jvm_loaded",
    "speaks",
    "stream_format",
]
