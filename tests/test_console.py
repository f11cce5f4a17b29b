"""The operations console, as a person uses it, on a stranger's pipeline.

`tierflow up` with a file that names its own streams (no `meetup`), one job of each kind,
an archived stream and tokens, while a producer keeps sending; then a real headless
Chromium (Debian's, driven by Playwright) opens the console at the gateway's `/`: the
token is entered once, the pipeline view shows every tier moving, a stream's tail filters,
each job's results are drawn by kind, the SQL box answers, and a stopped (SIGSTOPped)
bridge turns its box red with the reason. Every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import runstate
from runtime.config import load
from runtime.waiting import wait_until
from tests.support import with_nats

pytestmark = pytest.mark.timeout(1200)

TIERFLOW = str(Path(sys.executable).with_name("tierflow"))
PRODUCER = "shop-producer-tok"
CONSUMER = "shop-consumer-tok"
ORDERS_ONLY = "shop-orders-only-tok"
WAIT_MS = 240_000
REPORTS = Path(__file__).resolve().parents[1] / "reports"
T0_MS = 1_767_225_600_000

CONFIG = """
[ray]
num_cpus = 2
[roles.collector]
port = 0
[roles.gateway]
port = 0
[roles.logger]
k = 1
[spark]
master = "local[2]"
[auth]
producer_tokens = ["{producer}"]
consumer_tokens = ["{consumer}", "{orders_only}"]
[auth.consumer_streams]
"{orders_only}" = ["orders"]

[streams.orders]
subjects = ["shop.orders"]
schema = "id BIGINT, sku STRING, qty BIGINT, ts BIGINT"
event_time = "ts"
watermark = "5 seconds"
[streams.orders.archive]
flush_s = 5

[streams.clicks]
subjects = ["shop.clicks"]
schema = "user STRING, page STRING, ts BIGINT"

[[jobs]]
name = "top_skus"
kind = "topn"
stream = "orders"
field = "sku"
n = 5

[[jobs]]
name = "orders_per_sku"
kind = "count"
stream = "orders"
by = ["sku"]

[[jobs]]
name = "visitors"
kind = "distinct"
stream = "clicks"
field = "user"

[[jobs]]
name = "some_pages"
kind = "sample"
stream = "clicks"
field = "page"
n = 5
seed = 1

[[jobs]]
name = "answers"
kind = "custom"
stream = "clicks"
function = "cluster.demo.meetup:responses"

