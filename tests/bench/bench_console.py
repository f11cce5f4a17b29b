"""The operations console under a big pipeline: 50 streams and 100 jobs.

Prints numbers, asserts no speed (`make bench`). The real page and its files, served by
the gateway's own page routes (actors/access/pages.py) beside a stand-in `/v1/console`
that returns a view of 50 streams, 100 jobs and the seven tiers, with every figure moving
at each request; Debian's Chromium through Playwright loads it:

- first paint and first contentful paint (the browser's Paint Timing);
- time to the first full view: navigation start to 50 stream rows and 100 job rows drawn;
- a full update: one `poll()` (fetch, parse, draw every tier, stream and job and the
  chart), timed inside the page, `ROUNDS` times, p50 and p99.

Run alone: `.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_console.py`
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from aiohttp import web

from actors.access.pages import page_routes
from cluster.console.view import TIERS
from tests.bench.common import quantile, write_report
from tests.support import CHROMIUM, CHROMIUM_ARGS

STREAMS, JOBS, ROUNDS = 50, 100, 40
KINDS = ("topn", "count", "distinct", "sample", "custom", "sql")


def big_view(n: int) -> dict[str, Any]:
    """A view as cluster/console/view.py makes it, of STREAMS streams and JOBS jobs."""
    streams = [
        {
            "name": f"stream_{i:02d}",
            "subjects": [f"raw.s{i}"],
            "messages": 1000 * i + n,
            "bytes": 100_000 * i + n,
            "first_seq": 1,
            "last_seq": 1000 * i + n,
            "consumers": 3,
            "replicas": 1,
            "limits": {
                "max_age_s": 3600,
                "max_bytes": None,
                "max_msgs": None,
                "max_msgs_per_subject": None,
            },
            "compact": {"key": "id", "keep": 1} if i % 5 == 0 else None,
            "archive": {"partitioning": "day"} if i % 7 == 0 else None,
            "rate": float(n % 97),
            "dead_letters": i % 3,
        }
        for i in range(STREAMS)
    ]
    jobs = [
        {
            "name": f"job_{j:03d}",
            "kind": KINDS[j % len(KINDS)],
            "streams": [f"stream_{j % STREAMS:02d}"],
            "state": "running",
            "health": "ok",
            "why": "",
            "lag": n % 50,
            "batch_ms": 200 + j,
            "input_rows_per_s": float(n),
            "processed_rows_per_s": float(n + 1),
            "late_events": 0,
            "results": n * j,
            "restarts": 0,
            "watermark": None,
            "subject": f"results.job_{j:03d}",
        }
        for j in range(JOBS)
    ]
    tiers = [
        {
            "tier": t,
            "replicas": 3,
            "nodes": ["a", "b"],
            "load": n % 10,
            "rates": {
                "accepted": float(n),
                "logged": float(n),
                "published": float(n),
                "stored": float(n),
                "processed": float(n),
                "events_sent": float(n),
            },
            "state": "ok",
            "why": "",
        }
        for t in TIERS
    ]
    return {
        "at": float(n),
        "age_s": 0.5,
        "uptime_s": n,
        "tiers": tiers,
        "streams": streams,
        "jobs": jobs,
        "dead_letters": 5,
        "escalated": None,
        "escalations": [],
        "nodes": [{"alive": True}],
        "verifier": None,
    }


@pytest.mark.timeout(600)
async def test_console_with_50_streams_and_100_jobs() -> None:
    from playwright.async_api import async_playwright

    counter = itertools.count()

    async def console(_: web.Request) -> web.Response:
        return web.json_response(big_view(next(counter)))

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for _ in sock:  # subscriptions are not the subject here
            pass
        return sock

    app = web.Application()
    page_routes(app, {})
    app.router.add_get("/v1/console", console)
    app.router.add_get("/v1/ws", ws)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = await (
                await browser.new_context(viewport={"width": 1400, "height": 1000})
            ).new_page()
            began = time.perf_counter()
            await page.goto(url)
            await page.wait_for_function(
                f"() => document.querySelectorAll('#streams tbody tr').length === {STREAMS} "
                f"&& document.querySelectorAll('#jobs tbody tr').length === {JOBS}",
                timeout=60_000,
            )
            full_view_ms = (time.perf_counter() - began) * 1000
            paints = await page.evaluate(
                "() => Object.fromEntries(performance.getEntriesByType('paint')"
                ".map((p) => [p.name, p.startTime]))"
            )
            updates = []
            for _ in range(ROUNDS):
                updates.append(
                    await page.evaluate(
                        "async () => { const t = performance.now(); await window.tierflow.poll();"
                        " return performance.now() - t; }"
                    )
                )
            await browser.close()
    finally:
        await runner.cleanup()
    out = {
        "streams": STREAMS,
        "jobs": JOBS,
        "first_paint_ms": round(paints.get("first-paint", 0.0), 1),
        "first_contentful_paint_ms": round(paints.get("first-contentful-paint", 0.0), 1),
        "full_view_ms": round(full_view_ms, 1),
        "update_p50_ms": round(quantile(updates, 0.5) or 0.0, 1),
        "update_p99_ms": round(quantile(updates, 0.99) or 0.0, 1),
        "rounds": ROUNDS,
    }
    print(
        f"\nconsole, {STREAMS} streams and {JOBS} jobs: first paint {out['first_paint_ms']} ms, "
        f"first full view {out['full_view_ms']} ms, a full update p50 {out['update_p50_ms']} ms "
        f"p99 {out['update_p99_ms']} ms"
    )
    write_report("console", out)
