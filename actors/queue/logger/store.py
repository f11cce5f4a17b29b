"""`LogStore`: the LevelDB data path of one replica, no Ray and no threads of its own.

Every mutating call is one synced write batch (a `_Txn`), counters included. The record
and key formats are in `records`; the entry and token state machines in the package doc.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import msgspec
import plyvel

from actors.queue.logger.errors import LogFull
from actors.queue.logger.records import (
    _BE64,
    _FAILED,
    _MAX64,
    _SHIFT,
    _SIZE,
    COUNTS_KEY,
    EXPORTED,
    KEYS_KEY,
    KEYS_VERSION,
    NS_BY_RETRY,
    NS_BY_TIME,
    NS_DONE,
    NS_FAILED,
    NS_META,
    NS_TOKENS,
    NS_TRANSIENT,
    PARKED_MS,
    FailedEntry,
    IndexMeta,
    LogKey,
    _be,
    _Counts,
    _counts_dec,
    _enc,
    _failed_dec,
    _head_dec,
    _key,
    _log_key,
    _meta,
    _raws_dec,
    _seq,
    _split_key,
    _token_dec,
)
from actors.queue.logger.txn import _Txn
from runtime.data.events import Event, decode_batch, decode_event, encode_event
from runtime.state.checkpoint import CheckpointError, CheckpointLockedError, CheckpointStore
from runtime.waiting import poll

log = logging.getLogger(__name__)

# Chaos hook (cluster.chaos): while the file `<store dir>.fault` exists, every write of that
# store fails as a LevelDB IO error does ("full" in the file: a full disk), writing nothing.
FAULT_SUFFIX = ".fault"
# LevelDB's memtable for a log store. Entries live for well under a second (appended, then
# forgotten once JetStream holds them); with LevelDB's 4 MiB default the memtable is flushed
# every fraction of a second at full load and compaction keeps rewriting entries whose
# delete is still to come. 32 MiB cut the compaction thread's CPU about 3x (store alone,
# 40,000 events a round); the price is that much memory and WAL replayed on open.
WRITE_BUFFER_BYTES = 32 << 20
# Blocks of a log store are written uncompressed: nearly every entry is deleted before its
# block is read again, so compressing it at the memtable flush and decompressing it at the
# compaction that drops it is wasted (store alone: the compaction thread's CPU 1.57 ->
# 0.85 s for 360,000 events). Blocks a store already holds compressed stay readable.
COMPRESSION: str | None = None


class LogStore:
    """The durable log of one replica on LevelDB (`runtime.state.checkpoint.CheckpointStore`).

    One concept at some length: the log's entries, their index and their counters change
    together in one write batch, so they stay in one class.

    Not thread-safe: one owner (the `LogWriter` thread) calls it. Every mutating call is one
    synced write batch that also carries the counters, so `counts()` is O(1), survives a
    crash and always matches a full scan (`scan_counts()`).

    An in-memory index of every entry (storage key -> received_ms, size and token of a
    transient one; a marker for a failed one), read from disk at open, lets `append` and
    `forget` run without reading LevelDB: absent from the index is absent from the store
    (it changes with the entries, and is read again from disk after a call that did not
    end in a write). It costs about 150 bytes of memory an entry (150 MB at the default
    1,000,000 `max_events`) and one scan of the entries per open.

    Bounds: `append` refuses (LogFull) a batch that would take transient+failed past
    `max_events` or their encoded bytes past `max_bytes`. `fail` may grow bytes past the
    bound (a processed event can be larger than its raw form): refusing it would only keep
    the entry transient.
    """

    # up to this many entries `pending` looks in the index (a Python pass over it, about
    # 0.1 us an entry), past it at LevelDB's time index (live entries are then many and
    # dense, so a scan finds `limit` of them soon)
    pending_from_index_max = 50_000

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
        self._fault_path = self.path.with_name(self.path.name + FAULT_SUFFIX)
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
        self._prefix = {name: ns.key(b"") for name, ns in self._ns.items()}
        if self._ns[NS_META].get(KEYS_KEY) != KEYS_VERSION:
            self._migrate_keys()
        self._idx: dict[bytes, IndexMeta] = self._read_index()
        self._idx_stale = False
        # no transient entry was received before this (ms): `pending` scans the time index
        # from here, not over the deletes of every entry forgotten since the last compaction
        self.logged = 0  # entries appended since this process opened the store
        self._time_floor = 0
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

    def _read_index(self) -> dict[bytes, IndexMeta]:
        """The in-memory index as the disk has it: one scan of the entries (the events'
        heads decoded, their data skipped). About 150 bytes of memory an entry."""
        idx: dict[bytes, IndexMeta] = {}
        head = _head_dec.decode
        for k, raw in self._ns[NS_TRANSIENT].scan():
            h = head(raw)
            idx[k] = _meta(h.received_ms, len(raw), h.token)
        for k in self._ns[NS_FAILED].keys():  # noqa: SIM118 - a namespace, not a dict
            idx[k] = _FAILED
        return idx

    def _index(self) -> dict[bytes, IndexMeta]:
        """The index, rebuilt first if a call that changed it did not write."""
        if self._idx_stale:
            self._idx = self._read_index()
            self._idx_stale = False
            self._time_floor = 0
        return self._idx

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
            kind = self._fault_path.read_text()
        except FileNotFoundError:
            return
        detail = "No space left on device" if "full" in kind else "Input/output error"
        cause = plyvel.IOError(f"IO error: {detail} (injected)")
        raise CheckpointError(f"checkpoint store {self.path}: {cause}") from cause

    @contextlib.contextmanager
    def _txn(self) -> Iterator[_Txn]:
        self._index()
        tx = _Txn(self, self._store.batch())
        try:
            yield tx
            tx.finish()
            if not tx.writes:
                return
            self._check_fault()
            tx.batch.put(self._ns[NS_META], COUNTS_KEY, _enc.encode(tx.c))
            tx.batch.write()
        except BaseException:
            if tx.touched:  # changed in memory, not on disk: read it again before use
                self._idx_stale = True
            raise
        self._c = tx.c  # only once the batch is on disk

    # -- writes ------------------------------------------------------------------------

    def append(self, events: Sequence[Event] | bytes) -> int:
        """Log events as transient; returns how many were new. Ids already in the log (or
        repeated in the batch) are skipped. LogFull refuses the whole batch. `events` may
        be `encode_batch`'s bytes: each event is then stored as the bytes it arrived in
        (what `encode_event` gives), not decoded and encoded again."""
        n = self._append(events)
        self.logged += n  # on disk by now: `_append`'s batch is written when it returns
        return n

    def _append(self, events: Sequence[Event] | bytes) -> int:
        if isinstance(events, bytes | bytearray | memoryview):
            heads: Sequence[Any] = decode_batch(events)  # validates every event
            raws: Sequence[Any] = _raws_dec.decode(events)
        else:
            heads, raws = events, [encode_event(ev) for ev in events]
        idx = self._index()  # whose keys are every entry: absent there is absent on disk
        fresh: dict[bytes, tuple[Any, Any]] = {}
        for h, raw in zip(heads, raws, strict=True):
            k = _key(h.stream, h.id)
            if k not in idx and k not in fresh:  # the first of an id repeated in the batch
                fresh[k] = (h, raw)
        if not fresh:
            return 0
        n, nbytes = len(fresh), sum(len(raw) for _, raw in fresh.values())
        c = self._c
        if c.transient + c.failed + n > self.max_events or c.bytes + nbytes > self.max_bytes:
            raise LogFull(c.transient + c.failed, c.bytes, self.max_events, self.max_bytes)
        with self._txn() as tx:
            put, t_prefix, time_prefix = tx.put_stored, tx.t_prefix, tx.time_prefix
            pack = _BE64.pack
            by_token: dict[str, list[str]] = {}
            tx.touched = True
            low = self._time_floor
            for k, (h, raw) in fresh.items():
                ms = h.received_ms
                if not 0 <= ms <= _MAX64:
                    ms = min(max(ms, 0), _MAX64)
                if ms < low:
                    low = ms
                put(t_prefix + k, raw)
                put(time_prefix + pack(ms) + k, b"")
                token = h.token
                if token:
                    idx[k] = (ms << _SHIFT | len(raw), token)
                    by_token.setdefault(token, []).append(h.id)
                else:
                    idx[k] = ms << _SHIFT | len(raw)
            self._time_floor = low  # lowered before the write: a bound either way
            tx.writes += 2 * n
            tx.c.transient += n
            tx.c.bytes += nbytes
            for token, ids in by_token.items():
                tx.token_add(token, ids)
        return n

    def forget(
        self,
        keys: Sequence[bytes],
        seqs: Mapping[bytes, tuple[str, int] | None] | None = None,
    ) -> int:
        """Acked: drop the entries under these storage keys (`_key(stream, id)`, as
        `decode_forget` hands them over) from transient and failed; returns how many the log
        held. `seqs` (storage key -> (JetStream stream, seq)) is kept in the events' token
        records for `token_status`. A key that is not bytes is refused (TypeError): it
        could never match, so the forget would silently drop nothing."""
        seqs = seqs or {}
        n = fast = nbytes = 0
        idx = self._index()
        with self._txn() as tx:
            delete, t_prefix, time_prefix = tx.delete_stored, tx.t_prefix, tx.time_prefix
            pack = _BE64.pack
            tx.touched = True
            for k in dict.fromkeys(keys):
                m = idx.get(k)
                if m is None:
                    if k.__class__ is not bytes:
                        raise TypeError(f"forget takes storage keys, _key(stream, id), not {k!r}")
                    continue
                if m.__class__ is int and m >= 0:  # transient, no token: from the index alone
                    del idx[k]
                    delete(t_prefix + k)
                    delete(time_prefix + pack(m >> _SHIFT) + k)
                    nbytes += m & _SIZE
                    fast += 1
                    continue
                token = tx.drop_entry(k)  # transient with a token, or failed
                if token is None:
                    continue
                n += 1
                if token:
                    tx.token_ack(token, _split_key(k)[1], _seq(seqs.get(k)))
            tx.writes += 2 * fast
            tx.c.transient -= fast
            tx.c.bytes -= nbytes
        return n + fast

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
                    tx.drop_transient(k, tx.idx[k])
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
                    k = _key(ev.stream, ev.id)
                    tx.drop_entry(k)
                    tx.add_transient(k, value, ev.received_ms, ev.token)
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
        idx = self._index()  # (a rebuild resets the floor)
        t_ns = self._ns[NS_TRANSIENT]
        if len(idx) <= self.pending_from_index_max:
            # from the index: LevelDB's iterator would step over the delete of every entry
            # forgotten since the last compaction, up to the first live entry past the
            # cutoff (it does not stop at `stop`), at every call (the Replayer's, 2 a second)
            bound = min(cutoff, _MAX64 + 1) << _SHIFT  # meta < bound <=> received_ms < cutoff
            old: list[tuple[int, bytes]] = []
            for k, m in idx.items():
                if m.__class__ is tuple:
                    m = m[0]  # type: ignore[index]
                if 0 <= m < bound:  # type: ignore[operator]
                    old.append((m >> _SHIFT, k))  # type: ignore[operator]
            old.sort()  # (received_ms, key): the time index's order
            raws = t_ns.get_many([k for _, k in old[:limit]])
            return [decode_event(raw) for raw in raws if raw is not None]
        out = []
        first: int | None = None  # received_ms of the oldest entry found
        scanned = 0
        start = _be(self._time_floor)
        for key in self._ns[NS_BY_TIME].keys(start=start, stop=_be(cutoff), limit=limit):
            scanned += 1
            raw = t_ns.get(key[8:])
            if raw is not None:
                if first is None:
                    first = _BE64.unpack_from(key)[0]
                out.append(decode_event(raw))
        if first is not None:  # nothing live between the floor and it
            self._time_floor = first
        elif scanned < limit:  # nothing live before the cutoff
            self._time_floor = max(self._time_floor, min(cutoff, _MAX64))
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
        m = self._index().get(_log_key(key))
        if m is None:
            return None
        return "failed" if m == _FAILED else "transient"

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
        """The counters; `logged` counts the entries this process appended (a rate's
        source: it starts from 0 with the process, which a rate reads as a restart)."""
        c = self._c
        return {
            "transient": c.transient,
            "failed": c.failed,
            "bytes": c.bytes,
            "tokens": c.tokens,
            "logged": self.logged,
        }

    def scan_counts(self) -> dict[str, int]:
        """The counters recomputed by a full scan, plus the index sizes (a consistency check:
        `by_time == transient`, `by_retry == failed`, `tokens_done` == done records), and
        `logged` as it is (no scan recounts this process's appends)."""
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
            "index_mismatches": self.index_mismatches(),
            "logged": self.logged,
        }

    def index_mismatches(self) -> int:
        """How many keys the in-memory index holds differently from the disk (0 unless
        something changed entries behind the store's back)."""
        idx, disk = self._index(), self._read_index()
        return sum(1 for k in idx.keys() | disk.keys() if idx.get(k) != disk.get(k))

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
        idx = self._index()
        return [k in idx for k in keys]

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "created": self.created, **self.counts()}


def _open_store(path: pathlib.Path, timeout_s: float) -> CheckpointStore:
    """Open, waiting (bounded) while a dying predecessor still holds the LOCK."""
    last: list[CheckpointLockedError] = []

    def attempt() -> CheckpointStore | None:
        try:
            return CheckpointStore(
                path, write_buffer_size=WRITE_BUFFER_BYTES, compression=COMPRESSION
            )
        except CheckpointLockedError as exc:
            last[:] = [exc]
            return None

    store = poll(attempt, timeout_s)
    if store is None:
        raise last[0]
    return store
