"""MessageLogger: the collection tier's durable message log (book ch. 2, RBML/SBML/HML).

Nothing is answered as accepted before it is on all k+1 logger replicas. Layers, bottom up:

- `LogStore`: the LevelDB data path, no Ray. Every mutating call is ONE synced write batch
  (group commit), counters included, so a crash leaves all of a call or none of it.
- `LogWriter`: a pykka actor owning one `LogStore`, so blocking LevelDB work runs off the Ray
  actor's event loop; a `LocalSupervisor` restarts it (reopening the store) when it fails.
- `LoggerReplica`: the Ray actor of one replica; every mutating call carries the writer's epoch
  and is fenced (`runtime.replication`); the fence is persisted in the store's `meta`.
- `LoggerGroup`: the picklable client Collector and Bridge hold: writes go to every replica
  and succeed only when all acknowledged; reads go to the primary.

Entry state machine (one key; "gone" is also where a key never logged stays). Entries are
keyed by (stream, event id), as JetStream dedups Nats-Msg-Id per stream:

    (absent) --append--> transient --forget (ack)--> gone
    transient --fail--> failed(attempts=1) --forget (ack)--> gone
    failed(n) --fail--> failed(n+1)   (next_retry_ms = now + retry_delay_ms(n+1))

`forget`/`fail` of an id the log does not hold do nothing (a late ack or failure report of
an entry already completed must not resurrect it). Re-appending an id the log holds does
nothing either; re-appending one it already forgot logs it again (the dedup window of
JetStream, keyed by the same id, absorbs the resend).

Token state (request/acknowledge, one token for the events of one request):
logged (some event still transient) -> failed (some event in `failed`) -> queued (every
event acked; the seqs JetStream gave them are kept). Tokens with events still in the log
never expire; of the completed ones the newest `max_done_tokens` are kept (a count bound,
no clock): an older token answers `None` ("unknown or expired").
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import pathlib
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import plyvel
import pykka

from runtime.checkpoint import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointStore,
)
from runtime.clock import now_ms
from runtime.events import Event, decode_batch, decode_event, encode_batch, encode_event
from runtime.local_supervisor import LocalSupervisor, Supervised
from runtime.ray_supervisor import SupervisedActor
from runtime.replication import Fence, FencedError, ReplicaGroup, ReplicaMixin
from runtime.supervision import Backoff, ChildSpec, Intensity, backoff_delay
from runtime.waiting import poll

__all__ = [
    "FailedEntry",
    "LogFull",
    "LogStore",
    "LogUnavailable",
    "LogWriter",
    "LoggerGroup",
    "LogKey",
    "LoggerReplica",
    "TokenState",
    "WriterClient",
    "inspect",
    "key_of",
    "replace_replica",
    "settle_parked",
]

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- errors


class LogFull(Exception):
    """The log is at its bound (backpressure): the whole batch was refused, nothing written.

    `events`/`bytes` are the log's counts when it refused; the collector answers 503.
    """

    def __init__(self, events: int, nbytes: int, max_events: int = 0, max_bytes: int = 0) -> None:
        super().__init__(events, nbytes, max_events, max_bytes)  # args = ctor args: picklable
        self.events = events
        self.bytes = nbytes
        self.max_events = max_events
        self.max_bytes = max_bytes

    def __str__(self) -> str:
        return (
            f"message log full: {self.events}/{self.max_events} events, "
            f"{self.bytes}/{self.max_bytes} bytes"
        )


class LogUnavailable(Exception):
    """A replica did not take a write (down, restarting, too slow, catching up).

    The write may still have landed on the others: the caller answers 503 and the producer
    retries (with its own ids to make the retry idempotent). `replica` names the replica.
    """

    def __init__(self, replica: str, reason: str) -> None:
        super().__init__(replica, reason)
        self.replica = replica
        self.reason = reason

    def __str__(self) -> str:
        return f"logger replica {self.replica} unavailable: {self.reason}"


# ----------------------------------------------------------------------------- records


class FailedEntry(msgspec.Struct, frozen=True, array_like=True):
    """An entry of the `failed` store: the event (encoded) and its retry state."""

    raw: bytes  # encode_event(event); its length is what the bytes bound counts
    error: str
    attempts: int
    next_retry_ms: int

    @property
    def event(self) -> Event:
        return decode_event(self.raw)


class TokenState(msgspec.Struct, array_like=True):
    """One request/acknowledge token: its events and how far each got."""

    ids: list[str]
    acked: dict[str, tuple[str, int] | None] = {}  # id -> (stream, seq) once acked
    errors: dict[str, str] = {}  # id -> last error while the event is in `failed`
    done: int = 0  # completion order (0 while open); the expiry order of done tokens

    def complete(self) -> bool:
        return all(i in self.acked for i in self.ids)

    def state(self) -> str:
        if self.complete():
            return "queued"
        return "failed" if self.errors else "logged"


class _Counts(msgspec.Struct, array_like=True):
    """O(1) counters, written in every batch that changes them."""

    transient: int = 0
    failed: int = 0
    bytes: int = 0
    tokens: int = 0
    tokens_done: int = 0
    done_seq: int = 0


NS_TRANSIENT = "transient"  # id -> encode_event(event)
NS_FAILED = "failed"  # id -> FailedEntry
NS_TOKENS = "tokens"  # token -> TokenState
NS_META = "meta"  # counts, fence, catching_up
NS_BY_TIME = "transient.by_time"  # be64(received_ms) + id -> b""   (for pending)
NS_BY_RETRY = "failed.by_retry"  # be64(next_retry_ms) + id -> b""  (for due_failed)
NS_DONE = "tokens.done"  # be64(done) + token -> token        (expiry order)
EXPORTED = (NS_TRANSIENT, NS_FAILED, NS_TOKENS)  # transient first: see export()

COUNTS_KEY = b"counts"
FENCE_KEY = b"fence"
CATCHING_UP_KEY = b"catching_up"
# Entries are keyed by (stream, id): the Nats-Msg-Id dedups per JetStream stream, so the same
# id in two streams is two events. Stores without this marker were keyed by id alone and are
# migrated when opened.
KEYS_KEY = b"keys"
KEYS_VERSION = b"stream+id"
# Chaos hook (cluster.chaos): while the file `<store dir>.fault` exists, every write of that
# store fails as a LevelDB IO error does ("full" in the file: a full disk), writing nothing.
FAULT_SUFFIX = ".fault"

_BE64 = struct.Struct(">Q")
_MAX64 = (1 << 64) - 1
# next_retry_ms of a parked failed entry: never due, so no retry pass resends it; an
# operator settles it (`tierflow logger inspect` counts them). The bridge parks what it
# must not resend blindly and cannot prove absent, and poison it could only dead-letter
# with its body cut.
PARKED_MS = _MAX64


def _park_delay(attempts: int) -> int:
    return PARKED_MS


_enc = msgspec.msgpack.Encoder()
_counts_dec = msgspec.msgpack.Decoder(_Counts)
_failed_dec = msgspec.msgpack.Decoder(FailedEntry)
_token_dec = msgspec.msgpack.Decoder(TokenState)


def _be(n: int) -> bytes:
    return _BE64.pack(min(max(n, 0), _MAX64))


LogKey = tuple[str, str]  # (stream, event id): what the log, forget and fail address


def key_of(ev: Event) -> LogKey:
    """The log key of an event."""
    return (ev.stream, ev.id)


def _key(stream: str, id_: str) -> bytes:
    """Storage key of (stream, id). Stream names are letters, digits, '_' and '-' (config),
    so the first NUL splits it unambiguously whatever the id holds."""
    return stream.encode() + b"\x00" + id_.encode()


def _split_key(k: bytes) -> LogKey:
    """(stream, id) of a storage key."""
    stream, _, id_ = k.partition(b"\x00")
    return (stream.decode(), id_.decode())


def _log_key(key: LogKey) -> bytes:
    """Storage key of a caller's (stream, id); a bare id is refused (it would address the
    same id in every stream)."""
    if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(p, str) for p in key)):
        raise TypeError(f"log keys are (stream, id) pairs, got {key!r}")
    return _key(key[0], key[1])


def _seq(value: Any) -> tuple[str, int] | None:
    if value is None:
        return None
    stream, seq = value
    return (str(stream), int(seq))


# ----------------------------------------------------------------------------- LogStore


_MISSING: Any = object()


class _Txn:
    """Changes of one call: reads see the call's own earlier changes; applied as one batch."""

    def __init__(self, store: LogStore) -> None:
        self.s = store
        self.c = copy.copy(store._c)
        self.ops: list[tuple[bool, str, bytes, bytes]] = []  # (is_put, ns, key, value)
        self._entries: dict[bytes, tuple[str, Any] | None] = {}  # by storage key
        self._tokens: dict[str, TokenState | None] = {}

    def put(self, ns: str, key: bytes, value: bytes = b"") -> None:
        self.ops.append((True, ns, key, value))

    def delete(self, ns: str, key: bytes) -> None:
        self.ops.append((False, ns, key, b""))

    # entries -------------------------------------------------------------------

    def lookup(self, k: bytes) -> tuple[str, Any] | None:
        """("t", raw) | ("f", FailedEntry) | None for storage key `k`, as of this call's
        changes so far."""
        if k not in self._entries:
            raw = self.s._ns[NS_TRANSIENT].get(k)
            if raw is not None:
                self._entries[k] = ("t", raw)
            else:
                fraw = self.s._ns[NS_FAILED].get(k)
                self._entries[k] = None if fraw is None else ("f", _failed_dec.decode(fraw))
        return self._entries[k]

    def add_transient(self, ev: Event, raw: bytes) -> None:
        k = _key(ev.stream, ev.id)
        self.put(NS_TRANSIENT, k, raw)
        self.put(NS_BY_TIME, _be(ev.received_ms) + k)
        self.c.transient += 1
        self.c.bytes += len(raw)
        self._entries[k] = ("t", raw)

    def drop_transient(self, ev: Event, raw: bytes) -> None:
        k = _key(ev.stream, ev.id)
        self.delete(NS_TRANSIENT, k)
        self.delete(NS_BY_TIME, _be(ev.received_ms) + k)
        self.c.transient -= 1
        self.c.bytes -= len(raw)
        self._entries[k] = None

    def add_failed(self, k: bytes, fe: FailedEntry) -> None:
        self.put(NS_FAILED, k, _enc.encode(fe))
        self.put(NS_BY_RETRY, _be(fe.next_retry_ms) + k)
        self.c.failed += 1
        self.c.bytes += len(fe.raw)
        self._entries[k] = ("f", fe)

    def drop_failed(self, k: bytes, fe: FailedEntry) -> None:
        self.delete(NS_FAILED, k)
        self.delete(NS_BY_RETRY, _be(fe.next_retry_ms) + k)
        self.c.failed -= 1
        self.c.bytes -= len(fe.raw)
        self._entries[k] = None

    def drop_entry(self, k: bytes) -> Event | None:
        """Remove whatever the log holds under storage key `k`; returns the event it held."""
        cur = self.lookup(k)
        if cur is None:
            return None
        kind, val = cur
        if kind == "t":
            ev = decode_event(val)
            self.drop_transient(ev, val)
            return ev
        self.drop_failed(k, val)
        return val.event

    # tokens --------------------------------------------------------------------

    def token(self, token: str) -> TokenState | None:
        if token not in self._tokens:
            raw = self.s._ns[NS_TOKENS].get(token.encode())
            self._tokens[token] = None if raw is None else _token_dec.decode(raw)
        return self._tokens[token]

    def _unmark_done(self, token: str, st: TokenState) -> None:
        if st.done:
            self.delete(NS_DONE, _be(st.done) + token.encode())
            self.c.tokens_done -= 1
            st.done = 0

    def token_add(self, token: str, ids: Sequence[str]) -> None:
        st = self.token(token)
        if st is None:
            st = TokenState(ids=[])
            self.c.tokens += 1
            self._tokens[token] = st
        known = set(st.ids)
        for i in ids:
            if i not in known:
                st.ids.append(i)
                known.add(i)
            st.acked.pop(i, None)
            st.errors.pop(i, None)
        self._unmark_done(token, st)

    def token_ack(self, token: str, id_: str, seq: tuple[str, int] | None) -> None:
        st = self.token(token)
        if st is not None:  # None: expired, nothing to tell anyone
            st.acked[id_] = seq
            st.errors.pop(id_, None)

    def token_fail(self, token: str, id_: str, error: str) -> None:
        st = self.token(token)
        if st is not None:
            st.errors[id_] = error

    def token_put(self, token: str, new: TokenState) -> None:
        """Overwrite a token record (catch-up import)."""
        old = self.token(token)
        if old is None:
            self.c.tokens += 1
        else:
            self._unmark_done(token, old)
        if new.done:
            self.put(NS_DONE, _be(new.done) + token.encode(), token.encode())
            self.c.tokens_done += 1
            self.c.done_seq = max(self.c.done_seq, new.done)
        self._tokens[token] = new

    def finish(self) -> None:
        """Mark completed tokens, write touched token records, expire the oldest done ones."""
        completed: list[tuple[int, str]] = []
        for token, st in self._tokens.items():
            if st is None:
                continue
            if not st.done and st.complete():
                self.c.done_seq += 1
                st.done = self.c.done_seq
                self.put(NS_DONE, _be(st.done) + token.encode(), token.encode())
                self.c.tokens_done += 1
                completed.append((st.done, token))
            self.put(NS_TOKENS, token.encode(), _enc.encode(st))
        excess = self.c.tokens_done - self.s.max_done_tokens
        if excess <= 0:
            return
        victims: list[tuple[int, str]] = []
        stored = self.s._ns[NS_DONE].scan(limit=excess + len(self._tokens))
        for key, value in stored:
            done, token = _BE64.unpack_from(key)[0], value.decode()
            st = self._tokens.get(token, _MISSING)
            if st is _MISSING or (st is not None and st.done == done):
                victims.append((done, token))  # skip keys this call already removed
            if len(victims) >= excess:
                break
        victims += sorted(completed)
        for done, token in victims[:excess]:
            self.delete(NS_DONE, _be(done) + token.encode())
            self.delete(NS_TOKENS, token.encode())
            self.c.tokens -= 1
            self.c.tokens_done -= 1
            self._tokens[token] = None