[[jobs]]
name = "qty_per_10s"
kind = "sql"
sql = "SELECT window(ts, '10 seconds') AS w, sum(qty) AS qty, count(*) AS n FROM orders \
GROUP BY window(ts, '10 seconds')"
"""
JOB_DRAWN = {
    "top_skus": "bars",
    "orders_per_sku": "table",
    "visitors": "distinct",
    "some_pages": "table",
    "answers": "table",
    "qty_per_10s": "table",
}


def run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TIERFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def post(url: str, token: str, lines: list[dict[str, Any]]) -> int:
    body = "\n".join(json.dumps(e) for e in lines).encode()
    req = urllib.request.Request(
        url,
        data=body,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(json.loads(resp.read())["accepted"])


def get(url: str, token: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


class Producer(threading.Thread):
    """Orders and clicks at a steady pace until stopped (at most `limit_s`)."""

    def __init__(self, collector: str, limit_s: float = 1100.0) -> None:
        super().__init__(daemon=True)
        self.collector, self.limit_s = collector, limit_s
        self.stop = threading.Event()
        self.accepted = {"orders": 0, "clicks": 0}
        self.errors: list[str] = []

    def run(self) -> None:
        began, n = time.monotonic(), 0
        while not self.stop.is_set() and time.monotonic() - began < self.limit_s:
            ts = T0_MS + int((time.monotonic() - began) * 1000)
            orders = [
                {"id": n + i, "sku": f"sku-{(n + i) % 7}", "qty": (n + i) % 10, "ts": ts}
                for i in range(20)
            ]
            clicks = [
                {"user": f"u{(n + i) % 50}", "page": f"/p/{(n + i) % 9}", "ts": ts}
                for i in range(20)
            ]
            n += 20
            for stream, batch in (("orders", orders), ("clicks", clicks)):
                try:
                    url = f"{self.collector}/v1/streams/{stream}/events"
                    self.accepted[stream] += post(url, PRODUCER, batch)
                except Exception as err:  # shown by the test if nothing gets through
                    self.errors.append(repr(err))
            self.stop.wait(0.5)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("console")
    path = tmp / "tierflow.toml"
    page = tmp / "shop-page"  # the stranger's own page beside the console
    page.mkdir()
    (page / "index.html").write_text("<!doctype html><title>shop</title><h1>our shop</h1>")
    text = f'state_dir = "{tmp / "state"}"\n' + CONFIG.format(
        producer=PRODUCER, consumer=CONSUMER, orders_only=ORDERS_ONLY
    )
    text += f'\n[gateway.views]\nshop = "{page}"\n'
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")}
    cfg = load(path, environ=env)
    assert "meetup" not in cfg.streams
    up = run(["up", "--detach", "--config", str(path), "--timeout", "240"], env)
    assert up.returncode == 0, up.stdout + up.stderr
    producer = None
    try:
        state = runstate.read_state(cfg)
        assert state is not None
        producer = Producer(state["collector"]["url"])
        producer.start()
        yield {
            "gateway": state["gateway"]["url"],
            "nats": state["nats"]["url"],
            "path": path,
            "env": env,
            "producer": producer,
        }
    finally:
        if producer is not None:
            producer.stop.set()
            producer.join(30)
        down = run(["down", "--config", str(path)], env)
        assert down.returncode == 0, down.stdout + down.stderr


FIGURE_JS = """([tier, label]) => {
  const box = document.querySelector(`li.tier[data-tier="${tier}"]`);
  if (!box) return null;
  const dts = [...box.querySelectorAll('dt')];
  const dt = dts.find((d) => d.textContent === label);
  if (!dt) return null;
  const text = dt.nextElementSibling.textContent.replaceAll(',', '');
  return text === '–' ? null : Number(text);
}"""
DRAWN_JS = """([job, drawn]) => {
  const box = document.getElementById('results');
  const name = document.getElementById('results-name').textContent;
  if (!name.startsWith(job) || box.dataset.drawn !== drawn) return false;
  if (drawn === 'bars') return box.querySelectorAll('li.bar').length > 0;
  if (drawn === 'distinct') return Number(box.querySelector('.big')?.dataset.distinct) > 0;
  return box.querySelectorAll('tbody tr').length > 0;
}"""
BRIDGE_IS = "(s) => document.querySelector('li.tier[data-tier=bridge]')?.dataset.state === s"
FIRST_RATE = {
    "collector": "accepted/s",
    "logger": "logged/s",
    "bridge": "published/s",
    "jetstream": "stored/s",
    "analysis": "processed/s",
    "results": "published/s",
    "gateway": "sent/s",
}


def wait_console_view(gateway: str) -> None:
    """The launcher's first view reached the gateway (the console's data, over HTTP)."""
    wait_until(
        lambda: get(f"{gateway}/v1/console", CONSUMER)[0] == 200,
        timeout=120,
        interval=1,
        what="the console's first view at the gateway",
    )


async def test_a_token_restricted_to_one_stream_sees_only_that_stream_and_its_jobs(
    pipeline: dict[str, Any],
) -> None:
    gateway = pipeline["gateway"]
    await asyncio.to_thread(wait_console_view, gateway)
    assert get(f"{gateway}/v1/console", "wrong-token")[0] == 401
    status, everything = get(f"{gateway}/v1/console", CONSUMER)
    assert status == 200
    assert {"orders", "clicks"} <= {s["name"] for s in everything["streams"]}
    status, mine = get(f"{gateway}/v1/console", ORDERS_ONLY)
    assert status == 200 and [s["name"] for s in mine["streams"]] == ["orders"]
    assert {j["name"] for j in mine["jobs"]} <= {"top_skus", "orders_per_sku", "qty_per_10s"}
    assert all(j["streams"] == ["orders"] for j in mine["jobs"])
    # the raw bucket stays internal: only the filtered view leaves the gateway
    assert get(f"{gateway}/v1/kv/tierflow_status", CONSUMER)[0] == 403


async def test_the_console_shows_every_tier_moving_and_each_job_drawn_by_kind(
    pipeline: dict[str, Any], browser: Any
) -> None:
    gateway = pipeline["gateway"]
    await asyncio.to_thread(wait_console_view, gateway)
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    try:
        await page.goto(gateway + "/")
        # no token yet: the page asks for it once, then keeps it for the session
        await page.wait_for_selector("#token-form:not([hidden])", timeout=WAIT_MS)
        await page.fill("#token-input", CONSUMER)
        await page.click("#token-form button")
        await page.wait_for_function(
            "() => document.getElementById('feed').dataset.state === 'live'", timeout=WAIT_MS
        )
        await page.wait_for_selector("#token-form", state="hidden", timeout=WAIT_MS)
        # the config's own page is one click away, and served
        links = await page.eval_on_selector_all(
            "#views a", "(nodes) => nodes.map((a) => [a.textContent, a.getAttribute('href')])"
        )
        assert links == [["shop", "/shop/"]], links
        with urllib.request.urlopen(gateway + "/shop/", timeout=30) as resp:
            assert b"our shop" in resp.read()
        # the tail: the orders stream through a filter (the gateway sends: its rate moves)
        await page.click("nav [data-tab=streams]")
        await page.wait_for_selector('#streams tr[data-stream="orders"] button', timeout=WAIT_MS)
        await page.fill("#tail-filter", "SELECT id, qty WHERE qty >= 7")
        await page.click('#streams tr[data-stream="orders"] button')
        await page.wait_for_function(
            "() => document.querySelectorAll('#tail li.event').length >= 3", timeout=WAIT_MS
        )
        shown = await page.eval_on_selector_all(
            "#tail li.event code", "(nodes) => nodes.map((n) => JSON.parse(n.textContent))"
        )
        assert shown and all(set(e) == {"id", "qty"} and e["qty"] >= 7 for e in shown), shown
        # every tier of the pipeline moving, each by its own rate
        await page.click("nav [data-tab=pipeline]")
        for tier, label in FIRST_RATE.items():
            await page.wait_for_function(
                f"(args) => {{ const v = ({FIGURE_JS})(args); return v !== null && v > 0; }}",
                arg=[tier, label],
                timeout=WAIT_MS,
            )
        states = await page.eval_on_selector_all(
            "li.tier", "(nodes) => nodes.map((n) => [n.dataset.tier, n.dataset.state])"
        )
        assert [t for t, _ in states] == list(FIRST_RATE), states
        REPORTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(REPORTS / "console-pipeline.png"), full_page=True)
        # each job's results, drawn by its kind
        await page.click("nav [data-tab=jobs]")
        for job, drawn in JOB_DRAWN.items():
            await page.wait_for_selector(f'#jobs tr[data-job="{job}"] button', timeout=WAIT_MS)
            await page.click(f'#jobs tr[data-job="{job}"] button')
            await page.wait_for_function(
                DRAWN_JS,
                arg=[job, drawn],
                timeout=WAIT_MS,
            )
            if job == "top_skus":
                await page.screenshot(path=str(REPORTS / "console-jobs.png"), full_page=True)
        # counts: the rows, and their total over time
        await page.click('#jobs tr[data-job="orders_per_sku"] button')
        await page.wait_for_function(
            "() => Number(document.getElementById('results').dataset.total) > 0 "
            "&& document.querySelector('#results canvas') !== null",
            timeout=WAIT_MS,
        )
        await page.click('#jobs tr[data-job="top_skus"] button')
        await page.wait_for_function(DRAWN_JS, arg=["top_skus", "bars"], timeout=WAIT_MS)
        bars = await page.eval_on_selector_all(
            "#results li.bar", "(nodes) => nodes.map((n) => n.dataset.item)"
        )
        assert bars == [] or all(b.startswith("sku-") for b in bars)
        # the SQL box: at least what was accepted before the question
        await page.click("nav [data-tab=history]")
        before = pipeline["producer"].accepted["orders"]
        await page.fill("#sql-input", "SELECT count(*) AS n FROM orders")
        await page.click("#sql-form button")
        await page.wait_for_function(
            "() => document.querySelectorAll('#sql-result tbody tr').length === 1",
            timeout=WAIT_MS,
        )
        n = int(await page.inner_text("#sql-result tbody td"))
        assert n >= before > 0, pipeline["producer"].errors[:3]
        assert "orders" in await page.inner_text("#archive")

        # an audit reads every stream back; the promise panel shows its verdict. A stranger's
        # other publishers: one id on both streams (two events), one event with no id
        async def publish(nc: Any) -> None:
            js = nc.jetstream()
            for subject in ("shop.orders", "shop.clicks"):
                await js.publish(subject, b'{"id": -1}', headers={"Nats-Msg-Id": "same-id"})
            await js.publish("shop.orders", b'{"id": -2}')

        await asyncio.to_thread(with_nats, publish, pipeline["nats"])
        audited = await asyncio.to_thread(
            run, ["audit", "--json", "--config", str(pipeline["path"])], pipeline["env"]
        )
        assert audited.returncode == 0, audited.stdout + audited.stderr
        verdict = json.loads(audited.stdout)
        assert verdict["verdict"] == "ok" and verdict["streams"]["orders"]["events"] >= before
        assert verdict["streams"]["orders"]["without_id"] == 1
        await page.click("nav [data-tab=pipeline]")
        await page.wait_for_function(
            "() => document.getElementById('promise').dataset.verdict === 'ok'", timeout=WAIT_MS
        )
        assert "audit" in await page.inner_text("#promise")
    finally:
        await context.close()
    assert not errors, f"script errors in the page: {errors}"


def _bridge_pids(pipeline: dict[str, Any]) -> list[int]:
    out = run(["status", "--json", "--config", str(pipeline["path"])], pipeline["env"], 60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["roles"]["bridge"]["replicas"]
    return [int(r["pid"]) for r in rows if r.get("pid")]


async def test_a_stopped_bridge_turns_its_box_red_with_the_reason(
    pipeline: dict[str, Any], browser: Any
) -> None:
    gateway = pipeline["gateway"]
    await asyncio.to_thread(wait_console_view, gateway)
    pids = await asyncio.to_thread(_bridge_pids, pipeline)
    assert pids, "no bridge pid in the status"
    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    page = await context.new_page()
    try:
        await page.goto(f"{gateway}/?token={CONSUMER}")
        await page.wait_for_function(BRIDGE_IS, arg="ok", timeout=WAIT_MS)
        stopped = time.monotonic()
        os.kill(pids[0], signal.SIGSTOP)  # a bridge this test's runtime started
        try:
            await page.wait_for_function(BRIDGE_IS, arg="down", timeout=60_000)
            red_after_s = round(time.monotonic() - stopped, 1)
            why = await page.inner_text("li.tier[data-tier=bridge] .why")
            await page.screenshot(path=str(REPORTS / "console-bridge-down.png"), full_page=True)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[0], signal.SIGCONT)
        assert "not answering" in why, why
        REPORTS.mkdir(exist_ok=True)
        (REPORTS / "console.json").write_text(json.dumps({"bridge_red_after_s": red_after_s}))
        print(f"console: a stopped bridge's box turned red after {red_after_s} s")
    finally:
        await context.close()
