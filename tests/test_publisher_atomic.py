"""JetStreamPublisher.publish_atomic against a real nats-server: atomic batches (ADR-50)
with per-event dedup ids, the per-event fallbacks, the server's batch limit, and a server
killed mid-batch."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.api import StreamConfig

from runtime.config import Config
from runtime.nats.publisher import (
    MAX_ATOMIC_BATCH,
    Failed,
    JetStreamPublisher,
    Outgoing,
    Published,
    batch_headers,
    batch_limit_from,
    batch_wire,
)
from runtime.nats.server import NatsServer
from runtime.waiting import await_until
from tests.test_publisher import by_id, cfg, events, fresh_stream, nc, stream_ids

# cfg and nc are test_publisher's module fixtures, imported so pytest finds them here
__all__ = ["cfg", "nc"]

pytestmark = pytest.mark.timeout(120)
on_session_loop = pytest.mark.asyncio(loop_scope="session")

STREAM = "t"  # tests.test_publisher's helpers read stream `t` on subject raw.t
SUBJECT = "raw.t"
PLAIN = "plain"  # a stream created without allow_atomic (an operator's own)
PLAIN_SUBJECT = "plain.x"


@pytest.fixture
async def stream(nc: Client, nats_server: NatsServer, cfg: Config) -> str:
    """A fresh, empty stream `t` made by ensure_streams (so with allow_atomic), and no `plain`."""
    name = await fresh_stream(nc, nats_server, cfg, also_delete=(PLAIN,))
    info = await nc.jetstream().stream_info(name)
    assert info.config.allow_atomic is True
    return name


def assert_seqs_match(ok: list[Published], stored: list[tuple[int, str]]) -> None:
    """Every reported sequence is where the stream holds that id."""
    at = {mid: seq for seq, mid in stored}
    for p in ok:
        assert at[p.id] == p.seq, (p, at.get(p.id))


# ---- pure parts ---------------------------------------------------------------------------


@pytest.mark.unit
def test_batch_headers_and_limit_parsing() -> None:
    ev = Outgoing(id="a", subject="s", data=b"", headers={"X": "1"})
    assert batch_headers(ev, "b1", 3) == {
        "X": "1",
        "Nats-Msg-Id": "a",
        "Nats-Batch-Id": "b1",
        "Nats-Batch-Sequence": "3",
    }
    assert batch_headers(ev, "b1", 4, commit=True)["Nats-Batch-Commit"] == "1"
    assert batch_limit_from("atomic publish batch is too large: 1000") == 1000
    assert batch_limit_from("atomic publish batch is too large") is None


def nats_py_wire(evs: list[Outgoing], batch_id: str, reply: str) -> bytes:
    """What nats-py's `publish` sends for each message of the batch (its header block and
    `hpub_cmd`), the control line's empty reply written as one space, as the server reads it."""
    from nats.protocol.command import hpub_cmd

    out = b""
    for j, ev in enumerate(evs, 1):
        last = j == len(evs)
        headers = batch_headers(ev, batch_id, j, commit=last)
        hdr = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
        cmd = hpub_cmd(ev.subject, reply if last else "", hdr + b"\r\n", ev.data)
        out += cmd.replace(b"  ", b" ", 1) if not last else cmd
    return out