class LogStore:
    """The durable log of one replica on LevelDB (`runtime.checkpoint.CheckpointStore`).

    Not thread-safe: one owner (the `LogWriter` thread) calls it. Every mutating call is one
    synced write batch that also carries the counters, so `counts()` is O(1), survives a
    crash and always matches a full scan (`scan_counts()`).

    Bounds: `append` refuses (LogFull) a batch that would take transient+failed past
    `max_events` or their encoded bytes past `max_bytes`. `fail` may grow bytes past the
    bound (a processed event can be larger than its raw form): refusing it would only keep
    the entry transient.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_events: int,
        max_bytes: int,
        max_done_tokens: int = 100_000,
        open_timeout_s: float = 10.0,
    ) -> None:
        if max_events < 1 or max_bytes < 1 or max_done_tokens < 0:
            raise ValueError("max_events and max_bytes must be >= 1, max_done_tokens >= 0")
        self.path = pathlib.Path(path)
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.max_done_tokens = max_done_tokens
        self._open_timeout_s = open_timeout_s
        self._open()

    def _open(self) -> None:
        store = _open_store(self.path, self._open_timeout_s)
        self._store = store
        self._ns = {
            name: store.namespace(name)
            for name in (*EXPORTED, NS_META, NS_BY_TIME, NS_BY_RETRY, NS_DONE)
        }
        if self._ns[NS_META].get(KEYS_KEY) != KEYS_VERSION:
            self._migrate_keys()
        raw = self._ns[NS_META].get(COUNTS_KEY)
        if raw is not None:
            self._c = _counts_dec.decode(raw)
            self.created = False
            return
        # no counters: a new store (or one written by something else): count what is there
        scanned = self.scan_counts()
        fields = {f: scanned[f] for f in _Counts.__struct_fields__ if f in scanned}
        done_keys = self._ns[NS_DONE].keys()
        self._c = _Counts(
            **fields, done_seq=max((_BE64.unpack_from(k)[0] for k in done_keys), default=0)
        )
        self.created = not any(scanned[f] for f in ("transient", "failed", "tokens"))
        self._ns[NS_META].put(COUNTS_KEY, _enc.encode(self._c))

    def _migrate_keys(self, chunk: int = 10_000) -> None:
        """Re-key entries written under their id alone to (stream, id), with their index
        keys; counts do not change. Each chunk is one synced batch and a key already in the
        new form is left alone, so a crash midway is finished by the next open."""
        moves: list[tuple[str, str, bytes, bytes, bytes, bytes]] = []
        for key, value in self._ns[NS_TRANSIENT].scan():
            ev = decode_event(value)
            new = _key(ev.stream, ev.id)
            if key != new:
                moves.append((NS_TRANSIENT, NS_BY_TIME, key, new, value, _be(ev.received_ms)))
        for key, value in self._ns[NS_FAILED].scan():
            fe = _failed_dec.decode(value)
            new = _key(fe.event.stream, fe.event.id)
            if key != new:
                moves.append((NS_FAILED, NS_BY_RETRY, key, new, value, _be(fe.next_retry_ms)))
        for i in range(0, len(moves), chunk):
            with self._store.write_batch() as b:
                for ns, index, old, new, value, prefix in moves[i : i + chunk]:
                    b.delete(self._ns[ns], old)
                    b.put(self._ns[ns], new, value)
                    b.delete(self._ns[index], prefix + old)
                    b.put(self._ns[index], prefix + new, b"")
        if moves:
            log.info("%s: re-keyed %d entries to (stream, id)", self.path, len(moves))
        self._ns[NS_META].put(KEYS_KEY, KEYS_VERSION)

    def close(self) -> None:
        self._store.close()

    @property
    def closed(self) -> bool:
        return self._store.closed

    def _check_fault(self) -> None:
        """Raise what a failed LevelDB write raises (CheckpointError from plyvel.IOError)
        while an injected fault file exists; the writer then crashes and restarts as for a
        real IO error, and the replica answers an error, never an acknowledgement."""
        try:
            kind = self.path.with_name(self.path.name + FAULT_SUFFIX).read_text()
        except FileNotFoundError:
            return
        detail = "No space left on device" if "full" in kind else "Input/output error"
        cause = plyvel.IOError(f"IO error: {detail} (injected)")
        raise CheckpointError(f"checkpoint store {self.path}: {cause}") from cause

    @contextlib.contextmanager
    def _txn(self) -> Iterator[_Txn]:
        tx = _Txn(self)
        yield tx
        tx.finish()
        if not tx.ops:
            return
        self._check_fault()
        with self._store.write_batch() as b:
            for is_put, ns, key, value in tx.ops:
                if is_put:
                    b.put(self._ns[ns], key, value)
                else:
                    b.delete(self._ns[ns], key)
            b.put(self._ns[NS_META], COUNTS_KEY, _enc.encode(tx.c))
        self._c = tx.c  # only once the batch is on disk

    # -- writes ------------------------------------------------------------------------

    def append(self, events: Sequence[Event]) -> int:
        """Log events as transient; returns how many were new. Ids already in the log (or
        repeated in the batch) are skipped. LogFull refuses the whole batch."""
        fresh: dict[bytes, tuple[Event, bytes]] = {}
        t_ns, f_ns = self._ns[NS_TRANSIENT], self._ns[NS_FAILED]
        for ev in events:
            k = _key(ev.stream, ev.id)
            if k in fresh:
                continue
            if t_ns.get(k) is not None or f_ns.get(k) is not None:
                continue
            fresh[k] = (ev, encode_event(ev))
        if not fresh:
            return 0
        n, nbytes = len(fresh), sum(len(raw) for _, raw in fresh.values())
        c = self._c
        if c.transient + c.failed + n > self.max_events or c.bytes + nbytes > self.max_bytes:
            raise LogFull(c.transient + c.failed, c.bytes, self.max_events, self.max_bytes)
        with self._txn() as tx:
            by_token: dict[str, list[str]] = {}
            for ev, raw in fresh.values():
                tx.add_transient(ev, raw)
                if ev.token:
                    by_token.setdefault(ev.token, []).append(ev.id)
            for token, ids in by_token.items():
                tx.token_add(token, ids)
        return n

    def forget(
        self,
        keys: Sequence[LogKey],
        seqs: Mapping[LogKey, tuple[str, int] | None] | None = None,
    ) -> int:
        """Acked: drop the (stream, id) keys from transient and failed; returns how many the
        log held. `seqs` (key -> (JetStream stream, seq)) is kept in the events' token
        records for `token_status`."""
        seqs = seqs or {}
        n = 0
        with self._txn() as tx:
            for key in dict.fromkeys(keys):
                ev = tx.drop_entry(_log_key(key))
                if ev is None:
                    continue
                n += 1
                if ev.token:
                    tx.token_ack(ev.token, ev.id, _seq(seqs.get(key)))
        return n

    def fail(
        self,
        items: Sequence[tuple[Event, str]],
        now_ms: int,
        retry_delay_ms: Callable[[int], int],
    ) -> int:
        """Send failed: transient -> failed (attempts 1), failed -> failed (attempts + 1), due
        at `now_ms + retry_delay_ms(attempts)`. The event is stored as given (it may be the
        processed form), keeping the logged token. An id repeated in `items` is one failure
        (its last error). Returns how many entries moved."""
        n = 0
        with self._txn() as tx:
            one_each = {_key(e.stream, e.id): (e, err) for e, err in items}  # one per key
            for k, (ev, error) in one_each.items():
                cur = tx.lookup(k)
                if cur is None:
                    continue  # acked meanwhile, or never logged here
                kind, val = cur
                if kind == "t":
                    stored = decode_event(val)
                    tx.drop_transient(stored, val)
                    attempts = 1
                else:
                    stored = val.event
                    tx.drop_failed(k, val)
                    attempts = val.attempts + 1
                if ev.token != stored.token:
                    ev = msgspec.structs.replace(ev, token=stored.token)
                due = min(PARKED_MS, now_ms + max(0, int(retry_delay_ms(attempts))))
                tx.add_failed(k, FailedEntry(encode_event(ev), str(error), attempts, due))
                if stored.token:
                    tx.token_fail(stored.token, ev.id, str(error))
                n += 1
        return n

    def import_(self, entries: Sequence[tuple[str, bytes, bytes]]) -> int:
        """Write entries from `export` (catch-up), overwriting what this store holds for the
        same keys; idempotent. Bounds do not apply: a copy must be complete."""
        with self._txn() as tx:
            for ns, key, value in entries:
                if ns == NS_TRANSIENT:  # keys come from the values: any peer's layout
                    ev = decode_event(value)
                    tx.drop_entry(_key(ev.stream, ev.id))
                    tx.add_transient(ev, value)
                elif ns == NS_FAILED:
                    fe = _failed_dec.decode(value)
                    k = _key(fe.event.stream, fe.event.id)
                    tx.drop_entry(k)
                    tx.add_failed(k, fe)
                elif ns == NS_TOKENS:
                    tx.token_put(key.decode(), _token_dec.decode(value))
                else:
                    raise ValueError(f"cannot import into namespace {ns!r}")
        return len(entries)

    def put_meta(self, items: Mapping[bytes, bytes]) -> None:
        """Replica metadata (fence, flags), in one synced batch."""
        if COUNTS_KEY in items:
            raise ValueError("meta key 'counts' belongs to the store")
        self._check_fault()
        with self._store.write_batch() as b:
            for key, value in items.items():
                b.put(self._ns[NS_META], key, value)

    def get_meta(self, key: bytes) -> bytes | None:
        return self._ns[NS_META].get(key)

    def reset(self, keep_meta: Mapping[bytes, bytes] | None = None) -> None:
        """Delete the whole store and start empty, keeping `keep_meta` (a replica about to be
        caught up from a peer must hold exactly the peer's entries)."""
        self._store.close()
        shutil.rmtree(self.path, ignore_errors=True)
        self._open()
        if keep_meta:
            self.put_meta(keep_meta)

    # -- reads -------------------------------------------------------------------------

    def pending(self, older_than_ms: int, now_ms: int, limit: int) -> list[Event]:
        """Transient entries received before `now_ms - older_than_ms`, oldest first: in
        flight too long (bridge died, ack lost); the Replayer publishes them again."""
        cutoff = now_ms - older_than_ms
        if cutoff <= 0:
            return []
        t_ns = self._ns[NS_TRANSIENT]
        out = []
        for key in self._ns[NS_BY_TIME].keys(stop=_be(cutoff), limit=limit):
            raw = t_ns.get(key[8:])
            if raw is not None:
                out.append(decode_event(raw))
        return out

    def due_failed(self, now_ms: int, limit: int) -> list[Event]:
        """Failed entries whose retry time has come, earliest first."""
        f_ns = self._ns[NS_FAILED]
        out = []
        for key in self._ns[NS_BY_RETRY].keys(stop=_be(now_ms + 1), limit=limit):
            raw = f_ns.get(key[8:])
            if raw is not None:
                out.append(_failed_dec.decode(raw).event)
        return out

    def parked(self, limit: int) -> list[dict[str, Any]]:
        """Parked failed entries (never due, see PARKED_MS): what an operator settles."""
        f_ns = self._ns[NS_FAILED]
        out: list[dict[str, Any]] = []
        for key in self._ns[NS_BY_RETRY].keys(start=_be(PARKED_MS), limit=limit):
            raw = f_ns.get(key[8:])
            if raw is None:
                continue
            fe = _failed_dec.decode(raw)
            stream, _, id_ = key[8:].partition(b"\x00")
            out.append(
                {
                    "stream": stream.decode(),
                    "id": id_.decode(),
                    "error": fe.error,
                    "attempts": fe.attempts,
                    "bytes": len(fe.raw),
                }
            )
        return out

    def parked_count(self) -> int:
        return self._ns[NS_BY_RETRY].count(start=_be(PARKED_MS))

    def settle(self, keys: Sequence[LogKey], action: str, now_ms: int) -> int:
        """An operator's decision on parked entries, in one synced batch: "retry" makes
        them due now (the bridge checks again and resends only what it proves absent),
        "forget" drops them (seen stored, or given up on purpose). Entries that are not
        parked are left alone. Returns how many changed."""
        if action not in ("retry", "forget"):
            raise ValueError(f"settle action must be retry or forget, not {action!r}")
        n = 0
        with self._txn() as tx:
            for key in dict.fromkeys(tuple(k) for k in keys):
                k = _log_key(key)  # type: ignore[arg-type]
                cur = tx.lookup(k)
                if cur is None or cur[0] != "f" or cur[1].next_retry_ms < PARKED_MS:
                    continue
                fe: FailedEntry = cur[1]
                tx.drop_failed(k, fe)
                if action == "retry":
                    error = f"settled for retry: {fe.error}"
                    tx.add_failed(k, msgspec.structs.replace(fe, error=error, next_retry_ms=now_ms))
                n += 1
        return n

    def failed_entry(self, key: LogKey) -> FailedEntry | None:
        raw = self._ns[NS_FAILED].get(_log_key(key))
        return None if raw is None else _failed_dec.decode(raw)

    def where(self, key: LogKey) -> str | None:
        """Which store holds (stream, id): "transient", "failed" or None."""
        k = _log_key(key)
        if self._ns[NS_TRANSIENT].get(k) is not None:
            return "transient"
        return "failed" if self._ns[NS_FAILED].get(k) is not None else None

    def token_status(self, token: str) -> dict[str, Any] | None:
        """logged | failed (with errors) | queued; seqs of the acked events; None when the
        token is unknown or expired."""
        raw = self._ns[NS_TOKENS].get(token.encode())
        if raw is None:
            return None
        st = _token_dec.decode(raw)
        return {
            "token": token,
            "state": st.state(),
            "events": len(st.ids),
            "acked": len(st.acked),
            "seqs": {i: list(s) if s else None for i, s in st.acked.items()},
            "errors": dict(st.errors),
        }

    def counts(self) -> dict[str, int]:
        c = self._c
        return {"transient": c.transient, "failed": c.failed, "bytes": c.bytes, "tokens": c.tokens}

    def scan_counts(self) -> dict[str, int]:
        """The counters recomputed by a full scan, plus the index sizes (a consistency check:
        `by_time == transient`, `by_retry == failed`, `tokens_done` == done records)."""
        nbytes = sum(len(v) for _, v in self._ns[NS_TRANSIENT].scan())
        failed = 0
        for _, v in self._ns[NS_FAILED].scan():
            failed += 1
            nbytes += len(_failed_dec.decode(v).raw)
        return {
            "transient": self._ns[NS_TRANSIENT].count(),
            "failed": failed,
            "bytes": nbytes,
            "tokens": self._ns[NS_TOKENS].count(),
            "tokens_done": self._ns[NS_DONE].count(),
            "by_time": self._ns[NS_BY_TIME].count(),
            "by_retry": self._ns[NS_BY_RETRY].count(),
        }

    def export(
        self, after: bytes | None, limit: int
    ) -> tuple[list[tuple[str, bytes, bytes]], bytes | None]:
        """Up to `limit` entries after cursor `after` (None: from the start) and the cursor to
        pass next (None: done). Order: transient, failed, tokens. An entry moving from
        transient to failed during a chunked copy is therefore seen at least once (in one or
        the other), so a catch-up loses nothing; it may copy an entry acked meanwhile (a
        harmless replay: JetStream deduplicates by id)."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        entries: list[tuple[str, bytes, bytes]] = []
        first = 0 if after is None else after[0]
        for i in range(first, len(EXPORTED)):
            start = after[1:] + b"\x00" if after is not None and i == first else None
            for key, value in self._ns[EXPORTED[i]].scan(start=start, limit=limit - len(entries)):
                entries.append((EXPORTED[i], key, value))
            if len(entries) >= limit:
                return entries, bytes([i]) + entries[-1][1]
        return entries, None

    def entry_keys(self, after: bytes | None, limit: int) -> tuple[list[bytes], bytes | None]:
        """Up to `limit` storage keys of transient then failed entries after cursor `after`
        (None: from the start), and the next cursor (None: done). Keys only: what a
        reconciliation compares."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        keys: list[bytes] = []
        first = 0 if after is None else after[0]
        for i in range(first, 2):
            start = after[1:] + b"\x00" if after is not None and i == first else None
            keys += self._ns[EXPORTED[i]].keys(start=start, limit=limit - len(keys))
            if len(keys) >= limit:
                return keys, bytes([i]) + keys[-1]
        return keys, None

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """For each storage key: is it transient or failed here?"""
        t_ns, f_ns = self._ns[NS_TRANSIENT], self._ns[NS_FAILED]
        return [t_ns.get(k) is not None or f_ns.get(k) is not None for k in keys]

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "created": self.created, **self.counts()}


