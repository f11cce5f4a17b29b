"""The engines through runtime.engines.services: Spark session, Java check, embedded services."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from runtime.config import Config
from runtime.engines.services import (
    EngineError,
    java_major_version,
    require_java,
    spark_checkpoint_dir,
)
from tests.support import NatsFactory


def fake_java(tmp_path: Path, banner: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text(f"#!/bin/sh\necho '{banner}' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.parametrize(
    ("banner", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_381"', 8),
        ('openjdk version "11.0.2" 2019-01-15', 11),
    ],
)
def test_java_version_parsing(tmp_path: Path, banner: str, major: int) -> None:
    assert java_major_version(str(fake_java(tmp_path, banner) / "java")) == major


def test_old_or_missing_java_names_the_debian_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(fake_java(tmp_path, 'openjdk version "11.0.2"')))
    with pytest.raises(EngineError, match="found Java 11.*openjdk-17-jre-headless"):
        require_java()
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(EngineError, match="not found on PATH.*apt-get install openjdk-17"):
        require_java()


def test_this_machine_has_java_17() -> None:
    assert require_java() >= 17


def test_spark_session_is_local_with_checkpoints_under_state_dir(
    spark: object, session_cfg: Config
) -> None:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    assert isinstance(spark, SparkSession)
    ckpt = spark_checkpoint_dir(session_cfg)
    assert ckpt.is_dir() and str(ckpt).startswith(session_cfg.state_dir)
    assert spark.conf.get("spark.sql.streaming.checkpointLocation") == str(ckpt)
    assert spark.sparkContext.master.startswith("local")
    # Workers run the venv's interpreter, so Python UDFs (and DataSources) find pyarrow.
    assert (
        os.environ["PYSPARK_PYTHON"].endswith("python") or "python" in os.environ["PYSPARK_PYTHON"]
    )
    df = spark.range(1000).withColumn("k", F.col("id") % 7)
    counts = {r["k"]: r["n"] for r in df.groupBy("k").agg(F.count("*").alias("n")).collect()}
    assert sum(counts.values()) == 1000 and counts[0] == 143

    @F.udf("long")
    def double(x: int) -> int:
        return x * 2

    assert spark.range(3).select(double("id").alias("d")).collect()[2]["d"] == 4


async def test_external_nats_with_credentials_is_used_not_started(
    nats_factory: NatsFactory, tmp_path: Path
) -> None:
    """With nats.url set, Services starts no server and connects with the credentials."""
    import nats.errors

    from runtime.config import load
    from runtime.engines.services import Services, connect_nats, ensure_streams

    with nats_factory(user="app", password="pw") as ext:
        over = {
            "state_dir": str(tmp_path / "s"),
            "nats": {"url": ext.url},
            "streams": {"meetup": {"subjects": ["raw.meetup"]}},
        }
        good = load(
            environ={},
            overrides={**over, "nats": {**over["nats"], "user": "app", "password": "pw"}},
        )
        svc = Services.start(good, with_ray=False)
        try:
            assert svc.nats_server is None and svc.nats_url == ext.url
            nc = await connect_nats(good, svc.nats_url)
            assert await ensure_streams(nc, good) == ["meetup", "results", "deadletter"]
            js = nc.jetstream()
            ack = await js.publish("raw.meetup", b"{}", headers={"Nats-Msg-Id": "e1"})
            assert ack.stream == "meetup" and ack.seq == 1
            info = await js.stream_info("meetup")
            assert info.config.duplicate_window == 600.0
            await nc.close()
        finally:
            svc.stop()
        assert ext.running  # stop() leaves alone what it did not start
        bad = load(
            environ={},
            overrides={**over, "nats": {**over["nats"], "user": "app", "password": "no"}},
        )
        with pytest.raises(nats.errors.Error):
            await connect_nats(bad)


def test_embedded_services_start_and_stop_their_nats(tmp_path: Path) -> None:
    import psutil

    from runtime.config import load
    from runtime.engines.services import Services

    cfg = load(environ={}, overrides={"state_dir": str(tmp_path)})
    svc = Services.start(cfg, with_ray=False)
    pid = svc.nats_server.pid
    assert psutil.pid_exists(pid)
    assert (tmp_path / "nats").is_dir()  # the JetStream store lives under the state dir
    assert svc.describe()["nats"]["embedded"] is True
    svc.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
