"""Client cursors: where each subscriber is, replicated in NATS KV so any replica resumes it.

A cursor is keyed by (owner, client id, subscription id) and records the subscription
(stream, filter, ack mode) and `seq`: the last stream sequence delivered to the client (or, with
client acks, acknowledged by it). It lives in the KV bucket `tierflow_cursors`, replicated
on min(3, cluster size) servers (1 on a single node), so it outlives any gateway replica.
The owner is the identity of the token that made it (`owner_of`): client and subscription
ids are chosen by clients, so without it any token could read or move another's cursor.

Writes are batched, not per event: `update` only marks the cursor dirty; a flusher writes
the dirty ones every `FlushPolicy.interval_s` (or sooner once `max_pending` are dirty), and
the gateway flushes a subscription's cursor when it ends. What a resume guarantees:

- with the client's own last seq (`"after": L` / `"from": L+1`): no gap and no repeat,
  whatever the server's cursor says (events carry their seq; the client keeps the last);
- with the server cursor only (`"from": "cursor"`): no gap, and repeats are limited to
  what was delivered in the last flush interval before the gateway died (at-least-once);
  after a clean disconnect (cursor flushed on close) no repeat either.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import APIError, BucketNotFoundError, KeyDeletedError, KeyNotFoundError

log = logging.getLogger(__name__)

__all__ = [
    "BUCKET",
    "CursorRecord",
    "CursorStore",
    "FlushPolicy",
    "cursor_key",
    "open_bucket",
    "owner_of",
]

BUCKET = "tierflow_cursors"
DEFAULT_TTL_S = 7 * 24 * 3600.0
MAX_ID_CHARS = 200
_WRITE_CHUNK = 256


class CursorRecord(msgspec.Struct, kw_only=True):
    """One subscription's resume point: deliver from `seq + 1` on."""

    client: str
    sub: str
    stream: str
    seq: int
    filter: str = ""
    ack: bool = False
    gateway: str = ""
    updated_ms: int = 0
    owner: str = ""  # owner_of(token); "" for the gateway's own (webhooks)

    @property
    def key(self) -> str:
        return cursor_key(self.client, self.sub, self.owner)


class FlushPolicy(msgspec.Struct, frozen=True):
    """When dirty cursors are written: every `interval_s`, or once `max_pending` are dirty."""

    interval_s: float = 0.1
    max_pending: int = 256

    def due(self, pending: int, since_flush_s: float) -> bool:
        return pending > 0 and (pending >= self.max_pending or since_flush_s >= self.interval_s)


def _part(text: str, what: str) -> str:
    if not isinstance(text, str) or not text or len(text) > MAX_ID_CHARS:
        raise ValueError(f"{what} id must be a non-empty string of at most {MAX_ID_CHARS} chars")
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def cursor_key(client: str, sub: str, owner: str = "") -> str:
    """The KV key for (owner, client, subscription): each base64url, so any text is a valid
    key; an owner's keys (three parts) never meet the gateway's own (two parts)."""
    key = f"{_part(client, 'client')}.{_part(sub, 'subscription')}"
    return f"{_part(owner, 'owner')}.{key}" if owner else key


def owner_of(token: str | None) -> str:
    """The cursor owner for a client token: a hash (the bucket never holds a token), or
    "anon" when auth is off. A token's cursors are its own; a new token starts afresh."""
    if not token:
        return "anon"
    return "t-" + hashlib.sha256(b"tierflow-cursor-owner:" + token.encode()).hexdigest()[:32]


async def open_bucket(
    js: Any,
    bucket: str,
    *,
    replicas: int | None = None,
    ttl_s: float | None = None,
    history: int = 1,
) -> Any:
    """Bind the KV bucket, creating it if missing with `replicas` copies.

    `replicas=None` asks for min(3, cluster size): it tries 3, then 2, then 1, since the
    server refuses more replicas than it has peers (or any on a single node)."""
    with contextlib.suppress(BucketNotFoundError):
        return await js.key_value(bucket)
    tries = [replicas] if replicas else [3, 2, 1]
    last: Exception | None = None
    for n in tries:
        try:
            return await js.create_key_value(
                KeyValueConfig(
                    bucket=bucket,
                    history=history,
                    ttl=ttl_s,
                    replicas=n,
                    storage=StorageType.FILE,
                )
            )
        except APIError as err:
            last = err
            log.info("kv bucket %s with %d replicas: %r; trying fewer", bucket, n, err)
            with contextlib.suppress(BucketNotFoundError):  # a peer created it meanwhile
                return await js.key_value(bucket)
    raise RuntimeError(f"cannot create KV bucket {bucket!r}: {last!r}") from last


