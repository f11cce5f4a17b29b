"""Reading JetStream for the access tier: ephemeral pull consumers and single messages.

A feed (actors/access/fanout.py), a client's private history read and a webhook each read
a stream through their own `JetStreamReader`: no acks, memory storage, one replica, deleted
on close and by the server soon after its reader's process dies. KV buckets are streams
too (`KV_<bucket>`); their messages become key changes (messages.kv_message).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError

from actors.access.messages import KV_PREFIX, OpenReader, Reader, StreamMessage, kv_message
from actors.access.wire import tap
from runtime.errors import TierflowError
from runtime.nats.server import publish

__all__ = [
    "ConsumerLost",
    "JetStreamReader",
    "PullCredit",
    "delivery_position",
    "jetstream_opener",
    "stored_message",
]

_STATUS = "Status"
_PENDING = "Nats-Pending-Messages"
_GRACE_S = 0.5  # past the newest request's expiry, credit no answer accounted for is stale
_PLAIN_HEADERS = b"NATS/1.0\r\n"  # a header block with no status line: a stored message's


class PullCredit:
    """How many messages the pull requests still open may deliver, and when to ask for more.

    Pure but for the clock passed in. Requests overlap, so a batch stored while one request
    is being answered flows in on the next, with no round trip between (a request per
    fetch, answered once, cut an atomic batch in two with a round trip between the halves
    under load). What is requested but not delivered, plus what is delivered and not yet
    read, stays within `2 * batch`: the subscription's buffer is never asked to hold more.
    Requests end by being filled (silently: counted by deliveries) or expiring (a 408 with
    what it still owed); credit left past the newest request's expiry (an answer lost to
    a reconnect) is dropped, so reading can never stall on a request that no longer exists.
    """

    def __init__(self, batch: int, expires_s: float, clock: Callable[[], float]) -> None:
        self.batch = max(1, batch)
        self.expires_s = expires_s
        self._clock = clock
        self.credit = 0
        self._last_deadline = 0.0

    def want(self, buffered: int) -> int:
        """The batch of the request to send now (0: none), counted as open once returned."""
        now = self._clock()
        if self.credit and now > self._last_deadline + _GRACE_S:
            self.credit = 0  # every request sent has ended by now: what they owe is gone
        if buffered + self.credit >= self.batch:
            return 0
        self.credit += self.batch
        self._last_deadline = now + self.expires_s
        return self.batch

    def delivered(self, n: int = 1) -> None:
        self.credit = max(0, self.credit - n)

    def ended(self, owed: int) -> None:
        """A request expired (or was refused) owing `owed` messages."""
        self.credit = max(0, self.credit - owed)


class JetStreamReader:
    """An ephemeral pull consumer (no acks, memory storage, one replica) from `start_seq`,
    or of the last message per subject (a KV snapshot). Deleted with `close()`, and by the
    server after `inactive_s` if this process dies. Its pull requests overlap (`PullCredit`):
    what is stored while one fetch's messages are handled is already on its way.

    A stream reader's deliveries are taken off the wire (actors/access/wire.py: no nats-py
    `Msg`, header dict or callback per message); statuses (408, 409, 100, ...) and a KV
    reader's messages, whose headers matter, still come through nats-py to `_on_msg`.

    The consumer is one replica on one server: when that server is cut off or crashes, its
    pull requests vanish without an answer (no 503 until the cluster notices the route
    is gone, which a partition delays by minutes). So every request asks for idle
    heartbeats, and a reader that heard nothing (no message, no status) for
    `heartbeat_misses` heartbeats raises `ConsumerLost` on its next fetch: the caller
    reopens it from its position, on a server that answers."""

    def __init__(
        self,
        js: Any,
        stream: str,
        start_seq: int = 1,
        *,
        last_per_subject: bool = False,
        inactive_s: float = 30.0,
        pending_msgs: int = 8192,
        heartbeat_s: float = 2.0,
        heartbeat_misses: int = 3,
    ) -> None:
        self.js = js
        self.stream = stream
        self.start_seq = max(1, start_seq)
        self.kv = stream.startswith(KV_PREFIX)
        self._last_per_subject = last_per_subject
        self._inactive_s = inactive_s
        self._pending_msgs = pending_msgs
        self._sub: Any = None
        self.name = ""
        self.num_pending = 0
        self._next = self._inbox = ""
        self._buf: deque[Msg | tuple[StreamMessage, int]] = deque()
        self._tapped: Any = None
        self._ready = asyncio.Event()
        self._credit: PullCredit | None = None
        self._error: Exception | None = None
        self._heartbeat_s = heartbeat_s
        self._heartbeat_misses = heartbeat_misses
        self._silent_limit_s = 0.0  # 0: no heartbeats asked for, silence proves nothing
        self._heard = time.monotonic()  # last message or status from the consumer
        self._asked = 0.0  # when the first request since the last word heard went out

    async def open(self) -> JetStreamReader:
        self.name = f"tf-gw-{uuid.uuid4().hex[:16]}"
        config = ConsumerConfig(
            name=self.name,
            ack_policy=AckPolicy.NONE,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=self._inactive_s,
        )
        if self._last_per_subject:
            config.deliver_policy = DeliverPolicy.LAST_PER_SUBJECT
            bucket = self.stream[len(KV_PREFIX) :]
            config.filter_subject = f"$KV.{bucket}.>" if self.kv else ">"
        else:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self.start_seq
        info = await self.js.add_consumer(self.stream, config)
        self.num_pending = info.num_pending or 0
        nc = self.js._nc
        self._next = f"{self.js._prefix}.CONSUMER.MSG.NEXT.{self.stream}.{self.name}"
        self._inbox = nc.new_inbox()
        self._sub = await nc.subscribe(
            self._inbox,
            cb=self._on_msg,
            pending_msgs_limit=self._pending_msgs,
            pending_bytes_limit=256 << 20,
        )
        if not self.kv:
            self._tapped = tap(nc)
            self._tapped.register(self._sub._id, self._take)
        return self

    def _take(self, subject: bytes, reply: bytes, headers: bytes | None, data: bytes) -> bool:
        """A delivery straight off the wire, in arrival order; False for a status (no
        payload and a status line), which goes through nats-py to `_on_msg`."""
        if headers is not None and not data and not headers.startswith(_PLAIN_HEADERS):
            return False
        position = delivery_position(reply.decode())
        if position is None:  # a reply shape not known here: nats-py's Msg parses it
            msg = Msg(self.js._nc, subject.decode(), reply.decode(), data)
            self._buf.append(msg)
        else:
            seq, pending = position
            self._buf.append((StreamMessage(seq, subject.decode(), data), pending))
        if self._credit is not None:
            self._credit.delivered()
        self._heard = time.monotonic()
        self._ready.set()
        return True

    async def _on_msg(self, msg: Msg) -> None:
        """Every delivery and status of this reader's pull requests, in arrival order."""
        self._heard = time.monotonic()
        status = msg.headers.get(_STATUS) if msg.headers and not msg.data else None
        if status is None:
            self._buf.append(msg)
            if self._credit is not None:
                self._credit.delivered()
            self._ready.set()
            return
        if status == "100":  # idle heartbeat: nothing owed changes
            return
        if status in ("408", "409") and self._credit is not None:
            owed = msg.headers.get(_PENDING) if msg.headers else None
            self._credit.ended(int(owed) if owed and owed.isdigit() else 0)
            if status == "409":  # too many requests waiting: the next fetch asks again
                if "MaxWaiting" not in (msg.headers or {}).get("Description", ""):
                    self._error = _status_error(msg)  # consumer deleted, limits, ...
                    self._ready.set()
                return
            # expired: asked again at once, so a fetch waiting now does not wait for nothing
            with contextlib.suppress(Exception):  # a closed connection: the fetch raises
                await self._ask(self._credit.batch, self._credit.expires_s)
            return
        if status != "404":  # 503 no responders (consumer or stream gone), ...
            self._error = _status_error(msg)
            self._ready.set()

    async def _ask(self, max_events: int, timeout: float) -> None:
        """Keep pull requests open so deliveries flow without a round trip per fetch."""
        if self._credit is None or self._credit.batch != max(1, max_events):
            self._credit = PullCredit(max_events, max(timeout, 1.0), time.monotonic)
        batch = self._credit.want(len(self._buf))
        if batch:
            expires = int(self._credit.expires_s * 1e9)
            ask: dict[str, int] = {"batch": batch, "expires": expires}
            beat = min(self._heartbeat_s, self._credit.expires_s / 2)  # the server's rule
            if beat > 0:
                ask["idle_heartbeat"] = int(beat * 1e9)
                self._silent_limit_s = beat * self._heartbeat_misses
            body = json.dumps(ask).encode()
            await publish(self.js._nc, self._next, body, reply=self._inbox)  # raises a lost cancel
            if self._asked <= self._heard:  # heard since the last wait began: a new one
                self._asked = time.monotonic()

    async def fetch(self, max_events: int, timeout: float) -> list[StreamMessage]:
        """Up to `max_events` messages in stream order, waiting up to `timeout` for one;
        raises what the server answered when the consumer cannot be read (the caller
        reopens)."""
        if self._error is not None:
            raise self._error
        self._check_heard()
        await self._ask(max_events, timeout)
        if not self._buf:
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # never swallows the task's own cancel
                    await self._ready.wait()
            if self._error is not None:
                raise self._error
        buf = self._buf
        msgs = [buf.popleft() for _ in range(min(max_events, len(buf)))]
        await self._ask(max_events, timeout)
        out: list[StreamMessage] = []
        for m in msgs:
            if isinstance(m, tuple):
                out.append(m[0])
                self.num_pending = m[1]
                continue
            position = delivery_position(m.reply)
            if position is None:  # a reply shape not known here: nats-py's parse decides
                meta = m.metadata
                position = meta.sequence.stream, meta.num_pending
            seq, self.num_pending = position
            if self.kv:
                out.append(kv_message(seq, m.subject, m.data, m.headers))
            else:
                out.append(StreamMessage(seq, m.subject, m.data))
        return out

    def _check_heard(self) -> None:
        """Raise `ConsumerLost` when requests are open and the consumer has said nothing
        for longer than the heartbeats allow (see the class doc)."""
        # A request owes an answer: messages, heartbeats while it waits, a 408 when it
        # expires. Silence counts from the first request sent since the last word heard
        # (a reader left unread for a while heard nothing because it asked nothing).
        waiting = self._asked > self._heard
        silent = time.monotonic() - self._asked
        limit = self._silent_limit_s
        if limit and waiting and not self._buf and silent > limit:
            raise ConsumerLost(f"consumer {self.name} of {self.stream!r} silent for {silent:.1f}s")

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if self._tapped is not None and sub is not None:
            self._tapped.unregister(sub._id)
        with contextlib.suppress(Exception):
            if sub is not None:
                await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self.js.delete_consumer(self.stream, self.name)