@pytest.mark.unit
def test_batch_wire_is_what_nats_py_sends_or_none() -> None:
    evs = [Outgoing(id=f"id-{i}", subject="raw.t", data=b"{}" * i) for i in range(1, 4)]
    evs.append(Outgoing(id="last~", subject="raw.u", data=b""))
    assert batch_wire(evs, "b-1", "_INBOX.x.7", 1 << 20) == nats_py_wire(evs, "b-1", "_INBOX.x.7")
    one = [Outgoing(id="a", subject="s", data=b"x")]
    assert batch_wire(one, "b", "r", 0) == nats_py_wire(one, "b", "r")  # 0: no limit known
    # left to nats-py's checks: headers of its own, a space or line break, a big payload
    for odd in (
        Outgoing(id="a", subject="s", data=b"", headers={"X": "1"}),
        Outgoing(id="a b", subject="s", data=b""),
        Outgoing(id="a\r\nPUB x 1", subject="s", data=b""),
        Outgoing(id="a", subject="s t", data=b""),
        Outgoing(id="\u00e9", subject="s", data=b""),
        Outgoing(id="a", subject="s", data=b"x" * 11),
    ):
        assert batch_wire([*evs, odd], "b", "r", 10) is None, odd


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12),
        min_size=1,
        max_size=40,
    ),
    subjects=st.lists(st.sampled_from(["raw.t", "raw.u.v", "s"]), min_size=1, max_size=40),
    batch_id=st.text(
        st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20
    ),
)
def test_batch_wire_matches_nats_py_on_any_plain_batch(
    ids: list[str], subjects: list[str], batch_id: str
) -> None:
    evs = [
        Outgoing(id=i, subject=subjects[k % len(subjects)], data=b"x" * (k % 7))
        for k, i in enumerate(ids)
    ]
    assert batch_wire(evs, batch_id, "_INBOX.r.1", 1 << 20) == nats_py_wire(
        evs, batch_id, "_INBOX.r.1"
    )


@pytest.mark.unit
def test_batch_wire_sequences_of_every_width() -> None:
    evs = [Outgoing(id=f"e{i}", subject="raw.t", data=b"{}") for i in range(1002)]
    assert batch_wire(evs, "b", "r", 0) == nats_py_wire(evs, "b", "r")


# ---- against the server -------------------------------------------------------------------


@on_session_loop
async def test_batch_is_stored_with_every_id_and_right_seqs(nc: Client, stream: str) -> None:
    pub = JetStreamPublisher(nc)
    await pub.publish_batch(events("pre", 7))  # the batch does not start at sequence 1
    evs = events("at", 600)
    ok, bad = await pub.publish_atomic(evs, stream=stream)
    assert bad == []
    assert [p.id for p in ok] == [e.id for e in evs]
    assert [p.seq for p in ok] == list(range(8, 608))
    assert all(p.stream == STREAM and not p.duplicate for p in ok)
    assert pub.batches == 1 and pub.batch_fallbacks == 0 and pub.in_flight == 0
    stored = await stream_ids(nc, 607)
    assert_seqs_match(ok, stored)


@on_session_loop
async def test_resend_of_whole_batch_and_mixed_batch_store_one_copy(
    nc: Client, stream: str
) -> None:
    pub = JetStreamPublisher(nc)
    evs = events("rs", 400)
    first, bad = await pub.publish_atomic(evs[:200], stream=stream)
    assert bad == [] and pub.batches == 1
    again, bad = await pub.publish_atomic(evs[:200], stream=stream)  # 10201: every id stored
    assert bad == [] and pub.batch_fallbacks == 1
    assert [p.id for p in again] == [p.id for p in first]
    assert all(p.duplicate for p in again)
    assert [p.seq for p in again] == [p.seq for p in first]
    mixed = evs[100:300]  # half stored already, half new
    ok, bad = await pub.publish_atomic(mixed, stream=stream)
    assert bad == [] and pub.batch_fallbacks == 2
    got = by_id(ok)
    for i, e in enumerate(mixed):
        assert got[e.id].duplicate is (i < 100), e.id
    # the new half is committed as a batch next time: nothing to fall back for
    ok, bad = await pub.publish_atomic(evs[300:], stream=stream)
    assert bad == [] and pub.batches == 2 and pub.batch_fallbacks == 2
    stored = await stream_ids(nc, 400)
    assert sorted(mid for _, mid in stored) == sorted(e.id for e in evs)
    assert_seqs_match([*first, *by_id(ok).values(), *got.values()], stored)


