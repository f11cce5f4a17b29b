"""The Collector's side of the stream pattern: buffered source frames into the ingest path.

Its own module because here the collector is not served but reads: a `StreamIngest` node
(stream_ingest.py) writes a source's raw frames to the `buffer` stream, and every
collector binds one shared durable consumer per stream-pattern stream (buffer_consumer.py),
so the frames spread across replicas. Each fetched batch takes the ingest path
(`IngestPath.buffered`); a batch the path refuses (log full, fenced) is left unacked and
redelivered, which is this pattern's backpressure. A system stream's source is never
collected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from actors.collection.buffer import ensure_buffer_stream
from actors.collection.buffer_consumer import BufferConsumer, BufferedFrame
from actors.collection.ingest import IngestPath, is_system_stream
from runtime.engines.services import connect_nats

log = logging.getLogger(__name__)

__all__ = ["BufferIngest"]


class BufferIngest:
    """The buffer consumers of one Collector replica, one per stream-pattern stream."""

    def __init__(self, ingest: IngestPath, *, nats_url: str, name: str) -> None:
        self.ingest = ingest
        self.nats_url = nats_url
        self.name = name
        self._running: list[tuple[BufferConsumer, asyncio.Future[None]]] = []

    def streams(self) -> list[str]:
        """The configured streams with a source, less the system streams."""
        cfg = self.ingest.cfg
        out = []
        for s, sc in cfg.streams.items():
            if not sc.source.url:
                continue
            if is_system_stream(cfg, s):
                log.error("stream %r is a system stream: its source is not collected", s)
                continue
            out.append(s)
        return out

    async def start(self, stop: asyncio.Event) -> None:
        """Bind the consumers and read until `stop` is set (no stream: no connection)."""
        streams = self.streams()
        if not streams:
            return
        nc = await connect_nats(
            self.ingest.cfg, self.nats_url, name=f"collector-{self.name}-buffer", role="collector"
        )
        await ensure_buffer_stream(nc, streams)
        for stream in streams:
            consumer = BufferConsumer(nc, stream, self._handler(stream))
            await consumer.start()
            self._running.append((consumer, asyncio.ensure_future(consumer.run(stop))))

    async def close(self) -> None:
        """After `stop`: each consumer finishes its batch in hand, then unsubscribes."""
        for consumer, task in self._running:
            await task
            await consumer.close()

    def _handler(self, stream: str) -> Callable[[list[BufferedFrame]], Awaitable[None]]:
        async def handle(frames: list[BufferedFrame]) -> None:
            await self.ingest.buffered(stream, frames)

        return handle
