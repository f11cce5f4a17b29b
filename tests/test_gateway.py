"""Data access tier end to end: real nats-server, real Ray, real clients of each protocol.

Clients are independent of the gateway's code: `curl` for SSE and long polling, aiohttp's
WebSocket client, an aiohttp server as webhook receiver that checks the HMAC itself. Every
check compares what a client got with what the stream holds (sequences and payloads).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import shutil
import signal
import socket
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec
import pytest
import pytest_asyncio
from aiohttp import web

from actors.access import cursors, webhooks
from actors.access.auth import Access
from actors.access.cursors import FlushPolicy, cursor_key
from actors.access.gateway import Gateway
from actors.access.protocol import (
    CLOSE_BAD_MESSAGE,
    CLOSE_FORBIDDEN,
    CLOSE_TOO_SLOW,
    CLOSE_UNAUTHORIZED,
    CLOSE_UNKNOWN_STREAM,
    Problem,
    first_seq_to_deliver,
    parse_start,
    stream_ref,
)
from cluster.deploy.gateway import gateway_spec, start_gateways, stop_gateways
from runtime.config import (
    Config,
    ConfigError,
    GatewayOptions,
    WebhookOptions,
    dumps_toml,
    gateway_options,
    load,
    validate,
)
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsServer, connect
from runtime.supervision.ray_actors import supervised_options
from runtime.waiting import await_until
from tests.support import start_on_free_port

NS = "tf-gateway"
TOKEN = "tok-all"
LIMITED = "tok-results"
H = {"Authorization": f"Bearer {TOKEN}"}
NAMED = {"yes_only": "WHERE response = 'yes'"}
OPTIONS = GatewayOptions(
    max_lag=300,
    warn_lag=100,
    warn_every_s=0.2,
    ring_size=4096,
    backfill=2048,
    socket_sndbuf=16384,
    close_timeout_s=2.0,
    cursor_flush_s=0.1,
    topn_subject="results.meetup_topn",  # what `/streaming` serves (the demo's setting)
    webhooks=WebhookOptions(
        max_attempts=3,
        backoff_base_s=0.05,
        backoff_cap_s=0.2,
        lease_s=2.0,
        timeout_s=2.0,
        allow_networks=["127.0.0.1/32"],  # the receiver is on loopback
    ),
)
STREAMS = ["meetup", "results", "deadletter", "fo", "slow", "hooks", "polls", "sse", "hist"]
CURL = shutil.which("curl")
_json = msgspec.json.Encoder()


# --------------------------------------------------------------------------- pure parts


@pytest.mark.unit
def test_access_rules() -> None:
    a = Access(["t1", "t2"], {"t2": ["results", "kv:*"]}, ["KV_tierflow_cursors"])
    a.authenticate("t1")
    for token, status in [(None, 401), ("", 401), ("nope", 401)]:
        with pytest.raises(Problem) as info:
            a.authenticate(token)
        assert info.value.status == status
    a.authorize("t2", stream_ref("results"))
    a.authorize("t2", stream_ref("kv:results"))
    with pytest.raises(Problem, match="may not read stream 'meetup'") as info:
        a.authorize("t2", stream_ref("meetup"))
    assert info.value.status == 403
    with pytest.raises(Problem, match="internal") as info:
        a.authorize("t1", stream_ref("kv:tierflow_cursors"))
    Access([]).authenticate(None)  # no tokens: auth off


@pytest.mark.unit
def test_stream_names_and_start_positions() -> None:
    assert stream_ref("kv:results") == stream_ref("KV_results")
    assert stream_ref("kv:results").js == "KV_results" and stream_ref("meetup").kv is False
    with pytest.raises(Problem) as info:
        stream_ref("a.b")
    assert info.value.status == 404
    assert [first_seq_to_deliver(parse_start(s), 5, 9) for s in ["new", "all", "last", 7, "3"]] == [
        10,
        5,
        9,
        7,
        3,
    ]
    assert first_seq_to_deliver("last", 1, 0) == 1  # empty stream: the first message to come
    for bad in [-1, "soon", True, 1.5]:
        with pytest.raises(Problem):
            parse_start(bad)
    assert FlushPolicy(0.1, 3).due(3, 0.0) and FlushPolicy(0.1, 3).due(1, 0.2)
    assert not FlushPolicy(0.1, 3).due(0, 9.0)
    assert cursor_key("a.b c", "x/y").count(".") == 1  # any ids make one valid KV key


@pytest.mark.unit
@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[gateway.options]\nmax_lagg = 100\n", r"gateway\.options: .*unknown field `max_lagg`"),
        ('[gateway.options]\nmax_lag = "lots"\n', r"gateway\.options\.max_lag: Expected `int`"),
        ('[gateway.options]\ndefault_overflow = "drop"\n', r"gateway\.options\.default_overflow"),
        ("[gateway.options]\nring_size = 100\n", r"gateway\.options: ring_size 100 must be"),
        ("[gateway.options.webhooks]\nmax_attempt = 3\n", r"webhooks: .*unknown field"),
        ('[gateway.options.webhooks]\nlease_s = "5s"\n', r"gateway\.options\.webhooks\.lease_s"),
    ],
)
def test_gateway_options_are_refused_at_load_naming_the_key(
    tmp_path: Path, toml: str, key: str
) -> None:
    """A typo or a wrong type fails `load` (tierflow up, the CLI) with the key, not later
    in a restarting gateway actor; a caller's mapping is checked the same way."""
    path = tmp_path / "tierflow.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=key):
        load(path, environ={})
    table = tomllib.loads(toml)["gateway"]["options"]
    with pytest.raises(ConfigError, match=key):
        gateway_options(table)
    with pytest.raises(ConfigError, match=key):
        gateway_spec(load(environ={}), "gateway-0", nats_url="nats://x:4222", port=1, options=table)
    env = {"TIERFLOW_GATEWAY__OPTIONS__POLL_LIMIT": "many"}
    with pytest.raises(ConfigError, match=r"gateway\.options\.poll_limit: Expected `int`"):
        load(environ=env)