@on_session_loop
async def test_same_id_twice_in_one_call_is_stored_once(nc: Client, stream: str) -> None:
    pub = JetStreamPublisher(nc)
    evs = events("tw", 10)
    ok, bad = await pub.publish_atomic([*evs, evs[3]], stream=stream)
    assert bad == [] and len(ok) == 11 and pub.batch_fallbacks == 1
    assert [p.duplicate for p in ok if p.id == evs[3].id] == [False, True]
    await stream_ids(nc, 10)


@on_session_loop
async def test_stream_without_allow_atomic_falls_back_and_is_remembered(
    nc: Client, stream: str
) -> None:
    await nc.jetstream().add_stream(StreamConfig(name=PLAIN, subjects=[PLAIN_SUBJECT]))
    pub = JetStreamPublisher(nc)
    evs = events("pl", 300, subject=PLAIN_SUBJECT)
    ok, bad = await pub.publish_atomic(evs[:150], stream=PLAIN)
    assert bad == [] and [p.id for p in ok] == [e.id for e in evs[:150]]
    assert pub.batch_fallbacks == 1 and pub.batches == 0
    assert not pub.atomic_allowed(PLAIN) and pub.atomic_allowed(STREAM)
    ok2, bad = await pub.publish_atomic(evs[150:], stream=PLAIN)
    assert bad == [] and pub.batch_fallbacks == 1  # asked no more: straight to per event
    info = await nc.jetstream().stream_info(PLAIN)
    assert info.state.messages == 300  # the refused batch messages were not stored
    assert sorted(p.seq for p in ok + ok2) == list(range(1, 301))


@on_session_loop
async def test_batch_over_the_server_limit_is_split(nc: Client, stream: str) -> None:
    pub = JetStreamPublisher(nc)
    n = 2 * MAX_ATOMIC_BATCH + 300
    evs = events("sp", n)
    ok, bad = await pub.publish_atomic(evs, stream=stream)
    assert bad == [] and [p.id for p in ok] == [e.id for e in evs]
    assert pub.batches == 3 and pub.batch_fallbacks == 0
    assert_seqs_match(ok, await stream_ids(nc, n))


@on_session_loop
async def test_limit_learned_from_the_servers_refusal(nc: Client, stream: str) -> None:
    """A publisher told a larger limit than the server's (10199) publishes that batch
    event by event, then keeps to the limit the error names."""
    pub = JetStreamPublisher(nc, max_batch=MAX_ATOMIC_BATCH + 200)
    evs = events("lim", 2 * (MAX_ATOMIC_BATCH + 200))
    ok, bad = await pub.publish_atomic(evs[: MAX_ATOMIC_BATCH + 200], stream=stream)
    assert bad == [] and pub.batch_fallbacks == 1 and pub.batches == 0
    assert pub.max_batch == MAX_ATOMIC_BATCH
    ok2, bad = await pub.publish_atomic(evs[MAX_ATOMIC_BATCH + 200 :], stream=stream)
    assert bad == [] and pub.batches == 2 and pub.batch_fallbacks == 1
    assert_seqs_match(ok + ok2, await stream_ids(nc, len(evs)))


@on_session_loop
async def test_oversized_event_fails_alone_rest_is_committed(nc: Client, stream: str) -> None:
    good = events("ov", 40)
    poison = Outgoing(id="ov-poison", subject=SUBJECT, data=b"x" * (nc.max_payload - 16))
    reconnects = nc.stats["reconnects"]
    pub = JetStreamPublisher(nc)
    ok, bad = await pub.publish_atomic([*good[:20], poison, *good[20:]], stream=stream)
    assert [f.id for f in bad] == [poison.id] and bad[0].retryable is False
    assert "max_payload" in bad[0].error
    assert [p.id for p in ok] == [e.id for e in good]
    assert pub.batches == 1 and nc.is_connected and nc.stats["reconnects"] == reconnects
    assert_seqs_match(ok, await stream_ids(nc, 40))


