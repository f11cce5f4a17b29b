"""The gateway's wire tap (actors/access/wire.py): frames a taker claims are taken in wire
order, whatever way the bytes are cut into reads, and everything else reaches nats-py as
its own parser would hand it over (checked against nats-py's parser on the same bytes)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.protocol.parser import Parser

from actors.access.reader import JetStreamReader
from actors.access.wire import tap

pytestmark = pytest.mark.unit

STATUS_408 = b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 7\r\n\r\n"
STORED = b"NATS/1.0\r\nNats-Msg-Id: e-1\r\n\r\n"


def hmsg(subject: bytes, sid: int, reply: bytes, headers: bytes, payload: bytes) -> bytes:
    total = len(headers) + len(payload)
    return b"HMSG %s %d %s %d %d\r\n%s%s\r\n" % (
        subject,
        sid,
        reply,
        len(headers),
        total,
        headers,
        payload,
    )


WIRE = b"".join(
    [
        b"+OK\r\n",
        hmsg(b"raw.a", 7, b"$JS.ACK.s.c.1.1.1.1700000000000000000.9", STORED, b'{"n":1}'),
        b"PING\r\n",
        b"MSG raw.a 7 $JS.ACK.s.c.1.2.2.1700000000000000000.8 7\r\n" + b'{"n":2}' + b"\r\n",
        b"MSG other 3 5\r\nhello\r\n",  # another subscription: nats-py's
        hmsg(b"_INBOX.x", 7, b"", STATUS_408, b""),  # a status: declined by the taker
        hmsg(b"raw.a", 7, b"$JS.ACK.s.c.1.3.3.1700000000000000000.7", STORED, b""),
        b"MSG raw.a 7 $JS.ACK.s.c.1.4.4.1700000000000000000.6 2\r\n[]\r\n",
        b"PONG\r\n",
    ]
)


class FakeNc:
    """What a parser calls on its client, recorded in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.stats = {"in_msgs": 0, "in_bytes": 0}

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        self.events.append(("msg", sid, subject, reply, data, headers))

    async def _process_ping(self) -> None:
        self.events.append(("ping",))

    async def _process_pong(self) -> None:
        self.events.append(("pong",))


async def feed(parser: Parser, data: bytes, cuts: list[int]) -> None:
    last = 0
    for cut in [*cuts, len(data)]:
        await parser.parse(data[last:cut])
        last = cut


@pytest.mark.parametrize("step", [0, 1, 7, 64])
async def test_taken_frames_keep_wire_order_and_the_rest_goes_to_nats_py(step: int) -> None:
    oracle = FakeNc()
    await feed(Parser(oracle), WIRE, [])
    nc = FakeNc()
    nc._ps = Parser(nc)

    def take(subject: bytes, reply: bytes, headers: bytes | None, data: bytes) -> bool:
        if headers is not None and headers.startswith(b"NATS/1.0 "):
            return False
        nc.events.append(("msg", 7, subject, reply, data, headers))
        return True

    t = tap(nc)
    assert tap(nc) is t  # installed once per connection
    t.register(7, take)
    cuts = list(range(step, len(WIRE), step)) if step else []
    await feed(nc._ps, WIRE, cuts)
    assert nc.events == oracle.events  # the same frames, bytes and order
    assert nc._ps.buf == b""
    taken = [e for e in nc.events if e[0] == "msg" and e[1] == 7 and e[5] != STATUS_408]
    assert nc.stats == {"in_msgs": len(taken), "in_bytes": sum(len(e[4]) for e in taken)}
    t.unregister(7)
    nc.events.clear()
    await feed(nc._ps, WIRE, cuts)
    assert nc.events == oracle.events  # unregistered: all of it through nats-py


async def test_a_partial_frame_waits_for_the_rest() -> None:
    nc = FakeNc()
    nc._ps = Parser(nc)
    got: list[bytes] = []
    tap(nc).register(7, lambda s, r, h, d: got.append(d) is None)
    frame = b"MSG raw.a 7 $JS.ACK.s.c.1.4.4.1700000000000000000.6 2\r\n[]\r\n"
    for i in range(len(frame)):
        await nc._ps.parse(frame[i : i + 1])
    assert got == [b"[]"]
    assert nc.events == []


class FakeJs:
    def __init__(self) -> None:
        self._nc = FakeNc()


def test_the_reader_takes_deliveries_and_leaves_statuses_to_nats_py() -> None:
    reader = JetStreamReader(FakeJs(), "meetup")
    reply = b"$JS.ACK.meetup.c.1.41.41.1700000000000000000.3"
    assert reader._take(b"raw.meetup", reply, STORED, b'{"n":1}')
    assert reader._take(b"raw.meetup", reply, None, b"")  # stored empty, no headers
    assert not reader._take(b"_INBOX.x", b"", STATUS_408, b"")
    assert not reader._take(b"_INBOX.x", b"", b"NATS/1.0 100 Idle Heartbeat\r\n\r\n", b"")
    first, pending = reader._buf[0]  # type: ignore[misc]
    assert (first.seq, first.subject, first.raw, pending) == (41, "raw.meetup", b'{"n":1}', 3)
    assert len(reader._buf) == 2
    assert reader._ready.is_set()
