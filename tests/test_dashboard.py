"""The Meetup demo's page (a `[gateway.views]` view at /demo/) in a real headless Chromium,
served by the real Gateway.

Real parts: nats-server, the Gateway actors on a local Ray, the result sink (jobs/sink.py),
Chromium (Debian package `chromium`, driven by Playwright; never `playwright install`).
A producer in the test publishes generated RSVPs to `raw.meetup` and, like the analysis
tier, the exact top-N and per-city-minute rows of what it published so far. Every wait is
Playwright's `wait_for_function` with a timeout; the page is read from its DOM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from cluster.demo import VIEW_DIR, demo_config
from cluster.demo.rsvps import RsvpGenerator
from jobs.event_time import iso_ms
from jobs.sink import ResultSink
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsServer, connect

NS = "tf-dashboard"
TOKEN = "dash-token"
WAIT_MS = 60_000
SCREENSHOT = Path(__file__).resolve().parents[1] / "reports" / "dashboard.png"
NOT_MOUNTED = (
    "the Gateway does not serve the demo's view: actors.access.pages.page_routes(app, views) "
    "where Gateway._serve builds its app, with [gateway.views] demo"
)


# --------------------------------------------------------------------------- the pipeline


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    """A stranger's settings with the demo added, as `make demo` adds it (cluster/demo):
    the `meetup` stream, its page at /demo/, its queries."""
    cfg = demo_config(
        load(
            environ={},
            overrides={
                "state_dir": str(tmp_path_factory.mktemp("state")),
                "ray": {"namespace": NS},
                "auth": {"consumer_tokens": [TOKEN]},
            },
        )
    )
    assert "meetup" in cfg.streams and cfg.gateway.views == {"demo": str(VIEW_DIR)}
    assert {j["name"] for j in cfg.jobs} >= {"meetup_topn", "meetup_city_minute"}
    return cfg


@pytest.fixture(scope="module")
async def gateway(ray_module: Any, nats_server: NatsServer, cfg: Config) -> AsyncIterator[str]:
    """One real Gateway replica (a supervised Ray actor); yields its base URL."""
    from cluster.deploy.gateway import start_gateways, stop_gateways

    nc = await connect(nats_server.url)
    await ensure_streams(nc, cfg)
    await nc.close()
    names = await asyncio.to_thread(start_gateways, cfg, nats_server.url, 1, 0)
    ends = ray_module.get(ray_module.get_actor(names[0], namespace=NS).endpoints.remote())
    yield ends["url"]
    await asyncio.to_thread(stop_gateways, cfg, names)


@pytest.fixture(scope="module")
async def page_url(gateway: str) -> str:
    """The dashboard as the Gateway serves it (with the consumer token passed through)."""
    async with aiohttp.ClientSession() as http, http.get(gateway + "/demo/") as resp:
        if resp.status != 200:
            pytest.fail(NOT_MOUNTED)
    return f"{gateway}/demo/?token={TOKEN}"


@dataclass
class Producer:
    """RSVPs to `raw.meetup` and, like the analysis tier, the exact results of all of them."""

    nats_url: str
    gen: RsvpGenerator = field(default_factory=lambda: RsvpGenerator(7, topics=60, groups=300))
    topics: Counter[str] = field(default_factory=Counter)
    cities: Counter[tuple[str, str]] = field(default_factory=Counter)
    tops: list[list[dict[str, Any]]] = field(default_factory=list)
    no_ids: set[int] = field(default_factory=set)
    events: int = 0

    async def run(self, stop: asyncio.Event, per_tick: int = 20, tick_s: float = 0.2) -> None:
        nc = await connect(self.nats_url)
        js = nc.jetstream()
        topn = ResultSink(self.nats_url, query_name="meetup_topn", kv_prefix="meetup_topn")
        city = ResultSink(
            self.nats_url, query_name="meetup_city_minute", kv_prefix="meetup_city_minute"
        )
        batch = 0
        try:
            while not stop.is_set():  # bounded by the module's lifetime (stop is set at end)
                batch += 1
                touched = set()
                for r in self.gen.take(per_tick):
                    await js.publish(
                        "raw.meetup",
                        msgspec.json.encode(r),
                        headers={"Nats-Msg-Id": f"rsvp-{r['rsvp_id']}"},
                    )
                    self.events += 1
                    self.topics.update(t["topic_name"] for t in r["group"]["group_topics"])
                    minute = iso_ms(r["mtime"] - r["mtime"] % 60_000)
                    self.cities[(r["group"]["group_city"], minute)] += 1
                    touched.add((r["group"]["group_city"], minute))
                    if r["response"] == "no":
                        self.no_ids.add(r["rsvp_id"])
                top = [{"item": t, "count": c, "error": 0} for t, c in self.topics.most_common(10)]
                self.tops.append(top)
                row = {"key": "all", "top": top, "events": self.events}
                await topn.apublish_results(nc, [row], batch)
                rows = [
                    {"key": f"{c}|{m}", "city": c, "minute": m, "rsvps": self.cities[(c, m)]}
                    for c, m in sorted(touched)
                ]
                await city.apublish_results(nc, rows, batch)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), tick_s)
        finally:
            await nc.close()


@pytest.fixture(scope="module")
async def producer(gateway: str, nats_server: NatsServer) -> AsyncIterator[Producer]:
    prod = Producer(nats_server.url)
    stop = asyncio.Event()
    task = asyncio.ensure_future(prod.run(stop))
    yield prod
    stop.set()
    await asyncio.wait_for(task, 30)


# --------------------------------------------------------------------------- the browser


@contextlib.asynccontextmanager
async def open_page(browser: Any, url: str) -> AsyncIterator[Any]:
    """A fresh page; fails the test on any uncaught script error (network errors, which
    some tests cause on purpose, are the page's to show, not script errors)."""
    context = await browser.new_context(viewport={"width": 1280, "height": 1000})
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    await page.goto(url)
    try:
        yield page
    finally:
        await context.close()
    assert not errors, f"script errors in the page: {errors}"


BARS_JS = """() => [...document.querySelectorAll('#topn li.bar')].map((li) => ({
    item: li.querySelector('.label').textContent,
    count: Number(li.dataset.count),
    width: parseFloat(li.querySelector('.fill').style.width),
}))"""


def tops_equal(bars: list[dict[str, Any]], top: list[dict[str, Any]]) -> bool:
    return sorted((b["item"], b["count"]) for b in bars) == sorted(
        (t["item"], t["count"]) for t in top
    )


# --------------------------------------------------------------------------- tests


async def test_gateway_serves_the_console_and_the_demo_view(gateway: str) -> None:
    """The console at `/`, the demo's view at `/demo/` (no CDN: all local); neither's files
    reach outside their directories."""
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway + "/demo/") as resp:
            page = await resp.text()
            assert resp.status == 200, NOT_MOUNTED
            assert resp.content_type == "text/html"
            assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
        assert 'src="static/app.js"' in page and "http" not in page.split("<body")[0]
        async with http.get(gateway + "/demo/static/app.js") as resp:
            assert resp.status == 200 and resp.content_type == "text/javascript"
        async with http.get(gateway + "/demo", allow_redirects=False) as resp:
            assert resp.status == 302 and resp.headers["Location"] == "/demo/"
        async with http.get(gateway + "/") as resp:
            console = await resp.text()
            assert resp.status == 200 and "operations console" in console
        for name in ("console.js", "console.css", "uPlot.iife.min.js", "uPlot.min.css"):
            async with http.get(gateway + "/static/" + name) as resp:
                assert resp.status == 200, name
        for bad in (
            "/demo/static/nope.js",
            "/demo/static/..%2F__init__.py",
            "/demo/static/.hidden",
            "/static/app.js",  # the demo's file is not the console's
            "/static/uPlot-LICENSE.txt",
            "/nodemo/",
        ):
            async with http.get(gateway + bad) as resp:
                assert resp.status == 404, bad


