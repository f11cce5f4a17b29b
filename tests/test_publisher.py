"""runtime/nats/publisher.py against a real nats-server: pipelined acked publishing, dedup and
failures."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.nats.publisher import (
    MSG_ID_HEADER,
    JetStreamPublisher,
    LatencyReservoir,
    Outgoing,
    Published,
    _Slots,
    api_error_retryable,
    duplicate_window_for,
    jittered,
)
from runtime.nats.server import NatsServer, connect
from runtime.waiting import await_until

pytestmark = pytest.mark.timeout(120)
# The module-scoped client lives on the session loop; async tests must run there too.
on_session_loop = pytest.mark.asyncio(loop_scope="session")

STREAM = "t"
SUBJECT = "raw.t"


# ---- helpers ------------------------------------------------------------------------------


def events(prefix: str, n: int, subject: str = SUBJECT, size: int = 64) -> list[Outgoing]:
    return [
        Outgoing(id=f"{prefix}-{i:05d}", subject=subject, data=f"{prefix}-{i}".encode().ljust(size))
        for i in range(n)
    ]


async def stream_ids(nc: Client, expect: int, timeout: float = 20.0) -> list[tuple[int, str]]:
    """Every message of the stream as (stream seq, Nats-Msg-Id), read in bulk by a pull consumer.

    Asserts the stream holds exactly `expect` messages first, so a short read is a failure.
    """
    js = nc.jetstream()
    info = await js.stream_info(STREAM)
    assert info.state.messages == expect, info.state
    durable = f"reader-{uuid.uuid4().hex[:8]}"
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1)
    sub = await js.pull_subscribe(SUBJECT, durable=durable, stream=STREAM, config=config)
    out: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expect and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(batch=1000, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            out.extend((m.metadata.sequence.stream, m.headers[MSG_ID_HEADER]) for m in msgs)
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(STREAM, durable)
    assert len(out) == expect, f"read {len(out)} of {expect} before the deadline"
    return out


def by_id(items: list[Any]) -> dict[str, Any]:
    out = {x.id: x for x in items}
    assert len(out) == len(items), "an id was reported twice"
    return out


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    state = tmp_path_factory.mktemp("bridge-state")
    return load(
        environ={},
        overrides={"state_dir": str(state), "streams": {STREAM: {"subjects": [SUBJECT]}}},
    )


@pytest.fixture(scope="module")
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await connect(nats_server.url, name="test-bridge")
    yield client
    await client.close()


async def fresh_stream(
    nc: Client, nats_server: NatsServer, cfg: Config, also_delete: tuple[str, ...] = ()
) -> str:
    """Stream `t` fresh and empty (sequences start at 1, dedup state empty), made by
    ensure_streams as tierflow makes it; the server restarted if a test left it down."""
    if not nats_server.running:  # a previous test left it down
        nats_server.start()
    await await_until(lambda: nc.is_connected, 20, what="client reconnected")
    js = nc.jetstream()
    for name in (STREAM, *also_delete):
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(name)
    assert STREAM in await ensure_streams(nc, cfg)  # with the system streams
    return STREAM


@pytest.fixture
async def stream(nc: Client, nats_server: NatsServer, cfg: Config) -> str:
    return await fresh_stream(nc, nats_server, cfg)


# ---- pure parts ---------------------------------------------------------------------------


@pytest.mark.unit
def test_duplicate_window_exceeds_retry_horizon() -> None:
    assert duplicate_window_for(0) == 120.0
    assert duplicate_window_for(30) == 120.0
    for horizon in (61.0, 600.0, 86_400.0):
        assert duplicate_window_for(horizon) > horizon
    with pytest.raises(ValueError):
        duplicate_window_for(-1)


@pytest.mark.unit
def test_api_error_classification() -> None:
    assert api_error_retryable(503) and api_error_retryable(429)
    assert not api_error_retryable(400) and not api_error_retryable(404)
    assert not api_error_retryable(409, 10071)  # wrong last sequence: the event's fault
    assert api_error_retryable(409, 10158)  # the same id being stored: resend, get a dup


@pytest.mark.unit
def test_latency_reservoir_quantiles_and_ring() -> None:
    r = LatencyReservoir(size=100)
    assert r.quantile(0.5) is None
    for i in range(1, 101):
        r.add(i / 1000)
    assert r.quantile(0.0) == 0.001 and r.quantile(1.0) == 0.1
    assert abs(r.quantile(0.5) - 0.0505) < 0.001  # type: ignore[operator]
    for _ in range(100):
        r.add(5.0)  # the ring keeps only the newest 100
    assert len(r) == 100 and r.quantile(0.01) == 5.0


@pytest.mark.unit
@given(
    size=st.integers(1, 20),
    ops=st.lists(st.tuples(st.booleans(), st.floats(0, 1), st.integers(1, 45)), max_size=30),
)
def test_latency_reservoir_add_many_is_add_repeated(
    size: int, ops: list[tuple[bool, float, int]]
) -> None:
    many, one = LatencyReservoir(size=size), LatencyReservoir(size=size)
    for bulk, seconds, n in ops:
        if bulk:
            many.add_many(seconds, n)
        else:
            many.add(seconds)
        for _ in range(n if bulk else 1):
            one.add(seconds)
        assert len(many) == len(one) and many._ring[: len(many)] == one._ring[: len(one)]
        assert many._count % size == one._count % size


@pytest.mark.unit
async def test_slots_take_many_at_once_first_come_first_served() -> None:
    slots = _Slots(5)
    await slots.acquire(3)
    big = asyncio.ensure_future(slots.acquire(4))  # 2 free: waits, holding none
    await asyncio.sleep(0)
    small = asyncio.ensure_future(slots.acquire(1))  # fits, but waits behind the first
    await asyncio.sleep(0)
    assert not big.done() and not small.done() and slots.free == 2
    slots.release(2)
    await asyncio.sleep(0)
    assert big.done() and not small.done() and slots.free == 0
    slots.release(4)
    await asyncio.sleep(0)
    assert small.done() and slots.free == 3
    # a waiter cancelled gives way to the ones behind it and takes nothing
    blocked = asyncio.ensure_future(slots.acquire(5))
    behind = asyncio.ensure_future(slots.acquire(2))
    await asyncio.sleep(0)
    blocked.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await blocked
    await asyncio.sleep(0)
    assert behind.done() and slots.free == 1
    # granted just as it was cancelled: the slots go back
    slots.release(3)
    late = asyncio.ensure_future(slots.acquire(5))  # 4 free: waits
    other = asyncio.ensure_future(slots.acquire(1))
    await asyncio.sleep(0)
    assert slots.free == 4 and not late.done()
    slots.release(2)  # 6 free: `late` granted 5, `other` 1 ...
    late.cancel()  # ... but `late` is cancelled before it resumes
    with contextlib.suppress(asyncio.CancelledError):
        await late
    await other
    assert slots.free == 5  # `late` gave its 5 back


@pytest.mark.unit
def test_jittered_backoff_is_bounded_and_seeded() -> None:
    a = jittered(0.1, 1.0, random.Random(7))
    b = jittered(0.1, 1.0, random.Random(7))
    got = [a(n) for n in range(1, 12)]
    assert got == [b(n) for n in range(1, 12)]
    assert all(0 <= d <= min(1.0, 0.1 * 2 ** (n - 1)) for n, d in enumerate(got, 1))


# ---- against nats-server ------------------------------------------------------------------


@on_session_loop
async def test_5000_events_all_acked_in_order_with_msg_ids(nc: Client, stream: str) -> None:
    evs = events("one", 5000)
    pub = JetStreamPublisher(nc)
    ok, bad = await pub.publish_batch(evs)
    assert bad == []
    assert [p.id for p in ok] == [e.id for e in evs]
    assert sorted(p.seq for p in ok) == list(range(1, 5001))
    assert all(p.stream == STREAM and not p.duplicate for p in ok)
    assert (pub.published, pub.duplicates, pub.failed, pub.in_flight) == (5000, 0, 0, 0)
    assert len(pub.latency) == 5000 and pub.latency.quantile(0.99) is not None
    seq_of = {p.id: p.seq for p in ok}
    stored = await stream_ids(nc, 5000)
    assert sorted(mid for _, mid in stored) == sorted(seq_of)
    assert all(seq_of[mid] == seq for seq, mid in stored)  # acked seq is where it is stored


@on_session_loop
async def test_republishing_same_ids_is_all_duplicates(nc: Client, stream: str) -> None:
    evs = events("dup", 5000)
    pub = JetStreamPublisher(nc)
    first, bad = await pub.publish_batch(evs)
    assert bad == [] and len(first) == 5000
    again, bad = await pub.publish_batch(evs)
    assert bad == []
    assert [p.id for p in again] == [e.id for e in evs]
    assert all(p.duplicate for p in again)
    # JetStream's duplicate ack names the sequence of the stored original.
    assert [p.seq for p in again] == [p.seq for p in first]
    assert (pub.published, pub.duplicates) == (5000, 5000)
    await stream_ids(nc, 5000)


@on_session_loop
async def test_subject_without_stream_fails_with_no_responders(nc: Client, stream: str) -> None:
    evs = events("lost", 300, subject="nostream.x")
    pub = JetStreamPublisher(nc, ack_timeout=10.0)
    t0 = time.monotonic()
    ok, bad = await pub.publish_batch(evs)
    elapsed = time.monotonic() - t0
    assert ok == []
    assert [f.id for f in bad] == [e.id for e in evs]
    assert all("no responders" in f.error and "nostream.x" in f.error for f in bad)
    assert elapsed < 10.0, "no-responders must be reported as it arrives, not at the timeout"
    assert pub.failed == 300 and pub.in_flight == 0
    await stream_ids(nc, 0)


@on_session_loop
async def test_jetstream_api_error_carries_its_code(nc: Client, stream: str) -> None:
    evs = [
        Outgoing(id=f"api-{i}", subject=SUBJECT, data=b"x", headers={"Nats-Expected-Stream": "zz"})
        for i in range(20)
    ]
    ok, bad = await JetStreamPublisher(nc).publish_batch(evs)
    assert ok == [] and len(bad) == 20
    assert all("JetStream API error 400" in f.error and "10060" in f.error for f in bad), bad[0]
    assert not any(f.retryable for f in bad)  # the event itself is wrong: do not retry


@on_session_loop
async def test_window_is_pipelined_and_bounded(
    nc: Client, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = JetStreamPublisher(nc, max_in_flight=64)
    seen: list[int] = []
    real_publish = nc.publish

    async def spy(*args: Any, **kw: Any) -> None:
        seen.append(pub.in_flight)  # includes the event being sent
        await real_publish(*args, **kw)

    monkeypatch.setattr(nc, "publish", spy)
    ok, bad = await pub.publish_batch(events("win", 1000))
    assert bad == [] and len(ok) == 1000
    assert max(seen) == 64  # 64 acks outstanding at once, never more
    assert pub.in_flight == 0


@on_session_loop
async def test_concurrent_batches_share_the_window(nc: Client, stream: str) -> None:
    pub = JetStreamPublisher(nc, max_in_flight=100)
    a, b = events("ca", 700), events("cb", 900)
    (ok_a, bad_a), (ok_b, bad_b) = await asyncio.gather(pub.publish_batch(a), pub.publish_batch(b))
    assert bad_a == bad_b == []
    assert [p.id for p in ok_a] == [e.id for e in a]
    assert [p.id for p in ok_b] == [e.id for e in b]
    assert sorted(p.seq for p in ok_a + ok_b) == list(range(1, 1601))
    await stream_ids(nc, 1600)


@on_session_loop
async def test_nats_down_fails_fast_then_retry_lands_exactly_once(
    nc: Client, nats_server: NatsServer, stream: str
) -> None:
    ack_timeout = 1.0
    pub = JetStreamPublisher(nc, max_in_flight=256, ack_timeout=ack_timeout)
    before = events("pre", 500)
    ok, bad = await pub.publish_batch(before)
    assert bad == [] and len(ok) == 500

    evs = events("down", 2000)
    nats_server.kill()
    try:
        t0 = time.monotonic()
        ok, bad = await pub.publish_batch(evs)
        elapsed = time.monotonic() - t0
        assert ok == []
        assert [f.id for f in bad] == [e.id for e in evs]
        assert all(f.retryable for f in bad), {f.error for f in bad}
        # Bound, not speed: one ack timeout for what was on the wire, plus slack.
        assert elapsed < ack_timeout + 3.0, elapsed
        assert pub.in_flight == 0
    finally:
        nats_server.restart()
    await await_until(lambda: nc.is_connected, 20, what="client reconnected after restart")

    ok, bad = await pub.publish_with_retry(evs, attempts=20, backoff=lambda n: 0.05)
    assert bad == []
    assert sorted(p.id for p in ok) == sorted(e.id for e in evs)
    stored = await stream_ids(nc, 2500)
    ids = [mid for _, mid in stored]
    assert len(set(ids)) == 2500
    assert set(ids) == {e.id for e in before + evs}


@on_session_loop
async def test_half_already_stored_comes_back_duplicate(nc: Client, stream: str) -> None:
    evs = events("mix", 2000)
    pub = JetStreamPublisher(nc)
    ok, bad = await pub.publish_batch(evs[::2])
    assert bad == [] and len(ok) == 1000
    ok, bad = await pub.publish_batch(evs)
    assert bad == []
    got = by_id(ok)
    assert set(got) == {e.id for e in evs}
    for i, e in enumerate(evs):
        assert got[e.id].duplicate is (i % 2 == 0), e.id
    assert sorted(p.seq for p in ok if not p.duplicate) == list(range(1001, 2001))
    stored = await stream_ids(nc, 2000)
    assert sorted(mid for _, mid in stored) == sorted(e.id for e in evs)


@on_session_loop
async def test_retry_gives_up_on_non_retryable_and_counts_attempts(nc: Client, stream: str) -> None:
    good = events("rg", 50)
    lost = events("rl", 10, subject="nostream.y")  # no responders: retryable
    wrong = [
        Outgoing(id=f"rw-{i}", subject=SUBJECT, data=b"x", headers={"Nats-Expected-Stream": "zz"})
        for i in range(5)
    ]
    pauses: list[int] = []

    async def no_sleep(_: float) -> None:
        return None

    def backoff(n: int) -> float:
        pauses.append(n)
        return 0.0

    pub = JetStreamPublisher(nc)
    ok, bad = await pub.publish_with_retry(
        good + lost + wrong, attempts=3, backoff=backoff, sleep=no_sleep
    )
    assert {p.id for p in ok} == {e.id for e in good}
    assert {f.id for f in bad} == {e.id for e in lost + wrong}
    assert pauses == [1, 2]  # two retries after the first attempt
    # the non-retryable ones were sent once, the no-responders ones three times
    assert pub.failed == 3 * 10 + 5


@on_session_loop
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    size=st.integers(0, 400),
    window=st.integers(1, 300),
    lost_every=st.integers(0, 7),
)
async def test_every_id_reported_exactly_once(
    nc: Client, stream: str, size: int, window: int, lost_every: int
) -> None:
    prefix = uuid.uuid4().hex[:8]
    evs = [
        Outgoing(
            id=f"{prefix}-{i}",
            subject="nostream.z" if lost_every and i % lost_every == 0 else SUBJECT,
            data=b"p",
        )
        for i in range(size)
    ]
    pub = JetStreamPublisher(nc, max_in_flight=window)
    ok, bad = await pub.publish_batch(evs)
    reported = [p.id for p in ok] + [f.id for f in bad]
    assert sorted(reported) == sorted(e.id for e in evs)
    assert len(set(reported)) == len(reported)
    assert {f.id for f in bad} == {e.id for e in evs if e.subject != SUBJECT}
    assert all(isinstance(p, Published) for p in ok) and pub.in_flight == 0


@on_session_loop
async def test_silent_responder_times_out_each_event(nc: Client, stream: str) -> None:
    """A core subscriber that never answers: no 'no responders', so only the timeout ends it."""
    silent = await nc.subscribe("silent.x", cb=_ignore)
    try:
        pub = JetStreamPublisher(nc, max_in_flight=50, ack_timeout=0.5)
        t0 = time.monotonic()
        ok, bad = await pub.publish_batch(events("quiet", 120, subject="silent.x"))
        elapsed = time.monotonic() - t0
    finally:
        await silent.unsubscribe()
    assert ok == [] and len(bad) == 120
    assert all("timeout" in f.error and f.retryable for f in bad)
    # 120 events through a window of 50: three windows, each waits one ack timeout
    assert 3 * 0.5 - 0.05 <= elapsed < 3 * 0.5 + 3.0, elapsed
    assert pub.in_flight == 0


@on_session_loop
async def test_close_fails_in_flight_waiting_and_later_batches(nc: Client, stream: str) -> None:
    silent = await nc.subscribe("silent.y", cb=_ignore)
    try:
        pub = JetStreamPublisher(nc, max_in_flight=40, ack_timeout=30.0)
        sent = asyncio.create_task(pub.publish_batch(events("cl", 40, subject="silent.y")))
        await await_until(lambda: pub.in_flight == 40, 10, what="40 events in flight")
        waiting = asyncio.create_task(pub.publish_batch(events("cw", 10)))  # no room left
        await asyncio.sleep(0)
        assert not waiting.done()
        await pub.close()
        (ok, bad), (ok_w, bad_w) = await asyncio.wait_for(asyncio.gather(sent, waiting), 5.0)
    finally:
        await silent.unsubscribe()
    assert ok == [] and ok_w == []
    assert [f.id for f in bad] == [f"cl-{i:05d}" for i in range(40)]
    assert [f.id for f in bad_w] == [f"cw-{i:05d}" for i in range(10)]
    assert all(f.error == "publisher closed" and f.retryable for f in bad + bad_w)
    ok, bad = await pub.publish_batch(events("cl2", 3))
    assert ok == [] and [f.error for f in bad] == ["publisher closed"] * 3


@on_session_loop
async def test_malformed_events_fail_alone_and_not_retryable(nc: Client, stream: str) -> None:
    good = events("mf", 10)
    huge = Outgoing(id="mf-huge", subject=SUBJECT, data=b"x" * (nc.max_payload + 1))
    spaced = Outgoing(id="mf-space", subject="raw t", data=b"x")
    ok, bad = await JetStreamPublisher(nc).publish_batch([*good[:5], huge, spaced, *good[5:]])
    assert [p.id for p in ok] == [e.id for e in good]
    assert [(f.id, f.retryable) for f in bad] == [("mf-huge", False), ("mf-space", False)]
    assert "max_payload" in bad[0].error and "BadSubjectError" in bad[1].error
    await stream_ids(nc, 10)


async def _ignore(_msg: Any) -> None:
    return None


@pytest.mark.unit
def test_outgoing_is_frozen_with_default_headers() -> None:
    e = Outgoing(id="a", subject="s", data=b"d")
    assert e.headers == {}
    with pytest.raises(AttributeError):
        e.id = "b"  # type: ignore[misc]


@on_session_loop
async def test_poison_over_max_payload_with_headers_fails_alone_and_keeps_connection(
    nc: Client, stream: str
) -> None:
    """Payload under the server's max_payload but payload + headers over it: nats-py lets it
    through and the server resets the connection, failing every publish in flight. The
    publisher must refuse it before sending, non-retryable, with the reason."""
    good = events("pp", 40)
    poison = Outgoing(id="pp-poison", subject=SUBJECT, data=b"x" * (nc.max_payload - 16))
    batch = good[:20] + [poison] + good[20:]
    reconnects = nc.stats["reconnects"]
    pub = JetStreamPublisher(nc, ack_timeout=5.0)
    ok, bad = await pub.publish_batch(batch)
    assert [f.id for f in bad] == [poison.id]
    assert bad[0].retryable is False
    assert "max_payload" in bad[0].error, bad[0].error
    assert [p.id for p in ok] == [e.id for e in good]
    assert nc.is_connected and nc.stats["reconnects"] == reconnects
    stored = await stream_ids(nc, 40)
    assert sorted(mid for _, mid in stored) == sorted(e.id for e in good)


@on_session_loop
async def test_message_exactly_at_max_payload_with_headers_is_sent(nc: Client, stream: str) -> None:
    """The size check counts headers as the server does: one byte under is sent and stored."""
    from runtime.nats.publisher import header_bytes

    ev_id = "fit-exact"
    size = nc.max_payload - header_bytes({MSG_ID_HEADER: ev_id})
    ok, bad = await JetStreamPublisher(nc).publish_batch(
        [Outgoing(id=ev_id, subject=SUBJECT, data=b"y" * size)]
    )
    assert bad == [] and [p.id for p in ok] == [ev_id]
    assert nc.is_connected
