"""Deliveries taken off the NATS wire before nats-py builds anything for them.

A feed's reader gets thousands of JetStream deliveries a second. Through nats-py each one
costs a regex parse of its control line, a header dict, a `Msg`, a trip through its
subscription's queue and a callback task wake-up: most of a gateway's CPU at 5k events/s.
`tap(nc).register(sid, take)` offers every ``MSG``/``HMSG`` frame for subscription `sid`
to `take(subject, reply, headers, payload)` first, in wire order, straight from the
parser; what `take` declines (returns False for), and every frame of any other
subscription, goes on through nats-py exactly as before.

Relies on two internals of the pinned nats-py (2.16), as jobs/jetstream_read.py's
`take_deliveries` does for the Spark source: the protocol parser `nc._ps` (its class is
swapped for `_TapParser`, its state kept, so `reset()` on reconnect still works) and
`nc._process_msg`, which the parser hands a declined frame to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nats.protocol.parser import AWAITING_CONTROL_LINE as _AWAITING_CONTROL_LINE
from nats.protocol.parser import MAX_CONTROL_LINE_SIZE as _MAX_CONTROL_LINE
from nats.protocol.parser import Parser

__all__ = ["Take", "Tap", "tap"]

Take = Callable[[bytes, bytes, "bytes | None", bytes], bool]
"""(subject, reply, headers or None, payload) -> True when taken."""


class Tap:
    """One connection's takers, by subscription id."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.takers: dict[int, Take] = {}

    def register(self, sid: int, take: Take) -> None:
        self.takers[sid] = take

    def unregister(self, sid: int) -> None:
        self.takers.pop(sid, None)

    def take(
        self, sid: int, subject: bytes, reply: bytes, headers: bytes | None, data: bytes
    ) -> bool:
        taker = self.takers.get(sid)
        if taker is None or not taker(subject, reply, headers, data):
            return False
        stats = self.nc.stats  # as nats-py counts every message it processes
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        return True


def tap(nc: Any) -> Tap:
    """`nc`'s tap, installed on first use (one per connection; idempotent)."""
    existing = getattr(nc, "_tierflow_tap", None)
    if existing is not None:
        return existing
    t = Tap(nc)
    parser = nc._ps
    parser.__class__ = _TapParser
    parser.tap = t
    nc._tierflow_tap = t
    return t


class _TapParser(Parser):
    """nats-py's protocol parser with a fast lane for whole ``MSG`` / ``HMSG`` frames that a
    taker claims; anything else (other operations, partial frames, declined frames) is
    nats-py's own parse, with the buffer cut exactly where nats-py would have cut it."""

    tap: Tap

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        take = self.tap.take
        partial = False
        while True:
            declined: tuple[int, bytes, bytes, bytes, bytes | None] | None = None
            op_end = 0  # a whole line of another operation (PING, INFO, +OK, ...) ends here
            pos, size = 0, len(buf)
            view = memoryview(buf)
            try:
                while self.state == _AWAITING_CONTROL_LINE and pos < size:
                    if buf.startswith(b"HMSG ", pos):
                        head = 5
                    elif buf.startswith(b"MSG ", pos):
                        head = 4
                    else:
                        head = 0
                    eol = buf.find(b"\r\n", pos, pos + _MAX_CONTROL_LINE)
                    if eol < 0:
                        partial = size - pos < _MAX_CONTROL_LINE
                        break
                    if not head:
                        op_end = eol + 2
                        break
                    args = view[pos + head : eol].tobytes().split()
                    hdr_len = 0
                    if head == 5 and len(args) == 5:
                        subject, sid, reply, hdr, total = args
                        hdr_len = int(hdr)
                    elif head == 5 and len(args) == 4:
                        subject, sid, hdr, total = args
                        reply, hdr_len = b"", int(hdr)
                    elif head == 4 and len(args) == 4:
                        subject, sid, reply, total = args
                    elif head == 4 and len(args) == 3:
                        subject, sid, total = args
                        reply = b""
                    else:
                        break  # nats-py raises the protocol error
                    start = eol + 2
                    stop = start + int(total)
                    if size < stop + 2:
                        partial = True  # the payload is still on its way
                        break
                    body = start + hdr_len
                    headers = view[start:body].tobytes() if hdr_len else None
                    payload = view[body:stop].tobytes()
                    pos = stop + 2
                    if not take(int(sid), subject, reply, headers, payload):
                        declined = (int(sid), subject, reply, payload, headers)
                        break
            finally:
                view.release()
                if pos:
                    del buf[:pos]
            if declined is not None:
                await self.nc._process_msg(*declined)
            elif op_end:
                # nats-py parses that one line alone; the frames after it stay in this lane
                op_end -= pos
                rest = buf[op_end:]
                del buf[op_end:]
                await super().parse()
                buf.extend(rest)
            else:
                break
        if buf and not partial:
            await super().parse()
