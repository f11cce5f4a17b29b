"""`_Txn`: the changes of one `LogStore` call, applied as one synced write batch.

Reads through a `_Txn` see the call's own earlier changes; counters move with the entries
they count, and completed tokens past `max_done_tokens` expire in the same batch, so a
crash leaves all of a call or none of it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from actors.queue.logger.records import (
    _BE64,
    _FAILED,
    _SHIFT,
    _SIZE,
    NS_BY_RETRY,
    NS_BY_TIME,
    NS_DONE,
    NS_FAILED,
    NS_TOKENS,
    NS_TRANSIENT,
    FailedEntry,
    IndexMeta,
    TokenState,
    _be,
    _enc,
    _failed_dec,
    _meta,
    _token_dec,
)

if TYPE_CHECKING:  # the store hands itself in; importing it would be a cycle
    from actors.queue.logger.store import LogStore
    from runtime.state.checkpoint import Batch

_MISSING: Any = object()


def _time_of(m: IndexMeta) -> bytes:
    """The by_time prefix (be64 of received_ms) of a transient entry's index meta."""
    if m.__class__ is tuple:
        m = m[0]  # type: ignore[index]
    return _BE64.pack(m >> _SHIFT)  # type: ignore[operator]


class _Txn:
    """Changes of one call: reads see the call's own earlier changes; applied as one batch.

    Entry changes go straight into the store's in-memory index (`LogStore._idx`) as they
    are made: `LogStore._txn` rebuilds it from disk if the call does not end in a write.
    """

    def __init__(self, store: LogStore, batch: Batch) -> None:
        self.s = store
        self.c = copy.copy(store._c)
        self.batch = batch
        self.put_stored = batch.put_stored
        self.delete_stored = batch.delete_stored
        self.writes = 0  # LevelDB writes in `batch`: none, and the call writes nothing
        self.touched = False  # the index was changed (it must be rebuilt if not written)
        self.idx = store._idx
        self._prefix = store._prefix
        self.t_prefix = store._prefix[NS_TRANSIENT]
        self.time_prefix = store._prefix[NS_BY_TIME]
        # full values this call read or wrote: ("t", raw) | ("f", FailedEntry) | None
        self._entries: dict[bytes, tuple[str, Any] | None] = {}
        self._tokens: dict[str, TokenState | None] = {}

    def put(self, ns: str, key: bytes, value: bytes = b"") -> None:
        self.put_stored(self._prefix[ns] + key, value)
        self.writes += 1

    def delete(self, ns: str, key: bytes) -> None:
        self.delete_stored(self._prefix[ns] + key)
        self.writes += 1

    # entries -------------------------------------------------------------------

    def lookup(self, k: bytes) -> tuple[str, Any] | None:
        """("t", raw) | ("f", FailedEntry) | None for storage key `k`, as of this call's
        changes so far. Reads LevelDB only for an entry the index says is there."""
        entries = self._entries
        if k in entries:
            return entries[k]
        m = self.idx.get(k)
        cur: tuple[str, Any] | None = None
        if m is None:
            pass
        elif m == _FAILED:
            fraw = self.s._ns[NS_FAILED].get(k)
            cur = None if fraw is None else ("f", _failed_dec.decode(fraw))
        else:
            raw = self.s._ns[NS_TRANSIENT].get(k)
            cur = None if raw is None else ("t", raw)
        entries[k] = cur
        return cur

    def add_transient(self, k: bytes, raw: bytes, received_ms: int, token: str) -> None:
        """Log an event (encoded as `raw`) under its storage key `k`."""
        m = _meta(received_ms, len(raw), token)
        if received_ms < self.s._time_floor:
            self.s._time_floor = max(received_ms, 0)
        self.put_stored(self.t_prefix + k, raw)
        self.put_stored(self.time_prefix + _time_of(m) + k, b"")
        self.writes += 2
        self.c.transient += 1
        self.c.bytes += len(raw)
        self.touched = True
        self.idx[k] = m
        self._entries[k] = ("t", raw)

    def drop_transient(self, k: bytes, m: IndexMeta) -> str:
        """Drop the transient entry `k` whose index meta is `m`; returns its token."""
        token = ""
        if m.__class__ is tuple:
            m, token = m  # type: ignore[misc]
        self.delete_stored(self.t_prefix + k)
        self.delete_stored(self.time_prefix + _BE64.pack(m >> _SHIFT) + k)  # type: ignore[operator]
        self.writes += 2
        self.c.transient -= 1
        self.c.bytes -= m & _SIZE  # type: ignore[operator]
        self.touched = True
        del self.idx[k]
        self._entries[k] = None
        return token

    def add_failed(self, k: bytes, fe: FailedEntry) -> None:
        self.put(NS_FAILED, k, _enc.encode(fe))
        self.put(NS_BY_RETRY, _be(fe.next_retry_ms) + k)
        self.c.failed += 1
        self.c.bytes += len(fe.raw)
        self.touched = True
        self.idx[k] = _FAILED
        self._entries[k] = ("f", fe)

    def drop_failed(self, k: bytes, fe: FailedEntry) -> None:
        self.delete(NS_FAILED, k)
        self.delete(NS_BY_RETRY, _be(fe.next_retry_ms) + k)
        self.c.failed -= 1
        self.c.bytes -= len(fe.raw)
        self.touched = True
        self.idx.pop(k, None)
        self._entries[k] = None

    def drop_entry(self, k: bytes) -> str | None:
        """Remove whatever the log holds under storage key `k`; returns the token of the
        event it held ("" for none), None if it held nothing. A transient entry is dropped
        from its index meta alone, unread."""
        if k in self._entries and self._entries[k] is None:
            return None
        m = self.idx.get(k)
        if m is None:
            return None
        if m == _FAILED:
            cur = self.lookup(k)
            if cur is None:
                return None
            fe: FailedEntry = cur[1]
            self.drop_failed(k, fe)
            return fe.event.token
        return self.drop_transient(k, m)

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
