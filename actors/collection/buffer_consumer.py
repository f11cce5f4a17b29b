"""The processing side of the stream pattern: collectors reading `buffer.{stream}` back.

Every processing collector runs a `BufferConsumer` per stream-pattern stream, all bound to
one shared durable pull consumer, so the frames an ingest node buffered
(`actors/collection/buffer.py`) spread across the collectors as a work queue. Delivery is
at-least-once into `handler`: redelivered on a crash or a raised error, so downstream
dedups by the frame's msg id (the collector makes it the event id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from actors.collection.buffer import BUFFER_STREAM, POS_HEADER, buffer_subject
from runtime.nats.publisher import MSG_ID_HEADER

__all__ = [
    "BufferConsumer",
    "BufferedFrame",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BufferedFrame:
    """A frame read back from the buffer: `msg_id` is its dedup id (the downstream event id
    derives from it), `seq` its buffer sequence, `deliveries` > 1 on a redelivery."""

    data: bytes
    pos: int | None
    msg_id: str
    seq: int
    deliveries: int


def _buffered(msg: Msg) -> BufferedFrame:
    hdrs = msg.headers or {}
    raw = hdrs.get(POS_HEADER)
    meta = msg.metadata
    return BufferedFrame(
        data=msg.data,
        pos=int(raw) if raw is not None else None,
        msg_id=hdrs.get(MSG_ID_HEADER, ""),
        seq=meta.sequence.stream,
        deliveries=meta.num_delivered,
    )


class BufferConsumer:
    """One processing collector's reader of `buffer.{stream}`.

    Every `BufferConsumer` of a stream binds the same durable pull consumer (`durable`,
    default `proc_{stream}`), so they share the work: each frame goes to one of them.
    `handler(frames)` gets a fetched batch; the batch is acked only after it returns, and
    nak'ed (redelivered after `nak_delay_s`) if it raises. A consumer that dies holding a
    batch has it redelivered after `ack_wait_s`. So delivery is at-least-once: the handler
    must be idempotent by `msg_id`.
    """

    def __init__(
        self,
        nc: Client,
        stream: str,
        handler: Callable[[list[BufferedFrame]], Awaitable[None]],
        *,
        durable: str | None = None,
        batch: int = 256,
        fetch_timeout_s: float = 1.0,
        ack_wait_s: float = 5.0,
        max_ack_pending: int = 4096,
        nak_delay_s: float = 0.2,
        create_timeout_s: float = 30.0,
    ) -> None:
        self.stream = stream
        self.subject = buffer_subject(stream)
        self.durable = durable or f"proc_{stream}"
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.nak_delay_s = nak_delay_s
        self.create_timeout_s = create_timeout_s
        self._nc = nc
        self._handler = handler
        self._config = api.ConsumerConfig(
            durable_name=self.durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_ack_pending=max_ack_pending,
            deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=self.subject,
        )
        self._sub: JetStreamContext.PullSubscription | None = None
        self.fetched = 0
        self.handled = 0
        self.redelivered = 0
        self.handler_errors = 0
        self.fetch_errors = 0
        self.last_error: str | None = None

    async def start(self) -> None:
        """Create or bind the shared durable, retrying until `create_timeout_s` (right after a
        NATS node loss a consumer create can time out while leaders are elected)."""
        if self._sub is not None:
            return
        js = self._nc.jetstream()
        deadline = time.monotonic() + self.create_timeout_s
        attempt = 0
        while True:
            try:
                self._sub = await js.pull_subscribe(
                    self.subject, durable=self.durable, stream=BUFFER_STREAM, config=self._config
                )
                return
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(min(1.0, 0.1 * 2**attempt))
            attempt += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and handle batches until `stop` is set (noticed within `fetch_timeout_s`)."""
        await self.start()
        while not stop.is_set():
            await self.poll()

    async def poll(self) -> int:
        """One bounded fetch and its handling; the number of frames handled."""
        assert self._sub is not None, "call start() first"
        try:
            msgs = await self._sub.fetch(self.batch, timeout=self.fetch_timeout_s)
        except TimeoutError:  # nothing to fetch (nats-py raises both kinds)
            return 0
        except nats.errors.Error as err:  # e.g. a 503 while the server is busy or restarting
            self.fetch_errors += 1
            self.last_error = f"fetch: {type(err).__name__}: {err}"
            log.info("buffer %s: %s", self.stream, self.last_error)
            await asyncio.sleep(min(1.0, self.fetch_timeout_s))
            return 0
        self.fetched += len(msgs)
        frames = [_buffered(m) for m in msgs]
        self.redelivered += sum(1 for f in frames if f.deliveries > 1)
        try:
            await self._handler(frames)
        except Exception as err:  # noqa: BLE001 - the batch is redelivered
            self.handler_errors += 1
            self.last_error = f"{type(err).__name__}: {err}"
            log.warning("buffer %s handler failed: %s", self.stream, self.last_error)
            for m in msgs:
                with contextlib.suppress(nats.errors.Error):
                    await m.nak(delay=self.nak_delay_s)
            return 0
        for m in msgs:
            await m.ack()
        self.handled += len(msgs)
        return len(msgs)

    async def close(self) -> None:
        """Stop reading; the durable and its unacked frames stay for the other consumers."""
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def stats(self) -> dict[str, Any]:
        return {
            "fetched": self.fetched,
            "handled": self.handled,
            "redelivered": self.redelivered,
            "handler_errors": self.handler_errors,
            "fetch_errors": self.fetch_errors,
            "last_error": self.last_error,
        }
