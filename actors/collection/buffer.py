"""The stream pattern's buffer: the JetStream stream `buffer`, its positions and its writer.

An ingest node (`actors/collection/stream_ingest.py`) writes a source's raw frames to
`buffer.{stream}`; processing collectors read them back (`buffer_consumer.py`).

- `BufferWriter`: frames -> `buffer.{stream}` through `JetStreamPublisher`, in batches (by
  count and ms). A positioned frame goes out with `Nats-Msg-Id` = `{source_id}:{pos}` and a
  `Tf-Pos` header, so a frame written twice (a takeover that re-reads it, a retried publish)
  is stored once; an unpositioned frame gets a fresh time-ordered id. Given a `fence` (the
  lease's `fresh`), it refuses to write once the fence closes.
- `last_position` / `resume_position`: where a new active node resumes, read from the buffer.

The buffer keeps frames by age and size (limits retention), not until consumed: the newest
frame must stay readable for `last_position` after the consumers have acked it.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterable, Callable, Sequence
from typing import Any

import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext, api

from actors.collection.sources import Frame
from runtime.data.events import new_event_id
from runtime.errors import FencedError, TierflowError
from runtime.nats.publisher import JetStreamPublisher, Outgoing, jittered

__all__ = [
    "BUFFER_STREAM",
    "POS_HEADER",
    "BufferWriteError",
    "BufferWriter",
    "LeaderFenced",
    "buffer_subject",
    "check_stream_name",
    "ensure_buffer_stream",
    "frame_msg_id",
    "last_position",
    "resume_position",
]

BUFFER_STREAM = "buffer"
POS_HEADER = "Tf-Pos"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_STREAM_IN_USE = 10058  # JetStream: stream name already in use with a different configuration


def check_stream_name(stream: str) -> str:
    """A stream name becomes a subject token, a KV key part and a consumer name."""
    if not _NAME_RE.match(stream):
        raise ValueError(f"stream name {stream!r} must match {_NAME_RE.pattern}")
    return stream


def buffer_subject(stream: str) -> str:
    return f"{BUFFER_STREAM}.{check_stream_name(stream)}"


def frame_msg_id(source_id: str, pos: int | None) -> str:
    """The frame's dedup id: stable for a positioned frame, unique otherwise."""
    return f"{source_id}:{pos}" if pos is not None else new_event_id()


# --------------------------------------------------------------------------- the stream


async def ensure_buffer_stream(
    nc: Client,
    stream_names: Sequence[str] = (),
    *,
    duplicate_window_s: float = 120.0,
    max_age_s: float = 86_400.0,
    max_bytes: int = -1,
    replicas: int = 1,
) -> api.StreamInfo:
    """Create (or update) the `buffer` stream: file storage, limits retention, capturing
    `buffer.>` so every stream's `buffer.{stream}` subject lands in it without a racy
    read-modify-write of a subject list. `stream_names` are only validated here.

    `duplicate_window_s` bounds how late a re-read frame is still deduplicated: keep it
    above the longest takeover plus publish retry horizon."""
    for name in stream_names:
        check_stream_name(name)
    config = api.StreamConfig(
        name=BUFFER_STREAM,
        subjects=[f"{BUFFER_STREAM}.>"],
        storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.LIMITS,
        num_replicas=replicas,
        duplicate_window=duplicate_window_s,
        max_age=max_age_s,
        max_bytes=max_bytes,
        allow_direct=True,
    )
    js = nc.jetstream()
    try:
        return await js.add_stream(config)
    except nats.js.errors.BadRequestError as err:
        if err.err_code != _STREAM_IN_USE:
            raise
        return await js.update_stream(config)


async def last_position(js: JetStreamContext, stream: str) -> int | None:
    """`Tf-Pos` of the newest frame buffered for `stream`; None if there is none, or the
    newest frame is unpositioned."""
    try:
        msg = await js.get_last_msg(BUFFER_STREAM, buffer_subject(stream))
    except nats.js.errors.NotFoundError:
        return None
    raw = (msg.headers or {}).get(POS_HEADER)
    return int(raw) if raw is not None else None


async def resume_position(js: JetStreamContext, stream: str, overlap: int = 1) -> int | None:
    """Where a new active node asks its source to start: `last_position + 1`, moved back by
    `overlap - 1` frames. The newest stored frame is a safe resume point only if everything
    before it is stored too; a writer with at most `overlap` frames unresolved at once (one
    batch) can leave holes only within that many positions before it, and re-reading them
    costs nothing but duplicates JetStream drops. None: nothing buffered, start fresh."""
    if overlap < 1:
        raise ValueError(f"overlap must be >= 1, got {overlap}")
    last = await last_position(js, stream)
    return None if last is None else max(0, last + 1 - (overlap - 1))


# --------------------------------------------------------------------------- the writer


class BufferWriteError(TierflowError, RuntimeError):
    """Frames were still not stored after every retry (NATS down longer than the horizon)."""


