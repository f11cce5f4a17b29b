"""The stream pattern's ingest node and its buffer (book ch. 2, "scaling the stream pattern").

One long-lived source connection is pinned to one node. That node does no business logic:
it pushes raw frames into a durable JetStream buffer as fast as it can, and a separate,
horizontally scaled set of processing collectors consumes the buffer.

    source --(one connection)--> StreamIngest [active]  --> JetStream `buffer`, `buffer.{stream}`
                                 StreamIngest [standby] x k       |
                                                                  v
                                         BufferConsumer x n (one shared durable, work queue)

Pieces, each usable alone:

- `BufferWriter`: frames -> `buffer.{stream}` through `JetStreamPublisher`, in batches (by
  count and ms). A positioned frame goes out with `Nats-Msg-Id` = `{source_id}:{pos}` and a
  `Tf-Pos` header, so a frame written twice (a takeover that re-reads it, a retried publish)
  is stored once; an unpositioned frame gets a fresh time-ordered id.
- `last_position` / `resume_position`: where a new active node resumes, read from the buffer.
- `IngestLease` + `Leadership`: one active node among k+1, over the NATS KV bucket
  `tierflow_leases` (key `ingest.{stream}`, per-key TTL). The holder renews every ttl/3 with
  `update(last=revision)`; a standby tries `create` every `poll_s`. A failed renewal (another
  holder, or any error) stops the ingest work at once, and the writer refuses to publish once
  the last successful renewal is older than 2/3 of the TTL: a deposed node stops writing
  BEFORE its key can expire and a standby can take over. Only publishes already on the wire
  can land after that, and they carry the same `source:pos` ids as the new leader's, so
  JetStream keeps one copy (within the buffer's duplicate window): a brief overlap is
  harmless.
- `StreamIngest`: the Ray actor (a `SupervisedActor`) running the above for one source;
  `start_stream_ingest` starts k+1 named, detached replicas. A replica Ray restarted stays
  out of the lease race for two TTLs, so a dead leader's lease goes to a standby that
  stayed up (measured here: about 2.5-3.3 s from SIGKILL to the first frame buffered by the
  standby, with a 3 s TTL).
- `BufferConsumer`: the processing side; at-least-once into `handler`, redelivered on a
  crash or a raised error; downstream dedups by the frame's msg id.

The buffer keeps frames by age and size (limits retention), not until consumed: the newest
frame must stay readable for `last_position` after the consumers have acked it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import ray
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from actors.collection.sources import Frame, StreamSource, source_from_url
from runtime.config import Config, validate
from runtime.events import new_event_id
from runtime.loop_thread import LoopThread
from runtime.publisher import MSG_ID_HEADER, JetStreamPublisher, Outgoing, jittered
from runtime.ray_supervisor import SupervisedActor
from runtime.services import connect_nats
from runtime.supervision import Backoff, backoff_delay

__all__ = [
    "BUFFER_STREAM",
    "LEASE_BUCKET",
    "POS_HEADER",
    "BufferConsumer",
    "BufferWriteError",
    "BufferWriter",
    "BufferedFrame",
    "Fenced",
    "IngestLease",
    "Leadership",
    "StreamIngest",
    "Term",
    "buffer_subject",
    "ensure_buffer_stream",
    "ensure_lease_bucket",
    "frame_msg_id",
    "last_position",
    "resume_position",
]

log = logging.getLogger(__name__)

BUFFER_STREAM = "buffer"
POS_HEADER = "Tf-Pos"
LEASE_BUCKET = "tierflow_leases"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_STREAM_IN_USE = 10058  # JetStream: stream name already in use with a different configuration


def _check_stream_name(stream: str) -> str:
    """A stream name becomes a subject token, a KV key part and a consumer name."""
    if not _NAME_RE.match(stream):
        raise ValueError(f"stream name {stream!r} must match {_NAME_RE.pattern}")
    return stream


def buffer_subject(stream: str) -> str:
    return f"{BUFFER_STREAM}.{_check_stream_name(stream)}"


def frame_msg_id(source_id: str, pos: int | None) -> str:
    """The frame's dedup id: stable for a positioned frame, unique otherwise."""
    return f"{source_id}:{pos}" if pos is not None else new_event_id()


# --------------------------------------------------------------------------- the buffer


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
        _check_stream_name(name)
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


class BufferWriteError(RuntimeError):
    """Frames were still not stored after every retry (NATS down longer than the horizon)."""


