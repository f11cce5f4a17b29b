"""A JetStream-KV lease: one holder of a key at a time, fenced before the key can lapse.

Any role that must run something on exactly one replica (a stream's ingest node, a
webhook's sender) holds a lease on one key of a KV bucket and does the work only while it
holds it:

    kv = await ensure_lease_bucket(nc.jetstream())              # bucket `tierflow_leases`
    lease = KvLease(nc, kv, "ingest.orders", holder="node-a/3", ttl_s=3)
    await Leadership(lease, work).run(stop)     # work() runs only while the lease is held

- `KvLease`: acquire / renew / release with revision-checked puts. Every write carries a
  NATS per-message TTL of `ttl_s` whole seconds, so the key of a holder that stops renewing
  (SIGKILL, partition) expires by itself `ttl_s` after its last write, and a standby's
  create then succeeds. A renewal succeeds only at the revision this holder wrote last, so
  two holders never both renew. `fresh()` is the local fence: True only while the last
  successful write was SENT less than 2/3 of the TTL ago, i.e. well before the server
  can expire the key (its TTL runs from when it stored the write, after we sent it). A
  writer that checks `fresh()` before each side effect stops before anyone else can hold
  the lease; only effects already on the wire can land after that, so they must be
  idempotent (dedup ids) for a brief overlap to be harmless.
- `Leadership`: the loop around a lease. Standby: `try_acquire` every `poll_s`. Active:
  `renew` every ttl/3; a failed renewal cancels the work at once and goes back to
  standby; failed work is restarted after a backoff, lease still held. Each period as
  holder is a `Term` (wall-clock times, why it ended).

- `LeaseKeeper`: a `KvLease` held from sync code (an actor's threads) on a loop thread of
  its own; once acquired it renews by itself and calls `on_lost` when the lease is
  definitely someone else's (or gone), not on a mere missed answer. Its `epoch` is a
  fencing token for the writers it guards (jobs/sink.py).

On the wire (kept as stream ingest always wrote it): the value is the JSON object
`{"holder": <holder>, "at": <wall-clock seconds of the write>}`, plus `epoch` (the
revision of the term's first write; 0 in that write itself, whose epoch is its own
revision) and `info` (what the holder says about itself) where given; a graceful release
is a KV delete at the held revision. The bucket needs per-message TTL (`allow_msg_ttl`),
which nats-py's `create_key_value` turns on. A term's epoch only grows: it is a revision
of the bucket's stream (while the bucket itself is not deleted and made again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from runtime.loop_thread import LoopThread
from runtime.nats.publish import raise_swallowed_cancel
from runtime.supervision.policy import Backoff, backoff_delay

__all__ = [
    "LEASE_BUCKET",
    "KvLease",
    "LeaseKeeper",
    "LeaseState",
    "Leadership",
    "Term",
    "ensure_lease_bucket",
]

log = logging.getLogger(__name__)

LEASE_BUCKET = "tierflow_leases"
# A KV key: dot-separated tokens of letters, digits and -/_= (NATS' own key rule).
_KEY_RE = re.compile(r"^[-/_=A-Za-z0-9]+(\.[-/_=A-Za-z0-9]+)*$")
_WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream: the expected last revision did not match
T = TypeVar("T")


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


class _LeaseValue(msgspec.Struct, omit_defaults=True):
    holder: str
    at: float
    epoch: int = 0
    info: dict[str, Any] = msgspec.field(default_factory=dict)


_decode_lease = msgspec.json.Decoder(_LeaseValue).decode


@dataclass(frozen=True)
class LeaseState:
    """What the bucket holds for a lease key now: the last write's revision, its holder,
    the term's epoch (the revision of the term's first write), the holder's wall clock at
    the write (its own clock: not comparable across hosts) and what it says about itself."""

    revision: int
    holder: str
    epoch: int
    at: float
    info: Mapping[str, Any] = field(default_factory=dict)


class KvLease:
    """The lease on `key` in the KV bucket `kv`, held by `holder` (see the module doc).

    `try_acquire()` creates the key (or reclaims it if it still names this holder);
    `renew()` rewrites it only if it is still at our revision; both write with a TTL of
    `ttl_s` whole seconds (NATS per-message TTL), so a holder that stops renewing loses it
    `ttl_s` after its last renewal. Every call is bounded by `op_timeout_s` (default ttl/3)
    and any error counts as "not held". `fresh()` is the local fence: True while the last
    successful write was sent less than 2/3 of the TTL ago, i.e. well before the key can
    expire (the TTL runs from when the server stored it, after we sent it). `revision` is
    the held revision (None when not held): a fencing token a store can check.

    `holder` names this replica and incarnation: a restarted process must use a new one,
    or it would reclaim its dead predecessor's lease instead of waiting for it to lapse.
    """

    def __init__(
        self,
        nc: Client,
        kv: KeyValue,
        key: str,
        holder: str,
        *,
        ttl_s: int = 3,
        op_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        if int(ttl_s) != ttl_s or ttl_s < 1:
            raise ValueError(f"ttl_s must be a whole number of seconds >= 1, got {ttl_s}")
        if not _KEY_RE.match(key):
            raise ValueError(f"lease key {key!r} must match {_KEY_RE.pattern}")
        self.key = key
        self.holder = holder
        self.ttl_s = int(ttl_s)
        self.op_timeout_s = op_timeout_s or self.ttl_s / 3
        self._kv = kv
        self._js = nc.jetstream(timeout=self.op_timeout_s)
        # nats-py's KeyValue has no public subject/stream names, and its update() takes no TTL:
        # renewals publish to the key's subject directly, as update() itself does
        self._subject = f"{kv._pre}{self.key}"
        self._clock = clock
        self.info = dict(info or {})
        self.revision: int | None = None
        self.epoch: int | None = None  # the revision of this term's first write
        self._sent_at: float | None = None

    @property
    def held(self) -> bool:
        return self.revision is not None

    def fresh(self, now: float | None = None) -> bool:
        """Whether this holder may still act: held, and last written under 2/3 TTL ago."""
        if self.revision is None or self._sent_at is None:
            return False
        now = self._clock() if now is None else now
        return now - self._sent_at < self.ttl_s * 2 / 3

    def _value(self) -> bytes:
        return msgspec.json.encode(
            _LeaseValue(self.holder, time.time(), self.epoch or 0, self.info)
        )

    def _held_at(self, rev: int, sent: float) -> None:
        """A term began with the write at `rev`: its epoch."""
        self.revision, self.epoch, self._sent_at = rev, rev, sent

    async def _write(self, last: int) -> int:
        """Write the key if its last revision is `last` (0: absent); the new revision. A
        cancel nats-py swallowed is raised by the caller once the revision is noted."""
        hdrs = {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)}
        ack = await self._js.publish(self._subject, self._value(), headers=hdrs, msg_ttl=self.ttl_s)
        return ack.seq

    async def try_acquire(self) -> bool:
        """Take the lease if it is free (or ours); False if another holds it or on any error."""
        sent = self._clock()
        self.epoch = None  # a new term: its first write carries no epoch (it is its own)
        try:
            try:
                rev = await self._write(0)
            except nats.js.errors.APIError as err:
                if err.err_code not in _WRONG_LAST_SEQUENCE:
                    raise
                rev = await self._take_over_stale()
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as err:
            log.debug("lease %s: acquire failed: %r", self.key, err)
            rev = None
        if rev is not None:
            self._held_at(rev, sent)
        raise_swallowed_cancel()  # after noting the revision, so a release can delete it
        return rev is not None

    async def take(self, revision: int) -> bool:
        """Take the lease from a holder the caller knows is gone, at `revision` (the one
        it read): only if nobody wrote the key since. False if someone did or on any error."""
        sent = self._clock()
        self.epoch = None
        try:
            rev: int | None = await self._write(revision)
        except (nats.errors.Error, TimeoutError) as err:
            log.debug("lease %s: take at %d failed: %r", self.key, revision, err)
            rev = None
        if rev is not None:
            self._held_at(rev, sent)
        raise_swallowed_cancel()
        return rev is not None

    async def read(self) -> LeaseState | None:
        """The key's current value; None when absent, deleted or expired. Errors propagate:
        an unknown state is not a free lease."""
        try:
            msg = await self._js.get_last_msg(self._kv._stream, self._subject)
        except nats.js.errors.NotFoundError:
            return None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            return None
        value = _decode_lease(msg.data)
        assert msg.seq is not None
        return LeaseState(msg.seq, value.holder, value.epoch or msg.seq, value.at, value.info)

    async def extend(self) -> bool | None:
        """Renew, telling a lost lease from a lost answer: True renewed; False lost for
        good (another holder, or the key gone: it expired or was deleted); None no answer
        (still held if the server kept it: `fresh()` says how long to trust that). A
        renewal that landed though its answer was lost is recognised by the value (this
        holder, this epoch) and renewed from there."""
        if self.revision is None or self.epoch is None:
            return False
        sent = self._clock()
        try:
            try:
                rev = await self._write(self.revision)
            except nats.js.errors.APIError as err:
                if err.err_code not in _WRONG_LAST_SEQUENCE:
                    raise
                now = await self.read()
                if now is None or now.holder != self.holder or now.epoch != self.epoch:
                    log.warning("lease %s lost by %s: now %s", self.key, self.holder, now)
                    self.revision = None
                    return False
                rev = await self._write(now.revision)
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as err:
            log.info("lease %s: renewal by %s unanswered: %r", self.key, self.holder, err)
            raise_swallowed_cancel()
            return None
        self.revision, self._sent_at = rev, sent
        raise_swallowed_cancel()
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
        else:
            self._sent_at = sent
        raise_swallowed_cancel()  # after noting the revision, so a release can delete it
        return self.revision is not None

    async def release(self) -> None:
        """Give the lease up at once (graceful stop), so a standby need not wait for the TTL."""
        rev, self.revision, self._sent_at = self.revision, None, None
        if rev is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._kv.delete(self.key, last=rev)

    async def current_holder(self) -> str | None:
        """Who holds the key now, as far as the bucket says; None if nobody or unknown."""
        try:
            entry = await self._kv.get(self.key)
        except (nats.errors.Error, TimeoutError):
            return None
        return _decode_lease(entry.value or b"{}").holder


class LeaseKeeper:
    """A `KvLease` held from sync code: its own loop thread and NATS connection (from
    `connect`), so neither the caller's threads nor its loops ever wait on the lease.

    `acquire()` / `take(revision)` try to become the holder; `keep(on_lost)` then renews
    every ttl/3 (every second after a renewal that got no answer) and calls `on_lost(why)`
    once, from the loop thread, when the lease is definitely lost (`KvLease.extend`). Until
    then, `fresh()` is the local fence a writer checks before each side effect, and
    `epoch` the token it writes with; `confirm()` asks the bucket (for a writer that met
    a newer epoch than its own).
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Client]],
        key: str,
        holder: str,
        *,
        ttl_s: int,
        info: Mapping[str, Any] | None = None,
        bucket: str = LEASE_BUCKET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self.key, self.holder, self.ttl_s = key, holder, ttl_s
        self._info, self._bucket, self._clock = dict(info or {}), bucket, clock
        self._lt = LoopThread(f"lease-{key}")
        self._nc: Client | None = None
        self.lease: KvLease | None = None
        self._keeping: asyncio.Task[None] | None = None
        self.lost: str | None = None  # why the lease was lost, once it was

    def start(self, timeout_s: float = 30.0) -> LeaseKeeper:
        """Connect and make sure the bucket exists; raises what went wrong."""
        self._lt.start()
        try:
            self._lt.run_sync(self._open(), timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    async def _open(self) -> None:
        self._nc = await self._connect()
        kv = await ensure_lease_bucket(self._nc.jetstream(), self._bucket)
        self.lease = KvLease(
            self._nc,
            kv,
            self.key,
            self.holder,
            ttl_s=self.ttl_s,
            clock=self._clock,
            info=self._info,
        )

    def _run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        assert self.lease is not None, "start() first"
        return self._lt.run_sync(coro, timeout_s or self.ttl_s)  # type: ignore[arg-type]

    def read(self) -> LeaseState | None:
        """The key's state now (None: free); raises when the bucket does not answer."""
        assert self.lease is not None, "start() first"
        return self._run(self.lease.read())

    def acquire(self) -> bool:
        """Take the lease if it is free (or still names this holder)."""
        assert self.lease is not None, "start() first"
        return self._run(self.lease.try_acquire())

    def take(self, revision: int) -> bool:
        """Take the lease from a holder known to be gone, if still at `revision`."""
        assert self.lease is not None, "start() first"
        return self._run(self.lease.take(revision))

    @property
    def epoch(self) -> int:
        """This holder's term (0 when it holds none)."""
        return (self.lease.epoch or 0) if self.lease is not None and self.lease.held else 0

    def fresh(self) -> bool:
        """Whether this holder may still write (`KvLease.fresh`): held, not lost, and
        renewed well within the TTL; no I/O."""
        return self.lost is None and self.lease is not None and self.lease.fresh()

    async def confirm(self) -> bool:
        """Whether the bucket still names this holder at its epoch (from any loop)."""
        lease = self.lease
        if lease is None or self.lost is not None or not lease.held:
            return False
        try:
            now = await self._lt.run(lease.read())
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError):
            return False
        return now is not None and now.holder == self.holder and now.epoch == lease.epoch

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew from now on; `on_lost(why)` once the lease is lost for good."""
        assert self.lease is not None and self.lease.held, "acquire() first"
        self._keeping = self._lt.call(self._keep(on_lost))  # type: ignore[assignment]

    async def _keep(self, on_lost: Callable[[str], None]) -> None:
        lease = self.lease
        assert lease is not None
        renew_s = self.ttl_s / 3
        wait = renew_s
        while True:
            await asyncio.sleep(wait)
            done = await lease.extend()
            if done is False:
                self.lost = f"lease {self.key} (epoch {lease.epoch}) is no longer {self.holder}'s"
                try:
                    on_lost(self.lost)
                except Exception:
                    log.exception("lease %s: on_lost", self.key)
                return
            wait = renew_s if done else min(1.0, renew_s)

    def release(self) -> None:
        """Stop renewing and give the lease up (a standby need not wait for the TTL)."""
        if self.lease is None or self._lt.loop is None:
            return
        if self._keeping is not None:
            self._keeping.cancel()  # a concurrent.futures.Future: cancels the task
            self._keeping = None
        with contextlib.suppress(Exception):
            self._run(self.lease.release())

    def close(self) -> None:
        """Release (if held) and close the connection and the loop thread."""
        self.release()
        nc, self._nc = self._nc, None
        if nc is not None and self._lt.loop is not None:
            with contextlib.suppress(Exception):
                self._lt.run_sync(nc.close(), 10.0)
        self._lt.stop()


@dataclass
class Term:
    """One period as the holder (wall-clock times). Subclass it to note more per term."""

    acquired_at: float
    ended_at: float | None = None
    why_ended: str | None = None


TermT = TypeVar("TermT", bound=Term)


class Leadership(Generic[TermT]):
    """Runs `work()` only while holding `lease`.

    Standby: `try_acquire` every `poll_s`, the first time after `initial_delay_s`. Active:
    `renew` every ttl/3; a failed renewal cancels `work` at once (fencing) and goes back to
    standby. If `work` fails it is started again after a backoff, lease still held (the
    failure is the work's, not the holder's). On `stop` the work is cancelled and the lease
    released. `new_term(acquired_at)` makes each term's record (default `Term`).
    """

    def __init__(
        self,
        lease: KvLease,
        work: Callable[[], Awaitable[None]],
        *,
        new_term: Callable[[float], TermT] = Term,  # type: ignore[assignment]
        poll_s: float | None = None,
        initial_delay_s: float = 0.0,
        work_backoff: Backoff = Backoff(base_s=0.2, factor=2.0, cap_s=5.0, jitter=0.5),  # noqa: B008
        rng: random.Random | None = None,
    ) -> None:
        self.lease = lease
        self._work = work
        self._new_term = new_term
        self.poll_s = poll_s if poll_s is not None else lease.ttl_s / 6
        self.renew_s = lease.ttl_s / 3
        self.initial_delay_s = initial_delay_s
        self._backoff = work_backoff
        self._rng = rng or random.Random()
        self.role = "standby"
        self.terms: list[TermT] = []
        self.lost = 0
        self.work_failures = 0
        self.last_error: str | None = None

    @property
    def term(self) -> TermT | None:
        """The current term while active."""
        return self.terms[-1] if self.role == "active" and self.terms else None

    async def run(self, stop: asyncio.Event) -> None:
        """Stand by and lead, in turn, until `stop` is set."""
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
        self.terms.append(self._new_term(time.time()))
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
        log.warning(
            "lease %s: work failed (%s); restarting after backoff", self.lease.key, self.last_error
        )
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