@pytest.mark.unit
def test_a_valid_gateway_options_table_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "tierflow.toml"
    path.write_text(
        "[gateway.options]\n"
        "max_lag = 300\nwarn_lag = 100\nwarn_every_s = 0.5\nsocket_sndbuf = 16384\n"
        'topn_subject = "results.meetup_topn"\ninternal_streams = ["buffer"]\n'
        "[gateway.options.overflow]\n"
        'meetup = "drop_oldest"\n'
        "[gateway.options.webhooks]\n"
        'max_attempts = 3\nlease_s = 2\nallow_networks = ["127.0.0.1/32", "::1/128"]\n'
    )
    cfg = load(path, environ={})
    o = cfg.gateway.options
    assert (o.max_lag, o.warn_lag, o.warn_every_s, o.socket_sndbuf) == (300, 100, 0.5, 16384)
    assert o.topn_subject == "results.meetup_topn" and o.internal_streams == ["buffer"]
    assert o.overflow == {"meetup": "drop_oldest"}  # the table replaces the default one
    assert o.webhooks == WebhookOptions(
        max_attempts=3, lease_s=2.0, allow_networks=["127.0.0.1/32", "::1/128"]
    )
    assert o.ring_size == GatewayOptions().ring_size  # untouched keys keep their defaults
    again = tmp_path / "again.toml"
    again.write_text(dumps_toml(cfg))
    assert load(again, environ={}) == cfg
    assert validate(cfg.to_dict()) == cfg  # what a gateway actor is given
    assert gateway_options(msgspec.to_builtins(o)) == o
    # the defaults name the buckets the access tier uses; nothing names the Meetup demo
    assert GatewayOptions().cursor_bucket == cursors.BUCKET
    assert GatewayOptions().webhooks.bucket == webhooks.BUCKET
    assert GatewayOptions().topn_subject == ""


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    state: Path = tmp_path_factory.mktemp("state")
    streams = {name: {"subjects": [f"raw.{name}"]} for name in STREAMS}
    streams["results"] = {"subjects": ["results.>"]}
    streams["deadletter"] = {"subjects": ["deadletter.>"]}
    return load(
        environ={},
        overrides={
            "state_dir": str(state),
            "ray": {"namespace": NS},
            "auth": {"consumer_tokens": [TOKEN, LIMITED]},
            "streams": streams,
        },
    )


@pytest_asyncio.fixture(scope="module")
async def js(nats_server: NatsServer, cfg: Config) -> Any:
    nc = await connect(nats_server.url)
    await ensure_streams(nc, cfg)
    yield nc.jetstream()
    await nc.close()


@dataclass
class Gw:
    name: str
    handle: Any
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pid(self) -> int:
        import ray

        return ray.get(self.handle.heartbeat.remote(), timeout=30)["pid"]

    async def stats(self) -> dict[str, Any]:
        return await self.handle.stats.remote()

    async def serving(self) -> None:
        """Wait until this replica answers (after a restart, Ray brings it back)."""

        async def up() -> bool:
            async with aiohttp.ClientSession() as s, s.get(f"{self.url}/healthz") as r:
                return r.status == 200

        await await_until(up, timeout=60, what=f"{self.name} serving", swallow=True)


def _start_gateway(name: str, cfg: Config, nats_url: str) -> Gw:
    """A Gateway actor on a port chosen free (again, if another process takes it first)."""
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
                named_filters=NAMED,
                token_streams={LIMITED: ["results", "kv:results"]},
                options=OPTIONS,
            )
        )

    handle, port = start_on_free_port(name, NS, start)
    return Gw(name, handle, port)


@dataclass
class Pair:
    a: Gw
    b: Gw

    def by_instance(self, instance: str) -> Gw:
        return self.a if instance.startswith(self.a.name + ":") else self.b


@pytest.fixture(scope="module")
def gateways(ray_module: Any, nats_server: NatsServer, cfg: Config, js: Any) -> Iterator[Pair]:
    import ray

    pair = Pair(
        _start_gateway("gw-a", cfg, nats_server.url),
        _start_gateway("gw-b", cfg, nats_server.url),
    )
    yield pair
    for gw in (pair.a, pair.b):
        with contextlib.suppress(Exception):  # killed by a test and not back yet
            ray.get(gw.handle.shutdown.remote(), timeout=30)
        ray.kill(gw.handle, no_restart=True)


# --------------------------------------------------------------------------- helpers


async def publish(js: Any, subject: str, docs: list[Any]) -> list[int]:
    """Publish in order (one at a time would be slow with fsync: chunks in flight)."""
    seqs: list[int] = []
    for i in range(0, len(docs), 50):
        acks = await asyncio.gather(
            *(js.publish(subject, _json.encode(d)) for d in docs[i : i + 50])
        )
        seqs.extend(a.seq for a in acks)
    return seqs


async def last_seq(js: Any, stream: str) -> int:
    return (await js.stream_info(stream)).state.last_seq