class LeaderFenced(FencedError, RuntimeError):
    """The writer's fence said no: this node may no longer be the leader of its stream."""


class _End:
    """The reader's last item: the source ended, with `error` if it failed."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


async def _take_batch(
    queue: asyncio.Queue[Frame | _End], first: Frame, max_n: int, max_delay_s: float
) -> tuple[list[Frame], _End | None]:
    """`first` plus whatever else arrives within `max_delay_s` of it, up to `max_n` frames,
    taking what is already queued without waiting; and the end marker if it came."""
    batch = [first]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_delay_s
    while len(batch) < max_n:
        try:
            item = queue.get_nowait()
        except asyncio.QueueEmpty:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                item = await asyncio.wait_for(queue.get(), remaining)
            except TimeoutError:
                break
        if isinstance(item, _End):
            return batch, item
        batch.append(item)
    return batch, None


class BufferWriter:
    """Pushes frames of one stream into the buffer, batched, with dedup ids.

        writer = BufferWriter(nc, "orders", source_id="orders")
        await writer.pump(source)          # until the source ends; or write(frames) yourself

    Guarantees: `write` returns only when every frame is stored (or was already: a
    duplicate), else raises `BufferWriteError`; batches are written one after another, so at
    most `max_batch` frames are unresolved at any time (`resume_position`'s overlap). When
    `fence()` returns False, `write` raises `LeaderFenced` before sending anything more.
    """

    def __init__(
        self,
        nc: Client,
        stream: str,
        source_id: str,
        *,
        max_batch: int = 256,
        max_delay_s: float = 0.005,
        ack_timeout_s: float = 5.0,
        attempts: int = 5,
        fence: Callable[[], bool] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.stream = stream
        self.subject = buffer_subject(stream)
        self.source_id = source_id
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.attempts = attempts
        self._fence = fence
        self._pub = JetStreamPublisher(nc, max_in_flight=max_batch, ack_timeout=ack_timeout_s)
        self._backoff = jittered(0.05, 1.0, rng or random.Random())
        self.frames = 0  # frames handed to write()
        self.written = 0  # stored new
        self.duplicates = 0  # already stored (re-read or retried)
        self.batches = 0
        self.last_pos: int | None = None  # position of the last frame of the last batch
        self.first_write_at: float | None = None  # wall clock of the first stored batch
        self.last_write_at: float | None = None

    def outgoing(self, frame: Frame) -> Outgoing:
        headers = {POS_HEADER: str(frame.pos)} if frame.pos is not None else {}
        return Outgoing(frame_msg_id(self.source_id, frame.pos), self.subject, frame.data, headers)

    async def write(self, frames: Sequence[Frame]) -> None:
        """Store `frames` (chunks of `max_batch`, in order); see the class guarantees."""
        for i in range(0, len(frames), self.max_batch):
            chunk = frames[i : i + self.max_batch]
            if self._fence is not None and not self._fence():
                raise LeaderFenced(f"fence closed before writing {len(frames) - i} frames")
            self.frames += len(chunk)
            ok, failed = await self._pub.publish_with_retry(
                [self.outgoing(f) for f in chunk], attempts=self.attempts, backoff=self._backoff
            )
            if failed:
                raise BufferWriteError(
                    f"{len(failed)} of {len(chunk)} frames not stored: {failed[0].error}"
                )
            dups = sum(1 for p in ok if p.duplicate)
            self.duplicates += dups
            self.written += len(ok) - dups
            self.batches += 1
            self.last_pos = chunk[-1].pos
            self.last_write_at = time.time()
            if self.first_write_at is None:
                self.first_write_at = self.last_write_at

    async def pump(self, frames: AsyncIterable[Frame], queue_size: int | None = None) -> None:
        """Read `frames` as fast as they come (a reader task and a bounded queue, so the
        source is never held up by one publish round trip) and write them in batches until
        the iteration ends. A source error is raised here, after what it yielded is stored.
        Cancelling stops both the reading and the writing at once."""
        queue: asyncio.Queue[Frame | _End] = asyncio.Queue(queue_size or 4 * self.max_batch)

        async def read() -> None:
            error: BaseException | None = None
            try:
                async for frame in frames:
                    await queue.put(frame)
            except Exception as err:  # noqa: BLE001 - handed to the writer loop
                error = err
            await queue.put(_End(error))

        reader = asyncio.create_task(read())
        try:
            end: _End | None = None
            while end is None:
                item = await queue.get()
                if isinstance(item, _End):
                    end = item
                    break
                batch, end = await _take_batch(queue, item, self.max_batch, self.max_delay_s)
                await self.write(batch)
            if end.error is not None:
                raise end.error
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def close(self) -> None:
        await self._pub.close()

    def stats(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "written": self.written,
            "duplicates": self.duplicates,
            "batches": self.batches,
            "last_pos": self.last_pos,
            "first_write_at": self.first_write_at,
            "last_write_at": self.last_write_at,
        }