def _open_store(path: pathlib.Path, timeout_s: float) -> CheckpointStore:
    """Open, waiting (bounded) while a dying predecessor still holds the LOCK."""
    last: list[CheckpointLockedError] = []

    def attempt() -> CheckpointStore | None:
        try:
            return CheckpointStore(path)
        except CheckpointLockedError as exc:
            last[:] = [exc]
            return None

    store = poll(attempt, timeout_s)
    if store is None:
        raise last[0]
    return store


# ----------------------------------------------------------------------------- LogWriter


@dataclass(frozen=True)
class WriterOp:
    """A LogStore call for the writer thread: `getattr(store, method)(*args)`."""

    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class _Crash:
    reason: str


_WRITER_METHODS = frozenset(
    {
        "append",
        "parked",
        "parked_count",
        "settle",
        "forget",
        "fail",
        "import_",
        "put_meta",
        "get_meta",
        "reset",
        "pending",
        "due_failed",
        "failed_entry",
        "where",
        "token_status",
        "counts",
        "scan_counts",
        "export",
        "entry_keys",
        "holds",
        "describe",
    }
)


class LogWriter(Supervised, pykka.ThreadingActor):
    """Owns one LogStore; every LevelDB call of a replica runs on this actor's thread.

    Answers come back on the caller's future (LogFull, bad input). A store failure
    (`CheckpointError`) also makes the actor crash right after answering, so its
    `LocalSupervisor` starts a new one that reopens the store from disk.
    """

    def __init__(self, path: str, store_kwargs: Mapping[str, Any]) -> None:
        super().__init__()
        self.store = LogStore(path, **dict(store_kwargs))  # opened here: a failed open is a
        # failed start the supervisor retries with backoff

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _Crash):
            raise RuntimeError(f"log writer crashed: {message.reason}")
        if not isinstance(message, WriterOp) or message.method not in _WRITER_METHODS:
            raise ValueError(f"log writer cannot run {message!r}")
        try:
            return getattr(self.store, message.method)(*message.args)
        except CheckpointError as exc:
            self.actor_ref.tell(_Crash(repr(exc)))
            raise

    def on_stop(self) -> None:
        self.store.close()
        super().on_stop()

    def on_failure(self, exception_type: Any, exception_value: Any, traceback: Any) -> None:
        self.store.close()  # release the LOCK before the replacement opens it
        super().on_failure(exception_type, exception_value, traceback)