async def test_bars_appear_and_change_as_results_flow(
    browser: Any, page_url: str, producer: Producer
) -> None:
    async with open_page(browser, page_url) as page:
        await page.wait_for_function(
            "() => document.querySelectorAll('#topn li.bar').length === 10", timeout=WAIT_MS
        )
        first = await page.evaluate(BARS_JS)
        assert any(tops_equal(first, top) for top in producer.tops), first
        counts = [b["count"] for b in first]
        assert counts == sorted(counts, reverse=True)
        for bar in first:  # widths are proportional to counts, the largest fills the track
            assert abs(bar["width"] - 100 * bar["count"] / counts[0]) < 0.2, bar

        await page.wait_for_function(
            """(before) => [...document.querySelectorAll('#topn li.bar')]
                .some((li) => Number(li.dataset.count) !== before[li.dataset.item])""",
            arg={b["item"]: b["count"] for b in first},
            timeout=WAIT_MS,
        )
        later = await page.evaluate(BARS_JS)
        assert any(tops_equal(later, top) for top in producer.tops), later
        assert sum(b["count"] for b in later) > sum(counts)  # counts only grow

        # The other panels fill from the same live streams.
        await page.wait_for_function(
            "() => Number(document.getElementById('rate').textContent.replace(/,/g, '')) > 0",
            timeout=WAIT_MS,
        )
        await page.wait_for_function(
            "() => document.querySelectorAll('#cities tbody tr').length >= 3", timeout=WAIT_MS
        )
        rows = await page.evaluate(
            """() => [...document.querySelectorAll('#cities tbody tr')].map((tr) =>
                [...tr.children].map((td) => td.textContent))"""
        )
        truth = {(c, m.replace("T", " ")[:16]): n for (c, m), n in producer.cities.items()}
        for city, minute, rsvps in rows:  # never more than were published, and some
            assert 0 < int(rsvps) <= truth[(city, minute)], (city, minute, rsvps)
        await page.wait_for_function(
            "() => document.querySelectorAll('#matches li').length >= 5", timeout=WAIT_MS
        )
        conn = await page.inner_text("#conn")
        assert "live" in conn
        SCREENSHOT.parent.mkdir(exist_ok=True)
        await page.screenshot(path=str(SCREENSHOT), full_page=True)