class CursorStore:
    """Batched, replicated cursors (see the module doc). Runs on one event loop."""

    def __init__(
        self,
        kv: Any,
        policy: FlushPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.policy = policy or FlushPolicy()
        self._clock = clock
        self._dirty: dict[str, CursorRecord] = {}
        self._last_flush = clock()
        self._wake = asyncio.Event()
        self.counters = {"updates": 0, "writes": 0, "flushes": 0, "write_errors": 0}

    @classmethod
    async def open(
        cls,
        js: Any,
        *,
        bucket: str = BUCKET,
        replicas: int | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        policy: FlushPolicy | None = None,
    ) -> CursorStore:
        return cls(await open_bucket(js, bucket, replicas=replicas, ttl_s=ttl_s), policy)

    @property
    def pending(self) -> int:
        return len(self._dirty)

    async def get(self, client: str, sub: str, owner: str = "") -> CursorRecord | None:
        """The stored cursor, with any not yet flushed update of this process on top."""
        key = cursor_key(client, sub, owner)
        if key in self._dirty:
            return self._dirty[key]
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:
            return None
        try:
            record = msgspec.json.decode(entry.value, type=CursorRecord)
        except msgspec.DecodeError:
            log.warning("cursor %s: unreadable record ignored", key)
            return None
        return record if record.owner == owner else None

    def update(self, record: CursorRecord) -> None:
        """Remember the new position; written at the next flush (see FlushPolicy)."""
        self._dirty[record.key] = record
        self.counters["updates"] += 1
        if len(self._dirty) >= self.policy.max_pending:
            self._wake.set()

    async def flush(self, keys: Iterable[tuple[str, ...]] | None = None) -> int:
        """Write the dirty cursors (all, or those of these (client, sub[, owner])) now.

        A write that fails stays dirty for the next flush unless a newer update came."""
        if keys is None:
            batch, self._dirty = self._dirty, {}
            self._last_flush = self._clock()
            self.counters["flushes"] += 1
        else:
            batch = {}
            for parts in keys:
                key = cursor_key(*parts)
                if key in self._dirty:
                    batch[key] = self._dirty.pop(key)
        items = list(batch.items())
        written = 0
        for i in range(0, len(items), _WRITE_CHUNK):
            chunk = items[i : i + _WRITE_CHUNK]
            results = await asyncio.gather(
                *(self.kv.put(key, msgspec.json.encode(rec)) for key, rec in chunk),
                return_exceptions=True,
            )
            for (key, rec), result in zip(chunk, results, strict=True):
                if isinstance(result, BaseException):
                    self.counters["write_errors"] += 1
                    self._dirty.setdefault(key, rec)
                    log.info("cursor %s: write failed (%r); kept for the next flush", key, result)
                else:
                    written += 1
        self.counters["writes"] += written
        return written

    async def delete(self, client: str, sub: str, owner: str = "") -> None:
        key = cursor_key(client, sub, owner)
        self._dirty.pop(key, None)
        await self.kv.delete(key)

    async def run(self, stop: asyncio.Event) -> None:
        """Flush on the policy until `stop`, then once more."""
        stopped = asyncio.ensure_future(stop.wait())
        while not stop.is_set():
            wait = max(0.0, self.policy.interval_s - (self._clock() - self._last_flush))
            woken = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({woken, stopped}, timeout=wait, return_when="FIRST_COMPLETED")
            woken.cancel()
            self._wake.clear()
            if self.policy.due(len(self._dirty), self._clock() - self._last_flush):
                try:
                    await self.flush()
                except Exception:  # noqa: BLE001 - the flusher outlives a NATS outage
                    log.exception("cursor flush failed")
            elif not self._dirty:
                self._last_flush = self._clock()
        stopped.cancel()
        with contextlib.suppress(Exception):
            await self.flush()

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "pending": len(self._dirty)}
