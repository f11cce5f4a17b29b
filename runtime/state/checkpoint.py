"""Durable per-replica state on LevelDB (plyvel).

Each actor replica owns one `CheckpointStore` directory. Ray reruns an actor's `__init__` after a
restart and keeps nothing, so the actor reopens its store there and restores from it; the message
logger uses the same store as its durable log.

Guarantees:
- A synced write (the default) is on disk when the call returns. A write batch is atomic and is
  the group-commit unit: one fsync covers the whole batch, which is why hot paths batch.
- Namespaces never see each other's keys (prefix `name + b"\\x00"`; names may not contain NUL).
- Failures are `CheckpointError`s that name the directory and say what to do; use after `close()`
  raises instead of touching freed native handles. `close()` must not race operations running in
  other threads: the owning actor closes its store when it stops.
- `paranoid_checks` is on: a damaged log fails the open loudly instead of silently dropping the
  records after the damage (LevelDB's default). A torn tail left by a crash is still accepted.
"""

from __future__ import annotations

import os
import pathlib
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import plyvel

from runtime.errors import TierflowError

__all__ = [
    "Batch",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointStore",
    "Namespace",
    "SnapshotLog",
]


class CheckpointError(TierflowError):
    """Base class for every checkpoint store failure."""


class CheckpointLockedError(CheckpointError):
    """Another process or handle holds the store's LOCK."""


class CheckpointCorruptError(CheckpointError):
    """LevelDB found corruption in the store."""


def _locked_msg(path: pathlib.Path, detail: str) -> str:
    return (
        f"checkpoint store {path} is locked ({detail}): another replica or process has it open. "
        "Stop that process, or give each replica its own directory."
    )


def _corrupt_msg(path: pathlib.Path, detail: str) -> str:
    return (
        f"checkpoint store {path} is corrupt ({detail}). "
        f"Run `CheckpointStore.repair({str(path)!r})` (or `tierflow checkpoint repair {path}`), "
        "or delete the directory so the replica is rebuilt from a live peer."
    )


def _translate(exc: BaseException, path: pathlib.Path) -> CheckpointError:
    """Map a plyvel/LevelDB error to the matching CheckpointError with an actionable message."""
    detail = exc.args[0] if exc.args else str(exc)
    if isinstance(detail, bytes):
        detail = detail.decode("utf-8", "replace")
    detail = str(detail)
    if isinstance(exc, plyvel.CorruptionError) or "corruption" in detail.lower():
        return CheckpointCorruptError(_corrupt_msg(path, detail))
    if isinstance(exc, plyvel.IOError) and "lock" in detail.lower() and "ermission" not in detail:
        return CheckpointLockedError(_locked_msg(path, detail))
    if isinstance(exc, RuntimeError) and "closed" in detail:
        return CheckpointError(f"checkpoint store {path} is closed")
    return CheckpointError(f"checkpoint store {path}: {detail}")


class _Guard:
    """Cheap context manager (hot path: one per get/put) mapping native errors."""

    __slots__ = ("path",)

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, plyvel.Error | RuntimeError):
            raise _translate(exc, self.path) from exc


def _prefix(name: str) -> bytes:
    if not name or "\x00" in name:
        raise ValueError(f"namespace name must be non-empty and contain no NUL: {name!r}")
    return name.encode() + b"\x00"


def _bounds(
    start: bytes | None, stop: bytes | None, prefix: bytes | None
) -> tuple[bytes | None, bytes | None]:
    """Fold a key prefix into a [start, stop) range, so prefix combines with start/stop."""
    if not prefix:
        return start, stop
    lo = prefix if start is None else max(start, prefix)
    stripped = prefix.rstrip(b"\xff")  # the smallest key above every key with this prefix
    hi = stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None
    if stop is not None:
        hi = stop if hi is None else min(stop, hi)
    return lo, hi