class ConsumerLost(TierflowError):
    """A reader's consumer stopped answering (its server cut off or gone): reopen it."""


def _status_error(msg: Msg) -> Exception:
    """The error nats-py raises for a status answer (its `from_msg` only raises)."""
    try:
        APIError.from_msg(msg)
    except Exception as err:  # noqa: BLE001 - returned, for the next fetch to raise
        return err
    return APIError()  # not reached: from_msg always raises


def delivery_position(reply: str | None) -> tuple[int, int] | None:
    """(stream sequence, messages still pending) of a JetStream delivery, read from its
    reply subject as nats-py's `Msg.metadata` reads it (the v1 and v2 `$JS.ACK` shapes),
    without the datetime and dataclasses that parse builds for every message (a tenth of
    a feed's read CPU); None for anything else."""
    if not reply:
        return None
    t = reply.split(".")
    if len(t) < 9 or t[0] != "$JS" or t[1] != "ACK":
        return None
    try:
        if len(t) == 9:
            return int(t[5]), int(t[8])
        if len(t) >= 11:
            return int(t[Msg.Ack.StreamSeq]), int(t[Msg.Ack.NumPending])
    except ValueError:  # not numbers where they belong: not a delivery
        pass
    return None


def jetstream_opener(js: Any, stream: str, **options: Any) -> OpenReader:
    """`start_seq -> Reader` over JetStream `stream` (for a Feed or a history read)."""

    async def open_reader(start_seq: int) -> Reader:
        return await JetStreamReader(js, stream, start_seq, **options).open()

    return open_reader


def stored_message(raw: Any, kv: bool) -> StreamMessage:
    """A message read by sequence or by subject (`js.get_msg`, `js.get_last_msg`)."""
    data = raw.data or b""
    if kv:
        return kv_message(raw.seq, raw.subject, data, raw.headers)
    return StreamMessage(raw.seq, raw.subject, data)
