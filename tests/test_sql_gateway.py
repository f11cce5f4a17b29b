"""`POST /v1/sql` end to end: a real Gateway actor hands checked queries to a real
AnalysisDriver actor (Spark local[2]) that also runs the stream's archive job; consumer
tokens decide which streams a query may name; the dashboard's SQL box in real Chromium.

Real parts: nats-server, a local Ray, the two actors, Spark, Chromium (Playwright with
`executable_path`).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import ray

from cluster.deploy.analysis import DriverConflict, start_driver, stop_driver, wait_running
from cluster.deploy.gateway import start_gateways, stop_gateways, wait_gateway
from jobs.archive import queries_root
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsServer, connect
from runtime.waiting import await_until
from tests.test_dashboard import open_page

pytestmark = pytest.mark.timeout(600)
NS = "tf-sql-gateway"
ALICE = "tok-alice"
LIMITED = "tok-results-only"
ITEMS = ["tea", "coffee", "cake", "juice"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("state")),
            "ray": {"namespace": NS},
            "auth": {
                "consumer_tokens": [ALICE, LIMITED],
                "consumer_streams": {LIMITED: ["results"]},
            },
            "streams": {"orders": {"subjects": ["raw.orders"], "archive": {"flush_s": 1.0}}},
        },
    )


@pytest.fixture(scope="module")
def stack(ray_module: Any, nats_server: NatsServer, cfg: Config) -> Iterator[dict[str, Any]]:
    async def streams() -> None:
        nc = await connect(nats_server.url)
        try:
            await ensure_streams(nc, cfg)
        finally:
            await nc.close()

    asyncio.run(streams())
    driver = start_driver(cfg, nats_server.url)
    status = wait_running(driver, timeout=180)
    assert status.get("state") == "running", status
    names = start_gateways(cfg, nats_server.url, replicas=1, port=0)  # tierflow chooses
    port = wait_gateway(cfg, names[0])["port"]
    yield {"driver": driver, "url": f"http://127.0.0.1:{port}"}
    stop_gateways(cfg, names)
    stop_driver(driver)


@pytest.fixture(scope="module")
async def orders(stack: dict[str, Any], nats_server: NatsServer) -> list[dict[str, Any]]:
    """500 orders in JetStream, and the driver's archive job caught up with them."""
    rows = [{"item": ITEMS[i % 7 % 4], "qty": 1 + i % 3, "n": i} for i in range(500)]
    nc = await connect(nats_server.url)
    try:
        js = nc.jetstream()
        acks = [await js.publish_async("raw.orders", json.dumps(r).encode()) for r in rows]
        await asyncio.gather(*acks)
    finally:
        await nc.close()

    async def archived() -> bool:
        info = await stack["driver"].archives.remote()
        return info["orders"]["next_seq"] == len(rows) + 1

    await await_until(archived, timeout=120, what="the driver's archive job caught up")
    return rows


async def post(url: str, body: Any, token: str | None = ALICE) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers["Content-Type"] = "application/json"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/sql", data=data, headers=headers) as r,
    ):
        return r.status, await r.json()


async def test_a_query_runs_over_the_archive_in_the_driver(
    stack: dict[str, Any], orders: list[dict[str, Any]], cfg: Config
) -> None:
    assert list(Path(cfg.archive_root("orders"), "stream=orders").glob("date=*"))
    assert (queries_root(cfg) / "archive-orders" / "commits").is_dir()
    status, body = await post(
        stack["url"],
        {"sql": "SELECT item, sum(qty) AS qty FROM orders GROUP BY item ORDER BY item"},
    )
    assert status == 200, body
    want: Counter[str] = Counter()
    for o in orders:
        want[o["item"]] += o["qty"]
    assert body["columns"] == ["item", "qty"] and body["tables"] == ["orders"]
    assert body["rows"] == [[k, want[k]] for k in sorted(want)] and not body["truncated"]