class Fenced(RuntimeError):
    """The writer's fence said no: this node may no longer be the leader."""


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

        writer = BufferWriter(nc, "meetup", source_id="meetup")
        await writer.pump(source)          # until the source ends; or write(frames) yourself

    Guarantees: `write` returns only when every frame is stored (or was already: a
    duplicate), else raises `BufferWriteError`; batches are written one after another, so at
    most `max_batch` frames are unresolved at any time (`resume_position`'s overlap). When
    `fence()` returns False, `write` raises `Fenced` before sending anything more.
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
                raise Fenced(f"fence closed before writing {len(frames) - i} frames")
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


# --------------------------------------------------------------------------- leadership


async def ensure_lease_bucket(js: JetStreamContext, bucket: str = LEASE_BUCKET) -> KeyValue:
    """The lease bucket: history 1, file storage, per-message TTL allowed (each lease key
    expires `ttl` after its last write, so a dead holder's lease lapses by itself)."""
    try:
        kv = await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        kv = await js.create_key_value(
            bucket=bucket, history=1, storage=api.StorageType.FILE, direct=True
        )
    info = await js.stream_info(f"KV_{bucket}")
    if not info.config.allow_msg_ttl:
        raise RuntimeError(
            f"KV bucket {bucket!r} exists without per-message TTL (allow_msg_ttl); "
            "delete it so tierflow can create it"
        )
    return kv


class _LeaseValue(msgspec.Struct):
    holder: str
    at: float


_decode_lease = msgspec.json.Decoder(_LeaseValue).decode


class IngestLease:
    """The lease on `ingest.{stream}` in the KV bucket, held by `holder`.

    `try_acquire()` creates the key (or reclaims it if it still names this holder);
    `renew()` rewrites it only if it is still at our revision; both write with a TTL of
    `ttl_s` whole seconds (NATS per-message TTL), so a holder that stops renewing loses it
    `ttl_s` after its last renewal. Every call is bounded by `op_timeout_s` (default ttl/3)
    and any error counts as "not held". `fresh()` is the local fence: True while the last
    successful write was sent less than 2/3 of the TTL ago, i.e. well before the key can
    expire (the TTL runs from when the server stored it, after we sent it).
    """

    def __init__(
        self,
        nc: Client,
        kv: KeyValue,
        stream: str,
        holder: str,
        *,
        ttl_s: int = 3,
        op_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if int(ttl_s) != ttl_s or ttl_s < 1:
            raise ValueError(f"ttl_s must be a whole number of seconds >= 1, got {ttl_s}")
        self.key = f"ingest.{_check_stream_name(stream)}"
        self.holder = holder
        self.ttl_s = int(ttl_s)
        self.op_timeout_s = op_timeout_s or self.ttl_s / 3
        self._kv = kv
        self._js = nc.jetstream(timeout=self.op_timeout_s)
        # nats-py's KeyValue has no public subject/stream names, and its update() takes no TTL:
        # renewals publish to the key's subject directly, as update() itself does
        self._subject = f"{kv._pre}{self.key}"
        self._clock = clock
        self.revision: int | None = None
        self._sent_at: float | None = None

    @property
    def held(self) -> bool:
        return self.revision is not None

    def fresh(self, now: float | None = None) -> bool:
        if self.revision is None or self._sent_at is None:
            return False
        now = self._clock() if now is None else now
        return now - self._sent_at < self.ttl_s * 2 / 3

    def _value(self) -> bytes:
        return msgspec.json.encode(_LeaseValue(self.holder, time.time()))

    async def _write(self, last: int) -> int:
        """Write the key if its last revision is `last` (0: absent); the new revision."""
        hdrs = {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)}
        ack = await self._js.publish(self._subject, self._value(), headers=hdrs, msg_ttl=self.ttl_s)
        return ack.seq

    async def try_acquire(self) -> bool:
        sent = self._clock()
        try:
            try:
                rev = await self._write(0)
            except nats.js.errors.APIError as err:
                if err.err_code not in (10071, 10164):  # wrong last sequence
                    raise
                rev = await self._take_over_stale()
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as err:
            log.debug("lease %s: acquire failed: %r", self.key, err)
            rev = None
        if rev is None:
            return False
        self.revision, self._sent_at = rev, sent
        return True

    async def _take_over_stale(self) -> int | None:
        """The key exists: take it only if it is a delete/purge marker or names us (a write of
        ours whose answer was lost), and only at the revision just read."""
        msg = await self._js.get_last_msg(self._kv._stream, self._subject)
        op = (msg.headers or {}).get("KV-Operation")
        deleted = op in ("DEL", "PURGE")
        if not deleted and _decode_lease(msg.data or b"{}").holder != self.holder:
            return None
        assert msg.seq is not None
        return await self._write(msg.seq)

    async def renew(self) -> bool:
        """Extend the lease; False (and not held any more) if it was lost or on any error."""
        if self.revision is None:
            return False
        sent = self._clock()
        try:
            self.revision = await self._write(self.revision)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("lease %s lost by %s: %r", self.key, self.holder, err)
            self.revision = None
            return False
        self._sent_at = sent
        return True

    async def release(self) -> None:
        """Give the lease up at once (graceful stop), so a standby need not wait for the TTL."""
        rev, self.revision = self.revision, None
        if rev is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._kv.delete(self.key, last=rev)

    async def current_holder(self) -> str | None:
        try:
            entry = await self._kv.get(self.key)
        except (nats.errors.Error, TimeoutError):
            return None
        return _decode_lease(entry.value or b"{}").holder


@dataclass
class Term:
    """One period as the active node (wall-clock times)."""

    acquired_at: float
    ended_at: float | None = None
    why_ended: str | None = None
    resume_from: int | None = None
    first_write_at: float | None = None


class Leadership:
    """Runs `work()` only while holding `lease`.

    Standby: `try_acquire` every `poll_s`, the first time after `initial_delay_s`. Active:
    `renew` every ttl/3; a failed renewal cancels `work` at once (fencing) and goes back to
    standby. If `work` fails it is started again after a backoff, lease still held (a dead
    source is dead for every replica). On `stop` the work is cancelled and the lease
    released.
    """

    def __init__(
        self,
        lease: IngestLease,
        work: Callable[[], Awaitable[None]],
        *,
        poll_s: float | None = None,
        initial_delay_s: float = 0.0,
        work_backoff: Backoff = Backoff(base_s=0.2, factor=2.0, cap_s=5.0, jitter=0.5),  # noqa: B008
        rng: random.Random | None = None,
    ) -> None:
        self.lease = lease
        self._work = work
        self.poll_s = poll_s if poll_s is not None else lease.ttl_s / 6
        self.renew_s = lease.ttl_s / 3
        self.initial_delay_s = initial_delay_s
        self._backoff = work_backoff
        self._rng = rng or random.Random()
        self.role = "standby"
        self.terms: list[Term] = []
        self.lost = 0
        self.work_failures = 0
        self.last_error: str | None = None

    @property
    def term(self) -> Term | None:
        """The current term while active."""
        return self.terms[-1] if self.role == "active" and self.terms else None

    async def run(self, stop: asyncio.Event) -> None:
        if self.initial_delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.initial_delay_s)
        while not stop.is_set():
            if await self.lease.try_acquire():
                await self._lead(stop)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)

    async def _lead(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        self.terms.append(Term(acquired_at=time.time()))
        self.role = "active"
        log.info("lease %s acquired by %s", self.lease.key, self.lease.holder)
        stopping = asyncio.ensure_future(stop.wait())
        work: asyncio.Task[None] | None = None
        attempt, start_at = 0, loop.time()
        next_renew = loop.time() + self.renew_s
        why = "stopped"
        try:
            while True:
                if work is None and loop.time() >= start_at:
                    work = asyncio.ensure_future(self._work())
                wake = min(next_renew, start_at if work is None else next_renew)
                waits = {stopping} | ({work} if work is not None else set())
                await asyncio.wait(
                    waits, timeout=max(0.0, wake - loop.time()), return_when="FIRST_COMPLETED"
                )
                if stop.is_set():
                    break
                if work is not None and work.done():
                    attempt, start_at = self._work_ended(work, attempt, loop.time())
                    work = None
                if loop.time() >= next_renew:
                    if not await self.lease.renew():
                        self.lost += 1
                        why = "lease lost"
                        break
                    next_renew = loop.time() + self.renew_s
        finally:
            stopping.cancel()
            if work is not None:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self.role = "standby"
            self.terms[-1].ended_at, self.terms[-1].why_ended = time.time(), why
            if why == "stopped":
                await self.lease.release()
            log.info("lease %s: %s is standby (%s)", self.lease.key, self.lease.holder, why)

    def _work_ended(self, work: asyncio.Task[None], attempt: int, now: float) -> tuple[int, float]:
        """(attempt, when to start the work again) after it ended."""
        exc = None if work.cancelled() else work.exception()
        if exc is None:
            return 0, now + self._backoff.base_s
        self.work_failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("ingest work failed (%s); restarting after backoff", self.last_error)
        b = self._backoff
        delay = backoff_delay(
            attempt,
            base=b.base_s,
            factor=b.factor,
            cap=b.cap_s,
            jitter=b.jitter,
            rand=self._rng.random(),
        )
        return attempt + 1, now + delay


# --------------------------------------------------------------------------- the Ray actor

_SUMMED = ("frames", "reconnects", "failures", "gaps", "missed", "repeats", "malformed")
_SUMMED_F = ("downtime_s", "est_missed")
_WRITER_SUMMED = ("written", "duplicates", "batches")


def _restarted_by_ray() -> bool:
    """Whether this actor's process is a Ray restart (False if Ray cannot tell)."""
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - unknown: behave as a first start
        return False


class StreamIngest(SupervisedActor):
    """The ingest node of one stream-pattern source, active or standby by the lease.

    Active: resume the source at `resume_position` (positioned sources) and pump its frames
    into `buffer.{stream}`. Standby: try for the lease. A Ray restart reruns `__init__` with
    a new incarnation, hence a new lease holder id: it cannot reclaim the old lease and waits
    as a standby until the lease is free. All of it runs on a `LoopThread` started in
    `__init__`, so Ray's calls (heartbeat, stats, stop) never queue behind the data plane.

    Args:
        stream: the stream's name (subject token).
        url, kind: the source (see `actors.collection.sources.source_from_url`).
        nats_url: NATS server(s).
        config: the tierflow config (`Config.to_dict()`): NATS credentials (role `ingest`)
            and TLS; None connects with the defaults (no credentials, no TLS).
        state_dir: root of the actor's checkpoint store (SupervisedActor).
        source_id: prefix of the frames' dedup ids; the same for every replica (default the
            stream name), so replicas re-reading a position produce the same id.
        positioned: override the source's default.
        lease_ttl_s: lease TTL in whole seconds; a crashed leader is replaced in about this.
        max_batch, max_delay_ms: writer batching; `max_batch` is also the resume overlap.
        restart_delay_s: after a Ray restart, how long to stay out of the lease race
            (default two TTLs). A standby that stayed up acquires a dead leader's lease within
            a TTL plus a poll, so it wins: the lease goes to the replica that has been healthy,
            and a crash-looping replica cannot keep winning it back.
        source_options: more keywords for the source (backoff, read_timeout_s, ...).
    """

    def __init__(
        self,
        stream: str,
        url: str,
        kind: str = "auto",
        *,
        nats_url: str,
        state_dir: str,
        config: dict[str, Any] | None = None,
        source_id: str | None = None,
        positioned: bool | None = None,
        lease_ttl_s: int = 3,
        max_batch: int = 256,
        max_delay_ms: float = 5.0,
        restart_delay_s: float | None = None,
        source_options: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(state_dir, name=name)
        self.stream = _check_stream_name(stream)
        self.url = url
        self.kind = kind
        self.nats_url = nats_url
        self.cfg: Config = validate(config or {})
        self.source_id = source_id or stream
        self._positioned = positioned
        self._ttl_s = lease_ttl_s
        self._max_batch = max_batch
        self._max_delay_s = max_delay_ms / 1000
        self._source_options = dict(source_options or {})
        if restart_delay_s is None:
            restart_delay_s = 2.0 * lease_ttl_s
        self._initial_delay_s = restart_delay_s if _restarted_by_ray() else 0.0
        self.holder = f"{self.name}/{self.incarnation}"
        self._nc: Client | None = None
        self._leadership: Leadership | None = None
        self._source: StreamSource | None = None
        self._writer: BufferWriter | None = None
        self._term: Term | None = None
        self._totals: dict[str, float] = dict.fromkeys(_SUMMED + _SUMMED_F + _WRITER_SUMMED, 0)
        self._last_written: int | None = None
        self._position: int | None = None
        self._error: str | None = None
        self._dataplane = LoopThread(f"{self.name}-dataplane")
        self._dataplane.start(self._run)

    # ---- remote methods ---------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """Role, lease, terms and counters summed over every source connection and term."""
        return await self._dataplane.run(self._stats())

    async def stop(self) -> None:
        """Stop ingesting and release the lease (a standby takes over without waiting)."""
        await asyncio.to_thread(self._dataplane.stop, 15.0)

    # ---- internals (on the data-plane loop) ---------------------------------------------

    async def _stats(self) -> dict[str, Any]:
        totals = dict(self._totals)
        if self._source is not None:
            s = self._source.stats()
            for k in _SUMMED + _SUMMED_F:
                totals[k] += s[k]
        if self._writer is not None:
            self._note_progress(self._writer, self._term)
            w = self._writer.stats()
            for k in _WRITER_SUMMED:
                totals[k] += w[k]
        lead = self._leadership
        return {
            **self.heartbeat(),
            "stream": self.stream,
            "holder": self.holder,
            "role": lead.role if lead else "starting",
            "restart_delay_s": self._initial_delay_s,
            "lease_revision": lead.lease.revision if lead else None,
            "lease_lost": lead.lost if lead else 0,
            "work_failures": lead.work_failures if lead else 0,
            "last_error": (lead.last_error if lead else None) or self._error,
            "terms": [asdict(t) for t in lead.terms] if lead else [],
            "position": self._source.position if self._source else self._position,
            "last_written_pos": self._last_written,
            **{k: int(v) if k not in _SUMMED_F else v for k, v in totals.items()},
        }

    async def _run(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
        """The data plane: ready at once (NATS may come later), then serve until `stop`."""
        ready()
        attempt = 0
        while not stop.is_set():
            try:
                await self._serve(stop)
                return
            except Exception as err:  # noqa: BLE001 - NATS unreachable: retry with backoff
                self._error = f"{type(err).__name__}: {err}"
                log.warning("stream ingest %s: %s", self.name, self._error)
            await self._close_nc()
            delay = backoff_delay(
                attempt, base=0.2, factor=2.0, cap=5.0, jitter=0.5, rand=random.random()
            )
            attempt += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def _serve(self, stop: asyncio.Event) -> None:
        self._nc = await connect_nats(
            self.cfg, self.nats_url, name=f"tierflow-ingest-{self.name}", role="ingest"
        )
        await ensure_buffer_stream(self._nc, [self.stream])
        kv = await ensure_lease_bucket(self._nc.jetstream())
        lease = IngestLease(self._nc, kv, self.stream, self.holder, ttl_s=self._ttl_s)
        self._leadership = Leadership(lease, self._ingest, initial_delay_s=self._initial_delay_s)
        try:
            await self._leadership.run(stop)
        finally:
            await self._close_nc()

    async def _close_nc(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _ingest(self) -> None:
        """One run of the active role: resume the source from the buffer, pump frames."""
        assert self._nc is not None and self._leadership is not None
        lease = self._leadership.lease
        source = source_from_url(
            self.url, self.kind, positioned=self._positioned, **self._source_options
        )
        start = None
        if source.positioned:
            start = await resume_position(self._nc.jetstream(), self.stream, self._max_batch)
            source.seek(start)
        writer = BufferWriter(
            self._nc,
            self.stream,
            self.source_id,
            max_batch=self._max_batch,
            max_delay_s=self._max_delay_s,
            fence=lease.fresh,
        )
        term = self._leadership.term
        if term is not None and term.resume_from is None:
            term.resume_from = start
        self._source, self._writer, self._term = source, writer, term
        try:
            await writer.pump(source)
        finally:
            source.stop()
            await writer.close()
            self._fold(source, writer, term)

    def _fold(self, source: StreamSource, writer: BufferWriter, term: Term | None) -> None:
        """Add a finished source's and writer's counters to the totals."""
        s, w = source.stats(), writer.stats()
        for k in _SUMMED + _SUMMED_F:
            self._totals[k] += s[k]
        for k in _WRITER_SUMMED:
            self._totals[k] += w[k]
        self._position = source.position
        self._note_progress(writer, term)
        self._source, self._writer, self._term = None, None, None

    def _note_progress(self, writer: BufferWriter, term: Term | None) -> None:
        if writer.last_pos is not None:
            self._last_written = writer.last_pos
        if term is not None and term.first_write_at is None:
            term.first_write_at = writer.first_write_at


# --------------------------------------------------------------------------- the consumer


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
