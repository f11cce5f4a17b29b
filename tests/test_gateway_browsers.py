"""Browsers against the gateway: other origins, rebound host names, simple requests, and
the gateway's own buckets.

With auth off (the default) any page a browser opens can reach `127.0.0.1:8080`: a
WebSocket needs no CORS, a `text/plain` POST needs no preflight, and DNS rebinding makes
the attacker's name point at the gateway. Real parts: nats-server, two Gateway actors on a
local Ray (one with the default options and auth off; one with tokens, a custom cursor
bucket, a custom webhook bucket, `internal_streams = []` and configured origins/hosts),
aiohttp as the browser (it sends whatever Origin and Host headers a test sets).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec
import pytest

from actors.access.gateway import Gateway
from runtime.browsers import BrowserGuard
from runtime.config import Config, GatewayOptions, WebhookOptions, load
from runtime.engines.services import ensure_streams
from runtime.errors import ConfigError
from runtime.nats.lease import LEASE_BUCKET
from runtime.nats.server import NatsServer, connect
from runtime.supervision.ray_actors import supervised_options
from runtime.waiting import await_until
from tests.support import start_on_free_port
from tests.test_gateway import events_of, publish, read_until
from tests.test_gateway_security import receiver

NS = "tf-gwbrowse"
ALICE = "tok-b-alice"
BOB = "tok-b-bob"
EVIL = "http://evil.example"
DASH = "http://dash.example:9000"  # an origin the token gateway's config allows
CUSTOM_CURSORS = "my_cursors"
CUSTOM_HOOKS = "my_hooks"
_json = msgspec.json.Encoder()
STREAMS = {"brw": {"subjects": ["raw.brw"]}, "results": {"subjects": ["results.>"]}}
STREAMS["cbrw"] = {"subjects": ["raw.cbrw"]}  # the collector's
STREAMS["deadletter"] = {"subjects": ["deadletter.>"]}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def open_cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    """The defaults: auth off, default origins and hosts, default internal streams."""
    return load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("state")),
            "ray": {"namespace": NS},
            "streams": STREAMS,
        },
    )


@pytest.fixture(scope="module")
def tok_cfg(open_cfg: Config) -> Config:
    return load(
        environ={},
        overrides={
            "state_dir": open_cfg.state_dir,
            "ray": {"namespace": NS},
            "streams": STREAMS,
            "auth": {"consumer_tokens": [ALICE, BOB]},
            "browsers": {"allowed_origins": [DASH], "allowed_hosts": ["tierflow.internal"]},
        },
    )


TOK_OPTIONS = GatewayOptions(
    cursor_bucket=CUSTOM_CURSORS,
    cursor_flush_s=0.05,
    internal_streams=[],  # an operator "opening everything up"
    webhooks=WebhookOptions(
        bucket=CUSTOM_HOOKS, lease_s=2.0, timeout_s=2.0, allow_networks=["127.0.0.1/32"]
    ),
)


@pytest.fixture(scope="module")
async def js(nats_server: NatsServer, open_cfg: Config) -> AsyncIterator[Any]:
    nc = await connect(nats_server.url)
    await ensure_streams(nc, open_cfg)
    yield nc.jetstream()
    await nc.close()


def _start(name: str, cfg: Config, nats_url: str, options: GatewayOptions) -> tuple[Any, str]:
    import ray

    def start(port: int) -> Any:
        return (
            ray.remote(Gateway)
            .options(**supervised_options(name, NS, num_cpus=0))
            .remote(
                str(cfg.state_path),
                name=name,
                config=cfg.to_dict(),
                nats_url=nats_url,
                port=port,
                options=options,
            )
        )

    handle, port = start_on_free_port(name, NS, start)  # chosen again if taken first
    return handle, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gws(
    ray_module: Any, nats_server: NatsServer, open_cfg: Config, tok_cfg: Config, js: Any
) -> Iterator[dict[str, str]]:
    """{"open": url of the default gateway, "tok": url of the configured one}."""
    import ray

    started = {
        "open": _start("gwb-open", open_cfg, nats_server.url, GatewayOptions(cursor_flush_s=0.05)),
        "tok": _start("gwb-tok", tok_cfg, nats_server.url, TOK_OPTIONS),
    }
    yield {k: url for k, (_, url) in started.items()}
    for handle, _ in started.values():
        with contextlib.suppress(Exception):
            ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle, no_restart=True)


async def _stats(url: str, token: str | None = None) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(headers=auth(token) if token else None) as s,
        s.get(f"{url}/v1/stats") as r,
    ):
        assert r.status == 200, await r.text()
        return dict(await r.json())


def _subscribe(sid: str, stream: str, start: Any = "all") -> str:
    return _json.encode({"op": "subscribe", "id": sid, "stream": stream, "from": start}).decode()


# --------------------------------------------------------------------------- Origin


async def test_a_websocket_from_another_origin_is_refused_and_reads_nothing(
    js: Any, gws: dict[str, str]
) -> None:
    url = gws["open"]
    seqs = await publish(js, "raw.brw", [{"n": i, "secret": "s3"} for i in range(3)])
    before = (await _stats(url))["ws_connections"]
    async with aiohttp.ClientSession() as s:
        for path in ["/v1/ws?stream=brw&from=all", "/streaming"]:
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                async with s.ws_connect(url + path, origin=EVIL) as ws:
                    await ws.send_str(_subscribe("x", "brw"))
                    pytest.fail(f"{path}: upgraded for {EVIL}: {await ws.receive(timeout=5)}")
            assert info.value.status == 403, (path, info.value)
        async with s.get(url + "/v1/ws", headers={"Origin": EVIL, "Upgrade": "websocket"}) as r:
            assert r.status == 403
            assert "origin" in (await r.json())["error"].lower()
        assert (await _stats(url))["ws_connections"] == before  # no session was ever opened
        # the gateway's own origin and a client without Origin (a script) still read
        for origin in [url, None]:
            async with s.ws_connect(url + "/v1/ws", origin=origin) as ws:
                await ws.send_str(_subscribe("s", "brw", seqs[0]))
                frames = await read_until(ws, lambda f: len(events_of(f, "s")) >= 3)
                assert [f["seq"] for f in events_of(frames, "s")] == seqs, origin


async def test_data_requests_from_another_origin_are_refused(js: Any, gws: dict[str, str]) -> None:
    url = gws["open"]
    await publish(js, "raw.brw", [{"n": 1}])
    paths = [
        "/v1/streams",
        "/v1/streams/brw?since=0",
        "/v1/streams/brw/latest",
        "/v1/poll/brw?after=0&timeout=0",
        "/v1/sse/brw?from=all",
        "/v1/kv/results",
        "/v1/webhooks",
        "/v1/stats",
    ]
    async with aiohttp.ClientSession() as s:
        for path in paths:
            async with s.get(url + path, headers={"Origin": EVIL}) as r:
                assert r.status == 403, (path, r.status, await r.text())
                body = await r.json()
                assert EVIL in body["error"], (path, body)
            # a page's no-cors load (<script src>, <img>) carries no Origin, only Sec-Fetch-Site
            async with s.get(url + path, headers={"Sec-Fetch-Site": "cross-site"}) as r:
                assert r.status == 403, (path, r.status)
        async with s.delete(url + "/v1/webhooks/nope", headers={"Origin": EVIL}) as r:
            assert r.status == 403
        # same origin, and no Origin at all (curl, Python), are served
        for headers in [{"Origin": url}, {}, {"Sec-Fetch-Site": "same-origin", "Origin": url}]:
            async with s.get(url + "/v1/streams/brw/latest", headers=headers) as r:
                assert r.status == 200, (headers, await r.text())
        async with s.get(url + "/healthz", headers={"Origin": EVIL}) as r:
            assert r.status == 200  # the listed exception: it returns no data
        async with s.get(url + "/", headers={"Sec-Fetch-Site": "none"}) as r:
            assert r.status == 200  # the dashboard opened from the address bar


async def test_a_text_plain_sql_post_from_another_origin_runs_nothing(gws: dict[str, str]) -> None:
    """The simple request a page can send without a preflight: refused before the query
    is looked at (no analysis driver runs here: reaching it would be a 503)."""
    url = gws["open"]
    body = b'{"sql": "SELECT 1 AS one"}'
    async with aiohttp.ClientSession() as s:
        for headers, statuses in [
            ({"Origin": EVIL, "Content-Type": "text/plain"}, {403, 415}),
            ({"Content-Type": "text/plain"}, {415}),
            ({"Content-Type": "application/x-www-form-urlencoded"}, {415}),
            ({"Origin": EVIL, "Content-Type": "application/json"}, {403}),
            ({}, {415}),  # no type at all: not declared JSON
        ]:
            async with s.post(url + "/v1/sql", data=body, headers=headers) as r:
                assert r.status in statuses, (headers, r.status, await r.text())
                assert (await r.json())["error"], headers
        hook = b'{"url": "http://127.0.0.1:1/x", "stream": "brw"}'
        async with s.post(
            url + "/v1/webhooks", data=hook, headers={"Content-Type": "text/plain"}
        ) as r:
            assert r.status == 415 and "application/json" in (await r.json())["error"]
        assert "sql_queries" not in await _stats(url)  # nothing was handed to a driver
        # JSON from the gateway's own page (or a script) passes the guard: the missing
        # analysis driver answers
        for origin in [{"Origin": url}, {}]:
            json_h = {"Content-Type": "application/json; charset=utf-8", **origin}
            async with s.post(url + "/v1/sql", data=body, headers=json_h) as r:
                assert r.status == 503, (origin, await r.text())
                assert "analysis driver" in (await r.json())["error"]


# --------------------------------------------------------------------------- Host


async def test_a_rebound_host_name_is_refused(js: Any, gws: dict[str, str]) -> None:
    url = gws["open"]
    port = url.rsplit(":", 1)[1]
    rebound = {"Host": f"evil.example:{port}"}
    async with aiohttp.ClientSession() as s:
        for path in ["/v1/streams", "/v1/streams/brw/latest", "/v1/sse/brw", "/v1/stats"]:
            async with s.get(url + path, headers=rebound) as r:
                assert r.status in (403, 421), (path, r.status)
                assert "evil.example" in (await r.json())["error"]
        # the attacker's page is same-origin with its rebound name: still refused
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            async with s.ws_connect(
                url + "/v1/ws", headers=rebound, origin=f"http://evil.example:{port}"
            ):
                pass
        assert info.value.status in (403, 421)
        for host in [f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1"]:
            async with s.get(url + "/v1/streams", headers={"Host": host}) as r:
                assert r.status == 200, (host, await r.text())
        # the origin check goes by the Host it accepted: a page on localhost is same-origin
        local = {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}
        async with s.get(url + "/v1/streams", headers=local) as r:
            assert r.status == 200, await r.text()
        other_port = {"Host": f"localhost:{port}", "Origin": "http://localhost:1"}
        async with s.get(url + "/v1/streams", headers=other_port) as r:
            assert r.status == 403  # another port on the same host is another origin


async def test_configured_hosts_and_origins_are_served(js: Any, gws: dict[str, str]) -> None:
    url = gws["tok"]
    port = url.rsplit(":", 1)[1]
    seqs = await publish(js, "raw.brw", [{"n": "conf"}])
    async with aiohttp.ClientSession(headers=auth(ALICE)) as s:
        async with s.get(url + "/v1/streams", headers={"Host": f"tierflow.internal:{port}"}) as r:
            assert r.status == 200, await r.text()
        async with s.get(url + "/v1/streams", headers={"Host": f"tierflow.evil:{port}"}) as r:
            assert r.status in (403, 421)
        async with s.ws_connect(url + "/v1/ws", origin=DASH) as ws:
            await ws.send_str(_subscribe("d", "brw", seqs[0]))
            frames = await read_until(ws, lambda f: len(events_of(f, "d")) >= 1)
            assert events_of(frames, "d")[0]["seq"] == seqs[0]
        with pytest.raises(aiohttp.WSServerHandshakeError):
            async with s.ws_connect(url + "/v1/ws", origin=EVIL):
                pass
        # the allowed page can read answers (CORS), a stream's and a refusal's too
        async with s.get(url + "/v1/streams/brw/latest", headers={"Origin": DASH}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == DASH
        async with s.get(url + "/v1/streams/nosuch/latest", headers={"Origin": DASH}) as r:
            assert r.status == 404 and r.headers["Access-Control-Allow-Origin"] == DASH
        async with s.get(url + "/v1/sse/brw?from=all", headers={"Origin": DASH}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == DASH
        preflight = {
            "Origin": DASH,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        async with s.options(url + "/v1/sql", headers=preflight) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == DASH
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert "Content-Type" in r.headers["Access-Control-Allow-Headers"]
        async with s.options(url + "/v1/sql", headers={**preflight, "Origin": EVIL}) as r:
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
        async with s.get(url + "/v1/streams", headers={"Origin": EVIL}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers


@pytest.mark.unit
def test_bad_origins_and_hosts_fail_at_config_load() -> None:
    for bad, key in [
        ({"allowed_origins": ["evil.example"]}, r"browsers\.allowed_origins"),
        ({"allowed_origins": ["http://a.example/path"]}, r"browsers\.allowed_origins"),
        ({"allowed_hosts": ["a.example:80"]}, r"browsers\.allowed_hosts"),
        ({"allowed_hosts": ["a b"]}, r"browsers\.allowed_hosts"),
    ]:
        with pytest.raises(ConfigError, match=key):
            load(environ={}, overrides={"browsers": bad})
    ok = load(
        environ={},
        overrides={
            "browsers": {"allowed_origins": ["https://A.example", "*"], "allowed_hosts": ["*"]}
        },
    )
    assert ok.browsers.allowed_origins == ["https://A.example", "*"]


# --------------------------------------------------------------------------- stats, buckets


async def test_stats_show_no_other_tokens_webhook_ids(gws: dict[str, str]) -> None:
    url = gws["tok"]
    async with receiver() as (base, _), aiohttp.ClientSession() as s:
        body = {"url": f"{base}/ok", "stream": "brw"}
        async with s.post(f"{url}/v1/webhooks", json=body, headers=auth(ALICE)) as r:
            assert r.status == 201, await r.text()
            wid = (await r.json())["id"]
        try:

            async def alice_sees_it() -> bool:
                return wid in (await _stats(url, ALICE))["webhooks"]["holding"]

            await await_until(alice_sees_it, timeout=30, what="the sender holds its lease")
            bob = await _stats(url, BOB)
            assert wid not in msgspec.json.encode(bob).decode(), bob["webhooks"]
        finally:
            async with s.delete(f"{url}/v1/webhooks/{wid}", headers=auth(ALICE)) as r:
                assert r.status == 204


@pytest.fixture(scope="module")
async def secrets_held(gws: dict[str, str]) -> AsyncIterator[None]:
    """Every bucket the tests look at exists and holds something worth stealing."""
    async with aiohttp.ClientSession() as s:
        body = {"url": "http://127.0.0.1:9/x", "stream": "brw", "secret": "hunter2"}
        async with s.post(f"{gws['tok']}/v1/webhooks", json=body, headers=auth(BOB)) as r:
            assert r.status == 201, await r.text()
            wid = (await r.json())["id"]
        for url, h in [(gws["open"], {}), (gws["tok"], auth(BOB))]:
            async with s.ws_connect(url + "/v1/ws?stream=brw&from=all&client=c1", headers=h) as ws:
                await read_until(ws, lambda f: bool(f))
        yield
        async with s.delete(f"{gws['tok']}/v1/webhooks/{wid}", headers=auth(BOB)):
            pass


@pytest.mark.parametrize(
    ("gateway", "bucket"),
    [
        ("open", LEASE_BUCKET),
        ("open", "tierflow_cursors"),
        ("open", "tierflow_webhooks"),
        ("tok", LEASE_BUCKET),
        ("tok", CUSTOM_CURSORS),
        ("tok", CUSTOM_HOOKS),
        ("tok", "tierflow_cursors"),
    ],
)
async def test_the_gateways_own_buckets_are_never_served(
    js: Any, gws: dict[str, str], secrets_held: None, gateway: str, bucket: str
) -> None:
    """Leases, cursors and webhook secrets: not by KV snapshot, WebSocket, SSE, poll, latest
    or the stream list, whatever the cursor bucket is called or `internal_streams` says."""
    url = gws[gateway]
    headers = auth(ALICE) if gateway == "tok" else {}
    await js.stream_info(f"KV_{bucket}")  # it exists: a 404 would prove nothing
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.get(f"{url}/v1/streams") as r:
            listed = {d["stream"] for d in (await r.json())["streams"]}
            assert f"kv:{bucket}" not in listed, listed
            assert "kv:results" in listed or "results" in listed
        for path in [
            f"/v1/kv/{bucket}",
            f"/v1/sse/kv:{bucket}?from=all",
            f"/v1/sse/KV_{bucket}?from=all",
            f"/v1/poll/kv:{bucket}?after=0&timeout=0",
            f"/v1/streams/KV_{bucket}?since=0",
            f"/v1/streams/kv:{bucket}/latest",
        ]:
            async with s.get(url + path) as r:
                assert r.status == 403, (path, r.status, (await r.read())[:300])
        for stream in [f"kv:{bucket}", f"KV_{bucket}"]:
            async with s.ws_connect(url + "/v1/ws") as ws:
                await ws.send_str(_subscribe("k", stream))
                frames = await read_until(ws, lambda f: bool(f))
                assert frames[0].get("op") == "error" and frames[0]["code"] == 403, frames


@pytest.mark.unit
def test_browser_rules_compare_origins_by_scheme_host_and_port() -> None:
    guard = BrowserGuard.build(
        scheme="http", bind_host="127.0.0.1", allowed_hosts=["a.example"], pages=lambda p: p == "/"
    )

    def status(headers: dict[str, str], method: str = "GET", path: str = "/v1/x") -> int:
        refused = guard.check(method, path, headers, "127.0.0.1")
        return 200 if refused is None else refused.status

    assert status({"Host": "[::1]:8080", "Origin": "http://[::1]:8080"}) == 200
    assert status({"Host": "localhost", "Origin": "http://localhost:80"}) == 200
    assert status({"Host": "localhost:8080", "Origin": "https://localhost:8080"}) == 403
    assert status({"Host": "A.Example.:8080", "Origin": "http://a.example:8080"}) == 200
    assert status({"Host": "b.example:8080"}) == 421
    assert status({"Host": "127.0.0.1:8080", "Origin": "null"}) == 403
    assert status({}) == 200  # HTTP/1.0 without Host: no browser
    assert status({"Host": "127.0.0.1", "Sec-Fetch-Site": "cross-site"}, path="/") == 200
    assert status({"Host": "127.0.0.1", "Sec-Fetch-Site": "cross-site"}, "POST", "/") == 403
    json_post = {"Host": "127.0.0.1", "Content-Type": "Application/JSON; charset=utf-8"}
    assert status(json_post, "POST") == 200
    assert status({"Host": "127.0.0.1", "Content-Type": "multipart/form-data"}, "POST") == 415
    assert status({"Host": "evil.example", "Origin": "http://evil.example"}, path="/healthz") == 200
    loose = BrowserGuard.build(
        scheme="https", bind_host="0.0.0.0", allowed_hosts=["*"], allowed_origins=["*"]
    )
    assert (
        loose.check("GET", "/v1/x", {"Host": "any.example", "Origin": "http://x.example"}) is None
    )


# --------------------------------------------------------------------------- the collector


@pytest.fixture(scope="module")
def collector_url(
    ray_module: Any, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    from cluster.pipeline import start_collection_tier

    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("cstate")),
            "ray": {"namespace": NS},
            "roles": {"logger": {"k": 0}, "collector": {"replicas": 1}, "bridge": {"replicas": 1}},
            "streams": STREAMS,
        },
    )
    tier = start_collection_tier(cfg, nats_url=nats_server.url, collector_port=0)
    yield tier.url
    tier.stop()


async def test_another_sites_page_cannot_produce_to_the_collector(
    js: Any, collector_url: str
) -> None:
    """A WebSocket producer needs no CORS: a page elsewhere could write events."""
    url = collector_url
    port = url.rsplit(":", 1)[1]
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            async with s.ws_connect(f"{url}/v1/streams/cbrw/ws", origin=EVIL) as ws:
                await ws.send_str('{"id": "evil-1"}')
                pytest.fail(f"upgraded for {EVIL}: {await ws.receive(timeout=10)}")
        assert info.value.status == 403
        body = {"id": "evil-2"}
        async with s.post(
            f"{url}/v1/streams/cbrw/events", json=body, headers={"Origin": EVIL}
        ) as r:
            assert r.status == 403 and EVIL in (await r.json())["error"]
        rebound = {"Host": f"evil.example:{port}"}
        async with s.post(f"{url}/v1/streams/cbrw/events", json=body, headers=rebound) as r:
            assert r.status == 421
        async with s.get(f"{url}/healthz", headers=rebound) as r:
            assert r.status == 200
        # its own origin and plain clients still produce
        async with s.ws_connect(f"{url}/v1/streams/cbrw/ws", origin=url) as ws:
            await ws.send_str('{"id": "own-1"}')
            assert (await ws.receive_json(timeout=30))["ids"] == ["own-1"]
        ok = {"id": "plain-1"}
        async with s.post(f"{url}/v1/streams/cbrw/events?wait=queued", json=ok) as r:
            assert r.status == 200, await r.text()

    async def landed() -> bool:
        info = await js.stream_info("cbrw")
        return info.state.messages >= 2

    await await_until(landed, timeout=60, what="own events in cbrw")
    msgs = []
    for seq in range(1, (await js.stream_info("cbrw")).state.last_seq + 1):
        msgs.append((await js.get_msg("cbrw", seq)).data)
    assert not any(b"evil" in m for m in msgs), msgs