async def test_filter_box_shows_matching_rsvps(
    browser: Any, page_url: str, producer: Producer
) -> None:
    async with open_page(browser, page_url) as page:
        # The default filter from the page: names and cities of "yes" RSVPs only.
        await page.wait_for_function(
            "() => document.querySelectorAll('#matches li').length >= 3", timeout=WAIT_MS
        )
        keys = await page.evaluate(
            """() => [...document.querySelectorAll('#matches li')].map((li) =>
                [...li.querySelectorAll('.k')].map((k) => k.textContent).join(' '))"""
        )
        assert set(keys) == {"member.member_name: group.group_city:"}

        await page.fill("#filter-input", "SELECT rsvp_id, response WHERE response = 'no'")
        await page.click("#filter-form button")
        await page.wait_for_function(
            """() => document.querySelectorAll('#matches li').length >= 2
                && document.getElementById('filter-status').textContent.includes("= 'no'")""",
            timeout=WAIT_MS,
        )
        shown = await page.evaluate(
            """() => [...document.querySelectorAll('#matches li')].map((li) =>
                Object.fromEntries([...li.querySelectorAll('.k')].map((k) =>
                    [k.textContent.replace(/:$/, ''), k.nextSibling.nextSibling.textContent])))"""
        )
        for match in shown:
            assert match["response"] == "no" and set(match) == {"rsvp_id", "response"}
            assert int(match["rsvp_id"]) in producer.no_ids

        await page.fill("#filter-input", "SELECT FROM WHERE")
        await page.click("#filter-form button")
        await page.wait_for_function(
            "() => document.getElementById('filter-status').textContent.startsWith('rejected')",
            timeout=WAIT_MS,
        )
        assert "(400)" in await page.inner_text("#filter-status")
        assert "live" in await page.inner_text("#conn")  # one bad filter does not end the rest