@pytest.mark.parametrize(
    ("body", "token", "status", "reason"),
    [
        ({"sql": "SELECT 1"}, None, 401, "missing token"),
        ({"sql": "SELECT 1"}, "nope", 401, "invalid token"),
        ({"sql": "SELECT count(*) FROM orders"}, LIMITED, 403, "orders"),
        (b"{not json", ALICE, 400, "must be JSON"),
        (b"\xff\xfe", ALICE, 400, "must be JSON"),
        ({"sql": "DELETE FROM orders"}, ALICE, 400, "only a SELECT"),
        ({"sql": "SELECT * FROM json.`/etc/passwd`"}, ALICE, 400, "without a qualifier"),
        ({"sql": "SELECT * FROM nope"}, ALICE, 400, "unknown table 'nope'"),
        ({"sql": "SELECT 1", "limit": 0}, ALICE, 400, "limit must be"),
        ({"sql": "SELECT 1", "timeout_s": 0}, ALICE, 400, "timeout_s must be"),
        ({"sql": "SELECT 1", "extra": 1}, ALICE, 400, "must be JSON"),
        ({"sql": "SELECT no_such_column FROM orders"}, ALICE, 400, "no_such_column"),
    ],
)
async def test_refusals_name_the_problem(
    stack: dict[str, Any],
    orders: list[dict[str, Any]],
    body: Any,
    token: str | None,
    status: int,
    reason: str,
) -> None:
    got, answer = await post(stack["url"], body, token)
    assert got == status and reason in answer["error"], answer


async def test_the_consoles_sql_box_shows_the_rows(
    stack: dict[str, Any],
    orders: list[dict[str, Any]],
    browser: Any,
) -> None:
    async with open_page(browser, f"{stack['url']}/?token={ALICE}") as page:
        await page.click("nav [data-tab=history]")
        sql = "SELECT item, count(*) AS n FROM orders GROUP BY item ORDER BY item"
        await page.fill("#sql-input", sql)
        await page.click("#sql-form button")
        await page.wait_for_function(
            "() => document.querySelectorAll('#sql-result tbody tr').length > 0", timeout=60_000
        )
        rows = await page.eval_on_selector_all(
            "#sql-result tbody tr", "trs => trs.map(tr => [...tr.cells].map(c => c.textContent))"
        )
        want = Counter(o["item"] for o in orders)
        assert rows == [[k, str(want[k])] for k in sorted(want)]
        assert "4 rows from orders" in await page.text_content("#sql-status")
        await page.fill("#sql-input", "DROP TABLE orders")
        await page.click("#sql-form button")
        await page.wait_for_function(
            "() => document.getElementById('sql-status').textContent.startsWith('refused')",
            timeout=30_000,
        )
        assert "(400)" in await page.text_content("#sql-status")


def test_results_is_a_table_too(stack: dict[str, Any], orders: list[dict[str, Any]]) -> None:
    """`results` exists from start-up (system stream); a token limited to it may query it."""
    answer = ray.get(stack["driver"].sql.remote("SELECT count(*) AS n FROM results"), timeout=120)
    assert answer["status"] == 200 and answer["rows"][0][0] >= 0
    query = {"sql": "SELECT count(*) FROM results"}
    status, body = asyncio.run(post(stack["url"], query, LIMITED))
    assert status == 200, body


def test_starting_the_running_driver_again_adds_its_jobs_or_names_the_conflict(
    stack: dict[str, Any], cfg: Config, nats_server: NatsServer
) -> None:
    """A second `start_driver` under the same name starts the jobs the running driver lacks
    (before, it returned the running one silently, without them), and refuses what would
    mean another driver: another NATS, or a changed spec under a running job's name."""
    driver = stack["driver"]
    job = {"name": "orders_by_item", "kind": "count", "stream": "orders", "by": ["item"]}
    assert "orders_by_item" not in ray.get(driver.jobs.remote(), timeout=60)
    again = start_driver(cfg, nats_server.url, [job])
    try:
        assert again._actor_id == driver._actor_id
        assert "orders_by_item" in ray.get(driver.jobs.remote(), timeout=60)
        assert start_driver(cfg, nats_server.url, [job])._actor_id == driver._actor_id
        with pytest.raises(DriverConflict, match="another spec"):
            start_driver(cfg, nats_server.url, [{**job, "by": ["qty"]}])
        with pytest.raises(DriverConflict, match="nats_url"):
            start_driver(cfg, "nats://127.0.0.1:1", [])
        assert ray.get(driver.jobs.remote(), timeout=60)["orders_by_item"]["by"] == ["item"]
    finally:
        ray.get(driver.stop.remote("orders_by_item", 60.0), timeout=120)
