"""The log's on-disk format: its records and the LevelDB keys they live under.

Every byte here is what a replica's store holds and what `export`/`import_` copy between
replicas, so it must stay identical across versions (`KEYS_VERSION` marks the one
migration so far, see `LogStore._migrate_keys`). Records are msgpack arrays
(`array_like=True`); index keys start with a big-endian u64 so LevelDB orders them by time.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from runtime.data.events import Event, decode_event


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
EXPORTED = (NS_TRANSIENT, NS_FAILED, NS_TOKENS)  # transient first: see LogStore.export()

COUNTS_KEY = b"counts"
FENCE_KEY = b"fence"
CATCHING_UP_KEY = b"catching_up"
# Entries are keyed by (stream, id): the Nats-Msg-Id dedups per JetStream stream, so the same
# id in two streams is two events. Stores without this marker were keyed by id alone and are
# migrated when opened.
KEYS_KEY = b"keys"
KEYS_VERSION = b"stream+id"

_BE64 = struct.Struct(">Q")
_MAX64 = (1 << 64) - 1
# next_retry_ms of a parked failed entry: never due, so no retry pass resends it; an
# operator settles it (`tierflow logger inspect` counts them). The bridge parks what it
# must not resend blindly and cannot prove absent, and poison it could only dead-letter
# with its body cut.
PARKED_MS = _MAX64


class _Head(msgspec.Struct, frozen=True, array_like=True):
    """An encoded `Event` read for the in-memory index: the same fields in the same order
    (a test keeps them so), the subject and data left undecoded."""

    id: str
    stream: str
    subject: msgspec.Raw
    data: msgspec.Raw
    received_ms: int
    processed: bool = False
    token: str = ""


# The store's in-memory index (`LogStore`): storage key -> what forgetting the entry needs
# without reading it. A transient entry is `_meta(received_ms, size, token)`: the int
# `received_ms << _SHIFT | size` (received_ms clamped as `_be` does, size the encoded
# event's length), paired with the token when it has one; a failed entry is `_FAILED`.
_SHIFT = 40
_SIZE = (1 << _SHIFT) - 1
_FAILED = -1
IndexMeta = int | tuple[int, str]


def _meta(received_ms: int, size: int, token: str) -> IndexMeta:
    if not 0 <= received_ms <= _MAX64:
        received_ms = min(max(received_ms, 0), _MAX64)
    m = received_ms << _SHIFT | size
    return (m, token) if token else m


_enc = msgspec.msgpack.Encoder()
_counts_dec = msgspec.msgpack.Decoder(_Counts)
_failed_dec = msgspec.msgpack.Decoder(FailedEntry)
_token_dec = msgspec.msgpack.Decoder(TokenState)
_head_dec = msgspec.msgpack.Decoder(_Head)
# a batch (`encode_batch`) as its events' encodings, each the bytes `encode_event` gives
_raws_dec = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _be(n: int) -> bytes:
    return _BE64.pack(n if 0 <= n <= _MAX64 else min(max(n, 0), _MAX64))


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
    if isinstance(key, tuple) and len(key) == 2:
        stream, id_ = key
        if isinstance(stream, str) and isinstance(id_, str):
            return stream.encode() + b"\x00" + id_.encode()
    raise TypeError(f"log keys are (stream, id) pairs, got {key!r}")


# A forget as it crosses Ray: one msgpack blob, ([storage key], [(stream, id, js, seq)]),
# decoded in one call on each replica instead of unpickling a tuple per key. Keys travel as
# the storage keys the store looks up (`_key`), built once by the sender. Blobs of the
# earlier form, keys as (stream, id) pairs, are still read: `decode_forget` turns their
# pairs into storage keys, so the store takes one kind of key.
_ForgetWire = tuple[list[bytes], list[tuple[str, str, str, int]]]
_forget_dec = msgspec.msgpack.Decoder(_ForgetWire)
_forget_dec_pairs = msgspec.msgpack.Decoder(
    tuple[list[bytes | tuple[str, str]], list[tuple[str, str, str, int]]]
)


def encode_forget(
    keys: Sequence[LogKey], seqs: Mapping[LogKey, tuple[str, int] | None] | None
) -> bytes:
    """The wire form of a forget: its keys in order and the sequences that are known.
    Raises TypeError for a key that is not a (stream, id) pair (`_log_key`)."""
    known = [(k[0], k[1], s[0], s[1]) for k, s in (seqs or {}).items() if s is not None]
    return _enc.encode(([_log_key(k) for k in keys], known))


def decode_forget(blob: bytes) -> tuple[list[bytes], dict[bytes, tuple[str, int]]]:
    """`encode_forget`'s keys and known sequences back, both as storage keys (what
    `LogStore.forget` takes), whichever form the blob was written in."""
    try:
        keys, known = _forget_dec.decode(blob)
    except msgspec.ValidationError:  # the earlier form: (stream, id) pairs
        pairs, known = _forget_dec_pairs.decode(blob)
        keys = [k if k.__class__ is bytes else _key(*k) for k in pairs]
    return keys, {_key(stream, id_): (js, seq) for stream, id_, js, seq in known}


def _seq(value: Any) -> tuple[str, int] | None:
    if value is None:
        return None
    stream, seq = value
    return (str(stream), int(seq))