@on_session_loop
async def test_no_stream_for_the_subject_fails_retryable(nc: Client, stream: str) -> None:
    pub = JetStreamPublisher(nc, ack_timeout=2.0)
    ok, bad = await pub.publish_atomic(events("ns", 30, subject="nostream.z"), stream="none")
    assert ok == [] and len(bad) == 30
    assert all(f.retryable for f in bad) and pub.in_flight == 0


@on_session_loop
async def test_server_killed_mid_batches_then_retry_stores_each_once(
    nc: Client, nats_server: NatsServer, stream: str
) -> None:
    pub = JetStreamPublisher(nc, ack_timeout=1.0, max_batch=200)
    evs = events("kill", 30_000)
    task = asyncio.ensure_future(pub.publish_atomic(evs, stream=stream))
    try:
        await await_until(lambda: pub.batches >= 3, 30, interval=0.001, what="3 batches in")
    finally:
        nats_server.kill()
    try:
        ok, bad = await asyncio.wait_for(task, 60)
    finally:
        nats_server.restart()
    assert sorted([*(p.id for p in ok), *(f.id for f in bad)]) == sorted(e.id for e in evs)
    assert bad, "the kill came after every batch was in"
    assert all(f.retryable for f in bad), {f.error for f in bad if not f.retryable}
    assert pub.in_flight == 0
    await await_until(lambda: nc.is_connected, 20, what="client reconnected after restart")
    results: dict[str, Published] = {p.id: p for p in ok}
    pending: list[Failed] = bad
    want = {e.id: e for e in evs}
    for _ in range(20):  # bounded retries of what failed, same ids
        if not pending:
            break
        again, pending = await pub.publish_atomic([want[f.id] for f in pending], stream=stream)
        assert all(f.retryable for f in pending)
        results.update({p.id: p for p in again})
    assert pending == []
    stored = await stream_ids(nc, len(evs), timeout=60)
    assert sorted(mid for _, mid in stored) == sorted(want)
    assert_seqs_match(list(results.values()), stored)


@on_session_loop
async def test_concurrent_calls_share_batches_each_gets_its_own_outcomes(
    nc: Client, stream: str
) -> None:
    pub = JetStreamPublisher(nc)
    await pub.start()
    calls = [events(f"cc{c}", 100) for c in range(10)]
    got = await asyncio.gather(*(pub.publish_atomic(evs, stream=stream) for evs in calls))
    for evs, (ok, bad) in zip(calls, got, strict=True):
        assert bad == [] and [p.id for p in ok] == [e.id for e in evs]
    # two batches go out at once; the eight calls that came meanwhile share the third
    assert pub.batches <= 3 and pub.batch_fallbacks == 0
    assert_seqs_match([p for ok, _ in got for p in ok], await stream_ids(nc, 1000))


@on_session_loop
async def test_stored_id_in_one_call_of_a_shared_batch_keeps_everyone_exactly_once(
    nc: Client, stream: str
) -> None:
    pub = JetStreamPublisher(nc)
    old = events("so", 50)
    await pub.publish_atomic(old, stream=stream)
    fresh = [events(f"sf{c}", 60) for c in range(5)]
    calls = [*fresh[:2], old[:10] + events("sx", 5), *fresh[2:]]  # one call resends 10
    got = await asyncio.gather(*(pub.publish_atomic(evs, stream=stream) for evs in calls))
    for evs, (ok, bad) in zip(calls, got, strict=True):
        assert bad == [] and [p.id for p in ok] == [e.id for e in evs]
    resent = by_id(got[2][0])
    assert all(resent[e.id].duplicate for e in old[:10])
    assert not any(p.duplicate for ok, _ in got for p in ok if not p.id.startswith("so"))
    stored = await stream_ids(nc, 50 + 5 * 60 + 5)
    assert len({mid for _, mid in stored}) == len(stored)
    assert_seqs_match([p for ok, _ in got for p in ok], stored)
