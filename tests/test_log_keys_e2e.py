"""The same event id posted to two streams, end to end: real collector
(HTTP), real logger group (k=1, LevelDB), real bridge, real nats-server.

Collectors here hand nothing to the bridge in the background (`max_handoff_events=0`) and
the replayer's stale age is an hour, so what the log holds is exactly what was accepted
and the test drives publishing itself: with `?wait=queued`, and by handing the log's
pending entries to the bridge as its replayer does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import ray

from actors.queue.logger import LoggerGroup
from cluster.pipeline import CollectionTier, start_collection_tier
from cluster.verify import stream_ids
from runtime.config import Config
from runtime.data.events import decode_batch, encode_batch
from runtime.nats.server import NatsServer, connect
from runtime.waiting import await_until
from tests.support import tier_config

NS = "tf-log-keys"
FAR_FUTURE_MS = 1 << 50


def two_streams(state: Path) -> Config:
    return tier_config(
        state,
        NS,
        {"meetup": {"subjects": ["raw.meetup"]}, "clicks": {"subjects": ["raw.clicks"]}},
        {"collector": {"replicas": 1}, "bridge": {"replicas": 1}},
    )


@pytest.fixture(scope="module")
def tier(
    ray_module: Any, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CollectionTier]:
    t = start_collection_tier(
        two_streams(tmp_path_factory.mktemp("state")),
        nats_url=nats_server.url,
        collector_options={"max_handoff_events": 0},
        bridge_options={"stale_after_s": 3600.0},
    )
    yield t
    t.stop()


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, msgspec.json.decode(await r.read())


async def held(group: LoggerGroup) -> list[list[tuple[str, str]]]:
    """(stream, id) of every transient entry, per replica."""
    out = []
    for i in range(group.size):
        handle = ray.get_actor(group.replica_name(i), namespace=group.namespace)
        batch = await handle.pending.remote(0, FAR_FUTURE_MS, 1000)
        out.append(sorted((e.stream, e.id) for e in decode_batch(batch)))
    return out


async def counted(nats_server: NatsServer, stream: str) -> Any:
    nc = await connect(nats_server.url)
    try:
        return await stream_ids(nc, stream)
    finally:
        await nc.close()


async def replay_through_bridge(tier: CollectionTier, group: LoggerGroup) -> dict[str, Any]:
    """What the bridge's replayer does with orphans: the log's entries, one batch."""
    entries = await group.pending(0, now_ms=FAR_FUTURE_MS, limit=1000)
    bridge = tier.actor(tier.bridges[0])
    return await bridge.publish.remote(encode_batch(entries), group.name)


async def test_same_id_in_two_streams_is_logged_published_and_forgotten_separately(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    group = tier.loggers[0]
    base = f"{tier.url}/v1/streams"
    st_a, a = await post(f"{base}/meetup/events", {"id": "1", "n": "meetup"})
    st_b, b = await post(f"{base}/clicks/events", {"id": "1", "n": "clicks"})
    assert (st_a, a["ids"], st_b, b["ids"]) == (200, ["1"], 200, ["1"])
    # both answered 200, so both are on every replica
    assert await held(group) == [[("clicks", "1"), ("meetup", "1")]] * 2

    # the replayer's path: one batch holding id "1" twice (two streams); each lands once
    out = await replay_through_bridge(tier, group)
    assert out["failed"] == {}
    assert (await counted(nats_server, "meetup"))["1"] == 1
    assert (await counted(nats_server, "clicks"))["1"] == 1
    # the bridge forgets acked entries off the publish path: wait for it, bounded
    await await_until(group.drained, timeout=30, what="every replica drained")
    assert await held(group) == [[], []]


async def test_forget_for_one_stream_keeps_the_other_streams_entry(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    group = tier.loggers[0]
    base = f"{tier.url}/v1/streams"
    assert (await post(f"{base}/meetup/events", {"id": "2"}))[0] == 200
    assert (await post(f"{base}/clicks/events", {"id": "2"}))[0] == 200
    # meetup's "2" again, answered once JetStream has it: the bridge forgets (meetup, "2")
    st, body = await post(f"{base}/meetup/events?wait=queued", {"id": "2"})
    assert st == 200 and body["published"]["2"][0] == "meetup", body
    only_clicks = [[("clicks", "2")]] * 2  # clicks' entry is still logged

    async def meetup_forgotten() -> bool:  # the forget runs off the publish path
        return await held(group) == only_clicks

    await await_until(meetup_forgotten, timeout=30, what="meetup's entry forgotten")
    assert await held(group) == only_clicks
    assert (await counted(nats_server, "clicks"))["2"] == 0  # and not yet published

    out = await replay_through_bridge(tier, group)
    assert list(out["published"]) == ["2"] and out["published"]["2"][0] == "clicks"
    assert (await counted(nats_server, "meetup"))["2"] == 1
    assert (await counted(nats_server, "clicks"))["2"] == 1
    await await_until(group.drained, timeout=30, what="every replica drained")