def sse_parse(lines: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cur: dict[str, str] = {}
    for line in lines:
        if not line:
            if "data" in cur:
                out.append(
                    {
                        "event": cur.get("event", "message"),
                        "id": int(cur["id"]) if "id" in cur else None,
                        "data": msgspec.json.decode(cur["data"]),
                    }
                )
            cur = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(":")
            cur[key] = value[1:] if value.startswith(" ") else value
    return out


async def curl_sse(
    url: str,
    headers: dict[str, str],
    until: Callable[[list[dict[str, Any]]], bool],
    timeout: float = 30.0,
) -> list[dict[str, Any]]:
    """Read an SSE stream with curl until `until(events)`; every event, control ones too."""
    assert CURL, "curl is needed (apt-get install curl)"
    args = [CURL, "-sN", "--max-time", str(int(timeout))]
    for k, v in headers.items():
        args += ["-H", f"{k}: {v}"]
    proc = await asyncio.create_subprocess_exec(
        *args, url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    assert proc.stdout is not None
    lines: list[str] = []
    events: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(timeout):
            while not until(events):
                raw = await proc.stdout.readline()
                if not raw:
                    break
                lines.append(raw.decode().rstrip("\r\n"))
                if not lines[-1]:
                    events = sse_parse(lines)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    return events


async def curl_json(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    args = [CURL, "-s", "-w", "\n%{http_code}", "--max-time", "70"]
    for k, v in (headers or H).items():
        args += ["-H", f"{k}: {v}"]
    proc = await asyncio.create_subprocess_exec(
        *args, url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    out, _ = await proc.communicate()
    body, _, code = out.decode().rpartition("\n")
    return int(code), msgspec.json.decode(body) if body else None


def events_of(frames: list[dict[str, Any]], sid: str) -> list[dict[str, Any]]:
    return [
        f for f in frames if isinstance(f, dict) and f.get("op") == "event" and f.get("id") == sid
    ]


async def recv_json(ws: aiohttp.ClientWebSocketResponse, timeout: float = 10.0) -> Any:
    msg = await ws.receive(timeout=timeout)
    if msg.type != aiohttp.WSMsgType.TEXT:
        return msg
    return msgspec.json.decode(msg.data)


async def read_until(
    ws: aiohttp.ClientWebSocketResponse,
    done: Callable[[list[Any]], bool],
    timeout: float = 20.0,
) -> list[Any]:
    """Frames (dicts) until `done(frames)`; a close or error ends it (appended as is)."""
    frames: list[Any] = []
    async with asyncio.timeout(timeout):
        while not done(frames):
            frame = await recv_json(ws, timeout)
            frames.append(frame)
            if not isinstance(frame, dict):
                break
    return frames


# --------------------------------------------------------------------------- SSE, polling


@pytest.mark.skipif(CURL is None, reason="curl not installed")
async def test_sse_with_curl_gets_exactly_the_filtered_events_then_resumes(
    js: Any, gateways: Pair
) -> None:
    gw = gateways.a
    docs = [
        {"n": i, "response": "yes" if i % 3 == 0 else "no", "city": f"c{i % 5}"} for i in range(60)
    ]
    docs.append({"n": -1, "response": "yes", "city": "end"})  # sentinel: nothing after it
    seqs = await publish(js, "raw.sse", docs)
    flt = quote("SELECT n, city WHERE response = 'yes'")
    want = [
        (s, {"n": d["n"], "city": d["city"]})
        for s, d in zip(seqs, docs, strict=True)
        if d["response"] == "yes"
    ]

    def has_sentinel(evs: list[dict[str, Any]]) -> bool:
        return any(e["event"] == "message" and e["data"]["n"] == -1 for e in evs)

    got = await curl_sse(f"{gw.url}/v1/sse/sse?from={seqs[0]}&filter={flt}", H, has_sentinel)
    assert got[0]["event"] == "subscribed" and got[0]["data"]["from_seq"] == seqs[0]
    messages = [(e["id"], e["data"]) for e in got if e["event"] == "message"]
    assert messages == want

    # Last-Event-ID resumes right after that id, on the other replica too
    mid = want[9][0]
    more = await publish(js, "raw.sse", [{"n": -2, "response": "yes", "city": "x"}])
    resumed = await curl_sse(
        f"{gateways.b.url}/v1/sse/sse?filter={flt}",
        {**H, "Last-Event-ID": str(mid)},
        lambda evs: any(e["event"] == "message" and e["data"]["n"] == -2 for e in evs),
    )
    ids = [e["id"] for e in resumed if e["event"] == "message"]
    assert ids == [s for s, _ in want[10:]] + more


@pytest.mark.skipif(CURL is None, reason="curl not installed")
async def test_long_polling_with_curl_loses_nothing_between_polls(js: Any, gateways: Pair) -> None:
    gw = gateways.b
    start = await last_seq(js, "polls")
    docs = [{"n": i, "response": "yes" if i % 2 else "no"} for i in range(150)]
    docs.append({"n": -1, "response": "yes"})

    async def producer() -> list[int]:
        seqs: list[int] = []
        for i in range(0, len(docs), 15):  # bursts while the client polls
            seqs += await publish(js, "raw.polls", docs[i : i + 15])
            await asyncio.sleep(0.05)
        return seqs

    prod = asyncio.create_task(producer())
    got: list[dict[str, Any]] = []
    after, polls = start, 0
    async with asyncio.timeout(60):
        while not any(e["data"]["n"] == -1 for e in got):
            code, body = await curl_json(
                f"{gw.url}/v1/poll/polls?after={after}&timeout=2&filter=yes_only&limit=7"
            )
            assert code == 200, body
            assert body["next"] >= after
            got += body["events"]
            after, polls = body["next"], polls + 1
    seqs = await prod
    want = [s for s, d in zip(seqs, docs, strict=True) if d["response"] == "yes"]
    assert [e["seq"] for e in got] == want
    assert [e["data"] for e in got] == [d for d in docs if d["response"] == "yes"]
    assert polls > 5  # the limit forced many polls: each one resumed where the last ended

    # nothing new: the poll waits its timeout and hands back the same position
    code, body = await curl_json(f"{gw.url}/v1/poll/polls?after={after}&timeout=0.3")
    assert code == 200 and body == {"events": [], "next": after}


async def test_positions_older_than_the_ring_are_read_from_the_stream(
    js: Any, gateways: Pair
) -> None:
    """Ring 4096: once the feed has moved on, old positions come from a history read (a
    poll) or a private catch-up reader (a subscription) that hands over to the ring."""
    gw = gateways.b
    seqs = await publish(js, "raw.hist", [{"n": i} for i in range(10)])
    async with aiohttp.ClientSession(headers=H) as s:
        async with s.get(f"{gw.url}/v1/poll/hist?after={seqs[-1]}&timeout=0") as r:
            assert (await r.json())["events"] == []  # the feed now runs from about seq 1
        seqs += await publish(js, "raw.hist", [{"n": i} for i in range(10, 4600)])

        async def moved_on() -> bool:
            feed = (await gw.stats())["feeds"]["hist"]
            return feed["position"] > seqs[-1] and feed["ring_base"] > seqs[10]

        await await_until(moved_on, timeout=30, what="ring moved past the start")
        async with s.get(f"{gw.url}/v1/streams/hist?since={seqs[2]}&limit=5") as r:
            body = await r.json()
        assert [e["seq"] for e in body["events"]] == seqs[3:8] and body["next"] == seqs[7]
        flt = quote("WHERE n IN (1, 4000)")
        async with s.get(f"{gw.url}/v1/streams/hist?since=0&filter={flt}&limit=1") as r:
            body = await r.json()
        assert [e["data"]["n"] for e in body["events"]] == [1] and body["next"] >= seqs[1]
        found: list[int] = []
        async with asyncio.timeout(30):
            while not found:  # `next` skips what was examined: the next match comes next
                since = body["next"]
                async with s.get(f"{gw.url}/v1/streams/hist?since={since}&filter={flt}") as r:
                    body = await r.json()
                found = [e["data"]["n"] for e in body["events"]]
        assert found == [4000]
        async with s.ws_connect(f"{gw.url}/v1/ws") as ws:
            await ws.send_str('{"op":"subscribe","id":"h","stream":"hist","from":"all"}')
            frames = await read_until(
                ws, lambda fr: len(events_of(fr, "h")) >= len(seqs), timeout=60
            )
    assert [f["seq"] for f in events_of(frames, "h")] == seqs  # history, then the ring
    assert (await gw.stats())["feeds"]["hist"]["history_readers"] >= 2


async def test_latest_and_since(js: Any, gateways: Pair) -> None:
    seqs = await publish(
        js, "results.meetup_members", [{"key": "all", "distinct": i} for i in range(3)]
    )
    other = await publish(js, "results.meetup_responses", [{"key": "all", "yes": 1}])
    async with aiohttp.ClientSession(headers=H) as s:
        url = gateways.a.url
        async with s.get(f"{url}/v1/streams/results/latest") as r:
            assert r.status == 200 and (await r.json())["seq"] == other[0]
        async with s.get(f"{url}/v1/streams/results/latest?subject=results.meetup_members") as r:
            body = await r.json()
            assert body["seq"] == seqs[-1] and body["data"] == {"key": "all", "distinct": 2}
        async with s.get(f"{url}/v1/streams/results?since={seqs[0]}") as r:
            body = await r.json()
            assert [e["seq"] for e in body["events"]] == [*seqs[1:], *other]
            assert body["next"] == other[0]
        async with s.get(f"{url}/v1/streams/results/latest?since={seqs[0]}&limit=1") as r:
            assert [e["seq"] for e in (await r.json())["events"]] == [seqs[1]]


# --------------------------------------------------------------------------- WebSocket


async def test_ws_subscriptions_get_exactly_their_filtered_events(js: Any, gateways: Pair) -> None:
    start = await last_seq(js, "meetup") + 1
    docs = [{"n": i, "response": ["yes", "no", "maybe"][i % 3], "guests": i % 4} for i in range(40)]
    docs.append({"n": -1, "response": "yes", "guests": 9})
    async with aiohttp.ClientSession(headers=H) as s, s.ws_connect(f"{gateways.a.url}/v1/ws") as ws:
        for sid, flt in [("named", "yes_only"), ("sql", "SELECT n WHERE guests >= 2 OR n = -1")]:
            await ws.send_str(
                _json.encode(
                    {"op": "subscribe", "id": sid, "stream": "meetup", "filter": flt, "from": start}
                ).decode()
            )
            hello = await recv_json(ws)
            assert hello["op"] == "subscribed" and hello["from_seq"] == start, hello
        seqs = await publish(js, "raw.meetup", docs)

        def both_done(frames: list[Any]) -> bool:
            return all(
                any(f.get("data", {}).get("n") == -1 for f in events_of(frames, sid))
                for sid in ("named", "sql")
            )

        frames = await read_until(ws, both_done)
        named = [(f["seq"], f["data"]) for f in events_of(frames, "named")]
        assert named == [(s, d) for s, d in zip(seqs, docs, strict=True) if d["response"] == "yes"]
        sql = [(f["seq"], f["data"]) for f in events_of(frames, "sql")]
        assert sql == [
            (s, {"n": d["n"]})
            for s, d in zip(seqs, docs, strict=True)
            if d["guests"] >= 2 or d["n"] == -1
        ]
        assert all(f["subject"] == "raw.meetup" for f in events_of(frames, "sql"))

        await ws.send_str('{"op":"unsubscribe","id":"named"}')
        bye = await read_until(ws, lambda fr: any(f.get("op") == "unsubscribed" for f in fr))
        assert bye[-1] == {"op": "unsubscribed", "id": "named"}


async def test_cursor_resume_after_a_clean_disconnect_repeats_nothing(
    js: Any, gateways: Pair
) -> None:
    start = await last_seq(js, "meetup") + 1
    seqs = await publish(js, "raw.meetup", [{"n": i} for i in range(30)])
    sub = {
        "op": "subscribe",
        "id": "feed",
        "stream": "meetup",
        "from": start,
        "client": "c-clean",
        "ack": True,
    }
    async with aiohttp.ClientSession(headers=H) as s:
        async with s.ws_connect(f"{gateways.a.url}/v1/ws") as ws:
            await ws.send_str(_json.encode(sub).decode())
            frames = await read_until(ws, lambda fr: len(events_of(fr, "feed")) >= 12)
            got = [f["seq"] for f in events_of(frames, "feed")]
            await ws.send_str(_json.encode({"op": "ack", "id": "feed", "seq": got[11]}).decode())
            await asyncio.sleep(0)  # the ack goes out before the close
        resume = {
            "op": "subscribe",
            "id": "feed",
            "client": "c-clean",
            "from": "cursor",
            "ack": True,
        }
        async with s.ws_connect(f"{gateways.b.url}/v1/ws") as ws:
            await ws.send_str(_json.encode(resume).decode())
            frames = await read_until(ws, lambda fr: any(f.get("seq") == seqs[-1] for f in fr))
    hello = frames[0]
    assert hello["op"] == "subscribed" and hello["cursor"] is True and hello["stream"] == "meetup"
    assert hello["from_seq"] == got[11] + 1
    assert [f["seq"] for f in events_of(frames, "feed")] == seqs[12:]


async def test_twenty_clients_fail_over_to_another_replica_without_gap_or_repeat(
    js: Any, gateways: Pair
) -> None:
    """SIGKILL replica A under 20 streaming clients (plus 4 resuming from server cursors):
    each resumes on B from its own last seq with no gap and no duplicate."""
    start = await last_seq(js, "fo") + 1
    published: list[int] = []
    kill_now, all_on_b, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def producer() -> None:
        """Publishes until every client is on B, then a last stretch, then stops."""
        for i in range(0, 30_000, 10):  # bounded; ends long before in practice
            published.extend(await publish(js, "raw.fo", [{"n": n} for n in range(i, i + 10)]))
            await asyncio.sleep(0.04)
            if all_on_b.is_set():
                break
        published.extend(await publish(js, "raw.fo", [{"n": -n} for n in range(300)]))
        finished.set()

    @dataclass
    class Client:
        sid: str
        cursor: bool = False
        seqs: list[int] = field(default_factory=list)
        before_kill: int = 0
        last_seen: list[int] = field(default_factory=list)  # at each disconnect
        closes: list[Any] = field(default_factory=list)

    def caught_up(c: Client) -> bool:
        return finished.is_set() and bool(c.seqs) and c.seqs[-1] == published[-1]

    async def run_client(c: Client) -> None:
        url = f"{gateways.a.url}/v1/ws"
        first = True
        for _ in range(10):  # bounded reconnects
            msg: dict[str, Any] = {"op": "subscribe", "id": c.sid, "stream": "fo"}
            if c.cursor:
                msg.update(client=f"cl-{c.sid}", ack=True, **{"from": start if first else "cursor"})
            elif first:
                msg["from"] = start
            else:
                msg["after"] = c.seqs[-1] if c.seqs else start - 1
            try:
                async with aiohttp.ClientSession(headers=H) as s, s.ws_connect(url) as ws:
                    await ws.send_str(_json.encode(msg).decode())
                    deadline = time.monotonic() + 240  # bounded; the test's own waits end first
                    while time.monotonic() < deadline:
                        try:
                            m = await ws.receive(timeout=0.5)
                        except TimeoutError:
                            # the last event can arrive before the producer has its acks
                            # (and sets `finished`): look again while no frame comes
                            if caught_up(c):
                                return
                            continue
                        if m.type != aiohttp.WSMsgType.TEXT:
                            break
                        frame = msgspec.json.decode(m.data)
                        if frame["op"] != "event":
                            continue
                        c.seqs.append(frame["seq"])
                        if c.cursor:
                            ack = {"op": "ack", "id": c.sid, "seq": frame["seq"]}
                            await ws.send_str(_json.encode(ack).decode())
                        if caught_up(c):
                            return
                        if len(c.seqs) >= 100 and all(len(x.seqs) >= 100 for x in clients):
                            kill_now.set()
                    c.closes.append(ws.close_code)
            except (aiohttp.ClientError, ConnectionError) as err:
                c.closes.append(repr(err))  # A died under us
            c.last_seen.append(c.seqs[-1] if c.seqs else start - 1)
            if first:
                c.before_kill = c.last_seen[-1]
            url, first = f"{gateways.b.url}/v1/ws", False
        raise AssertionError(f"{c.sid} kept losing its connection: {c.closes}")

    clients = [Client(f"c{i}") for i in range(20)] + [
        Client(f"k{i}", cursor=True) for i in range(4)
    ]
    prod = asyncio.create_task(producer())
    tasks = [asyncio.create_task(run_client(c)) for c in clients]
    await asyncio.wait_for(kill_now.wait(), 60)
    pid = gateways.a.pid()
    os.kill(pid, signal.SIGKILL)

    async def everyone_on_b() -> dict[str, Any] | None:
        feed = (await gateways.b.stats())["feeds"].get("fo", {})
        return feed if feed.get("subscribers") == len(clients) else None

    feed = await await_until(everyone_on_b, timeout=60, what="every client resumed on B")
    all_on_b.set()
    await asyncio.wait_for(prod, 120)
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    expected = list(range(start, published[-1] + 1))
    assert published == expected  # the stream holds exactly these
    for c in clients:
        assert c.before_kill < expected[-1] and c.last_seen, c.sid  # it did fail over
        if not c.cursor:
            assert c.seqs == expected, f"{c.sid}: gap or repeat after failover ({c.closes})"
        else:  # server cursor: at-least-once; repeats only of what came before a reconnect
            assert sorted(set(c.seqs)) == expected, f"{c.sid}: gap after failover"
            repeated = [q for q, n in Counter(c.seqs).items() if n > 1]
            assert all(q <= max(c.last_seen) for q in repeated), c.sid
            print(f"{c.sid}: {len(repeated)} repeated after resuming from the server cursor")
    assert feed["consumers"] == 1 and feed["history_open"] == 0, feed  # n:1 on replica B
    await gateways.a.serving()  # Ray restarted A: it serves again by itself
    assert gateways.a.pid() != pid


async def test_a_slow_client_is_warned_then_cut_off_while_a_normal_one_gets_everything(
    js: Any, gateways: Pair
) -> None:
    gw = gateways.b
    start = await last_seq(js, "slow") + 1
    before = (await gw.stats())["slow_disconnects"]
    pad = "x" * 2000
    docs = [{"n": i, "pad": pad} for i in range(900)]
    sub = {"op": "subscribe", "id": "s", "stream": "slow", "from": start}
    # small receive buffers (no autotuning), so "not reading" shows within a few hundred KB
    connector = aiohttp.TCPConnector(socket_factory=_small_rcvbuf)
    async with (
        aiohttp.ClientSession(headers=H, connector=connector) as s,
        aiohttp.ClientSession(headers=H) as normal,  # the kernel's buffers, autotuned
    ):
        slow = await s.ws_connect(f"{gw.url}/v1/ws")
        fast = await normal.ws_connect(f"{gw.url}/v1/ws")
        dropper = await s.ws_connect(f"{gw.url}/v1/ws")
        for ws in (slow, fast):
            await ws.send_str(_json.encode(sub).decode())
        await dropper.send_str(_json.encode({**sub, "policy": "drop_oldest"}).decode())
        fast_frames: list[Any] = []

        async def read_fast() -> None:
            async with asyncio.timeout(120):
                while len(events_of(fast_frames, "s")) < len(docs):
                    fast_frames.append(frame := await recv_json(fast, 120))
                    if not isinstance(frame, dict):
                        return

        fast_task = asyncio.create_task(read_fast())
        seqs: list[int] = []
        for i in range(0, len(docs), 50):
            # the normal client keeps pace with the stream; on a loaded machine this test's
            # own event loop could otherwise starve its reader past the lag bound
            seqs += await publish(js, "raw.slow", docs[i : i + 50])
            want = len(seqs)
            await await_until(
                lambda want=want: len(events_of(fast_frames, "s")) >= want or fast_task.done(),
                timeout=60,
                what="the normal client keeping pace",
            )
        # neither slow client reads until the gateway has acted on both
        await await_until(
            lambda: _stat_above(gw, "slow_disconnects", before),
            timeout=60,
            what="slow client cut off",
        )
        await await_until(lambda: _stat_above(gw, "dropped", 0), timeout=60, what="drops")
        frames = await read_until(slow, lambda fr: False, timeout=30)
        await fast_task
        dropped_frames = await read_until(
            dropper, lambda fr: any(f.get("seq") == seqs[-1] for f in fr), timeout=30
        )
        for ws in (slow, fast, dropper):
            await ws.close()
    lags = [f for f in frames if isinstance(f, dict) and f.get("op") == "lag"]
    assert lags and all(f["policy"] == "disconnect" and f["behind"] >= 100 for f in lags)
    closing = frames[-1]
    assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == CLOSE_TOO_SLOW
    assert "too slow" in closing.extra
    got = [f["seq"] for f in events_of(frames, "s")]
    assert got == seqs[: len(got)] and len(got) < len(seqs)  # in order until cut off
    # the normal client was never held back: everything, in order, never warned or cut off
    assert [f["seq"] for f in events_of(fast_frames, "s")] == seqs
    assert all(isinstance(f, dict) for f in fast_frames)  # no close frame among them
    assert not [f for f in fast_frames if f.get("op") in ("lag", "dropped")]
    # drop_oldest: skipped ahead, told how many, and everything else arrived in order
    received = [f["seq"] for f in events_of(dropped_frames, "s")]
    drops = [f for f in dropped_frames if f.get("op") == "dropped"]
    assert drops and received == sorted(set(received)) and received[-1] == seqs[-1]
    skipped = set(seqs) - set(received)
    assert len(skipped) == sum(d["count"] for d in drops)
    assert skipped == {q for d in drops for q in range(d["from_seq"], d["to_seq"] + 1)}


async def test_a_slow_sse_client_is_warned_then_cut_off(js: Any, gateways: Pair) -> None:
    gw = gateways.a
    await gw.serving()
    start = await last_seq(js, "slow") + 1
    before = (await gw.stats())["slow_disconnects"]
    connector = aiohttp.TCPConnector(socket_factory=_small_rcvbuf)
    docs = [{"n": i, "pad": "y" * 2000} for i in range(900)]
    async with (
        aiohttp.ClientSession(headers=H, connector=connector) as s,
        s.get(f"{gw.url}/v1/sse/slow?from={start}") as r,
    ):
        assert r.status == 200
        seqs = await publish(js, "raw.slow", docs)
        await await_until(
            lambda: _stat_above(gw, "slow_disconnects", before), timeout=60, what="cut off"
        )
        raw = await asyncio.wait_for(r.content.read(), 30)  # everything, to the end
    events = sse_parse(raw.decode().split("\n"))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "subscribed" and kinds[-1] == "error" and "lag" in kinds
    assert events[-1]["data"]["code"] == CLOSE_TOO_SLOW
    lag = next(e for e in events if e["event"] == "lag")["data"]
    assert lag["behind"] >= 100 and lag["policy"] == "disconnect"
    got = [e["id"] for e in events if e["event"] == "message"]
    assert got == seqs[: len(got)] and len(got) < len(seqs)


def _small_rcvbuf(addr_info: Any) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    return sock


async def _stat_above(gw: Gw, key: str, value: int) -> bool:
    return (await gw.stats())[key] > value


# --------------------------------------------------------------------------- cursors


async def test_cursor_store_batches_writes_and_reads_them_back(js: Any) -> None:
    from actors.access.cursors import CursorRecord, CursorStore

    store = await CursorStore.open(js, bucket="test_cursors", policy=FlushPolicy(60.0, 3))
    rec = CursorRecord(client="a.b/c", sub="s 1", stream="meetup", seq=5, filter="WHERE x = 1")
    store.update(rec)
    store.update(CursorRecord(client="a.b/c", sub="s 1", stream="meetup", seq=7))
    assert store.pending == 1 and (await store.get("a.b/c", "s 1")).seq == 7  # not written yet
    other = await CursorStore.open(js, bucket="test_cursors")  # another replica
    assert await other.get("a.b/c", "s 1") is None
    assert await store.flush() == 1 and store.pending == 0
    assert (await other.get("a.b/c", "s 1")).seq == 7
    assert store.counters["writes"] == 1 and store.counters["updates"] == 2
    stop = asyncio.Event()
    runner = asyncio.create_task(store.run(stop))
    for i in range(3):  # max_pending reached: flushed without waiting for the interval
        store.update(CursorRecord(client=f"c{i}", sub="s", stream="meetup", seq=i))
    await await_until(lambda: store.pending == 0, timeout=10, what="flush on max_pending")
    stop.set()
    await runner
    assert (await other.get("c2", "s")).seq == 2
    await store.delete("c2", "s")
    assert await other.get("c2", "s") is None


async def test_cursor_bucket_takes_three_replicas_on_a_cluster(tmp_path: Path) -> None:
    from actors.access.cursors import open_bucket
    from runtime.nats.server import NatsCluster

    with NatsCluster(tmp_path, nodes=3).start() as cluster:
        nc = await connect(cluster.url)
        try:
            kv = await open_bucket(nc.jetstream(), "cursors_r3")
            info = await nc.jetstream().stream_info("KV_cursors_r3")
            assert info.config.num_replicas == 3
            await kv.put("k", b"v")
        finally:
            await nc.close()


# --------------------------------------------------------------------------- errors


async def test_bad_requests_get_clear_errors_and_the_gateway_stays_up(gateways: Pair) -> None:
    gw = gateways.a
    await gw.serving()
    async with aiohttp.ClientSession() as s:
        cases = [
            ("/v1/poll/meetup?after=0&timeout=0", {}, 401, "missing token"),
            ("/v1/poll/meetup?after=0&timeout=0", {"Authorization": "Bearer nope"}, 401, "invalid"),
            (
                "/v1/poll/meetup?after=0&timeout=0",
                {"Authorization": f"Bearer {LIMITED}"},
                403,
                "may not read",
            ),
            ("/v1/poll/kv:tierflow_cursors?after=0&timeout=0", H, 403, "internal"),
            ("/v1/poll/nosuch?after=0&timeout=0", H, 404, "unknown stream"),
            ("/v1/poll/meetup?after=x", H, 400, "after must be an integer"),
            (f"/v1/sse/meetup?filter={quote('SELECT a WHERE b ~ 1')}", H, 400, "bad filter"),
            ("/v1/kv/nosuch", H, 404, "unknown stream"),
        ]
        for path, headers, status, words in cases:
            async with s.get(gw.url + path, headers=headers) as r:
                body = await r.json()
                assert r.status == status and words in body["error"], (path, body)
                if status == 401:
                    assert r.headers["WWW-Authenticate"] == "Bearer"
        async with s.get(
            f"{gw.url}/v1/poll/meetup?filter={quote('SELECT a WHERE')}", headers=H
        ) as r:
            body = await r.json()
            assert r.status == 400 and (body["line"], body["column"]) == (1, 14)

        async def ws_case(url: str, frames: list[str | bytes]) -> list[Any]:
            async with s.ws_connect(url) as ws:
                for f in frames:
                    await (ws.send_bytes(f) if isinstance(f, bytes) else ws.send_str(f))
                return await read_until(ws, lambda fr: False, timeout=10)

        ws_url = f"{gw.url}/v1/ws"
        out = await ws_case(ws_url, [])
        assert out[0]["code"] == 401 and out[-1].data == CLOSE_UNAUTHORIZED
        out = await ws_case(f"{ws_url}?token=nope", [])
        assert out[0]["reason"] == "invalid token" and out[-1].data == CLOSE_UNAUTHORIZED
        for frame in [
            "not json",
            '{"op":"dance","id":"x"}',
            '{"op":"subscribe"}',
            '{"op":"subscribe","id":5}',
            "[1]",
            b"\x00",
        ]:
            out = await ws_case(f"{ws_url}?token={TOKEN}", [frame])
            assert out[0]["op"] == "error" and out[0]["code"] == 400, (frame, out)
            assert out[-1].data == CLOSE_BAD_MESSAGE, frame
        out = await ws_case(
            f"{ws_url}?token={LIMITED}", ['{"op":"subscribe","id":"m","stream":"meetup"}']
        )
        assert out[0] == {
            "op": "error",
            "id": "m",
            "code": 403,
            "reason": "this token may not read stream 'meetup'",
        }
        assert out[-1].data == CLOSE_FORBIDDEN
        out = await ws_case(
            f"{ws_url}?token={TOKEN}", ['{"op":"subscribe","id":"u","stream":"nosuch"}']
        )
        assert out[0]["code"] == 404 and out[-1].data == CLOSE_UNKNOWN_STREAM
        bad = _json.encode(
            {"op": "subscribe", "id": "f", "stream": "meetup", "filter": "SELECT a\nWHERE b = = 1"}
        ).decode()
        out = await ws_case(f"{ws_url}?token={TOKEN}", [bad])
        assert out[0]["code"] == 400 and (out[0]["line"], out[0]["column"]) == (2, 11)
        assert out[-1].data == CLOSE_BAD_MESSAGE
        # with a live subscription, a refused one is an error frame and the connection goes on
        async with s.ws_connect(f"{ws_url}?token={TOKEN}&stream=meetup&id=live") as ws:
            assert (await recv_json(ws))["op"] == "subscribed"
            await ws.send_str('{"op":"subscribe","id":"u","stream":"nosuch"}')
            err = await recv_json(ws)
            assert err["id"] == "u" and err["code"] == 404
            await ws.send_str('{"op":"ack","id":"live","seq":1}')
            err = await recv_json(ws)
            assert err["code"] == 400 and "ack" in err["reason"]
            await ws.send_str('{"op":"slow_down","id":"live","max_rate":5}')
            await ws.send_str('{"op":"unsubscribe","id":"live"}')
            assert await recv_json(ws) == {"op": "unsubscribed", "id": "live"}
        async with s.get(f"{gw.url}/healthz") as r:
            assert r.status == 200
    stats = await gw.stats()
    assert stats["unauthorized"] >= 4 and stats["malformed"] >= 6 and stats["not_found"] >= 3


# --------------------------------------------------------------------------- data sync


async def test_kv_snapshot_then_deltas_over_the_websocket(js: Any, gateways: Pair) -> None:
    from nats.js.api import KeyValueConfig

    kv = await js.create_key_value(KeyValueConfig(bucket="results", history=1))
    await kv.put(
        "meetup_topn.all", _json.encode({"key": "all", "top": [{"item": "Python", "count": 3}]})
    )
    await kv.put("meetup_members.all", _json.encode({"key": "all", "distinct": 10}))
    await kv.put("gone.all", b'{"key": "all"}')
    await kv.delete("gone.all")
    async with aiohttp.ClientSession(headers=H) as s:
        async with s.get(f"{gateways.b.url}/v1/kv/results") as r:
            snap = await r.json()
        entries = {e["key"]: e["value"] for e in snap["entries"]}
        assert entries == {
            "meetup_topn.all": {"key": "all", "top": [{"item": "Python", "count": 3}]},
            "meetup_members.all": {"key": "all", "distinct": 10},
        }
        assert snap["revision"] == (await js.stream_info("KV_results")).state.last_seq
        async with s.ws_connect(f"{gateways.b.url}/v1/ws") as ws:
            await ws.send_str(
                _json.encode(
                    {
                        "op": "subscribe",
                        "id": "kv",
                        "stream": snap["stream"],
                        "after": snap["revision"],
                    }
                ).decode()
            )
            assert (await recv_json(ws))["from_seq"] == snap["revision"] + 1
            await kv.put("meetup_members.all", _json.encode({"key": "all", "distinct": 11}))
            await kv.delete("meetup_topn.all")
            frames = await read_until(ws, lambda fr: len(events_of(fr, "kv")) >= 2)
    deltas = [f["data"] for f in events_of(frames, "kv")]
    assert [(d["key"], d["op"]) for d in deltas] == [
        ("meetup_members.all", "put"),
        ("meetup_topn.all", "del"),
    ]
    assert deltas[0]["value"] == {"key": "all", "distinct": 11}
    assert deltas[0]["revision"] > snap["revision"]


async def test_streaming_endpoint_sends_the_top_list_on_every_change(
    js: Any, gateways: Pair
) -> None:
    top1 = [{"item": "Python", "count": 5, "error": 0}]
    top2 = [{"item": "Go", "count": 7, "error": 0}, *top1]
    await publish(js, "results.meetup_topn", [{"key": "all", "top": top1, "events": 5}])
    async with (
        aiohttp.ClientSession() as s,
        s.ws_connect(f"{gateways.a.url}/streaming?token={TOKEN}") as ws,
    ):
        assert await recv_json(ws) == top1  # the current list at once
        await publish(
            js, "results.meetup_topn", [{"key": "all", "top": top1, "events": 6}]
        )  # same list
        await publish(js, "results.meetup_members", [{"key": "all", "distinct": 3}])  # other query
        await publish(js, "results.meetup_topn", [{"key": "all", "top": top2, "events": 12}])
        assert await recv_json(ws) == top2  # nothing in between: unchanged and other subjects


# --------------------------------------------------------------------------- webhooks


@dataclass
class Receiver:
    """A webhook receiver that checks signatures itself; `/flaky` fails each delivery's first
    two attempts, `/down` always fails."""

    secrets: dict[str, str] = field(default_factory=dict)
    got: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    bad_signatures: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        kind = request.match_info["kind"]
        body = await request.read()
        doc = msgspec.json.decode(body)
        secret = self.secrets[doc["webhook"]]
        expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, request.headers["X-Tierflow-Signature"]):
            self.bad_signatures += 1
            return web.Response(status=401)
        delivery = request.headers["X-Tierflow-Delivery"]
        self.attempts[delivery] = self.attempts.get(delivery, 0) + 1
        if kind == "down" or (kind == "flaky" and self.attempts[delivery] <= 2):
            return web.Response(status=503)
        self.got.setdefault(kind, []).append(
            {**doc, "delivery": delivery, "attempt": int(request.headers["X-Tierflow-Attempt"])}
        )
        return web.Response(status=204)


async def test_webhooks_signed_retried_dead_lettered_and_surviving_a_restart(
    js: Any, gateways: Pair
) -> None:
    rx = Receiver()
    app = web.Application()
    app.router.add_post("/{kind}", rx.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    await gateways.a.serving()
    hooks: dict[str, dict[str, Any]] = {}
    try:
        async with aiohttp.ClientSession(headers=H) as s:
            for kind, flt, secret in [
                ("ok", "SELECT n WHERE kind = 'a'", "s3cret"),
                ("flaky", "", None),
                ("down", "WHERE kind = 'b'", "x"),
            ]:
                body = {"url": f"{base}/{kind}", "stream": "hooks", "filter": flt, "from": "new"}
                if secret:
                    body["secret"] = secret
                async with s.post(f"{gateways.a.url}/v1/webhooks", json=body) as r:
                    reg = await r.json()
                    assert r.status == 201, reg
                hooks[kind] = reg
                rx.secrets[reg["id"]] = reg["secret"]
            assert len(hooks["flaky"]["secret"]) >= 32  # generated when not given
            async with s.post(
                f"{gateways.a.url}/v1/webhooks", json={"url": "ftp://x", "stream": "hooks"}
            ) as r:
                assert r.status == 400 and "http" in (await r.json())["error"]
            async with s.post(
                f"{gateways.a.url}/v1/webhooks",
                json={"url": base, "stream": "hooks", "filter": "WHERE"},
            ) as r:
                assert r.status == 400 and (await r.json())["column"] == 6
            async with s.get(f"{gateways.b.url}/v1/webhooks") as r:  # the other replica knows
                listed = (await r.json())["webhooks"]
            assert {h["id"] for h in listed} >= {h["id"] for h in hooks.values()}
            assert all("secret" not in h for h in listed)

        docs = [{"n": i, "kind": "a" if i % 2 == 0 else "b"} for i in range(10)]
        seqs = await publish(js, "raw.hooks", docs)
        ids = {k: h["id"] for k, h in hooks.items()}
        await await_until(
            lambda: len(rx.got.get("ok", [])) >= 5 and len(rx.got.get("flaky", [])) >= 10,
            timeout=60,
            what="deliveries",
        )
        ok = rx.got["ok"]
        assert [(d["seq"], d["data"]) for d in ok] == [
            (q, {"n": d["n"]}) for q, d in zip(seqs, docs, strict=True) if d["kind"] == "a"
        ]
        assert [d["delivery"] for d in ok] == [f"{ids['ok']}:{d['seq']}" for d in ok]
        assert rx.bad_signatures == 0
        flaky = rx.got["flaky"]
        assert [d["seq"] for d in flaky] == seqs and all(d["attempt"] == 3 for d in flaky)

        dead = await _dead_letters(js, ids["down"], 5)
        assert [d["seq"] for d in dead] == [
            q for q, d in zip(seqs, docs, strict=True) if d["kind"] == "b"
        ]
        assert all(d["attempts"] == 3 and d["error"] == "HTTP 503" for d in dead)

        # kill the replica delivering `ok`: the registration and its position survive
        async def hook_status() -> dict[str, Any] | None:
            url = f"{gateways.b.url}/v1/webhooks/{ids['ok']}"
            async with aiohttp.ClientSession(headers=H) as s, s.get(url) as r:
                status = await r.json()
            return status if status["delivered_seq"] == seqs[-1] else None

        status = await await_until(hook_status, timeout=30, what="webhook position stored")
        assert "secret" not in status and status["owner"]
        holder = gateways.by_instance(status["owner"])
        os.kill(holder.pid(), signal.SIGKILL)
        more = await publish(js, "raw.hooks", [{"n": 100 + i, "kind": "a"} for i in range(4)])
        await await_until(
            lambda: {d["seq"] for d in rx.got["ok"]} >= set(more), timeout=60, what="after kill"
        )
        delivered = [d["seq"] for d in rx.got["ok"]]
        assert (
            sorted(set(delivered))
            == [q for q, d in zip(seqs, docs, strict=True) if d["kind"] == "a"] + more
        )
        print(f"webhook repeats after the failover: {len(delivered) - len(set(delivered))}")
        await holder.serving()
        async with aiohttp.ClientSession(headers=H) as s:
            for h in hooks.values():
                async with s.delete(f"{holder.url}/v1/webhooks/{h['id']}") as r:
                    assert r.status == 204
            async with s.get(f"{holder.url}/v1/webhooks/{ids['ok']}") as r:
                assert r.status == 404
    finally:
        await runner.cleanup()


async def _dead_letters(js: Any, webhook: str, n: int) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        sub = await js.pull_subscribe("deadletter.webhooks", stream="deadletter")
        try:
            msgs = await sub.fetch(100, timeout=1)
        except TimeoutError:
            msgs = []
        finally:
            await sub.unsubscribe()
        found = [msgspec.json.decode(m.data) for m in msgs]
        return [d for d in found if d["webhook"] == webhook]

    return await await_until(
        lambda: _at_least(read(), n), timeout=60, what="dead letters", swallow=True
    )


async def _at_least(coro: Any, n: int) -> Any:
    found = await coro
    return found if len(found) >= n else None


# --------------------------------------------------------------------------- replicas


def test_replicas_share_one_port(
    ray_module: Any, nats_server: NatsServer, cfg: Config, js: Any
) -> None:
    import ray

    names = start_gateways(cfg, nats_server.url, replicas=2, port=0, options=OPTIONS)
    try:
        ports = {ray.get(ray.get_actor(n, namespace=NS).endpoints.remote())["port"] for n in names}
        assert len(ports) == 1
        port = ports.pop()

        async def hit() -> set[str]:
            seen: set[str] = set()
            for _ in range(40):  # new connections: the kernel spreads them over the replicas
                async with (
                    aiohttp.ClientSession() as s,
                    s.get(f"http://127.0.0.1:{port}/healthz") as r,
                ):
                    seen.add((await r.json())["name"])
            return seen

        assert asyncio.run(hit()) == set(names)
    finally:
        stop_gateways(cfg, names)


# --------------------------------------------------------------------------- NATS restart (last)


async def test_streaming_survives_a_nats_restart(
    js: Any, gateways: Pair, nats_server: NatsServer
) -> None:
    gw = gateways.b
    start = await last_seq(js, "meetup") + 1
    sub = {"op": "subscribe", "id": "r", "stream": "meetup", "from": start}
    async with aiohttp.ClientSession(headers=H) as s, s.ws_connect(f"{gw.url}/v1/ws") as ws:
        await ws.send_str(_json.encode(sub).decode())
        first = await publish(js, "raw.meetup", [{"n": i} for i in range(20)])
        frames = await read_until(ws, lambda fr: len(events_of(fr, "r")) >= 20)
        await asyncio.to_thread(nats_server.restart)
        await await_until(
            lambda: js.stream_info("meetup"), timeout=30, what="JetStream back", swallow=True
        )
        then = await publish(js, "raw.meetup", [{"n": i} for i in range(20, 40)])
        frames += await read_until(
            ws, lambda fr: any(f.get("seq") == then[-1] for f in fr), timeout=60
        )
    assert [f["seq"] for f in events_of(frames, "r")] == first + then
    assert (await gw.stats())["feeds"]["meetup"]["reopens"] >= 1
