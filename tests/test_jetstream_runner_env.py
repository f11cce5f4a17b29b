"""Spark's streaming source runner must not change the shape of the source's shared env map.

`PythonStreamingSourceRunner.init` puts four keys into the registered source's one
`java.util.HashMap` without a lock; two queries starting at once in a fresh driver can corrupt
it, after which every task of that driver fails with `java.io.OptionalDataException` (seen in
make bench: both queries of a restarted driver never committed a batch). `register` puts the
keys there first, so a query's init only replaces values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jobs.jetstream import register
from tests.support import NatsFactory, with_nats
from tests.test_jetstream_source import add_stream, event, publish

pytestmark = pytest.mark.timeout(180)


def source_env(spark: Any) -> dict[str, str]:
    """The registered jetstream source's env map, as the JVM holds it."""
    manager = spark._jsparkSession.sessionState().dataSourceManager()
    env = manager.lookupDataSource("jetstream").dataSourceCls().envVars()
    return {str(k): str(env.get(k)) for k in env.keySet().toArray()}


def test_a_streaming_query_adds_no_key_to_the_shared_env(
    spark: Any, nats_factory: NatsFactory, tmp_path: Path
) -> None:
    url = nats_factory(sync_interval="2m").url
    add_stream(url, "envcheck", ["raw.envcheck"])
    with_nats(
        lambda nc: publish(nc, [("raw.envcheck", event(i, "k"), None) for i in range(20)]), url
    )
    register(spark)
    before = source_env(spark)
    assert {"SPARK_LOCAL_DIRS", "SPARK_BUFFER_SIZE", "SPARK_AUTH_SOCKET_TIMEOUT"} <= set(before)

    seen: list[int] = []

    def collect(df: Any, batch_id: int) -> None:
        seen.extend(r.seq for r in df.select("seq").collect())

    q = (
        spark.readStream.format("jetstream")
        .option("url", url)
        .option("stream", "envcheck")
        .load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(seen) == list(range(1, 21))
    after = source_env(spark)
    assert set(after) == set(before), "the runner inserted keys into the shared map"
    # init put the same values, but for the local directories (a placeholder until then)
    assert {k: v for k, v in after.items() if k != "SPARK_LOCAL_DIRS"} == {
        k: v for k, v in before.items() if k != "SPARK_LOCAL_DIRS"
    }
