"""Reading JetStream for the access tier: ephemeral pull consumers and single messages.

A feed (actors/access/fanout.py), a client's private history read and a webhook each read
a stream through their own `JetStreamReader`: no acks, memory storage, one replica, deleted
on close and by the server soon after its reader's process dies. KV buckets are streams
too (`KV_<bucket>`); their messages become key changes (messages.kv_message).
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.access.messages import KV_PREFIX, OpenReader, Reader, StreamMessage, kv_message

__all__ = ["JetStreamReader", "delivery_position", "jetstream_opener", "stored_message"]


class JetStreamReader:
    """An ephemeral pull consumer (no acks, memory storage, one replica) from `start_seq`,
    or of the last message per subject (a KV snapshot). Deleted with `close()`, and by the
    server after `inactive_s` if this process dies."""

    def __init__(
        self,
        js: Any,
        stream: str,
        start_seq: int = 1,
        *,
        last_per_subject: bool = False,
        inactive_s: float = 30.0,
        pending_msgs: int = 8192,
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
        self._sub = await self.js.pull_subscribe_bind(
            name=self.name,
            stream=self.stream,
            pending_msgs_limit=self._pending_msgs,
            pending_bytes_limit=256 << 20,
        )
        return self

    async def fetch(self, max_events: int, timeout: float) -> list[StreamMessage]:
        try:
            msgs = await self._sub.fetch(max_events, timeout=timeout)
        except TimeoutError:  # nats-py raises its TimeoutError, a subclass
            return []
        out: list[StreamMessage] = []
        for m in msgs:
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

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        with contextlib.suppress(Exception):
            if sub is not None:
                await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self.js.delete_consumer(self.stream, self.name)


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