class CheckpointStore:
    """One LevelDB directory, opened by exactly one handle at a time (LevelDB's LOCK file)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        sync: bool = True,
        create: bool = True,
        write_buffer_size: int | None = None,
        compression: str | None = "snappy",
    ) -> None:
        """`write_buffer_size`: LevelDB's memtable bytes (default 4 MiB). A store whose
        entries mostly die young (the message log) compacts less with a bigger one, and
        spends less on `compression` (None: blocks written uncompressed; every block says
        how it is stored, so a store opens whatever wrote it)."""
        self.path = pathlib.Path(path)
        self.sync = sync
        self.closed = True
        if create:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CheckpointError(f"cannot create checkpoint store {self.path}: {exc}") from exc
        elif not self.path.is_dir():
            raise CheckpointError(f"checkpoint store {self.path} does not exist (create=False)")
        try:
            extra = {} if write_buffer_size is None else {"write_buffer_size": write_buffer_size}
            self._db = plyvel.DB(
                str(self.path),
                create_if_missing=create,
                paranoid_checks=True,
                compression=compression,
                **extra,
            )
        except (plyvel.Error, OSError) as exc:
            raise _translate(exc, self.path) from exc
        self._guard_cm = _Guard(self.path)
        self.closed = False

    def _guard(self) -> _Guard:
        """Refuse use after close and turn native errors into CheckpointErrors."""
        if self.closed:
            raise CheckpointError(f"checkpoint store {self.path} is closed")
        return self._guard_cm

    def namespace(self, name: str) -> Namespace:
        """A view whose keys are stored as `name.encode() + b"\\x00" + key`."""
        return Namespace(self, name)

    def _sync(self, sync: bool | None) -> bool:
        return self.sync if sync is None else sync

    @contextmanager
    def write_batch(self, *, sync: bool | None = None) -> Iterator[Batch]:
        """Atomic writes across namespaces: committed (one fsync if synced) on a clean exit,
        discarded if the block raises."""
        with self._guard():
            wb = self._db.write_batch(sync=self._sync(sync))
        batch = Batch(self, wb)
        yield batch
        with self._guard():
            wb.write()

    def batch(self, *, sync: bool | None = None) -> Batch:
        """A batch committed only by its `write()` (one fsync if synced); dropping it unwritten
        discards it. For callers that decide at the end whether to write at all."""
        with self._guard():
            return Batch(self, self._db.write_batch(sync=self._sync(sync)))

    def close(self) -> None:
        """Release the LOCK so another handle (e.g. a restarted replica) can open the store."""
        if not self.closed:
            self.closed = True
            self._db.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.path)!r}, closed={self.closed})"

    @staticmethod
    def repair(path: str | os.PathLike[str]) -> None:
        """Salvage what LevelDB can read; records in damaged blocks may be lost."""
        p = pathlib.Path(path)
        try:
            plyvel.repair_db(str(p))
        except (plyvel.Error, OSError) as exc:
            raise _translate(exc, p) from exc


class Namespace:
    """A key space inside a store; every multi-key operation is a single atomic batch."""

    def __init__(self, store: CheckpointStore, name: str) -> None:
        self.store = store
        self.name = name
        self.prefix = _prefix(name)
        with store._guard():
            self._pdb = store._db.prefixed_db(self.prefix)

    def __repr__(self) -> str:
        return f"Namespace({self.name!r}, {self.store!r})"

    def _closed(self) -> CheckpointError:
        return CheckpointError(f"checkpoint store {self.store.path} is closed")

    # get/put/delete are on the log's hot path (a lookup per appended entry): a plain
    # try/except maps native errors as `_Guard` does, without a context manager per call
    def get(self, key: bytes, default: bytes | None = None) -> bytes | None:
        if self.store.closed:
            raise self._closed()
        try:
            return self._pdb.get(key, default)
        except (plyvel.Error, RuntimeError) as exc:
            raise _translate(exc, self.store.path) from exc

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """`get` of each key, in order (None where absent); not a snapshot: for one owner
        whose own writes are the only ones."""
        if self.store.closed:
            raise self._closed()
        get = self._pdb.get
        try:
            return [get(k) for k in keys]
        except (plyvel.Error, RuntimeError) as exc:
            raise _translate(exc, self.store.path) from exc

    def key(self, key: bytes) -> bytes:
        """The key as stored (with this namespace's prefix), for `Batch.apply`."""
        return self.prefix + key

    def put(self, key: bytes, value: bytes, *, sync: bool | None = None) -> None:
        if self.store.closed:
            raise self._closed()
        try:
            self._pdb.put(key, value, sync=self.store._sync(sync))
        except (plyvel.Error, RuntimeError) as exc:
            raise _translate(exc, self.store.path) from exc

    def delete(self, key: bytes, *, sync: bool | None = None) -> None:
        if self.store.closed:
            raise self._closed()
        try:
            self._pdb.delete(key, sync=self.store._sync(sync))
        except (plyvel.Error, RuntimeError) as exc:
            raise _translate(exc, self.store.path) from exc

    def _iter(
        self, start: bytes | None, stop: bytes | None, prefix: bytes | None, **kw: Any
    ) -> Iterator[Any]:
        lo, hi = _bounds(start, stop, prefix)
        if lo is not None and hi is not None and lo >= hi:
            return iter(())
        with self.store._guard():
            return self._pdb.iterator(start=lo, stop=hi, **kw)

    def _drain(self, it: Any, limit: int | None) -> Iterator[Any]:
        """Yield from a plyvel iterator with close/closed-store handling and an optional limit."""
        if limit is not None and limit <= 0:
            return
        n = 0
        try:
            for item in it:
                yield item
                n += 1
                if limit is not None and n >= limit:
                    return
        except (plyvel.Error, RuntimeError) as exc:
            raise _translate(exc, self.store.path) from exc
        finally:
            if hasattr(it, "close") and not self.store.closed:
                it.close()

    def scan(
        self,
        start: bytes | None = None,
        stop: bytes | None = None,
        *,
        prefix: bytes | None = None,
        reverse: bool = False,
        limit: int | None = None,
    ) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs in key order (descending if reverse); stop is exclusive."""
        return self._drain(self._iter(start, stop, prefix, reverse=reverse), limit)

    def keys(
        self,
        start: bytes | None = None,
        stop: bytes | None = None,
        *,
        prefix: bytes | None = None,
        reverse: bool = False,
        limit: int | None = None,
    ) -> Iterator[bytes]:
        it = self._iter(start, stop, prefix, reverse=reverse, include_value=False)
        return self._drain(it, limit)

    def count(
        self, start: bytes | None = None, stop: bytes | None = None, *, prefix: bytes | None = None
    ) -> int:
        return sum(1 for _ in self.keys(start, stop, prefix=prefix))

    def delete_range(
        self,
        start: bytes | None = None,
        stop: bytes | None = None,
        *,
        prefix: bytes | None = None,
        sync: bool | None = None,
    ) -> int:
        """Delete every key in the range in one atomic batch; returns how many were deleted.
        Keys written by another thread while this runs may survive."""
        return self.delete_many(list(self.keys(start, stop, prefix=prefix)), sync=sync)

    def put_many(self, items: Iterable[tuple[bytes, bytes]], *, sync: bool | None = None) -> int:
        """Write items in one atomic batch (one fsync when synced); returns how many."""
        n = 0
        with self.store.write_batch(sync=sync) as b:
            for key, value in items:
                b.put(self, key, value)
                n += 1
        return n

    def delete_many(self, keys: Iterable[bytes], *, sync: bool | None = None) -> int:
        """Delete keys in one atomic batch; returns the number of deletes issued (LevelDB cannot
        tell whether a key existed without reading it)."""
        n = 0
        with self.store.write_batch(sync=sync) as b:
            for key in keys:
                b.delete(self, key)
                n += 1
        return n


class Batch:
    """Writes collected inside `CheckpointStore.write_batch()`; applied together or not at all."""

    def __init__(self, store: CheckpointStore, wb: Any) -> None:
        self._store = store
        self._wb = wb
        # stored keys (`Namespace.key`) straight to LevelDB's batch: hot loops call these
        # once or twice per entry, so they are the native methods themselves
        self.put_stored: Callable[[bytes, Any], None] = wb.put
        self.delete_stored: Callable[[bytes], None] = wb.delete

    def _key(self, ns: Namespace | str, key: bytes) -> bytes:
        if isinstance(ns, Namespace):
            if ns.store is not self._store:
                raise ValueError(f"{ns!r} belongs to another store")
            return ns.prefix + key
        return _prefix(ns) + key

    def put(self, ns: Namespace | str, key: bytes, value: bytes) -> None:
        self._wb.put(self._key(ns, key), value)

    def delete(self, ns: Namespace | str, key: bytes) -> None:
        self._wb.delete(self._key(ns, key))

    def write(self) -> None:
        """Commit a batch from `CheckpointStore.batch()`: all of it or none."""
        with self._store._guard():
            self._wb.write()

    def apply(self, ops: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Many writes at once: (stored key, value) puts, (stored key, None) deletes, in
        order. Stored keys come from `Namespace.key`, so namespaces stay apart."""
        put, delete = self._wb.put, self._wb.delete
        for key, value in ops:
            if value is None:
                delete(key)
            else:
                put(key, value)


_SEQ = struct.Struct(">Q")  # big-endian so byte order is numeric order
_SNAP_KEY = b"latest"


class SnapshotLog:
    """Snapshot-plus-log: actors persist a full state snapshot now and then and append small
    log entries in between; restore() returns the latest snapshot and the entries after it.

    The snapshot and the trimming of the log it covers are one atomic batch, so a crash leaves
    either the old snapshot with its log or the new one with the trimmed log, never a mix.
    """

    def __init__(self, store: CheckpointStore, name: str) -> None:
        self.store = store
        self.name = name
        self._snap = store.namespace(f"{name}.snap")
        self._log = store.namespace(f"{name}.log")
        self._lock = threading.Lock()  # seq allocation and its write happen in seq order
        raw = self._snap.get(_SNAP_KEY)
        self._snap_seq = _SEQ.unpack_from(raw)[0] if raw is not None else 0
        last_log = next(self._log.keys(reverse=True, limit=1), None)
        self.last_seq = max(self._snap_seq, _SEQ.unpack(last_log)[0] if last_log else 0)

    def append(self, entry: bytes, *, sync: bool | None = None) -> int:
        """Durably append one entry (synced by default) and return its seq."""
        return self.append_many([entry], sync=sync)[0]

    def append_many(self, entries: Sequence[bytes], *, sync: bool | None = None) -> list[int]:
        """Append entries in one atomic batch: one fsync for all of them (group commit)."""
        with self._lock:
            seqs = list(range(self.last_seq + 1, self.last_seq + 1 + len(entries)))
            if not seqs:
                return []
            with self.store.write_batch(sync=sync) as b:
                for seq, entry in zip(seqs, entries, strict=True):
                    b.put(self._log, _SEQ.pack(seq), entry)
            self.last_seq = seqs[-1]
            return seqs

    def snapshot(self, state: bytes, *, upto: int | None = None, sync: bool | None = None) -> None:
        """Store `state` as covering every entry <= upto (default last_seq) and drop those
        entries, atomically. upto may not move backwards past an earlier snapshot."""
        with self._lock:
            upto = self.last_seq if upto is None else upto
            if not self._snap_seq <= upto <= self.last_seq:
                raise ValueError(
                    f"snapshot upto={upto} outside [{self._snap_seq}, {self.last_seq}] "
                    f"(previous snapshot seq, last appended seq)"
                )
            doomed = list(self._log.keys(stop=_SEQ.pack(upto + 1)))
            with self.store.write_batch(sync=sync) as b:
                b.put(self._snap, _SNAP_KEY, _SEQ.pack(upto) + state)
                for key in doomed:
                    b.delete(self._log, key)
            self._snap_seq = upto

    def restore(self) -> tuple[bytes | None, list[tuple[int, bytes]]]:
        """(latest snapshot or None, [(seq, entry)] with seq > the snapshot's seq, ascending)."""
        with self._lock:
            raw = self._snap.get(_SNAP_KEY)
            state, seq = (None, 0) if raw is None else (raw[_SEQ.size :], _SEQ.unpack_from(raw)[0])
            entries = [(_SEQ.unpack(k)[0], v) for k, v in self._log.scan(start=_SEQ.pack(seq + 1))]
            return state, entries
