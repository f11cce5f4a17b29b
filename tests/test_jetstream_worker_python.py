"""The jetstream source's worker interpreter (jobs/spark_session.py `worker_python` and
jobs/worker_python.sh): Spark's pyspark and py4j zips leave a worker's PYTHONPATH only when
this interpreter has the same packages, every other entry stays in order, and a streaming
query's Python source process is really started that way, forked from the source zygote
(jobs/source_zygote.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs import source_zygote
from jobs.jetstream import register
from jobs.source_zygote import ZYGOTE_ENV
from jobs.spark_session import (
    WORKER_DROP_ENV,
    WORKER_PYTHON,
    WORKER_PYTHON_ENV,
    installed_like_spark,
    worker_python,
)
from runtime.waiting import wait_until
from tests.support import with_nats

pytestmark = pytest.mark.timeout(300)

SPARK_PATH = os.pathsep.join(
    ["/spark/python/lib/pyspark.zip", "/spark/python/lib/py4j-0.10.9.9-src.zip", "/spark/core.jar"]
)


@pytest.mark.unit
def test_the_zips_are_dropped_only_locally_with_the_same_packages() -> None:
    w = worker_python("/venv/bin/python", SPARK_PATH, local=True, same_packages=True)
    assert w.exec == str(WORKER_PYTHON)
    assert w.env == {
        WORKER_PYTHON_ENV: "/venv/bin/python",
        WORKER_DROP_ENV: os.pathsep.join(SPARK_PATH.split(os.pathsep)[:2]),
    }
    for local, same in ((False, True), (True, False)):
        w = worker_python("/venv/bin/python", SPARK_PATH, local=local, same_packages=same)
        assert (w.exec, w.env) == ("/venv/bin/python", {})
    # nothing to drop, or no usable wrapper: Spark's own launch
    assert worker_python("py", "/a.jar", local=True, same_packages=True).env == {}
    missing = Path("/nonexistent/worker_python.sh")
    w = worker_python("py", SPARK_PATH, local=True, same_packages=True, wrapper=missing)
    assert (w.exec, w.env) == ("py", {})


@pytest.mark.unit
def test_this_interpreter_has_the_packages_spark_runs() -> None:
    import pyspark

    assert installed_like_spark(sys.executable, pyspark.__version__)
    assert not installed_like_spark(sys.executable, "0.0.1")
    assert not installed_like_spark("/no/such/python", pyspark.__version__)


def test_the_wrapper_drops_exactly_the_listed_entries_and_imports_installed_pyspark(
    tmp_path: Path,
) -> None:
    import pyspark

    zips = Path(pyspark.__file__).parent / "python" / "lib"
    listed = sorted(str(p) for p in zips.glob("*.zip"))
    assert listed, "pyspark ships its zips"
    other = tmp_path / "with space"
    path = os.pathsep.join([listed[0], str(other), *listed[1:], "", "/last"])
    env = {
        **os.environ,
        "PYTHONPATH": path,
        WORKER_PYTHON_ENV: sys.executable,
        WORKER_DROP_ENV: os.pathsep.join(listed),
    }
    script = "import os, pyspark; print(os.environ['PYTHONPATH']); print(pyspark.__file__)"
    out = subprocess.run(
        [str(WORKER_PYTHON), "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    kept, imported = out.stdout.splitlines()
    assert kept == os.pathsep.join([str(other), "", "/last"])
    assert imported == pyspark.__file__  # from the installed package, not the zip


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(): v.decode("utf-8", "replace") for k, v in pairs}


def test_a_streaming_query_source_process_runs_without_the_zips(
    spark: Any, nats_server: Any, tmp_path: Path
) -> None:
    """The process Spark starts for a query's offsets is the wrapped interpreter: the
    zips are gone from its PYTHONPATH, and the query reads every event."""

    async def fill(nc: Any) -> None:
        js = nc.jetstream()
        await js.add_stream(name="wp", subjects=["raw.wp"])
        for i in range(20):
            await js.publish("raw.wp", b'{"i": %d}' % i)

    with_nats(fill, nats_server.url)
    register(spark)
    zygote = source_zygote._zygote
    assert zygote is not None
    wait_until(lambda: Path(zygote.path).is_socket(), 60, 0.05, what="the zygote listening")
    jvm_pid = spark.sparkContext._gateway.proc.pid
    seen: list[int] = []
    query = (
        spark.readStream.format("jetstream")
        .option("url", nats_server.url)
        .option("stream", "wp")
        .load()
        .writeStream.foreachBatch(lambda df, _: seen.extend(r.seq for r in df.collect()))
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        wait_until(lambda: len(seen) >= 20, timeout=120, what="the query's 20 events")

        def runner() -> int | None:
            for pid in _children(jvm_pid):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"python_streaming_source_runner" in cmd:
                    return pid
            return None

        pid = wait_until(runner, timeout=30, what="the query's source process")
        env = _environ(pid)
        # the runner itself was forked from this process's source zygote, imports done
        assert env[ZYGOTE_ENV] == zygote.path
        forked = wait_until(lambda: _children(zygote.process.pid), 30, what="a forked runner")
    finally:
        query.stop()
    wait_until(
        lambda: not any(Path(f"/proc/{p}").exists() for p in forked), 60, what="the runner's end"
    )
    assert sorted(seen) == list(range(1, 21))
    assert env[WORKER_PYTHON_ENV] == spark.sparkContext.pythonExec
    assert "pyspark.zip" not in env["PYTHONPATH"]
    assert "pyspark.zip" in env[WORKER_DROP_ENV]
