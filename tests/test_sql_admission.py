"""Ad-hoc SQL cannot starve or kill the analysis driver: while a count job keeps answering
exactly over events published during the test, hostile queries are refused (400, with the
reason), more queries than the driver's SQL slots are answered 429 with `Retry-After`, and
with every slot held by long queries the control methods (`status`, `jobs`) still answer
and the streaming job still makes progress. Afterwards the job's counts equal what was
published, and the query never restarted. Also: a query naming no table needs a token
allowed on every stream, an unknown table's refusal lists only the token's streams, and
`${...}` never reaches Spark.

Real parts: nats-server, a local Ray, the AnalysisDriver actor (Spark local[4], its
default) running the job, a Gateway actor, aiohttp over TCP.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import ray

from cluster.deploy.gateway import start_gateways, stop_gateways, wait_gateway
from jobs.sink import results_by_query
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.waiting import await_until
from tests.support import BackgroundLoad, NatsFactory, running_driver, with_nats

pytestmark = pytest.mark.timeout(900)

NS = "tf-sql-admission"
ALL = "tok-all"
LIMITED = "tok-orders-only"
REGIONS = ("north", "south", "east", "west")
JOB = {"name": "per_region", "kind": "count", "stream": "orders", "by": ["region"]}
SEED = 3000
SLOTS = 2  # jobs.sql_admission.SQL_SLOTS: the config's default
LONG_S = 90.0
# long (billions of rows: cancelled at LONG_S), and interruptible: a join on four keys
# feeds 10,000 generated rows per pair, and the sorted join reads its next row (checked for
# a kill) between them
LONG = (
    "SELECT count(*) AS n FROM orders a JOIN orders b ON a.region = b.region "
    "LATERAL VIEW explode(sequence(1, 10000)) t AS i"
)
PROBE = "SELECT count(*) AS n FROM orders"
HOSTILE = {
    "repeat over an exploded sequence": (
        "SELECT max(length(repeat('x', 100000000))) AS n "
        "FROM (SELECT explode(sequence(1, 1000)) AS i)",
        "repeat",
    ),
    "a huge sequence": ("SELECT size(sequence(1, 1000000000)) AS n", "sequence"),
    "a broadcast hint on a large stream": (
        "SELECT /*+ BROADCAST(a) */ count(*) AS n FROM orders a JOIN orders b "
        "ON a.region = b.region",
        "hint",
    ),
    "self cross joins in CTEs": (
        "WITH a AS (SELECT * FROM orders), b AS (SELECT x.region FROM a x CROSS JOIN a y), "
        "c AS (SELECT x.region FROM b x CROSS JOIN b y) SELECT count(*) AS n FROM c",
        "condition",
    ),
    "comma joins in CTEs": (
        "WITH a AS (SELECT * FROM orders), b AS (SELECT x.region FROM a x, a y), "
        "c AS (SELECT x.region FROM b x, b y) SELECT count(*) AS n FROM c",
        "condition",
    ),
    "an environment variable": ("SELECT '${env:PATH}' AS p", "substitut"),
    "a Java property": ("SELECT '${system:user.home}' AS p", "substitut"),
    "a Spark setting": ("SELECT '${spark.master}' AS p", "substitut"),
}


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    return nats_factory().url


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory, nats_url: str) -> Config:
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("sql-admission")),
            "nats": {"url": nats_url},
            "ray": {"namespace": NS},
            "spark": {"master": "local[4]", "conf": {"spark.sql.shuffle.partitions": 2}},
            "auth": {"consumer_tokens": [ALL, LIMITED], "consumer_streams": {LIMITED: ["orders"]}},
            "streams": {
                "orders": {"subjects": ["shop.orders.>"]},
                "hidden": {"subjects": ["hidden.>"]},
            },
        },
    )
    with_nats(lambda nc: ensure_streams(nc, cfg), nats_url)
    return cfg


@pytest.fixture(scope="module")
def stack(ray_module: Any, cfg: Config, nats_url: str) -> Iterator[dict[str, Any]]:
    with running_driver(cfg, nats_url, [{**JOB, "trigger_s": 1.0}]) as driver:
        names = start_gateways(cfg, nats_url, replicas=1, port=0)  # tierflow chooses
        port = wait_gateway(cfg, names[0])["port"]
        try:
            yield {"driver": driver, "url": f"http://127.0.0.1:{port}"}
        finally:
            stop_gateways(cfg, names)


class Orders(BackgroundLoad):
    """Orders `start`.. with ids, 20 every 0.1 s (or all at once with `burst`), each resent
    with its id until acknowledged; `sent` holds the acknowledged ones' regions."""

    def __init__(self, url: str, start: int, limit: int, *, burst: bool = False) -> None:
        super().__init__(url)
        self.n, self.end, self.burst = start, start + limit, burst
        self.sent: Counter[str] = Counter()

    async def main(self, nc: Any) -> None:
        js = nc.jetstream(timeout=10)
        while self.n < self.end and not self.stopping:
            batch = []
            for _ in range(min(200 if self.burst else 20, self.end - self.n)):
                region = REGIONS[self.n * 7 % 11 % 4]
                body = json.dumps({"region": region, "n": self.n}).encode()
                batch.append((region, f"o-{self.n}", body))
                self.n += 1
            for attempt in range(20):
                try:
                    acks = [
                        await js.publish_async(f"shop.orders.{r}", b, headers={"Nats-Msg-Id": i})
                        for r, i, b in batch
                    ]
                    await asyncio.gather(*acks)
                    break
                except Exception:  # noqa: BLE001 - resent with the same ids
                    if attempt == 19:
                        raise
                    await asyncio.sleep(0.2)
            self.sent.update(r for r, _, _ in batch)
            if not self.burst:
                await asyncio.sleep(0.1)


