"""The jetstream source's per-process NATS connection (jobs/jetstream_read.py): reused across
reads, replaced when it is closed, one per endpoint so each endpoint's credentials apply;
reads sharing it stay apart; and the light imports Spark's fresh Python processes pay."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig

from jobs import jetstream_read
from jobs.jetstream_options import SeqRange, SourceOptions, schema
from jobs.jetstream_read import _arrow_schema, _process, close_shared_clients, read_range
from runtime.nats.server import NatsEndpoint
from tests.support import NatsFactory, with_nats

pytestmark = pytest.mark.timeout(120)

N = 3000
USER, PASSWORD = "reader", "s3cret-pw"


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    server = nats_factory(sync_interval="2m", user=USER, password=PASSWORD)
    url = f"nats://{USER}:{PASSWORD}@127.0.0.1:{server.port}"

    async def fill(nc: Client) -> None:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="shared", subjects=["raw.s.>"]))
        futs = [
            await js.publish_async(f"raw.s.{'ab'[i % 2]}", json.dumps({"i": i}).encode())
            for i in range(N)
        ]
        await asyncio.wait_for(asyncio.gather(*futs), 60)

    with_nats(fill, url)
    return f"nats://127.0.0.1:{server.port}"


@pytest.fixture(autouse=True)
def fresh_clients() -> Any:
    close_shared_clients()
    yield
    close_shared_clients()


def options(url: str, **more: str) -> SourceOptions:
    base = NatsEndpoint(url, user=USER, password=PASSWORD).to_options()
    return SourceOptions.parse({**base, "stream": "shared", **more})


def seqs(opts: SourceOptions, start: int, end: int) -> list[int]:
    return [s for b in read_range(opts, SeqRange(start, end)) for s in b.column("seq").to_pylist()]


def shared_client(opts: SourceOptions) -> Client | None:
    return _process().client(opts.nats).nc


def test_reads_reuse_one_connection_and_replace_a_closed_one(nats_url: str) -> None:
    opts = options(nats_url, fetchBatch="500")
    assert seqs(opts, 1, 1001) == list(range(1, 1001))
    first = shared_client(opts)
    assert first is not None and first.is_connected  # kept open after the read
    assert seqs(opts, 1001, 2001) == list(range(1001, 2001))
    assert shared_client(opts) is first

    jetstream_read._run(_process().loop, first.close(), 10.0)  # a connection that died
    assert seqs(opts, 2001, N + 1) == list(range(2001, N + 1))
    second = shared_client(opts)
    assert second is not None and second is not first and second.is_connected


def test_each_endpoint_connects_with_its_own_credentials(nats_url: str) -> None:
    good = options(nats_url)
    assert seqs(good, 1, 101) == list(range(1, 101))
    wrong = SourceOptions.parse(
        {**NatsEndpoint(nats_url, user=USER, password="wrong").to_options(), "stream": "shared"}
    )
    with pytest.raises(Exception, match="(?i)authorization"):
        seqs(wrong, 1, 101)  # the cached good connection is not used for other credentials
    assert shared_client(wrong) is None
    assert seqs(good, 101, 201) == list(range(101, 201))


def test_interleaved_reads_on_the_shared_connection_each_get_their_own_range(
    nats_url: str,
) -> None:
    a_opts = options(nats_url, fetchBatch="300")
    b_opts = options(nats_url, fetchBatch="200", subject="raw.s.b")
    a = read_range(a_opts, SeqRange(1, 1501))
    b = read_range(b_opts, SeqRange(1001, N + 1))
    got_a: list[int] = []
    got_b: list[int] = []
    for batch_a, batch_b in zip(a, b, strict=False):  # both consumers live at once
        got_a += batch_a.column("seq").to_pylist()
        got_b += batch_b.column("seq").to_pylist()
    got_a += [s for batch in a for s in batch.column("seq").to_pylist()]
    got_b += [s for batch in b for s in batch.column("seq").to_pylist()]
    assert shared_client(a_opts) is shared_client(b_opts)
    assert got_a == list(range(1, 1501))
    assert got_b == [s for s in range(1001, N + 1) if (s - 1) % 2 == 1]  # raw.s.b only


@pytest.mark.unit
def test_arrow_schema_is_sparks_own_conversion() -> None:
    from pyspark.sql.pandas.types import to_arrow_schema

    assert _arrow_schema() == to_arrow_schema(schema(), timezone="UTC")


def test_the_source_imports_neither_the_config_nor_the_server_side() -> None:
    """Spark starts a fresh Python process per streaming query for the source's offsets:
    what jobs.jetstream imports is paid before every query's first batch."""
    code = (
        "import sys, jobs.jetstream, runtime.nats.endpoint; "
        "heavy = ['runtime.config', 'runtime.tls', 'runtime.nats.server', 'sqlglot', "
        "'cryptography', 'pandas']; print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
