"""NATS deliveries taken off the wire before nats-py builds anything for them.

Through nats-py each delivered message costs a regex parse of its control line, a header
dict, a `Msg`, a trip through its subscription's queue and a callback wake-up: most of a
reader's CPU at thousands of messages a second. `FastLaneParser` offers every whole
``MSG``/``HMSG`` frame to its `take(sid, subject, reply, headers, payload)` first, in wire
order, straight from the buffer; what `take` declines (returns False for), and every
other operation, goes on through nats-py's own handling. Used by the gateway's stream
readers (actors/access/wire.py) and the Spark source's workers (jobs/jetstream_read.py).

Relies on two internals of the pinned nats-py (2.16): the protocol parser `nc._ps`, whose
class `install` swaps (its state kept, so `reset()` on reconnect still works), and
`nc._process_msg`, which a declined frame is handed to. A leaf: it imports nats-py's parser
alone, so the Spark source's per-query process stays light.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nats.protocol.parser import AWAITING_CONTROL_LINE as _AWAITING_CONTROL_LINE
from nats.protocol.parser import MAX_CONTROL_LINE_SIZE as _MAX_CONTROL_LINE
from nats.protocol.parser import Parser

__all__ = ["FastLaneParser", "Take", "install"]

Take = Callable[[int, bytes, bytes, "bytes | None", bytes], bool]
"""(sid, subject, reply, headers or None, payload) -> True when taken."""


def install(nc: Any, take: Take) -> None:
    """Make `nc`'s parser offer its ``MSG``/``HMSG`` frames to `take` first."""
    parser = nc._ps
    parser.__class__ = FastLaneParser
    parser.take = take


class FastLaneParser(Parser):
    """nats-py's protocol parser with a fast lane for whole ``MSG`` / ``HMSG`` frames that
    `take` claims; anything else (other operations, partial frames, declined frames) is
    nats-py's own parse, with the buffer cut exactly where nats-py would have cut it. Each
    field is copied out of the buffer once (through a memoryview, released before the
    buffer is cut)."""

    take: Take

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        take = self.take
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
