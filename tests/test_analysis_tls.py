"""With `tls.verify_clients` on, the analysis tier's NATS connections (the Spark source and
the result sink) present the client certificate, not only trust the CA.

A real embedded nats-server with client verification on (as `tierflow up` starts it). The
whole pipeline under mutual TLS is `tests/test_config_matrix.py`'s `tokens-and-mutual-tls`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from jobs.jetstream_options import SourceOptions
from jobs.jetstream_read import stream_bounds
from jobs.sink import ResultSink
from runtime.certs import make_dev_certs
from runtime.config import Config, load
from runtime.engines.services import connect_nats, ensure_streams
from runtime.nats.server import NatsEndpoint
from tests.support import NatsFactory

pytestmark = pytest.mark.timeout(120)


def mtls_config(tmp_path: Path, **more: Any) -> Config:
    """Client verification on, with dev certificates made under the state dir."""
    state = tmp_path / "state"
    make_dev_certs(state / "certs")
    return load(
        environ={},
        overrides={
            "state_dir": str(state),
            "tls": {"enabled": True, "verify_clients": True},
            **more,
        },
    )


@pytest.fixture
def mtls(nats_factory: NatsFactory, tmp_path: Path) -> Any:
    cfg = mtls_config(tmp_path, streams={"flights": {}})
    with nats_factory.from_config(cfg) as server:
        yield cfg, server


def test_source_and_sink_connect_with_the_client_certificate(mtls: tuple[Config, Any]) -> None:
    cfg, server = mtls

    async def setup() -> None:
        nc = await connect_nats(cfg, server.url, name="setup")
        try:
            await ensure_streams(nc, cfg)
            js = nc.jetstream()
            for i in range(3):
                await js.publish("raw.flights", json.dumps({"i": i}).encode())
        finally:
            await nc.close()

    asyncio.run(setup())
    target = NatsEndpoint.from_config(cfg, "analysis", url=server.url)
    assert target.tls_cert and target.tls_key  # the client pair, not only the CA
    source = SourceOptions.parse({**target.to_options(), "stream": "flights"})

    async def source_sees_the_stream() -> int:
        nc = await source.nats.connect(name="mtls-source")
        try:
            return (await stream_bounds(nc, "flights")).latest
        finally:
            await nc.close()

    assert asyncio.run(source_sees_the_stream()) == 4  # the next sequence after 3 events
    report = ResultSink.for_query(target, "mtls_q").publish_results([{"key": "a", "n": 1}], 0)
    assert (report.published, report.kv_puts) == (1, 1)


def test_a_recompute_reads_and_serves_under_mutual_tls(
    mtls: tuple[Config, Any], spark: Any
) -> None:
    """`tierflow jobs recompute`'s engine under mutual TLS: the batch read of the stream
    (Spark's Python workers) and the view's results and KV puts present the client pair."""
    from jobs.jetstream import register
    from jobs.recompute import recompute, serve_view
    from jobs.sink import results_by_query
    from jobs.sql import StreamTable
    from runtime.job_specs import decode_spec

    cfg, server = mtls

    async def setup() -> None:
        nc = await connect_nats(cfg, server.url, name="setup")
        try:
            await ensure_streams(nc, cfg)
            js = nc.jetstream()
            for i in range(7):
                await js.publish("raw.flights", json.dumps({"carrier": "AB"[i % 2]}).encode())
        finally:
            await nc.close()

    asyncio.run(setup())
    register(spark)
    target = NatsEndpoint.from_config(cfg, "analysis", url=server.url)
    spec = decode_spec(
        {"name": "tls_count", "kind": "count", "stream": "flights", "by": ["carrier"]}
    )
    view = recompute(spark, target, spec, StreamTable("flights"), high_water=6)
    assert sorted((r["carrier"], r["count"]) for r in view.rows) == [("A", 3), ("B", 3)]
    serve_view(target, view)

    async def kv() -> dict[str, Any]:
        nc = await connect_nats(cfg, server.url, name="read")
        try:
            return (await results_by_query(nc.jetstream()))["tls_count"]
        finally:
            await nc.close()

    assert {k: v["count"] for k, v in asyncio.run(kv()).items()} == {"A": 3, "B": 3}


def test_a_sql_job_joins_a_kv_table_as_the_analysis_user_under_mutual_tls(
    nats_factory: NatsFactory, tmp_path: Path, spark: Any
) -> None:
    """A sql job over a stream and a KV table, with role users and client certificates on:
    the analysis user's permissions let the source read the bucket's stream, and the job's
    rows land in its results."""
    from nats.js.api import KeyValueConfig

    from jobs.jetstream import register
    from jobs.running import start_job
    from jobs.sink import results_by_query
    from runtime.job_specs import decode_spec

    cfg = mtls_config(
        tmp_path,
        nats={"role_users": True},
        streams={"orders": {"schema": "id BIGINT, item STRING, qty BIGINT"}},
        tables={"prices": {"bucket": "prices", "prefix": "item", "schema": "price DOUBLE"}},
    )
    with nats_factory.from_config(cfg) as server:

        async def setup() -> None:
            nc = await connect_nats(cfg, server.url, name="setup")
            try:
                await ensure_streams(nc, cfg)
                js = nc.jetstream()
                kv = await js.create_key_value(KeyValueConfig(bucket="prices"))
                for item, price in (("a", 1.5), ("b", 2.0)):
                    await kv.put(f"item.{item}", json.dumps({"price": price}).encode())
                for i in range(6):
                    order = {"id": i, "item": "abc"[i % 3], "qty": i}
                    await js.publish("raw.orders", json.dumps(order).encode())
            finally:
                await nc.close()

        asyncio.run(setup())
        register(spark)
        target = NatsEndpoint.from_config(cfg, "analysis", url=server.url)
        assert target.user and target.tls_cert  # the analysis role's user, with its pair
        spec = decode_spec(
            {
                "name": "priced",
                "kind": "sql",
                "sql": "SELECT o.id AS key, o.qty * p.price AS total "
                "FROM orders o JOIN prices p ON p.key = o.item",
            }
        )
        query = start_job(
            spark,
            spec,
            target,
            tmp_path / "ckpt",
            trigger={"availableNow": True},
            streams=cfg.sql_tables(),
        )
        assert query.awaitTermination(120) and query.exception() is None

        async def results() -> dict[str, Any]:
            nc = await connect_nats(cfg, server.url, name="read")
            try:
                return (await results_by_query(nc.jetstream())).get("priced", {})
            finally:
                await nc.close()

        got = {int(k): v["total"] for k, v in asyncio.run(results()).items()}
        # item c has no price: an inner join leaves its orders out
        assert got == {0: 0.0, 1: 2.0, 3: 4.5, 4: 8.0}