async def test_resumes_without_gap_after_a_gateway_crash(
    browser: Any, page_url: str, producer: Producer, ray_module: Any
) -> None:
    """SIGKILL the Gateway: the page shows the outage, reconnects with backoff to the
    restarted replica and resumes every subscription after its last seq."""
    async with open_page(browser, page_url) as page:
        await page.wait_for_function(
            "() => window.tierflow && window.tierflow.conn.subs.get('rate').lastSeq > 0",
            timeout=WAIT_MS,
        )
        # Record every raw RSVP seq the rate panel receives (all RSVPs: contiguous seqs).
        await page.evaluate(
            """() => { const sub = window.tierflow.conn.subs.get('rate'); const inner = sub.onEvent;
                window.seen = []; sub.onEvent = (f) => { window.seen.push(f.seq); inner(f); }; }"""
        )
        await page.wait_for_function("() => window.seen.length >= 20", timeout=WAIT_MS)
        actor = ray_module.get_actor("gateway-0", namespace=NS)
        pid = (await asyncio.to_thread(ray_module.get, actor.stats.remote(), timeout=30))["pid"]
        before = await page.evaluate("() => window.seen.length")
        os.kill(pid, signal.SIGKILL)
        await page.wait_for_function(
            "() => document.getElementById('conn').dataset.state === 'reconnecting'",
            timeout=WAIT_MS,
        )
        await page.wait_for_function(
            """(n) => document.getElementById('conn').dataset.state === 'live'
                && window.seen.length > n + 50""",
            arg=before,
            timeout=60_000,
        )
        seen = await page.evaluate("() => window.seen")
        assert seen == list(range(seen[0], seen[0] + len(seen))), "gap or repeat across crash"
        assert int(await page.inner_text("#stat-reconnects")) >= 1


async def test_a_page_without_token_is_told_why(browser: Any, page_url: str) -> None:
    async with open_page(browser, page_url.split("?")[0]) as page:
        await page.wait_for_function(
            "() => document.getElementById('conn').dataset.state === 'refused'", timeout=WAIT_MS
        )
        assert "4401" in await page.inner_text("#conn")


async def test_lag_warnings_and_drops_are_shown(browser: Any) -> None:
    """Unit level (a fake gateway next to the real static files): the page shows the
    gateway's in-stream lag warning and the count of messages it dropped."""
    from aiohttp import web

    from actors.access.pages import page_routes

    async def ws_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            frame = msgspec.json.decode(msg.data)
            sid = frame.get("id")
            if frame.get("op") == "subscribe":
                await ws.send_json({"op": "subscribed", "id": sid, "from_seq": 1})
            if sid == "rate":
                await ws.send_json({"op": "event", "id": sid, "seq": 1, "data": {"rsvp_id": 1}})
                await ws.send_json(
                    {"op": "lag", "id": sid, "behind": 5000, "policy": "drop_oldest"}
                )
                await ws.send_json({"op": "dropped", "id": sid, "count": 7})
        return ws

    app = web.Application()
    page_routes(app, {"demo": str(VIEW_DIR)})
    app.router.add_get("/v1/ws", ws_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()  # no port to lose between choice and bind
    port = runner.addresses[0][1]
    try:
        async with open_page(browser, f"http://127.0.0.1:{port}/demo/") as page:
            await page.wait_for_function(
                "() => document.getElementById('stat-dropped').textContent === '7'",
                timeout=WAIT_MS,
            )
            assert await page.inner_text("#stat-lag") == "1 (last: 5000 behind)"
            assert await page.get_attribute("#conn", "data-state") == "lagging"
            assert "server dropped 7 messages of rate" in await page.inner_text("#conn")
    finally:
        await runner.cleanup()
