"""The stream pattern against a real nats-server, a real local Ray and a real ReplayServer:
buffer writes and positions (actors/collection/buffer.py), lease fencing (runtime/nats/lease.py),
the shared buffer consumer (buffer_consumer.py), and the acceptance test of the ingest node
(stream_ingest.py): the active node is SIGKILLed mid-stream and every event still lands
exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import pytest
import ray
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.collection.buffer import (
    BUFFER_STREAM,
    POS_HEADER,
    BufferWriter,
    LeaderFenced,
    buffer_subject,
    ensure_buffer_stream,
    frame_msg_id,
    last_position,
    resume_position,
)
from actors.collection.buffer_consumer import BufferConsumer, BufferedFrame
from actors.collection.sources import Frame
from actors.collection.stream_ingest import lease_key
from cluster.demo.rsvps import RsvpGenerator
from cluster.deploy.stream_ingest import start_stream_ingest
from cluster.replay import GeneratorSource, ReplayServer
from runtime.nats.lease import KvLease, Leadership, ensure_lease_bucket
from runtime.nats.publisher import MSG_ID_HEADER
from runtime.nats.server import NatsServer, connect
from runtime.waiting import WaitTimeout, await_until
from tests.support import fresh_ray

pytestmark = pytest.mark.timeout(120)
on_session_loop = pytest.mark.asyncio(loop_scope="session")

NS = f"test-ingest-{uuid.uuid4().hex[:8]}"
TTL = 2  # lease TTL (s) for the lease tests: short, so expiry tests stay quick


def fresh_stream() -> str:
    return f"s{uuid.uuid4().hex[:10]}"


def frames(start: int, n: int) -> list[Frame]:
    return [Frame(p, b'{"n":%d}' % p) for p in range(start, start + n)]


async def read_buffer(nc: Client, stream: str, timeout: float = 20.0) -> list[tuple[Any, ...]]:
    """Every buffered frame of `stream` as (pos header, msg id, data), in buffer order.

    Reads until the count the stream reports for the subject, so a short read fails."""
    js = nc.jetstream()
    subject = buffer_subject(stream)
    info = await js.stream_info(BUFFER_STREAM, subjects_filter=subject)
    expect = (info.state.subjects or {}).get(subject, 0)
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        mem_storage=True,
        inactive_threshold=30.0,
    )
    sub = await js.pull_subscribe(subject, stream=BUFFER_STREAM, config=config)
    out: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expect and time.monotonic() < deadline:
            with contextlib.suppress(nats.errors.TimeoutError):
                for m in await sub.fetch(500, timeout=1.0):
                    h = m.headers or {}
                    out.append((h.get(POS_HEADER), h.get(MSG_ID_HEADER), m.data))
    finally:
        await sub.unsubscribe()
    assert len(out) == expect, f"read {len(out)} of {expect}"
    return out


async def subject_count(nc: Client, stream: str) -> int:
    subject = buffer_subject(stream)
    info = await nc.jetstream().stream_info(BUFFER_STREAM, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await connect(nats_server.url, name="test-ingest")
    await ensure_buffer_stream(client)
    yield client
    await client.close()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    with fresh_ray(NS):
        yield


# ---- pure parts ---------------------------------------------------------------------------


@pytest.mark.unit
def test_names_and_ids() -> None:
    assert buffer_subject("meetup") == "buffer.meetup"
    for bad in ("a.b", "a b", "*", ">", ""):
        with pytest.raises(ValueError):
            buffer_subject(bad)
    assert frame_msg_id("src", 42) == "src:42"
    assert frame_msg_id("src", None) != frame_msg_id("src", None)
    assert lease_key("meetup") == "ingest.meetup"  # the key every release has used
    with pytest.raises(ValueError):
        lease_key("a.b")
    with pytest.raises(ValueError):
        KvLease(None, None, "ingest.s", "h", ttl_s=1.5)  # type: ignore[arg-type]
    for bad_key in ("", "a b", "a..b", ".a", "a.", "a.*"):
        with pytest.raises(ValueError):
            KvLease(None, None, bad_key, "h")  # type: ignore[arg-type]


# ---- BufferWriter and positions --------------------------------------------------------------


@on_session_loop
async def test_writer_dedups_positions_and_last_position(nc: Client) -> None:
    stream = fresh_stream()
    js = nc.jetstream()
    assert await last_position(js, stream) is None
    assert await resume_position(js, stream, overlap=8) is None
    writer = BufferWriter(nc, stream, source_id="src", max_batch=40)
    await writer.write(frames(0, 100))
    assert (writer.written, writer.duplicates, writer.batches) == (100, 0, 3)
    assert await last_position(js, stream) == 99
    assert await resume_position(js, stream) == 100
    assert await resume_position(js, stream, overlap=10) == 91
    await writer.write(frames(50, 50))  # a takeover re-reading 50..99
    assert (writer.written, writer.duplicates) == (100, 50)
    stored = await read_buffer(nc, stream)
    assert [(p, mid) for p, mid, _ in stored] == [(str(i), f"src:{i}") for i in range(100)]
    assert stored[7][2] == b'{"n":7}'
    await writer.close()


@on_session_loop
async def test_unpositioned_frames_get_unique_ids(nc: Client) -> None:
    stream = fresh_stream()
    writer = BufferWriter(nc, stream, source_id="src")
    await writer.write([Frame(None, b"x")] * 30)
    stored = await read_buffer(nc, stream)
    assert len(stored) == 30 and len({mid for _, mid, _ in stored}) == 30
    assert all(p is None for p, _, _ in stored)
    assert await last_position(nc.jetstream(), stream) is None
    await writer.close()


@on_session_loop
async def test_pump_batches_and_stores_before_raising_the_source_error(nc: Client) -> None:
    stream = fresh_stream()

    async def source() -> AsyncIterator[Frame]:
        for f in frames(0, 1000):
            yield f
            if f.pos is not None and f.pos % 100 == 99:
                await asyncio.sleep(0.001)
        raise ConnectionError("source broke")

    writer = BufferWriter(nc, stream, source_id="p", max_batch=64)
    with pytest.raises(ConnectionError, match="source broke"):
        await writer.pump(source())
    assert writer.written == 1000 and writer.last_pos == 999
    assert 1000 / 64 <= writer.batches < 1000  # grouped, never above max_batch
    stored = await read_buffer(nc, stream)
    assert [int(p) for p, _, _ in stored] == list(range(1000))  # in order
    await writer.close()


@on_session_loop
async def test_closed_fence_stops_the_writer(nc: Client) -> None:
    stream = fresh_stream()
    allowed = [True]
    writer = BufferWriter(nc, stream, source_id="f", max_batch=10, fence=lambda: allowed[0])
    await writer.write(frames(0, 10))
    allowed[0] = False
    with pytest.raises(LeaderFenced):
        await writer.write(frames(10, 10))
    assert await subject_count(nc, stream) == 10
    await writer.close()


# ---- the lease -----------------------------------------------------------------------------


@on_session_loop
async def test_lease_is_exclusive_and_lapses_without_renewal(nc: Client) -> None:
    kv = await ensure_lease_bucket(nc.jetstream())
    stream = fresh_stream()
    a = KvLease(nc, kv, lease_key(stream), "a", ttl_s=TTL)
    b = KvLease(nc, kv, lease_key(stream), "b", ttl_s=TTL)
    assert await a.try_acquire() and a.fresh()
    assert not await b.try_acquire()
    rev = a.revision
    assert await a.renew() and a.revision is not None and a.revision > rev  # type: ignore[operator]
    assert not await b.try_acquire()
    assert await b.current_holder() == "a"
    last_renewal = time.monotonic()  # a "crashes": no more renewals
    await await_until(b.try_acquire, TTL + 5, interval=0.1, what="b takes the lapsed lease")
    assert time.monotonic() - last_renewal >= TTL / 2  # not before the TTL ran out
    assert await b.current_holder() == "b"
    assert not await a.renew()  # deposed: revision mismatch
    assert not a.held and not a.fresh()
    assert not await a.try_acquire()


@on_session_loop
async def test_lease_reclaims_its_own_key_after_a_lost_answer(nc: Client) -> None:
    kv = await ensure_lease_bucket(nc.jetstream())
    stream = fresh_stream()
    a = KvLease(nc, kv, lease_key(stream), "a", ttl_s=TTL)
    assert await a.try_acquire()
    a.revision = None  # as if the answer to our last write never came
    assert await a.try_acquire()  # the key still names us: taken back at its revision
    assert not await KvLease(nc, kv, lease_key(stream), "a2", ttl_s=TTL).try_acquire()


class Worker:
    """A `work` for Leadership: counts ticks while running, notes being cancelled."""

    def __init__(self, fail_first: int = 0) -> None:
        self.ticks = 0
        self.starts = 0
        self.cancelled = 0
        self.fail_first = fail_first

    async def __call__(self) -> None:
        self.starts += 1
        if self.starts <= self.fail_first:
            raise RuntimeError(f"failure {self.starts}")
        try:
            while True:
                self.ticks += 1
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@contextlib.asynccontextmanager
async def leading(leadership: Leadership) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(leadership.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@on_session_loop
async def test_leadership_stops_work_at_once_when_deposed(nc: Client) -> None:
    kv = await ensure_lease_bucket(nc.jetstream())
    stream = fresh_stream()
    work = Worker()
    lead = Leadership(KvLease(nc, kv, lease_key(stream), "a", ttl_s=TTL), work)
    async with leading(lead):
        await await_until(lambda: lead.role == "active" and work.ticks > 5, 10, what="active")
        # another node overwrites the key (no TTL: it stays until deleted)
        stolen_at = time.monotonic()
        await kv.put(f"ingest.{stream}", msgspec.json.encode({"holder": "z", "at": 0.0}))
        # fenced within one renewal period plus one call, i.e. before a TTL could run out
        await await_until(
            lambda: work.cancelled == 1 and lead.role == "standby", TTL, what="work cancelled"
        )
        assert time.monotonic() - stolen_at < TTL
        assert lead.role == "standby" and lead.lost == 1
        assert lead.terms[0].why_ended == "lease lost"
        ticks = work.ticks
        await asyncio.sleep(TTL / 2)  # a standby must not be working: nothing may tick
        assert work.ticks == ticks and lead.role == "standby"
        await kv.delete(f"ingest.{stream}")  # the other node let go
        # the role turns active before its work's task has run: wait for the work's start
        await await_until(
            lambda: lead.role == "active" and work.starts == 2, TTL + 5, what="working again"
        )
        assert len(lead.terms) == 2 and work.starts == 2


@on_session_loop
async def test_leadership_restarts_failed_work_and_releases_on_stop(nc: Client) -> None:
    kv = await ensure_lease_bucket(nc.jetstream())
    stream = fresh_stream()
    work_a, work_b = Worker(fail_first=2), Worker()
    lead_a = Leadership(KvLease(nc, kv, lease_key(stream), "a", ttl_s=TTL), work_a)
    lead_b = Leadership(KvLease(nc, kv, lease_key(stream), "b", ttl_s=TTL), work_b)
    async with leading(lead_a) as stop_a:
        await await_until(lambda: work_a.ticks > 5, 20, what="work running after 2 failures")
        assert lead_a.work_failures == 2 and lead_a.lost == 0 and lead_a.role == "active"
        assert lead_a.last_error == "RuntimeError: failure 2"
        async with leading(lead_b):
            await asyncio.sleep(TTL)  # b keeps trying while a renews: no takeover
            assert lead_b.role == "standby" and work_b.starts == 0
            stop_a.set()
            await await_until(lambda: lead_a.role == "standby", 10, what="a stopped")
            assert lead_a.terms[-1].why_ended == "stopped"
            await await_until(lambda: lead_b.role == "active", TTL + 5, what="b takes over")
            assert await lead_b.lease.current_holder() == "b"


# ---- BufferConsumer --------------------------------------------------------------------------


@on_session_loop
async def test_two_consumers_share_the_buffer_exactly_once(nc: Client) -> None:
    stream, n = fresh_stream(), 2000
    got: dict[str, list[BufferedFrame]] = {"a": [], "b": []}

    def handler(name: str) -> Any:
        async def handle(batch: list[BufferedFrame]) -> None:
            await asyncio.sleep(0.005)  # some work, so the other consumer gets a turn
            got[name].extend(batch)

        return handle

    consumers = [BufferConsumer(nc, stream, handler(k), batch=50) for k in got]
    # both bound before any frame is written (seen on a loaded machine: one consumer bound
    # so late that the other had handled every frame by then)
    await asyncio.gather(*(c.start() for c in consumers))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(c.run(stop)) for c in consumers]
    writer = BufferWriter(nc, stream, source_id="c", max_batch=100)
    try:
        await writer.write(frames(0, n))
        await await_until(lambda: len(got["a"]) + len(got["b"]) >= n, 30, what="all handled")
        await asyncio.sleep(0.5)  # anything more would be a duplicate
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await writer.close()
    every = got["a"] + got["b"]
    assert sorted(f.pos for f in every) == list(range(n))  # type: ignore[type-var]
    assert len({f.msg_id for f in every}) == n
    assert got["a"] and got["b"]  # both shared the work
    assert all(f.deliveries == 1 for f in every)
    assert sum(c.handled for c in consumers) == n
    assert every[0].data == b'{"n":%d}' % every[0].pos


@on_session_loop
async def test_a_failed_batch_is_redelivered(nc: Client) -> None:
    stream, n = fresh_stream(), 300
    handled: list[BufferedFrame] = []
    failed: list[BufferedFrame] = []

    async def flaky(batch: list[BufferedFrame]) -> None:
        if not failed:  # the first batch fails once, as a crash would
            failed.extend(batch)
            raise RuntimeError("handler crashed")
        handled.extend(batch)

    writer = BufferWriter(nc, stream, source_id="r")
    await writer.write(frames(0, n))
    await writer.close()
    consumer = BufferConsumer(nc, stream, flaky, batch=100, nak_delay_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await await_until(lambda: len(handled) >= n, 30, what="all handled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert sorted(f.pos for f in handled) == list(range(n))  # type: ignore[type-var]
    assert len(failed) == 100
    again = {f.msg_id: f.deliveries for f in handled}
    assert all(again[f.msg_id] == 2 for f in failed)  # the same frames, delivered again
    assert consumer.handler_errors == 1 and consumer.redelivered == 100


# ---- the acceptance test: Ray, SIGKILL, takeover, exactly once --------------------------------


async def call(handle: Any, method: str, timeout: float = 5.0) -> Any:
    return await asyncio.wait_for(getattr(handle, method).remote(), timeout)


@on_session_loop
async def test_standby_takes_over_after_sigkill_and_every_event_lands_once(
    ray_local: None, nats_server: NatsServer, nc: Client, tmp_path: Path
) -> None:
    stream, n = fresh_stream(), 3000
    replay = ReplayServer(GeneratorSource(9), rate=1000, count=n)
    await replay.start()
    handles = start_stream_ingest(
        stream,
        replay.stream_url,
        "ws",
        replicas=2,
        nats_url=nats_server.url,
        state_dir=str(tmp_path),
        namespace=NS,
        lease_ttl_s=3,
    )
    try:

        async def roles() -> list[str]:
            return [s["role"] for s in await asyncio.gather(*(call(h, "stats") for h in handles))]

        # An actor still being created under load answers `stats` late: a timed-out
        # call is "not yet", bounded by the wait's own deadline.
        await await_until(
            lambda: _sorted(roles()), 60, interval=0.1, swallow=True, what="one active, one standby"
        )
        stats = await asyncio.gather(*(call(h, "stats") for h in handles))
        active = 0 if stats[0]["role"] == "active" else 1
        victim, survivor = handles[active], handles[1 - active]
        before = stats[active]

        async def victim_wrote() -> bool:
            return ((await call(victim, "stats"))["last_written_pos"] or 0) >= 1000

        await await_until(
            victim_wrote, 30, interval=0.05, swallow=True, what="1000 frames buffered"
        )
        killed_at = time.time()
        os.kill(before["pid"], signal.SIGKILL)

        async def took_over() -> dict[str, Any] | None:
            s = await call(survivor, "stats")
            terms = s["terms"]
            return s if terms and terms[-1]["first_write_at"] else None

        try:
            after = await await_until(
                took_over, 30, interval=0.05, swallow=True, what="standby takes over"
            )
        except WaitTimeout as err:
            seen = await asyncio.gather(
                *(call(h, "stats") for h in handles), return_exceptions=True
            )
            raise AssertionError(f"{err}; stats now: {seen}") from err
        term = after["terms"][-1]
        takeover_s = term["first_write_at"] - killed_at
        print(
            f"\ntakeover: lease acquired {term['acquired_at'] - killed_at:.2f} s after SIGKILL, "
            f"first frame buffered {takeover_s:.2f} s after it; resumed from position "
            f"{term['resume_from']} (lease TTL 3 s)"
        )
        assert takeover_s < 30

        async def all_buffered() -> bool:
            return await subject_count(nc, stream) >= n

        await await_until(all_buffered, 60, interval=0.2, what="3000 frames buffered")
        stored = await read_buffer(nc, stream)
        positions = [int(p) for p, _, _ in stored]
        assert len(positions) == n and set(positions) == set(range(n))  # each exactly once
        assert {mid for _, mid, _ in stored} == {f"{stream}:{p}" for p in range(n)}
        want = [msgspec.json.encode(r) for r in RsvpGenerator(9).take(n)]
        assert all(data == want[int(p)] for p, _, data in stored)

        final = await call(survivor, "stats")
        assert final["role"] == "active" and final["lease_lost"] == 0
        assert term["resume_from"] is not None and term["resume_from"] <= positions[-1]

        async def restarted_as_standby() -> dict[str, Any] | None:
            s = await call(victim, "stats")
            ok = s["incarnation"] != before["incarnation"] and s["role"] == "standby"
            return s if ok else None

        back = await await_until(
            restarted_as_standby, 60, interval=0.2, swallow=True, what="victim back as standby"
        )
        assert back["pid"] != before["pid"] and back["terms"] == []
        assert before["restart_delay_s"] == 0 and back["restart_delay_s"] == 6.0
        assert await subject_count(nc, stream) == n  # nothing written twice since
    finally:
        for h in handles:
            with contextlib.suppress(Exception):
                await call(h, "stop", 15)
            ray.kill(h, no_restart=True)
        await replay.stop()


async def _sorted(roles: Any) -> bool:
    return sorted(await roles) == ["active", "standby"]
