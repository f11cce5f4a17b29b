"""BrokerBridge retries past the duplicate window, poison events and dead letters.

Real parts: a nats-server this module starts and stops, a local Ray with a real logger
group (LevelDB), and a BrokerBridge built in this process (its data plane runs on its own
loop thread, as in the actor). The stream `s` has a duplicate window of a few seconds, so
an outage longer than the window is cheap to stage.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.queue.bridge import PARKED, BrokerBridge, dead_letter_id
from actors.queue.logger import LoggerGroup, LogUnavailable
from cluster.deploy.logger import start_logger_group
from cluster.verify import stream_ids
from runtime.config import load
from runtime.data.events import Event, encode_batch, new_event_id
from runtime.engines.services import ensure_streams
from runtime.inline import inline_parts
from runtime.nats.publisher import MSG_ID_HEADER
from runtime.nats.server import NatsServer, connect
from runtime.waiting import await_until

pytestmark = pytest.mark.timeout(240)

WINDOW_S = 3.0  # the stream's duplicate window: the blind-retry horizon is half of it
NS = "tierflow-tests"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def event(data: bytes, *, age_s: float = 0.0, processed: bool = True) -> Event:
    return Event(
        new_event_id(), "s", "raw.s", data, now_ms() - int(age_s * 1000), processed=processed
    )


@pytest.fixture(scope="module")
def rig(
    ray_module: Any, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[BrokerBridge, LoggerGroup, Any]]:
    state: Path = tmp_path_factory.mktemp("bridge-retries-state")
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(state),
            "streams": {
                "s": {
                    "subjects": ["raw.s"],
                    "duplicate_window_s": WINDOW_S,
                    "logic": {"validate": {"n": "int"}},
                },
                "s2": {"subjects": ["raw.s2"], "logic": {"validate": {"n": "int"}}},
                "deadletter": {"subjects": ["deadletter.>"], "duplicate_window_s": WINDOW_S},
            },
        },
    )
    name = f"bl{uuid.uuid4().hex[:6]}"
    controller, group = start_logger_group(
        name,
        0,
        state,
        NS,
        max_events=100_000,
        max_bytes=1 << 30,
        retry_base_ms=100,
        retry_cap_ms=500,
    )
    bridge = BrokerBridge(
        str(state),
        name=f"{name}-bridge",
        config=cfg.to_dict(),
        nats_url=nats_server.url,
        loggers=[group],
        replay=False,  # the tests drive replay passes themselves
        ack_timeout_s=2.0,
        stale_after_s=1.0,
        reconnect_deadline_s=5.0,
        clock_skew_s=1.0,
    )
    try:
        yield bridge, group, cfg
    finally:
        bridge.shutdown()
        controller.shutdown()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Any]:
    client = await connect(nats_server.url, name="test-bridge-retries")
    yield client
    await client.close()


async def drain(
    bridge: BrokerBridge, group: LoggerGroup, events: list[Event], timeout: float = 60.0
) -> None:
    """Replay passes until the log holds none of `events` (bounded)."""

    async def gone() -> bool:
        await bridge.replay_now()
        transient = {e.id for e in await group.pending(0, limit=100_000)}
        for e in events:
            if e.id in transient or await failed_entry(group, e) is not None:
                return False
        return True

    await await_until(gone, timeout=timeout, interval=0.3, what="events completed", swallow=True)


async def failed_entry(group: LoggerGroup, ev: Event) -> dict[str, Any] | None:
    return await group.handles[0].failed_entry.remote((ev.stream, ev.id))


async def test_ack_lost_before_outage_longer_than_dedup_window_stores_once(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nats_server: NatsServer, nc: Any
) -> None:
    """The event is stored but its ack is lost, then NATS is down longer than the stream's
    duplicate window. The resend after the outage must not store it again."""
    bridge, group, _ = rig
    ev = event(b'{"n": 1}')
    await group.append([ev])
    # the publish landed, the ack never came back: JetStream holds it, the log still does
    await nc.jetstream().publish("raw.s", ev.data, headers={MSG_ID_HEADER: ev.id})
    await nc.close()
    nats_server.stop()
    try:
        answer = await bridge.publish(encode_batch([ev]), group.name)
        assert ev.id in answer["failed"], answer
        assert (await failed_entry(group, ev)) is not None
        await await_until(
            lambda: now_ms() - ev.received_ms > (2 * WINDOW_S + 1) * 1000,
            timeout=30,
            what="the outage outlasted the duplicate window",
        )
    finally:
        nats_server.start()
    await drain(bridge, group, [ev])
    client = await connect(nats_server.url)
    try:
        assert (await stream_ids(client, "s"))[ev.id] == 1
    finally:
        await client.close()
    assert (await bridge.stats())["found_stored"] >= 1


async def test_past_horizon_absent_event_is_resent_once(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """Past the horizon an event JetStream does not hold is proven absent and resent."""
    bridge, group, _ = rig
    ev = event(b'{"n": 2}', age_s=10 * WINDOW_S)
    await group.append([ev])
    await drain(bridge, group, [ev])
    assert (await stream_ids(nc, "s"))[ev.id] == 1


async def test_past_horizon_unprovable_is_parked_not_resent(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """A range too big to read within the bound: parked (never resent blind, never due)."""
    bridge, group, _ = rig
    ev = event(b'{"n": 3}', age_s=10 * WINDOW_S)
    await nc.jetstream().publish("raw.s", b'{"n": 0}', headers={MSG_ID_HEADER: new_event_id()})
    await group.append([ev])
    bridge.path.verify_max_messages = 0  # the stream holds something to read: over the bound

    async def parked() -> bool:
        await bridge.replay_now()
        fe = await failed_entry(group, ev)
        return fe is not None and fe["error"].startswith(PARKED)

    try:
        await await_until(parked, timeout=30, interval=0.3, what="parked", swallow=True)
        await bridge.replay_now()  # parked: never due, so no pass resends it
    finally:
        bridge.path.verify_max_messages = 200_000
    assert (await stream_ids(nc, "s"))[ev.id] == 0


async def test_handoff_answer_is_counts_and_the_work_is_the_same(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """`detail=False` (the collector's background hand-off): the answer holds counts, not
    a dict of every id, while publishing, dead-lettering and forgetting are unchanged. The
    batch comes as the collector sends it, in parts Ray inlines, cut inside an event."""
    bridge, group, _ = rig
    good = [event(b'{"n": %d}' % i) for i in range(30)]
    poison = event(b"p" * (nc.max_payload - 16))
    batch = good[:10] + [poison] + good[10:]
    await group.append(batch)
    first, *more = inline_parts(encode_batch(batch))
    assert more  # over 96 KiB: more than one part
    answer = await bridge.publish(first, group.name, False, *more)
    assert answer == {"published": 30, "failed": 0, "deadlettered": 1}
    stored = await stream_ids(nc, "s")
    assert all(stored[e.id] == 1 for e in good) and stored[poison.id] == 0
    await bridge.flush_forgets()
    logged = {e.id for e in await group.pending(0, now_ms() + 60_000, 100_000)}
    assert not logged & {e.id for e in good}  # acked: forgotten
    fe = await failed_entry(group, poison)
    assert fe is not None and fe["error"].startswith(PARKED), fe


async def test_poison_event_mid_batch_is_dead_lettered_others_land_once(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """An event whose payload fits max_payload but not with its headers, in the middle of a
    batch: dead-lettered with the reason (its full body kept parked in the
    log); every other event of the batch lands exactly once, in the same call."""
    bridge, group, _ = rig
    good = [event(b'{"n": %d}' % i) for i in range(40)]
    poison = event(b"p" * (nc.max_payload - 16))
    batch = good[:20] + [poison] + good[20:]
    await group.append(batch)
    answer = await bridge.publish(encode_batch(batch), group.name)
    assert answer["failed"] == {}, answer["failed"]
    assert set(answer["published"]) == {e.id for e in good}
    assert "max_payload" in answer["deadlettered"][poison.id]
    stored = await stream_ids(nc, "s")
    assert all(stored[e.id] == 1 for e in good)
    assert stored[poison.id] == 0
    dead = await nc.jetstream().get_last_msg("deadletter", f"deadletter.{poison.stream}")
    assert dead.headers[MSG_ID_HEADER] == dead_letter_id(poison.stream, poison.id)
    assert dead.headers["Tf-Id"] == poison.id
    assert "max_payload" in dead.headers["Tf-Error"]
    assert dead.headers["Tf-Truncated"] == str(len(poison.data))
    fe = await failed_entry(group, poison)
    assert fe is not None and fe["error"].startswith(PARKED), fe
    await bridge.replay_now()  # parked: never due, so no pass resends it
    assert (await stream_ids(nc, "s"))[poison.id] == 0


async def test_failing_dead_letters_move_to_failed_store_and_do_not_starve_orphans(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """While dead-letter publishes fail, the invalid events go to the failed store
    (retried with backoff) instead of staying transient at the head of `pending()`, so the
    valid orphans behind them are published."""
    bridge, group, cfg = rig
    js = nc.jetstream()
    await js.delete_stream("deadletter")  # dead-letter publishes now find no stream
    invalid = [event(b'{"x": %d}' % i, age_s=60, processed=False) for i in range(4)]
    orphans = [event(b'{"n": %d}' % i, age_s=50, processed=False) for i in range(2)]
    await group.append(invalid + orphans)
    bridge.replayer.batch = len(invalid)  # a pass sees only as many as the invalid ones
    try:

        async def orphans_landed() -> bool:
            await bridge.replay_now()
            stored = await stream_ids(nc, "s")
            return all(stored[e.id] == 1 for e in orphans)

        await await_until(orphans_landed, timeout=30, interval=0.3, what="orphans published")
        for e in invalid:
            fe = await failed_entry(group, e)
            assert fe is not None and "dead-letter publish failed" in fe["error"], fe
    finally:
        bridge.replayer.batch = 4096
        await ensure_streams(nc, cfg)
    await drain(bridge, group, invalid)
    dead = await stream_ids(nc, "deadletter")
    assert all(dead[dead_letter_id(e.stream, e.id)] == 1 for e in invalid)


class _DownGroup:
    """A logger group whose replicas do not answer."""

    name = "down"

    async def heal(self) -> dict[int, int]:
        return {}

    async def pending(self, *args: Any) -> list[Event]:
        raise LogUnavailable("down-0", "no answer within 5s")

    async def due_failed(self, *args: Any) -> list[Event]:
        raise LogUnavailable("down-0", "no answer within 5s")


async def test_one_unreachable_logger_group_does_not_stop_the_others(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """A replay pass carries on past a group that cannot be read."""
    bridge, group, _ = rig
    orphan = event(b'{"n": 7}', age_s=5)
    await group.append([orphan])
    attached = bridge.replayer.loggers
    bridge.replayer.loggers = {"down": _DownGroup(), group.name: group}  # type: ignore[dict-item]
    try:
        await bridge.replay_now()
    finally:
        bridge.replayer.loggers = attached
    assert (await stream_ids(nc, "s"))[orphan.id] == 1
    assert (await bridge.stats())["replay_errors"] >= 1


async def test_dead_letter_recorded_before_ack_loss_past_window_is_not_recorded_twice(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """The dead-letter record of an invalid event landed but the log kept the event (ack
    lost); resent after the deadletter stream's duplicate window,
    it must be found, not recorded twice."""
    bridge, group, _ = rig
    bad = event(b'{"x": "late"}', processed=False)
    await group.append([bad])
    headers = {MSG_ID_HEADER: dead_letter_id(bad.stream, bad.id), "Tf-Error": "earlier attempt"}
    await nc.jetstream().publish(f"deadletter.{bad.stream}", bad.data, headers=headers)
    await await_until(
        lambda: now_ms() - bad.received_ms > (2 * WINDOW_S + 1) * 1000,
        timeout=30,
        what="past the deadletter stream's duplicate window",
    )
    await drain(bridge, group, [bad])
    assert (await stream_ids(nc, "deadletter"))[dead_letter_id(bad.stream, bad.id)] == 1


async def test_live_group_lists_parked_and_settle_retry_lets_the_bridge_publish(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """A parked entry stays put through replay passes until settled; "retry" makes it due
    and the next pass publishes it (fresh, so without a scan) exactly once."""
    bridge, group, _ = rig
    ev = event(b'{"n": 9}')
    await group.append([ev])
    await group.fail([(ev, f"{PARKED}: test")], park=True)
    await bridge.replay_now()
    assert ev.id in {p["id"] for p in await group.parked()}
    assert (await stream_ids(nc, "s"))[ev.id] == 0
    await group.settle([(ev.stream, ev.id)], "retry")
    assert ev.id not in {p["id"] for p in await group.parked()}
    await drain(bridge, group, [ev])
    assert (await stream_ids(nc, "s"))[ev.id] == 1


async def test_same_id_invalid_in_two_streams_gets_two_dead_letter_records(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """One deadletter stream holds every stream's records: the same event id refused in
    two streams is two records, neither taken for a duplicate of the other."""
    bridge, group, _ = rig
    a = event(b'{"x": "a"}', processed=False)
    b = msgspec.structs.replace(a, stream="s2", subject="raw.s2", data=b'{"x": "b"}')
    await group.append([a, b])
    await drain(bridge, group, [a, b])
    dead = await stream_ids(nc, "deadletter")
    assert dead[dead_letter_id("s", a.id)] == 1
    assert dead[dead_letter_id("s2", a.id)] == 1
    for stream, body in (("s", a.data), ("s2", b.data)):
        msg = await nc.jetstream().get_last_msg("deadletter", f"deadletter.{stream}")
        assert msg.data == body and msg.headers["Tf-Id"] == a.id


async def test_concurrent_calls_land_once_in_order_and_are_forgotten_after_ack(
    rig: tuple[BrokerBridge, LoggerGroup, Any], nc: Any
) -> None:
    """Several bridge calls in flight at once (the collector's hand-off senders): every
    event stored once, each call's events in their order in the stream, and every acked
    entry forgotten once the bridge's forgets are flushed (off the publish path)."""
    bridge, group, _ = rig
    calls = [[event(b'{"n": %d}' % (100 * c + i)) for i in range(60)] for c in range(6)]
    every = [e for call in calls for e in call]
    await group.append(every)
    answers = await asyncio.gather(
        *(bridge.publish(encode_batch(call), group.name) for call in calls)
    )
    for call, answer in zip(calls, answers, strict=True):
        assert answer["failed"] == {}, answer["failed"]
        seqs = [answer["published"][e.id][1] for e in call]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    stored = await stream_ids(nc, "s")
    assert all(stored[e.id] == 1 for e in every)
    await bridge.flush_forgets()
    held = {e.id for e in await group.pending(0, limit=100_000)}
    assert not held & {e.id for e in every}
    stats = await bridge.stats()
    assert stats["forgets_pending"] == 0 and stats["forgets_left"] == 0
