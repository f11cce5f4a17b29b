"""The data access tier under attack: the dashboard's files, webhooks and cursors.

Real parts: nats-server, one Gateway actor on a local Ray with consumer tokens on, curl and
aiohttp as clients, aiohttp servers on loopback as webhook receivers (127.0.0.1 is on the
webhook allow-list explicitly; 127.0.0.2 is loopback too and is not). Each test plays the
attacker (another token, a forged path, a private target) and checks what it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import msgspec
import pytest
from aiohttp import web

from actors.access.gateway import Gateway
from actors.access.webhooks import BUCKET as WEBHOOK_BUCKET
from runtime.config import Config, GatewayOptions, WebhookOptions, load
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsServer, connect
from runtime.supervision.ray_actors import supervised_options
from tests.support import start_on_free_port
from tests.test_gateway import _dead_letters, events_of, publish, read_until, recv_json

NS = "tf-gwsec"
ALICE = "tok-alice"
BOB = "tok-bob"
LIMITED = "tok-results-only"
_json = msgspec.json.Encoder()
OPTIONS = GatewayOptions(
    cursor_flush_s=0.05,
    close_timeout_s=2.0,
    webhooks=WebhookOptions(
        max_attempts=2,
        backoff_base_s=0.05,
        backoff_cap_s=0.1,
        lease_s=2.0,
        timeout_s=2.0,
        allow_networks=["127.0.0.1/32"],
    ),
)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    streams = {name: {"subjects": [f"raw.{name}"]} for name in ["sec", "hooksec", "curs"]}
    streams["results"] = {"subjects": ["results.>"]}
    streams["deadletter"] = {"subjects": ["deadletter.>"]}
    return load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("state")),
            "ray": {"namespace": NS},
            "auth": {"consumer_tokens": [ALICE, BOB, LIMITED]},
            "streams": streams,
        },
    )


@pytest.fixture(scope="module")
async def js(nats_server: NatsServer, cfg: Config) -> AsyncIterator[Any]:
    nc = await connect(nats_server.url)
    await ensure_streams(nc, cfg)
    yield nc.jetstream()
    await nc.close()


@pytest.fixture(scope="module")
def gw(ray_module: Any, nats_server: NatsServer, cfg: Config, js: Any) -> Iterator[str]:
    """One real gateway replica; yields its base URL."""
    import ray

    def start(port: int) -> Any:
        return (
            ray.remote(Gateway)
            .options(**supervised_options("gwsec", NS, num_cpus=0))
            .remote(
                str(cfg.state_path),
                name="gwsec",
                config=cfg.to_dict(),
                nats_url=nats_server.url,
                port=port,
                token_streams={LIMITED: ["results"]},
                options=OPTIONS,
            )
        )

    handle, port = start_on_free_port("gwsec", NS, start)  # chosen again if taken first
    yield f"http://127.0.0.1:{port}"
    try:  # False: its loop did not stop within 30 s (a webhook sender ran on after its stop)
        assert ray.get(handle.shutdown.remote(), timeout=60), "the gateway did not stop"
    finally:
        ray.kill(handle, no_restart=True)


@contextlib.asynccontextmanager
async def receiver(host: str = "127.0.0.1") -> AsyncIterator[tuple[str, dict[str, list[Any]]]]:
    """A webhook receiver on `host`: `/ok` records, `/redirect` answers 307 to `/ok`."""
    got: dict[str, list[Any]] = {"ok": [], "redirect": []}

    async def ok(request: web.Request) -> web.Response:
        got["ok"].append(msgspec.json.decode(await request.read()))
        return web.Response(status=204)

    async def redirect(request: web.Request) -> web.Response:
        got["redirect"].append(msgspec.json.decode(await request.read()))
        raise web.HTTPTemporaryRedirect("/ok")

    app = web.Application()
    app.router.add_post("/ok", ok)
    app.router.add_post("/redirect", redirect)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    try:
        yield f"http://{host}:{runner.addresses[0][1]}", got
    finally:
        await runner.cleanup()


async def raw_get(url: str) -> tuple[int, bytes]:
    """GET exactly this path over a plain socket: HTTP clients normalise or re-encode a
    path, and the attack is in the bytes of the request line."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        request = f"GET {parts.path} HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n"
        writer.write(request.encode("ascii"))
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=30)  # HTTP/1.0: until close
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# --------------------------------------------------------------------------- dashboard files


