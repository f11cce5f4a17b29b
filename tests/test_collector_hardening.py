"""The collection tier's answers under faults (partial writes, a fenced logger, retried ack
tokens), its size limit and its system streams: a real collector tier on Ray, real LevelDB
replicas (k=1), real nats-server.

Every answer that names ids lets the producer resend them; every refusal names a reason
and leaves the streams as they were.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from actors.collection.ingest import HEADER_RESERVE, wire_overhead
from cluster.pipeline import CollectionTier, start_collection_tier
from cluster.verify import judge, stream_ids
from runtime.nats.server import NatsServer, connect
from runtime.waiting import await_until
from tests.support import tier_config

NS = "tf-hardening"
STREAMS = {
    "meetup": {"subjects": ["raw.meetup"]},
    "results": {"subjects": ["results.>"]},
    "deadletter": {"subjects": ["deadletter.>"]},
}


@pytest.fixture(scope="module")
def tier(
    ray_module: Any, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CollectionTier]:
    cfg = tier_config(tmp_path_factory.mktemp("state"), NS, STREAMS, {"collector": {"port": 0}})
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        udp = s.getsockname()[1]
    t = start_collection_tier(cfg, nats_url=nats_server.url, udp_port=udp)
    yield t
    t.stop()


async def ids_in(server: NatsServer, stream: str) -> dict[str, int]:
    nc = await connect(server.url)
    try:
        return dict(await stream_ids(nc, stream))
    finally:
        await nc.close()


async def post(url: str, body: bytes | dict | list) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, data=data, headers={"Content-Type": "application/json"}) as r,
    ):
        raw = await r.read()
        return r.status, (msgspec.json.decode(raw) if raw else None)


async def landed_once(server: NatsServer, stream: str, ids: list[str]) -> None:
    async def there() -> bool:
        found = await ids_in(server, stream)
        return all(found.get(i) for i in ids)

    await await_until(there, timeout=120, interval=0.5, what=f"{ids} in {stream}", swallow=True)
    verdict = judge(ids, await ids_in(server, stream))
    assert verdict.ok, str(verdict)


# --------------------------------------------------------------------------- retried ack tokens


async def test_retried_ack_token_request_gets_a_token_that_answers(tier: CollectionTier) -> None:
    """The same `?ack=token` request sent twice (ids already logged): the second token
    answers too, instead of 404."""
    url = f"{tier.url}/v1/streams/meetup/events?ack=token"
    body = [{"id": "tok-retry-1"}, {"id": "tok-retry-2"}]
    st, first = await post(url, body)
    assert st == 202, first
    st, again = await post(url, body)
    assert st == 202, again
    async with aiohttp.ClientSession() as s:
        for token in (first["token"], again["token"]):
            async with s.get(f"{tier.url}/v1/acks/{token}") as r:
                status = await r.json()
                assert r.status == 200, status
                assert status["events"] == 2


# --------------------------------------------------------------------------- system streams


async def test_producers_cannot_write_system_streams(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    """`results` and `deadletter` belong to the runtime: HTTP, WebSocket, NATS and UDP
    producers are refused with 403, and neither stream changes."""
    before = {s: await ids_in(nats_server, s) for s in ("results", "deadletter")}
    for stream in ("results", "deadletter"):
        for path in ("events", "fire"):
            st, answer = await post(
                f"{tier.url}/v1/streams/{stream}/{path}", {"id": f"sys-{stream}-{path}"}
            )
            assert st == 403, (stream, path, answer)
            assert "system stream" in answer["error"]
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await s.ws_connect(f"{tier.url}/v1/streams/{stream}/ws")
            assert err.value.status == 403
    nc = await connect(nats_server.url)
    try:
        reply = await nc.request("ingest.results", b'{"id": "sys-nats"}', timeout=30)
        assert msgspec.json.decode(reply.data)["status"] == 403
    finally:
        await nc.close()
    name = tier.collectors[0]
    rejected = (await tier.actor(name).stats.remote())["rejected"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b'results {"id": "sys-udp"}', ("127.0.0.1", tier.udp_port))

    async def udp_refused() -> bool:
        return (await tier.actor(name).stats.remote())["rejected"] > rejected

    await await_until(udp_refused, timeout=30, what="UDP datagram refused")
    # a user stream still takes events, and lands after the refused ones were sent
    st, _ = await post(f"{tier.url}/v1/streams/meetup/events", {"id": "sys-after"})
    assert st == 200
    await landed_once(nats_server, "meetup", ["sys-after"])
    assert {s: await ids_in(nats_server, s) for s in before} == before


# --------------------------------------------------------------------------- the NATS payload limit


async def test_event_at_the_nats_limit_lands_and_one_byte_over_is_413(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    """The server counts headers in max_payload: the collector's limit is max_payload less
    the headers the bridge sends, read from the server it is connected to."""
    nc = await connect(nats_server.url)
    max_payload = nc.max_payload
    await nc.close()

    def event(eid: str, size: int) -> bytes:
        head = b'{"id":"' + eid.encode() + b'","pad":"'
        return head + b"x" * (size - len(head) - 2) + b'"}'

    over_id, at_id = "big-over", "big-at1"
    assert wire_overhead(at_id) == len(f"NATS/1.0\r\nNats-Msg-Id: {at_id}\r\n\r\n") + HEADER_RESERVE
    url = f"{tier.url}/v1/streams/meetup/events"
    # one byte over: refused before logging, naming the server's limit
    over = max_payload - wire_overhead(over_id) + 1
    st, answer = await post(url, event(over_id, over))
    assert st == 413, answer
    assert str(max_payload) in answer["error"] and answer["max_payload"] == max_payload
    # even an event that fits max_payload without its headers is refused (the old hole)
    st, _ = await post(url, event(over_id, max_payload - 8))
    assert st == 413
    at = max_payload - wire_overhead(at_id)
    body = event(at_id, at)
    assert len(body) == at
    st, answer = await post(url, body)
    assert st == 200, answer
    await landed_once(nats_server, "meetup", [at_id])
    assert (await ids_in(nats_server, "meetup")).get(over_id, 0) == 0


# --------------------------------------------------------------------------- partial writes


async def _fault_backup(tier: CollectionTier, on: bool) -> None:
    """The backup replica's LevelDB refuses every write while the fault file exists."""
    from actors.queue.logger import FAULT_SUFFIX

    group = tier.loggers[0]
    st = (await group.status())[1 - group.primary]
    path = Path(st["path"])
    fault = path.with_name(path.name + FAULT_SUFFIX)
    if on:
        fault.write_text("io")
    else:
        fault.unlink(missing_ok=True)


