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
    NS_BY_RETRY,
    NS_BY_TIME,
    NS_DONE,
    NS_FAILED,
    NS_TOKENS,
    NS_TRANSIENT,
    FailedEntry,
    TokenState,
    _be,
    _enc,
    _failed_dec,
    _key,
    _token_dec,
)
from runtime.events import Event, decode_event

if TYPE_CHECKING:  # the store hands itself in; importing it would be a cycle
    from actors.queue.logger.store import LogStore

_MISSING: Any = object()


class _Txn:
    """Changes of one call: reads see the call's own earlier changes; applied as one batch."""

    def __init__(self, store: LogStore) -> None:
        self.s = store
        self.c = copy.copy(store._c)
        # (stored key, value) puts and (stored key, None) deletes, for `Batch.apply`
        self.ops: list[tuple[bytes, bytes | None]] = []
        self._prefix = store._prefix
        self._t_prefix = store._prefix[NS_TRANSIENT]
        self._time_prefix = store._prefix[NS_BY_TIME]
        self._entries: dict[bytes, tuple[str, Any] | None] = {}  # by storage key
        self._tokens: dict[str, TokenState | None] = {}

    def put(self, ns: str, key: bytes, value: bytes = b"") -> None:
        self.ops.append((self._prefix[ns] + key, value))

    def delete(self, ns: str, key: bytes) -> None:
        self.ops.append((self._prefix[ns] + key, None))

    # entries -------------------------------------------------------------------

    def lookup(self, k: bytes) -> tuple[str, Any] | None:
        """("t", raw) | ("f", FailedEntry) | None for storage key `k`, as of this call's
        changes so far."""
        if k not in self._entries:
            self.prefetch((k,))
        return self._entries[k]

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Read what the store holds under `keys` (those this call has not touched yet).

        The `failed` namespace is read only when the store's counters say it holds
        something: they are written in the same synced batch as the entries they count
        (and recounted by a scan when a store has none), so `failed == 0` means empty.
        """
        entries = self._entries
        todo = [k for k in dict.fromkeys(keys) if k not in entries]
        if not todo:
            return
        missing = []
        for k, raw in zip(todo, self.s._ns[NS_TRANSIENT].get_many(todo), strict=True):
            if raw is not None:
                entries[k] = ("t", raw)
            else:
                entries[k] = None
                missing.append(k)
        if missing and self.s._c.failed:
            for k, fraw in zip(missing, self.s._ns[NS_FAILED].get_many(missing), strict=True):
                if fraw is not None:
                    entries[k] = ("f", _failed_dec.decode(fraw))

    def add_transient(self, ev: Event, raw: bytes, k: bytes | None = None) -> None:
        """Log `ev` (encoded as `raw`) under its storage key `k` (computed if not given)."""
        if k is None:
            k = _key(ev.stream, ev.id)
        ops = self.ops
        ops.append((self._t_prefix + k, raw))
        ops.append((self._time_prefix + _be(ev.received_ms) + k, b""))
        self.c.transient += 1
        self.c.bytes += len(raw)
        self._entries[k] = ("t", raw)

    def drop_transient(self, ev: Event, raw: bytes, k: bytes | None = None) -> None:
        if k is None:
            k = _key(ev.stream, ev.id)
        ops = self.ops
        ops.append((self._t_prefix + k, None))
        ops.append((self._time_prefix + _be(ev.received_ms) + k, None))
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
            self.drop_transient(ev, val, k)
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