async def test_dashboard_static_serves_no_file_outside_its_directory(
    gw: str, tmp_path: Path
) -> None:
    """`/static/<encoded absolute or ../ path>` must not reach a file elsewhere on the host."""
    secret = tmp_path / "secret.html"
    secret.write_text("<p>host secret</p>")
    dash = Path(__file__).resolve().parents[1] / "actors" / "access" / "console"
    up = quote("../" * (len(dash.parts) + 2), safe="") + quote(str(secret).lstrip("/"), safe="")
    for path in [
        "/static/" + quote(str(secret), safe=""),  # %2Ftmp%2F...%2Fsecret.html
        "/static/" + up,  # ..%2F..%2F...tmp%2F...
        "/static/..%2F..%2Fgateway.py",
        "/static/%2E%2E%2Fpages.py",
        "/static/vendor%2FuPlot.min.css",  # by its bare name only
    ]:
        status, body = await raw_get(gw + path)
        assert b"host secret" not in body, path
        assert status == 404, (path, status, body[:200])
    status, body = await raw_get(gw + "/static/console.js")  # its own files still load
    assert status == 200 and b"subscribe" in body


# --------------------------------------------------------------------------- webhook targets


@pytest.mark.unit
def test_webhook_targets_are_checked_on_every_resolved_address() -> None:
    """Pure policy: private, loopback, link-local, mapped and unspecified addresses are
    refused unless allowed; a name is refused if ANY of its addresses is."""
    from actors.access.webhooks import TargetPolicy

    policy = TargetPolicy.from_networks([])
    for addr in [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "::1",
        "fe80::1",
        "fc00::1",
        "::ffff:127.0.0.1",
        "224.0.0.1",
    ]:
        assert not policy.allows(ipaddress.ip_address(addr)), addr
    assert policy.allows(ipaddress.ip_address("93.184.215.14"))
    assert policy.allows(ipaddress.ip_address("2606:4700::1"))
    loop_ok = TargetPolicy.from_networks(["127.0.0.1/32"])
    assert loop_ok.allows(ipaddress.ip_address("127.0.0.1"))
    assert loop_ok.allows(ipaddress.ip_address("::ffff:127.0.0.1"))
    assert not loop_ok.allows(ipaddress.ip_address("127.0.0.2"))
    with pytest.raises(ValueError, match="allow_networks"):
        TargetPolicy.from_networks(["not-a-network"])


@pytest.mark.unit
async def test_dns_rebinding_is_caught_at_delivery_time() -> None:
    """A name that resolved to a public address at registration and to loopback at delivery
    is refused when the connection is made (the resolver the sender connects through)."""
    from actors.access.webhooks import (
        GuardedResolver,
        TargetPolicy,
        WebhookError,
        check_target,
        sender_session,
    )

    answers = [["93.184.215.14"], ["93.184.215.14", "127.0.0.1"], ["127.0.0.1"], ["127.0.0.1"]]

    class Flipping(aiohttp.abc.AbstractResolver):
        async def resolve(
            self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
        ) -> list[Any]:
            addrs = answers.pop(0)
            return [
                {
                    "hostname": host,
                    "host": a,
                    "port": port,
                    "family": socket.AF_INET,
                    "proto": 0,
                    "flags": socket.AI_NUMERICHOST,
                }
                for a in addrs
            ]

        async def close(self) -> None:
            pass

    policy = TargetPolicy.from_networks([])
    guarded = GuardedResolver(policy, Flipping())
    first = await check_target("http://rebind.example/hook", policy, guarded)
    assert first == "http://rebind.example/hook"
    with pytest.raises(WebhookError, match="127.0.0.1") as err:
        await guarded.resolve("rebind.example", 80)
    assert err.value.status == 400
    # the delivery session connects through that resolver: refused, or allowed if listed
    async with receiver() as (base, got):
        url = base.replace("127.0.0.1", "rebind.example") + "/ok"
        async with sender_session(guarded, 5.0) as session:
            with pytest.raises(WebhookError, match="not allowed"):
                await session.post(url, data=b"{}")
        assert got["ok"] == []
        allowed = GuardedResolver(TargetPolicy.from_networks(["127.0.0.1/32"]), Flipping())
        async with sender_session(allowed, 5.0) as session, session.post(url, data=b"{}") as r:
            assert r.status == 204 and got["ok"] == [{}]