async def test_partial_write_503_carries_ids_and_the_resend_is_stored_once(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    """The primary holds the batch, the backup failed: 503 with the assigned ids (HTTP
    and WebSocket); resending those ids stores each event once."""
    url = f"{tier.url}/v1/streams/meetup/events"
    await _fault_backup(tier, True)
    try:
        st, answer = await post(url, [{"n": 1}, {"n": 2}])  # ids generated by the collector
        assert st == 503, answer
        assert "resend" in answer["error"] and len(answer["ids"]) == 2
        async with aiohttp.ClientSession() as s, s.ws_connect(f"{url[:-7]}/ws") as ws:
            await ws.send_str('[{"n": 3}]')
            frame = await ws.receive_json(timeout=60)
        assert frame["status"] == 503 and len(frame["ids"]) == 1, frame
    finally:
        await _fault_backup(tier, False)
    ids = answer["ids"] + frame["ids"]
    items = [{"id": i, "n": n} for i, n in zip(ids, (1, 2, 3), strict=True)]

    async def resent() -> bool:
        st, _ = await post(url, items)
        return st == 200

    await await_until(resent, timeout=120, interval=1.0, what="the resend accepted")
    await landed_once(nats_server, "meetup", ids)


# --------------------------------------------------------------------------- fenced logger (last:
# it moves the logger group's epoch)


async def test_fenced_logger_answers_503_and_the_resend_is_accepted(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    """A write refused as fenced reaches the collector (a logger client that does not
    follow epochs by itself, as when the epoch moves again under its retry): HTTP and
    WebSocket producers get a 503 with the reason and the ids (not a 500 or a dead
    socket), and a resend with the same ids is accepted once the collector adopted the
    new epoch."""
    import asyncio
    import dataclasses

    import ray

    from actors.collection.collector import Collector

    group = tier.logger_groups[0]
    stale = dataclasses.replace(tier.loggers[0], follow_epochs=False, handles=[])
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: group.promote(group.primary or 0))
    name = "collector-fenced"
    actor = (
        ray.remote(Collector)
        .options(name=name, namespace=NS, num_cpus=0)
        .remote(
            str(tier.cfg.state_path),
            name=name,
            config=tier.cfg.to_dict(),
            logger=stale,
            bridges=tier.bridges,
            nats_url=nats_server.url,
            port=0,
            namespace=NS,
            nats_ingest=False,
        )
    )
    try:
        base = (await actor.endpoints.remote())["url"]
        url = f"{base}/v1/streams/meetup/events"
        st, answer = await post(url, {"id": "fenced-http"})
        assert st == 503, answer
        assert "fenced" in answer["error"] and answer["ids"] == ["fenced-http"]

        async def adopted() -> bool:
            return (await post(url, {"id": "fenced-probe"}))[0] == 200

        await await_until(adopted, timeout=120, interval=1.0, what="the new epoch adopted")
        # a second promotion: the WebSocket producer's next write is fenced too
        await loop.run_in_executor(None, lambda: group.promote(group.primary or 0))
        async with aiohttp.ClientSession() as s, s.ws_connect(f"{base}/v1/streams/meetup/ws") as ws:
            await ws.send_str('{"id": "fenced-ws"}')
            frame = await ws.receive_json(timeout=60)
            assert frame["frame"] == 1 and frame["status"] == 503, frame
            assert "fenced" in frame["error"] and frame["ids"] == ["fenced-ws"]
            await ws.send_str('{"id": "fenced-ws-2"}')  # the socket is still open
            assert (await ws.receive_json(timeout=60))["frame"] == 2
        ids = ["fenced-http", "fenced-probe", "fenced-ws", "fenced-ws-2"]

        async def resent() -> bool:
            st, _ = await post(url, [{"id": i} for i in ids])
            return st == 200

        await await_until(resent, timeout=120, interval=1.0, what="the resend accepted")
        assert (await actor.stats.remote())["fenced"] >= 2
    finally:
        await actor.shutdown.remote()
        ray.kill(actor)
    await landed_once(nats_server, "meetup", ids)
