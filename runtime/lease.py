"""A JetStream-KV lease: one holder of a key at a time, fenced before the key can lapse.

Any role that must run something on exactly one replica (a stream's ingest node, a
webhook's sender) holds a lease on one key of a KV bucket and does the work only while it
holds it:

    kv = await ensure_lease_bucket(nc.jetstream())              # bucket `tierflow_leases`
    lease = KvLease(nc, kv, "ingest.meetup", holder="node-a/3", ttl_s=3)
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

On the wire (kept as stream ingest always wrote it): the value is the JSON object
`{"holder": <holder>, "at": <wall-clock seconds of the write>}`; a graceful release is a
KV delete at the held revision. The bucket needs per-message TTL (`allow_msg_ttl`), which
nats-py's `create_key_value` turns on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from runtime.nats_publish import raise_swallowed_cancel
from runtime.supervision import Backoff, backoff_delay

__all__ = [
    "LEASE_BUCKET",
    "KvLease",
    "Leadership",
    "Term",
    "ensure_lease_bucket",
]

log = logging.getLogger(__name__)

LEASE_BUCKET = "tierflow_leases"
# A KV key: dot-separated tokens of letters, digits and -/_= (NATS' own key rule).
_KEY_RE = re.compile(r"^[-/_=A-Za-z0-9]+(\.[-/_=A-Za-z0-9]+)*$")
_WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream: the expected last revision did not match


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
        self.revision: int | None = None
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
        return msgspec.json.encode(_LeaseValue(self.holder, time.time()))

    async def _write(self, last: int) -> int:
        """Write the key if its last revision is `last` (0: absent); the new revision. A
        cancel nats-py swallowed is raised by the caller once the revision is noted."""
        hdrs = {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)}
        ack = await self._js.publish(self._subject, self._value(), headers=hdrs, msg_ttl=self.ttl_s)
        return ack.seq

    async def try_acquire(self) -> bool:
        """Take the lease if it is free (or ours); False if another holds it or on any error."""
        sent = self._clock()
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
            self.revision, self._sent_at = rev, sent
        raise_swallowed_cancel()  # after noting the revision, so a release can delete it
        return rev is not None

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
        rev, self.revision = self.revision, None
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