async def test_webhook_targets_on_private_networks_are_refused(gw: str) -> None:
    async with receiver() as (base, _), aiohttp.ClientSession(headers=auth(ALICE)) as s:
        port = base.rsplit(":", 1)[1]
        for url in [
            f"http://127.0.0.2:{port}/ok",  # loopback, not on the allow-list
            f"http://localhost:{port}/ok",  # resolves to ::1 too on most hosts, or 127.0.0.1
            "http://10.0.0.1/ok",
            "http://169.254.169.254/latest/meta-data",
            "http://[::1]/ok",
            "http://[::ffff:10.0.0.1]/ok",
            "http://0.0.0.0/ok",
        ]:
            body = {"url": url, "stream": "hooksec"}
            async with s.post(f"{gw}/v1/webhooks", json=body) as r:
                answer = await r.json()
            if url.startswith("http://localhost") and r.status == 201:
                # only when localhost is 127.0.0.1 alone (allowed); then clean up
                assert {a[4][0] for a in socket.getaddrinfo("localhost", None)} == {"127.0.0.1"}
                async with s.delete(f"{gw}/v1/webhooks/{answer['id']}") as d:
                    assert d.status == 204
                continue
            assert r.status == 400, (url, answer)
            assert "not allowed" in answer["error"], (url, answer)
        async with s.post(
            f"{gw}/v1/webhooks", json={"url": f"{base}/ok", "stream": "hooksec"}
        ) as r:
            reg = await r.json()
            assert r.status == 201, reg  # 127.0.0.1 is on the allow-list
        async with s.delete(f"{gw}/v1/webhooks/{reg['id']}") as r:
            assert r.status == 204


async def test_webhook_redirects_are_not_followed(js: Any, gw: str) -> None:
    async with receiver() as (base, got), aiohttp.ClientSession(headers=auth(ALICE)) as s:
        body = {"url": f"{base}/redirect", "stream": "hooksec", "from": "new"}
        async with s.post(f"{gw}/v1/webhooks", json=body) as r:
            reg = await r.json()
            assert r.status == 201, reg
        try:
            [seq] = await publish(js, "raw.hooksec", [{"n": "redirected"}])
            dead = await _dead_letters(js, reg["id"], 1)
            assert [(d["seq"], d["error"]) for d in dead] == [(seq, "HTTP 307")]
            assert [d["seq"] for d in got["redirect"]] == [seq, seq]  # both attempts
            assert got["ok"] == []  # the redirect target was never called
        finally:
            async with s.delete(f"{gw}/v1/webhooks/{reg['id']}") as r:
                assert r.status == 204


async def test_a_stored_webhook_to_a_forbidden_target_is_not_delivered(js: Any, gw: str) -> None:
    """A registration already in the bucket (written before the allow-list, or by hand) is
    checked again at delivery: nothing reaches 127.0.0.2, the event is dead-lettered."""
    async with receiver("127.0.0.2") as (base, got):
        kv = await js.key_value(WEBHOOK_BUCKET)
        wid = "f0rb1dden0000001"
        reg = {
            "id": wid,
            "url": f"{base}/ok",
            "stream": "hooksec",
            "filter": "",
            "secret": "s",
            "start_seq": (await js.stream_info("hooksec")).state.last_seq + 1,
            "created_ms": 1,
        }
        await kv.put(f"reg.{wid}", _json.encode(reg))
        try:
            [seq] = await publish(js, "raw.hooksec", [{"n": "private"}])
            dead = await _dead_letters(js, wid, 1)
            assert dead[0]["seq"] == seq and "not allowed" in dead[0]["error"], dead
            assert got["ok"] == []
        finally:
            await kv.delete(f"reg.{wid}")