class WriterClient:
    """A supervised LogWriter and the way to reach its current incarnation.

    Calls are retried on a new incarnation when the old one died before handling them
    (pykka answers those with ActorDeadError, so nothing of them was applied).
    """

    CHILD = "writer"

    def __init__(
        self,
        path: str | os.PathLike[str],
        store_kwargs: Mapping[str, Any],
        *,
        label: str = "",
        on_escalate: Callable[[str], None] | None = None,
        intensity: Intensity = Intensity(5, 10.0),  # noqa: B008 - frozen value
        backoff: Backoff = Backoff(base_s=0.05, cap_s=2.0),  # noqa: B008 - frozen value
        sweep_interval_s: float = 1.0,
    ) -> None:
        self.label = label or str(path)
        self.escalated: str | None = None
        self._on_escalate = on_escalate
        spec = ChildSpec(self.CHILD, LogWriter, args=(str(path), dict(store_kwargs)))
        self.supervisor = LocalSupervisor.start(
            [spec],
            intensity=intensity,
            backoff=backoff,
            on_escalate=self._escalate,
            sweep_interval_s=sweep_interval_s,
        )
        self._sup = self.supervisor.proxy()
        self._ref: pykka.ActorRef[Any] | None = None

    def _escalate(self, reason: str) -> None:
        self.escalated = reason
        log.error("log writer %s escalated: %s", self.label, reason)
        if self._on_escalate is not None:
            self._on_escalate(reason)

    def cached(self) -> pykka.ActorRef[Any] | None:
        """The current writer if it is known and alive, without blocking."""
        ref = self._ref
        return ref if ref is not None and ref.is_alive() else None

    def current(self, timeout: float) -> pykka.ActorRef[Any]:
        """The live writer, waiting (bounded) while the supervisor restarts it. Blocking."""
        ref = self.cached()
        if ref is not None:
            return ref

        def probe() -> pykka.ActorRef[Any] | None:
            if self.escalated is not None:
                raise LogUnavailable(self.label, f"log writer gave up: {self.escalated}")
            try:
                child = self._sup.get_child(self.CHILD).get(timeout=timeout)
            except pykka.ActorDeadError:
                raise LogUnavailable(self.label, "log writer supervisor stopped") from None
            return child if child is not None and child.is_alive() else None

        ref = poll(probe, timeout)
        if ref is None:
            raise LogUnavailable(self.label, f"log writer not back within {timeout}s")
        self._ref = ref
        return ref

    def call(self, method: str, *args: Any, timeout: float = 30.0, attempts: int = 5) -> Any:
        """Run one store call and wait for it. Blocking: for `__init__` and tests."""
        for _ in range(attempts):
            ref = self.current(timeout)
            try:
                return ref.ask(WriterOp(method, args), timeout=timeout)
            except pykka.ActorDeadError:
                self._ref = None
        raise LogUnavailable(self.label, f"log writer kept dying ({attempts} attempts)")

    def stop(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(pykka.ActorDeadError):
            self.supervisor.stop(block=True, timeout=timeout)


def _wait_all(futures: Sequence[pykka.Future[Any]], timeout: float) -> list[Any]:
    return [f.get(timeout=timeout) for f in futures]


# ----------------------------------------------------------------------------- replica


class LoggerReplica(SupervisedActor, ReplicaMixin):
    """One replica of a logger group (wrap with `ray.remote`; `start_logger_group` does).

    The store lives in `state_dir/logger/<actor name>`; `__init__` (rerun by Ray after a
    crash) reopens it. A replica whose directory is new while it has peers (`replicas > 1`)
    is `catching_up`: it takes writes but refuses reads and exports until the group copied
    a peer into it (`LoggerGroup.catch_up`); the flag is persisted, so a restart in the
    middle of a copy stays catching up.

    Fencing: each mutating call carries the writer's epoch; an older one than the replica
    accepted raises FencedError. The fence check and the hand-off to the writer happen with
    no await in between, and the writer runs its mailbox in order, so once `set_epoch`
    returned no write with an older epoch can still land.
    """

    def __init__(
        self,
        state_dir: str,
        group: str,
        *,
        max_events: int,
        max_bytes: int,
        replicas: int = 1,
        max_done_tokens: int = 100_000,
        retry_base_ms: int = 500,
        retry_cap_ms: int = 30_000,
        op_timeout_s: float = 30.0,
        restart_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(state_dir)
        self.group = group
        self.retry_base_ms = retry_base_ms
        self.retry_cap_ms = retry_cap_ms
        self._op_timeout_s = op_timeout_s
        self._restart_timeout_s = restart_timeout_s
        self.path = pathlib.Path(state_dir) / "logger" / self.name
        self._started = False
        self._writer = WriterClient(
            self.path,
            {
                "max_events": max_events,
                "max_bytes": max_bytes,
                "max_done_tokens": max_done_tokens,
            },
            label=self.name,
            on_escalate=self._writer_gave_up,
        )
        raw = self._writer.call("get_meta", FENCE_KEY)
        self._loaded_fence = Fence.from_bytes(raw) if raw is not None else None
        flag = self._writer.call("get_meta", CATCHING_UP_KEY)
        if flag is None:
            # first start on this directory (the flag is written before any call can be
            # accepted): an empty store with peers must be copied from one before it counts
            counts = self._writer.call("counts")
            empty = not (counts["transient"] or counts["failed"] or counts["tokens"])
            self.catching_up = empty and replicas > 1
            self._writer.call("put_meta", {CATCHING_UP_KEY: b"1" if self.catching_up else b"0"})
        else:
            self.catching_up = flag == b"1"
        self._fence_dirty = False
        self._replicas = replicas
        self._started = True

    def _writer_gave_up(self, reason: str) -> None:
        """The writer's supervisor gave up (crash loop). Once started, end the process so
        Ray restarts the whole replica and a fresh `__init__` reopens the store (on a timer,
        never inside a Ray call). During `__init__` the error is raised instead: a store
        that cannot even open (corrupt, unreadable) fails the actor's creation, which names
        the path and the repair command, rather than a restart loop."""
        log.error("logger replica %s: log writer gave up: %s", self.name, reason)
        if self._started:
            threading.Timer(0.05, os._exit, (1,)).start()

    # -- ReplicaMixin hooks: the fence lives in the store's meta ----------------------

    def _load_fence(self) -> Fence | None:
        return self._loaded_fence

    def _save_fence(self, fence: Fence) -> None:
        self._fence_dirty = True  # written by the next hand-off, ahead of the write

    async def set_epoch(self, epoch: int, primary_index: int) -> int:
        """Accept a promotion, durably, after every write admitted before it."""
        self.fence.advance(epoch, primary_index)
        self._fence_dirty = True
        await self._op(None)
        return self.fence.epoch

    # -- the writer --------------------------------------------------------------------

    def _retry_delay_ms(self, attempts: int) -> int:
        return int(
            backoff_delay(
                max(0, attempts - 1),
                base=self.retry_base_ms,
                factor=2.0,
                cap=self.retry_cap_ms,
                jitter=0.0,
                rand=0.0,
            )
        )

    def _submit(self, ref: pykka.ActorRef[Any], method: str | None, args: tuple[Any, ...]) -> Any:
        """Hand the fence (if changed; always when `method` is None) and the call to the
        writer, in this order, with no await in between."""
        futures = []
        sent_fence = False
        try:
            if self._fence_dirty or method is None:
                futures.append(
                    ref.ask(
                        WriterOp("put_meta", ({FENCE_KEY: self.fence.to_bytes()},)), block=False
                    )
                )
                self._fence_dirty = False
                sent_fence = True
            if method is not None:
                futures.append(ref.ask(WriterOp(method, args), block=False))
        except BaseException:
            self._fence_dirty = self._fence_dirty or sent_fence
            raise
        return futures, sent_fence

    async def _op(self, method: str | None, *args: Any, epoch: int | None = None) -> Any:
        """Run a store call on the writer; fenced when `epoch` is given."""
        loop = asyncio.get_running_loop()
        for _ in range(5):
            ref = self._writer.cached()
            if ref is None:
                ref = await loop.run_in_executor(
                    None, self._writer.current, self._restart_timeout_s
                )
            try:
                if epoch is None:
                    futures, sent_fence = self._submit(ref, method, args)
                else:
                    futures, sent_fence = self.fenced_write(
                        epoch, lambda r=ref: self._submit(r, method, args)
                    )
            except pykka.ActorDeadError:
                continue  # dead before it took anything: retry (and re-check the fence)
            if not futures:
                return None
            try:
                results = await loop.run_in_executor(None, _wait_all, futures, self._op_timeout_s)
            except pykka.ActorDeadError:
                self._fence_dirty = self._fence_dirty or sent_fence
                continue
            except pykka.Timeout:
                self._fence_dirty = self._fence_dirty or sent_fence
                raise LogUnavailable(
                    self.name, f"log writer did not answer within {self._op_timeout_s}s"
                ) from None
            except BaseException:
                self._fence_dirty = self._fence_dirty or sent_fence
                raise
            return results[-1]
        raise LogUnavailable(self.name, "log writer kept dying")

    def _readable(self) -> None:
        if self.catching_up:
            raise LogUnavailable(self.name, "catching up from a peer")

    # -- writes (fenced) -----------------------------------------------------------------

    async def append(self, epoch: int, batch: bytes) -> int:
        """Log an encoded batch; returns how many events were new here."""
        return await self._op("append", decode_batch(batch), epoch=epoch)

    async def forget(
        self,
        epoch: int,
        keys: Sequence[LogKey],
        seqs: Mapping[LogKey, tuple[str, int] | None] | None = None,
    ) -> int:
        """Drop (stream, id) keys (acked); returns how many this replica held."""
        return await self._op("forget", [tuple(k) for k in keys], dict(seqs or {}), epoch=epoch)

    async def fail(
        self, epoch: int, batch: bytes, errors: Sequence[str], now_ms: int, park: bool = False
    ) -> int:
        """`batch` holds the failed events (encoded), `errors` their errors, in order."""
        events = decode_batch(batch)
        if len(events) != len(errors):
            raise ValueError(f"{len(events)} events but {len(errors)} errors")
        items = list(zip(events, errors, strict=True))
        delay = _park_delay if park else self._retry_delay_ms
        return await self._op("fail", items, now_ms, delay, epoch=epoch)

    async def settle(self, epoch: int, keys: list[LogKey], action: str, now_ms: int) -> int:
        """Parked entries: "retry" (due now) or "forget"; see LogStore.settle."""
        return await self._op("settle", [tuple(k) for k in keys], action, now_ms, epoch=epoch)

    async def parked(self, limit: int = 1000) -> list[dict[str, Any]]:
        self._readable()
        return await self._op("parked", limit)

    async def import_(self, epoch: int, entries: list[tuple[str, bytes, bytes]]) -> int:
        return await self._op("import_", entries, epoch=epoch)

    async def begin_catch_up(self, epoch: int) -> None:
        """Empty the store and refuse reads until `finish_catch_up`."""
        self.catching_up = True
        keep = {CATCHING_UP_KEY: b"1", FENCE_KEY: self.fence.to_bytes()}
        await self._op("reset", keep, epoch=epoch)

    async def finish_catch_up(self, epoch: int) -> None:
        await self._op("put_meta", {CATCHING_UP_KEY: b"0"}, epoch=epoch)
        self.catching_up = False

    # -- reads -------------------------------------------------------------------------

    async def pending(self, older_than_ms: int, now_ms: int, limit: int) -> bytes:
        self._readable()
        return encode_batch(await self._op("pending", older_than_ms, now_ms, limit))

    async def due_failed(self, now_ms: int, limit: int) -> bytes:
        self._readable()
        return encode_batch(await self._op("due_failed", now_ms, limit))

    async def failed_entry(self, key: LogKey) -> dict[str, Any] | None:
        fe = await self._op("failed_entry", tuple(key))
        if fe is None:
            return None
        return {"error": fe.error, "attempts": fe.attempts, "next_retry_ms": fe.next_retry_ms}

    async def token_status(self, token: str) -> dict[str, Any] | None:
        self._readable()
        return await self._op("token_status", token)

    async def counts(self, readable: bool = False) -> dict[str, int]:
        """This store's counts; with `readable`, refused while catching up (they are not
        the group's then)."""
        if readable:
            self._readable()
        return await self._op("counts")

    async def scan_counts(self) -> dict[str, int]:
        return await self._op("scan_counts")

    async def export(
        self, after: bytes | None, limit: int
    ) -> tuple[list[tuple[str, bytes, bytes]], bytes | None]:
        self._readable()
        return await self._op("export", after, limit)

    async def entry_keys(self, after: bytes | None, limit: int) -> tuple[list[bytes], bytes | None]:
        self._readable()
        return await self._op("entry_keys", after, limit)

    async def holds(self, keys: list[bytes]) -> list[bool]:
        self._readable()
        return await self._op("holds", keys)

    async def _check_disk(self) -> None:
        """A store without the catching-up flag lost its directory under this running
        replica (the writer reopened an empty one): its contents must not pass for the
        group's, so it is marked catching up (heal then promotes a peer and rebuilds it)."""
        if self.catching_up or self._replicas < 2:
            return
        if await self._op("get_meta", CATCHING_UP_KEY) is None:
            log.error(
                "logger replica %s: store %s lost under it; catching up", self.name, self.path
            )
            self.catching_up = True
            self._fence_dirty = True  # the fence went with the directory
            await self._op("put_meta", {CATCHING_UP_KEY: b"1"})

    async def status(self) -> dict[str, Any]:
        await self._check_disk()
        return {
            **self.heartbeat(),
            "group": self.group,
            "path": str(self.path),
            "epoch": self.fence.epoch,
            "primary": self.fence.primary,
            "catching_up": self.catching_up,
            "counts": await self._op("counts"),
            "parked": await self._op("parked_count"),
        }

    async def crash_writer(self) -> None:
        """Fault injection: make the LogWriter fail (its supervisor restarts it)."""
        ref = self._writer.cached() or self._writer.current(self._restart_timeout_s)
        ref.tell(_Crash("injected"))


# ----------------------------------------------------------------------------- client


def _cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's RayTaskError wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


@dataclass
class LoggerGroup:
    """Client of one logger group: plain data plus Ray handles, so it pickles into the
    Collector's and the Bridge's kwargs.

    Writes (`append`, `forget`, `fail`) go to every replica concurrently and return only
    when all acknowledged; a replica that fails or misses `deadline_s` makes the call raise
    LogUnavailable naming it (the collector answers 503). LogFull and FencedError from any
    replica propagate as themselves. Reads go to the primary.

    The epoch is the one the group's controller announced when this client was made. After
    a promotion writes raise FencedError; the holder takes a new client from the controller
    (`LoggerGroup.of(replica_group)`) or adopts the replicas' epoch on purpose (`refresh`).
    Handles of replaced replicas are looked up again by name.
    """

    name: str
    namespace: str
    size: int
    epoch: int
    primary: int = 0
    deadline_s: float = 5.0
    handles: list[Any] = field(default_factory=list)
    # Adopt a newer epoch the replicas accepted (a promotion by `heal` in another holder)
    # and retry once, for writes refused as fenced and reads of a primary that cannot serve.
    follow_epochs: bool = True
    # `heal` drops an entry a replica holds and the primary does not only when the primary
    # lacked it on two checks this far apart: appends reach replicas one by one.
    reconcile_grace_s: float = 30.0
    reconcile_page: int = 5000
    max_missed_forgets: int = 100_000
    # per replica: forgets it missed while the others took them; keys absent from the
    # primary -> when first seen; where the scan of its keys goes on
    _missed: dict[int, dict[LogKey, None]] = field(default_factory=dict, init=False, repr=False)
    _suspects: dict[int, dict[bytes, float]] = field(default_factory=dict, init=False, repr=False)
    _scan_at: dict[int, bytes] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def of(cls, group: ReplicaGroup, *, deadline_s: float = 5.0) -> LoggerGroup:
        return cls(
            name=group.role,
            namespace=group.namespace,
            size=len(group.replicas),
            epoch=group.epoch,
            primary=group.primary or 0,
            deadline_s=deadline_s,
            handles=group.replicas,
        )

    def replica_name(self, index: int) -> str:
        return f"{self.name}-{index}"

    # -- plumbing ----------------------------------------------------------------------

    async def _handle(self, index: int, *, fresh: bool = False) -> Any:
        if not fresh and index < len(self.handles) and self.handles[index] is not None:
            return self.handles[index]
        import ray

        loop = asyncio.get_running_loop()
        handle = await loop.run_in_executor(
            None, lambda: ray.get_actor(self.replica_name(index), namespace=self.namespace)
        )
        while len(self.handles) < self.size:
            self.handles.append(None)
        self.handles[index] = handle
        return handle

    async def _call(self, index: int, method: str, *args: Any, deadline_s: float | None) -> Any:
        """One remote call; errors come back as LogUnavailable, FencedError or LogFull."""
        from ray.exceptions import ActorDiedError

        timeout = self.deadline_s if deadline_s is None else deadline_s
        for attempt in range(2):
            try:
                handle = await self._handle(index, fresh=attempt > 0)
            except ValueError:  # no actor under that name right now (being replaced)
                raise LogUnavailable(self.replica_name(index), "no such actor") from None
            try:
                ref = getattr(handle, method).remote(*args)
                return await asyncio.wait_for(ref, timeout)
            except TimeoutError:
                raise LogUnavailable(
                    self.replica_name(index), f"no answer within {timeout}s"
                ) from None
            except ActorDiedError as exc:
                if attempt == 0:
                    continue  # maybe replaced under the same name: look it up again
                raise LogUnavailable(self.replica_name(index), f"dead: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - classified below
                cause = _cause(exc)
                if isinstance(cause, FencedError):
                    raise FencedError(cause.current, cause.offered) from None
                if isinstance(cause, LogFull):
                    raise LogFull(*cause.args) from None
                if isinstance(cause, LogUnavailable):
                    raise LogUnavailable(*cause.args) from None
                raise LogUnavailable(self.replica_name(index), repr(cause)) from exc
        raise AssertionError("unreachable")

    async def _all(self, method: str, *args: Any, deadline_s: float | None) -> list[Any]:
        """One fenced write on every replica; `args[0]` is the epoch. Refused as fenced,
        a following client adopts the newer epoch and sends it once more (idempotent)."""
        results = await self._gather(method, args, deadline_s)
        fenced = any(isinstance(r, FencedError) for r in results)
        follow = fenced and self.follow_epochs and bool(args) and args[0] == self.epoch
        if follow and await self.refresh() > args[0]:
            args = (self.epoch, *args[1:])
            results = await self._gather(method, args, deadline_s)
        if method == "forget":
            self._note_missed_forgets(results, args[1])
        errors = [r for r in results if isinstance(r, BaseException)]
        for kind in (FencedError, LogFull, LogUnavailable):
            found = [e for e in errors if isinstance(e, kind)]
            if found:
                if kind is LogUnavailable and len(found) > 1:
                    names = ", ".join(e.replica for e in found)
                    raise LogUnavailable(found[0].replica, f"{found[0].reason} (down: {names})")
                raise found[0]
        if errors:
            raise errors[0]
        return results

    async def _gather(
        self, method: str, args: tuple[Any, ...], deadline_s: float | None
    ) -> list[Any]:
        return await asyncio.gather(
            *(self._call(i, method, *args, deadline_s=deadline_s) for i in range(self.size)),
            return_exceptions=True,
        )

    def _note_missed_forgets(self, results: Sequence[Any], keys: Sequence[LogKey]) -> None:
        """A replica that missed a forget the others took keeps entries already published;
        `heal` sends it again. Bounded: past the bound the key scan of `heal` finds them."""
        if all(isinstance(r, BaseException) for r in results):
            return  # nothing dropped anywhere: the caller retries the whole forget
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                missed = self._missed.setdefault(i, {})
                room = self.max_missed_forgets - len(missed)
                missed.update(dict.fromkeys(tuple(k) for k in list(keys)[: max(0, room)]))

    # -- writes ------------------------------------------------------------------------

    async def append(
        self, events: Sequence[Event] | bytes, *, deadline_s: float | None = None
    ) -> None:
        """Returns once every replica holds the batch (synced); see the class doc."""
        batch = events if isinstance(events, bytes) else encode_batch(events)
        if not isinstance(events, bytes) and not events:
            return
        await self._all("append", self.epoch, batch, deadline_s=deadline_s)

    async def forget(
        self,
        keys: Sequence[LogKey],
        seqs: Mapping[LogKey, tuple[str, int] | None] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> None:
        """Drop acked (stream, id) keys on every replica (`key_of(event)`)."""
        if keys:
            for key in keys:
                _log_key(key)  # refuse a bare id here, not on the replicas
            await self._all(
                "forget", self.epoch, list(keys), dict(seqs or {}), deadline_s=deadline_s
            )

    async def fail(
        self,
        items: Sequence[tuple[Event, str]],
        now_ms: int | None = None,
        *,
        deadline_s: float | None = None,
        park: bool = False,
    ) -> None:
        if not items:
            return
        batch = encode_batch([e for e, _ in items])
        errors = [str(err) for _, err in items]
        now = now_ms() if now_ms is None else now_ms
        await self._all("fail", self.epoch, batch, errors, now, park, deadline_s=deadline_s)

    async def settle(
        self, keys: Sequence[LogKey], action: str, *, deadline_s: float | None = None
    ) -> None:
        """An operator's decision on parked (stream, id) entries: "retry" or "forget"."""
        if keys:
            keys = [tuple(k) for k in keys]  # type: ignore[misc]
            await self._all("settle", self.epoch, keys, action, now_ms(), deadline_s=deadline_s)

    async def parked(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The primary's parked entries (stream, id, error, attempts, bytes)."""
        return await self._call(self.primary, "parked", limit, deadline_s=None)

    # -- reads (primary) ---------------------------------------------------------------

    async def pending(
        self, older_than_ms: int, now_ms: int | None = None, limit: int = 1000
    ) -> list[Event]:
        now = now_ms() if now_ms is None else now_ms
        raw = await self._read("pending", older_than_ms, now, limit)
        return decode_batch(raw)

    async def due_failed(self, now_ms: int | None = None, limit: int = 1000) -> list[Event]:
        now = now_ms() if now_ms is None else now_ms
        raw = await self._read("due_failed", now, limit)
        return decode_batch(raw)

    async def token_status(self, token: str) -> dict[str, Any] | None:
        return await self._read("token_status", token)

    async def _read(self, method: str, *args: Any) -> Any:
        """A read of the primary. If it cannot serve (back on an empty disk, catching up)
        a following client adopts a newer primary, promoting a healthy replica if none was,
        and reads once more."""
        try:
            return await self._call(self.primary, method, *args, deadline_s=None)
        except LogUnavailable:
            if not self.follow_epochs:
                raise
            before = (self.epoch, self.primary)
            await self._follow_primary(await self.status())
            if (self.epoch, self.primary) == before:
                raise
        return await self._call(self.primary, method, *args, deadline_s=None)

    async def counts(self, index: int | None = None) -> dict[str, int]:
        """Replica `index`'s counts, or the group's: the primary's, following a promotion
        when the primary came back empty (its zeros are not the group's)."""
        if index is None:
            return await self._read("counts", True)
        return await self._call(index, "counts", deadline_s=None)

    async def status(self) -> list[dict[str, Any]]:
        """Every replica's status, or {"replica", "error"} for one that did not answer."""
        out: list[dict[str, Any]] = []
        for i in range(self.size):
            try:
                out.append(await self._call(i, "status", deadline_s=None))
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                out.append({"name": self.replica_name(i), "error": str(exc)})
        return out

    async def drained(self) -> bool:
        """True when EVERY replica answers and holds nothing transient or failed: a replica
        that missed a forget still holds entries the primary dropped (until `heal`
        reconciles it), and would replay them if promoted."""
        for i in range(self.size):
            try:
                c = await self._call(i, "counts", deadline_s=None)
            except (LogUnavailable, FencedError):
                return False
            if c["transient"] or c["failed"]:
                return False
        return True

    # -- control -----------------------------------------------------------------------

    async def refresh(self) -> int:
        """Adopt the newest epoch (and its primary) the replicas accepted; returns it."""
        answers = await asyncio.gather(
            *(self._call(i, "status", deadline_s=None) for i in range(self.size)),
            return_exceptions=True,
        )
        known = [a for a in answers if isinstance(a, dict) and a.get("primary") is not None]
        if not known:
            raise LogUnavailable(self.name, "no replica knows its primary")
        best = max(known, key=lambda a: a["epoch"])
        self.epoch, self.primary = best["epoch"], best["primary"]
        return self.epoch

    async def catch_up(
        self, index: int, *, source: int | None = None, chunk: int = 2000, timeout_s: float = 600.0
    ) -> int:
        """Copy every entry of `source` (default: the primary) into replica `index`, which is
        emptied first and counts for reads again once done. Writes keep flowing to it
        meanwhile. Returns the number of entries copied."""
        src = self.primary if source is None else source
        if src == index:
            raise ValueError(f"replica {index} cannot catch up from itself")
        for pending in (self._missed, self._suspects, self._scan_at):
            pending.pop(index, None)
        call_deadline = max(self.deadline_s, 30.0)
        deadline = time.monotonic() + timeout_s
        await self._call(index, "begin_catch_up", self.epoch, deadline_s=call_deadline)
        cursor: bytes | None = None
        copied = 0
        while True:
            if time.monotonic() > deadline:
                raise LogUnavailable(self.replica_name(index), f"catch-up over {timeout_s}s")
            entries, cursor = await self._call(
                src, "export", cursor, chunk, deadline_s=call_deadline
            )
            if entries:
                await self._call(index, "import_", self.epoch, entries, deadline_s=call_deadline)
                copied += len(entries)
            if cursor is None:
                break
        await self._call(index, "finish_catch_up", self.epoch, deadline_s=call_deadline)
        log.info("%s caught up from %s: %d entries", self.replica_name(index), src, copied)
        return copied

    async def heal(self) -> dict[int, int]:
        """Catch up every replica that came back empty (Ray restarted it on a fresh disk,
        or its directory was lost) from the primary; returns {index: entries copied}.

        Cheap when all is well (one status call per replica), so a periodic loop (the
        bridge's replayer) can run it: a lost replica is replaced by Ray and caught up
        here without an operator.
        """
        statuses = await self.status()
        if await self._follow_primary(statuses):
            statuses = await self.status()
        primary = statuses[self.primary] if self.primary < len(statuses) else {}
        if primary.get("error") or primary.get("catching_up"):
            return {}  # nothing trustworthy to copy from (no healthy replica: logged)
        healed: dict[int, int] = {}
        for i, st in enumerate(statuses):
            if i != self.primary and st.get("catching_up"):
                healed[i] = await self.catch_up(i)
        for i, st in enumerate(statuses):
            ok = not st.get("error") and not st.get("catching_up")
            if ok and i != self.primary and i not in healed:
                await self._reconcile(i, primary, st)
        return healed

    async def _follow_primary(self, statuses: Sequence[Mapping[str, Any]]) -> bool:
        """Adopt the newest epoch the replicas report; if its primary came back empty
        (catching up), promote a healthy replica. Returns whether the primary changed."""
        before = (self.epoch, self.primary)
        known = [s for s in statuses if not s.get("error") and s.get("primary") is not None]
        if known and self.follow_epochs:
            best = max(known, key=lambda s: s["epoch"])
            if best["epoch"] > self.epoch:
                self.epoch, self.primary = best["epoch"], best["primary"]
        current = statuses[self.primary] if self.primary < len(statuses) else {}
        if current.get("catching_up") and not current.get("error"):
            await self.promote_healthy(statuses)
        return (self.epoch, self.primary) != before

    async def promote_healthy(self, statuses: Sequence[Mapping[str, Any]]) -> int | None:
        """Make the lowest-indexed replica that answers and is not catching up the primary
        under a new epoch (every holder picks the same one, so two promoting at once agree);
        returns it, or None (logged) when no replica can lead: reads then keep failing and
        writes keep needing every replica, so nothing is acknowledged on fewer copies."""
        healthy = [
            i for i, s in enumerate(statuses) if not s.get("error") and not s.get("catching_up")
        ]
        if not healthy:
            log.error("%s: no healthy replica to promote: %s", self.name, statuses)
            return None
        index = healthy[0]
        epoch = 1 + max([self.epoch, *(s.get("epoch", 0) for s in statuses if not s.get("error"))])
        results = await asyncio.gather(
            *(self._call(i, "set_epoch", epoch, index, deadline_s=None) for i in range(self.size)),
            return_exceptions=True,
        )
        if results[index] != epoch:  # it went down, or another holder promoted further
            log.warning("%s: promoting %d under epoch %d: %r", self.name, index, epoch, results)
            await self.refresh()
            return None
        self.epoch, self.primary = epoch, index
        log.warning(
            "%s: replica %d promoted under epoch %d (the primary came back empty); "
            "not acknowledged by %s",
            self.name,
            index,
            epoch,
            [i for i, r in enumerate(results) if r != epoch],
        )
        return index

    async def _reconcile(
        self, index: int, primary: Mapping[str, Any], status: Mapping[str, Any]
    ) -> int:
        """Drop from replica `index` the entries the primary no longer holds (forgets it
        missed): first the ones this client saw it miss, then, when its counts differ from
        the primary's, one page of a key scan compared with the primary. An entry absent
        from the primary is dropped only when still absent `reconcile_grace_s` after it was
        first seen (an append in flight may have reached this replica first). Returns the
        entries dropped."""
        dropped = 0
        missed = self._missed.pop(index, None)
        if missed:
            try:
                await self._call(index, "forget", self.epoch, list(missed), {}, deadline_s=None)
            except (LogUnavailable, FencedError):
                self._missed.setdefault(index, {}).update(missed)
                return 0
            dropped += len(missed)
        now = time.monotonic()
        suspects = self._suspects.setdefault(index, {})
        ripe = [k for k, seen in suspects.items() if now - seen >= self.reconcile_grace_s]
        if ripe:
            held = await self._call(self.primary, "holds", ripe, deadline_s=None)
            gone = [k for k, h in zip(ripe, held, strict=True) if not h]
            if gone:
                keys = [_split_key(k) for k in gone]
                await self._call(index, "forget", self.epoch, keys, {}, deadline_s=None)
                dropped += len(gone)
            for k in ripe:
                suspects.pop(k, None)
        mine, theirs = status.get("counts", {}), primary.get("counts", {})
        differ = any(mine.get(f) != theirs.get(f) for f in ("transient", "failed"))
        if differ or index in self._scan_at:
            page, cursor = await self._call(
                index, "entry_keys", self._scan_at.get(index), self.reconcile_page, deadline_s=None
            )
            held = await self._call(self.primary, "holds", page, deadline_s=None) if page else []
            for k, h in zip(page, held, strict=True):
                if not h:
                    suspects.setdefault(k, now)
            if cursor is None:
                self._scan_at.pop(index, None)
            else:
                self._scan_at[index] = cursor
        if dropped:
            log.warning(
                "%s: replica %d reconciled: %d entries the primary dropped",
                self.name,
                index,
                dropped,
            )
        return dropped


# ----------------------------------------------------------------------------- group


async def _catch_up_all(client: LoggerGroup, indexes: Sequence[int]) -> None:
    for i in indexes:
        await client.catch_up(i)


async def replace_replica(
    group: ReplicaGroup, index: int, *, chunk: int = 2000, timeout_s: float = 60.0
) -> int:
    """Replace replica `index` (a lost node, a dead or damaged store) with a fresh actor and
    catch it up from the primary; returns the entries copied."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, group.replace, index, timeout_s)
    client = LoggerGroup.of(group)
    return await client.catch_up(index, chunk=chunk)


# ----------------------------------------------------------------------------- inspect


def settle_parked(
    state_dir: str | os.PathLike[str],
    group: str,
    action: str,
    keys: Sequence[LogKey] | None = None,
    *,
    now_ms: int | None = None,
) -> dict[str, int]:
    """Settle parked entries of logger group `group` in its stopped stores (every replica
    directory `state_dir/logger/<group>-<i>`, so the replicas stay identical): `keys`, or
    every entry parked on any replica when None. Returns {replica: entries changed}. A
    running replica's store is locked: CheckpointLockedError (stop tierflow first)."""
    import re

    root = pathlib.Path(state_dir) / "logger"
    pattern = re.compile(rf"{re.escape(group)}-\d+")
    paths = sorted(p for p in root.glob(f"{group}-*") if p.is_dir() and pattern.fullmatch(p.name))
    if not paths:
        raise FileNotFoundError(f"no logger group {group!r} under {root}")
    stores = []
    try:
        for path in paths:
            stores.append(LogStore(path, max_events=1 << 62, max_bytes=1 << 62, open_timeout_s=1))
        if keys is None:
            found: dict[LogKey, None] = {}
            for store in stores:
                found.update((p["stream"], p["id"]) for p in store.parked(1 << 62))
            keys = list(found)
        now = now_ms() if now_ms is None else now_ms
        return {st.path.name: st.settle(keys, action, now) for st in stores}
    finally:
        for store in stores:
            store.close()


def inspect(state_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Per replica directory under `state_dir/logger/`: counts, epoch, catching_up. A store
    held by a running replica is reported as "locked (running)", never opened twice."""
    root = pathlib.Path(state_dir) / "logger"
    if not root.is_dir():
        return []
    rows = []
    for path in sorted(p for p in root.iterdir() if p.is_dir()):
        row: dict[str, Any] = {"replica": path.name, "path": str(path)}
        try:
            store = CheckpointStore(path, create=False)
        except CheckpointLockedError:
            rows.append({**row, "state": "locked (running)"})
            continue
        except CheckpointError as exc:
            rows.append({**row, "state": f"error: {exc}"})
            continue
        try:
            meta = store.namespace(NS_META)
            raw = meta.get(COUNTS_KEY)
            c = _counts_dec.decode(raw) if raw is not None else _Counts()
            fence = meta.get(FENCE_KEY)
            row.update(
                state="ok",
                transient=c.transient,
                failed=c.failed,
                parked=store.namespace(NS_BY_RETRY).count(start=_be(PARKED_MS)),
                bytes=c.bytes,
                tokens=c.tokens,
                epoch=Fence.from_bytes(fence).epoch if fence else 0,
                catching_up=meta.get(CATCHING_UP_KEY) == b"1",
            )
        except (CheckpointError, msgspec.DecodeError, ValueError) as exc:
            row["state"] = f"error: {exc}"
        finally:
            store.close()
        rows.append(row)
    return rows
