"""Where the JVM jetstream source's jar lives, and a Spark conf that loads it.

The jar is compiled from ``jobs/jvm`` against pyspark's own jars by `tierflow check`
(`jobs.jvm_source.build`, which `make setup`'s ``java`` step runs), one per venv, under
``<venv>/share/tierflow``. A session started without it reads JetStream through the Python
source alone (`jobs.jvm_source.stream_format`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

JARS_KEY = "spark.jars"


def source_jar() -> Path:
    """Per pyspark version: a jar compiled against other Spark jars is never loaded (a venv
    whose pyspark changed reads through the Python source until `tierflow check` runs)."""
    import pyspark

    return Path(sys.prefix) / "share" / "tierflow" / f"tierflow-jetstream-{pyspark.__version__}.jar"


def with_source_jar(conf: Mapping[str, str], jar: Path | None = None) -> dict[str, str]:
    """`conf` with the source's jar added to ``spark.jars`` when it has been built."""
    path = jar or source_jar()
    out = dict(conf)
    if not path.is_file():
        return out
    jars = [j for j in out.get(JARS_KEY, "").split(",") if j.strip()]
    if str(path) not in jars:
        out[JARS_KEY] = ",".join([*jars, str(path)])
    return out


__all__ = ["JARS_KEY", "source_jar", "with_source_jar"]