async def test_webhooks_are_seen_and_deleted_only_by_their_owner(gw: str) -> None:
    async with receiver() as (base, _):
        async with aiohttp.ClientSession(headers=auth(ALICE)) as s:
            body = {"url": f"{base}/ok", "stream": "hooksec"}
            async with s.post(f"{gw}/v1/webhooks", json=body) as r:
                alice = await r.json()
                assert r.status == 201, alice
        async with aiohttp.ClientSession(headers=auth(LIMITED)) as s:
            body = {"url": f"{base}/ok", "stream": "results"}
            async with s.post(f"{gw}/v1/webhooks", json=body) as r:
                limited = await r.json()
                assert r.status == 201, limited
        try:
            for token, mine, theirs in [(BOB, None, alice), (LIMITED, limited, alice)]:
                async with aiohttp.ClientSession(headers=auth(token)) as s:
                    async with s.get(f"{gw}/v1/webhooks") as r:
                        listed = {h["id"] for h in (await r.json())["webhooks"]}
                    assert theirs["id"] not in listed
                    assert mine is None or mine["id"] in listed
                    async with s.get(f"{gw}/v1/webhooks/{theirs['id']}") as r:
                        assert r.status == 404
                    async with s.delete(f"{gw}/v1/webhooks/{theirs['id']}") as r:
                        assert r.status == 404
            async with aiohttp.ClientSession(headers=auth(ALICE)) as s:
                async with s.get(f"{gw}/v1/webhooks/{alice['id']}") as r:
                    assert r.status == 200  # still there after the attempts
                async with s.get(f"{gw}/v1/webhooks") as r:
                    assert limited["id"] not in {h["id"] for h in (await r.json())["webhooks"]}
        finally:
            for token, reg in [(ALICE, alice), (LIMITED, limited)]:
                async with (
                    aiohttp.ClientSession(headers=auth(token)) as s,
                    s.delete(f"{gw}/v1/webhooks/{reg['id']}") as r,
                ):
                    assert r.status == 204


# --------------------------------------------------------------------------- cursors and acks


async def _ws_sub(
    session: aiohttp.ClientSession, url: str, frame: dict[str, Any], n: int
) -> tuple[aiohttp.ClientWebSocketResponse, list[Any]]:
    ws = await session.ws_connect(f"{url}/v1/ws")
    await ws.send_str(_json.encode(frame).decode())
    frames = await read_until(
        ws,
        lambda fr: (
            len(events_of(fr, frame["id"])) >= n
            or any(isinstance(f, dict) and f.get("op") == "error" for f in fr)
        ),
    )
    return ws, frames


def _unsubscribed(frames: list[Any]) -> bool:
    return any(isinstance(f, dict) and f.get("op") == "unsubscribed" for f in frames)


async def test_acks_beyond_what_was_delivered_are_refused(js: Any, gw: str) -> None:
    start = (await js.stream_info("curs")).state.last_seq + 1
    seqs = await publish(js, "raw.curs", [{"n": i} for i in range(5)])
    sub = {"op": "subscribe", "id": "s", "stream": "curs", "from": start, "client": "c-ack"}
    sub["ack"] = True
    async with aiohttp.ClientSession(headers=auth(ALICE)) as s:
        ws, frames = await _ws_sub(s, gw, sub, 5)
        async with ws:
            assert [f["seq"] for f in events_of(frames, "s")] == seqs
            await ws.send_str(_json.encode({"op": "ack", "id": "s", "seq": seqs[1]}).decode())
            await ws.send_str(_json.encode({"op": "ack", "id": "s", "seq": 10**9}).decode())
            error = await recv_json(ws)
            assert error["op"] == "error" and error["code"] == 400, error
            assert error["delivered_seq"] == seqs[-1] and str(10**9) in error["reason"]
        resume = {"op": "subscribe", "id": "s", "client": "c-ack", "from": "cursor"}
        ws, frames = await _ws_sub(s, gw, {**resume, "stream": "curs", "ack": True}, 3)
        async with ws:
            assert frames[0]["op"] == "subscribed" and frames[0]["cursor"] is True, frames[0]
            assert frames[0]["from_seq"] == seqs[1] + 1  # the last real ack, not 10**9