def counts(url: str) -> dict[str, int]:
    rows = with_nats(lambda nc: results_by_query(nc.jetstream()), url).get(JOB["name"], {})
    return {row["region"]: int(row["count"]) for row in rows.values()}


async def post(url: str, sql: str, token: str = ALL, **kw: Any) -> tuple[int, Any, Any]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/sql", data=json.dumps({"sql": sql, **kw}), headers=headers) as r,
    ):
        return r.status, r.headers, await r.json()


async def call(ref: Any, timeout: float) -> Any:
    return await asyncio.to_thread(ray.get, ref, timeout=timeout)


async def test_sql_cannot_starve_or_kill_the_streaming_job(
    stack: dict[str, Any], cfg: Config, nats_url: str
) -> None:
    driver, url = stack["driver"], stack["url"]
    sent: Counter[str] = Counter()
    seed = Orders(nats_url, 0, SEED, burst=True).start()
    await asyncio.to_thread(seed.finish)
    sent += seed.sent

    def seeded() -> bool:
        return sum(counts(nats_url).values()) == SEED

    # the results bucket is made by the job's first batch: until then, no answer
    await await_until(
        lambda: asyncio.to_thread(seeded), 240, 0.5, what="the seed counted", swallow=True
    )
    load = Orders(nats_url, SEED, 1_000_000).start()  # steady load until stopped
    try:
        # every hostile query: refused before Spark, by the gateway and by the driver
        for what, (sql, reason) in HOSTILE.items():
            status, _, body = await post(url, sql)
            assert status == 400 and reason in body["error"], (what, status, body)
            answer = await call(driver.sql.remote(sql), 60)
            assert answer["status"] == 400 and reason in answer["error"], (what, answer)

        # every slot taken by a long query
        long = [driver.sql.remote(LONG, 10, LONG_S) for _ in range(SLOTS)]

        async def full() -> bool:
            status, headers, body = await post(url, PROBE)
            return status == 429

        await await_until(full, 120, 0.2, what="every SQL slot taken")
        before = dict(load.sent)

        # a burst of more queries than there are slots: answered at once, 429
        burst = await asyncio.gather(*(post(url, PROBE) for _ in range(3 * SLOTS)))
        assert any(s == 429 for s, _, _ in burst), [(s, b) for s, _, b in burst]
        for status, headers, body in burst:
            assert status in (200, 429), (status, body)
            if status == 429:
                assert int(headers["Retry-After"]) == body["retry_after_s"] >= 1, body
                assert "retry after" in body["error"]

        # the control methods answer (a generous deadline: an answer, not a speed)
        status = await call(driver.status.remote(), 60)
        assert status["state"] == "running" and status["role"] == "active", status
        wanted = await call(driver.jobs.remote(), 60)
        assert JOB["name"] in wanted
        # and the streaming job counts events published while the slots are full
        target = sum(before.values()) + SEED

        def caught_up() -> bool:
            return sum(counts(nats_url).values()) >= target

        await await_until(
            lambda: asyncio.to_thread(caught_up), 300, 0.5, what="the job counting on"
        )
        # ... all of it while every slot was still taken
        assert await full(), "the long queries ended before the checks: make LONG longer"

        for answer in await asyncio.gather(*(call(ref, LONG_S + 180) for ref in long)):
            assert answer["status"] in (200, 504), answer
    finally:
        load.join()
    sent += load.sent

    def exact() -> bool:
        return counts(nats_url) == dict(sent)

    await await_until(lambda: asyncio.to_thread(exact), 300, 0.5, what="exact counts")
    assert sum(sent.values()) > SEED
    row = (await call(driver.status.remote(), 60))["queries"][JOB["name"]]
    assert row["state"] == "running" and row["restarts"] == 0, row


async def test_a_query_without_a_table_needs_every_stream(stack: dict[str, Any]) -> None:
    status, _, body = await post(stack["url"], "SELECT 1 AS one", token=LIMITED)
    assert status == 403 and "names no table" in body["error"], body
    status, _, body = await post(stack["url"], "SELECT 1 AS one", token=ALL)
    assert status == 200 and body["rows"] == [[1]], body
    # the driver too, for a caller that may read only some streams
    answer = await call(stack["driver"].sql.remote("SELECT 1 AS one", allowed=["orders"]), 120)
    assert answer["status"] == 400 and "names no table" in answer["error"], answer


async def test_an_unknown_table_lists_only_what_the_token_may_read(
    stack: dict[str, Any],
) -> None:
    status, _, body = await post(stack["url"], "SELECT * FROM nope", token=LIMITED)
    assert status == 400 and body["error"].endswith("the tables are: orders"), body
    status, _, body = await post(stack["url"], "SELECT * FROM nope", token=ALL)
    assert status == 400 and "hidden" in body["error"] and "orders" in body["error"], body