async def test_cursors_belong_to_the_token_that_made_them(js: Any, gw: str) -> None:
    """Bob names Alice's client and subscription ids: he gets no cursor of hers, and his
    acks move only his own; Alice resumes exactly where she acknowledged."""
    start = (await js.stream_info("curs")).state.last_seq + 1
    seqs = await publish(js, "raw.curs", [{"n": i} for i in range(6)])
    sub = {"op": "subscribe", "id": "feed", "stream": "curs", "client": "shared-id", "ack": True}
    async with aiohttp.ClientSession(headers=auth(ALICE)) as s:
        ws, frames = await _ws_sub(s, gw, {**sub, "from": start}, 6)
        async with ws:
            await ws.send_str(_json.encode({"op": "ack", "id": "feed", "seq": seqs[2]}).decode())
            await ws.send_str(_json.encode({"op": "unsubscribe", "id": "feed"}).decode())
            await read_until(ws, _unsubscribed)
    async with aiohttp.ClientSession(headers=auth(BOB)) as s:
        ws, frames = await _ws_sub(s, gw, {**sub, "from": "cursor"}, 1)
        async with ws:
            assert frames[0]["op"] == "error" and frames[0]["code"] == 410, frames[0]
        ws, frames = await _ws_sub(s, gw, {**sub, "from": seqs[4]}, 2)  # Bob's own cursor
        async with ws:
            await ws.send_str(_json.encode({"op": "ack", "id": "feed", "seq": seqs[5]}).decode())
            await ws.send_str(_json.encode({"op": "unsubscribe", "id": "feed"}).decode())
            await read_until(ws, _unsubscribed)
    async with aiohttp.ClientSession(headers=auth(ALICE)) as s:
        ws, frames = await _ws_sub(s, gw, {**sub, "from": "cursor"}, 3)
        async with ws:
            assert frames[0]["cursor"] is True and frames[0]["from_seq"] == seqs[3], frames[0]
            assert [f["seq"] for f in events_of(frames, "feed")] == seqs[3:]


async def test_a_missing_cursor_is_an_error_naming_the_oldest_sequence(js: Any, gw: str) -> None:
    await publish(js, "raw.curs", [{"n": "x"}])
    first = (await js.stream_info("curs")).state.first_seq
    sub = {"op": "subscribe", "id": "gone", "stream": "curs", "client": "c-gone", "from": "cursor"}
    async with aiohttp.ClientSession(headers=auth(ALICE)) as s:
        ws, frames = await _ws_sub(s, gw, sub, 1)
        async with ws:
            err = frames[0]
            assert err["op"] == "error" and err["code"] == 410, err
            assert (
                err["first_seq"] == first
                and f"oldest sequence still available is {first}" in (err["reason"])
            )
            closed = await ws.receive(timeout=10)
            assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 4410
        url = f"{gw}/v1/sse/curs?client=c-gone&sub=gone&from=cursor"
        async with s.get(url) as r:
            body = await r.json()
            assert r.status == 410 and body["first_seq"] == first, body
        # a client without a cursor that asks for "new" or "all" is still served
        ws, frames = await _ws_sub(s, gw, {**sub, "from": "all"}, 1)
        async with ws:
            assert frames[0]["op"] == "subscribed" and frames[0]["from_seq"] == first


async def test_streaming_serves_only_a_configured_topn_subject(gw: str) -> None:
    """The gateway knows no demo: without `gateway.options.topn_subject` (the default),
    `/streaming` says so (error frame, close 4404) instead of guessing a subject."""
    async with (
        aiohttp.ClientSession(headers=auth(ALICE)) as s,
        s.ws_connect(f"{gw}/streaming") as ws,
    ):
        error = await recv_json(ws)
        assert error["op"] == "error" and error["code"] == 404, error
        assert "gateway.options.topn_subject" in error["reason"]
        closed = await ws.receive(timeout=10)
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 4404, closed


@pytest.mark.unit
def test_a_bad_webhook_allow_list_fails_at_config_load() -> None:
    from runtime.config import ConfigError

    hooks = {"allow_networks": ["127.0.0.1/32", "10.0.0.0/8", "::1/128"]}
    load(environ={}, overrides={"gateway": {"options": {"webhooks": hooks}}})
    with pytest.raises(ConfigError, match=r"allow_networks: 'intranet' is not a network"):
        load(
            environ={},
            overrides={"gateway": {"options": {"webhooks": {"allow_networks": ["intranet"]}}}},
        )
