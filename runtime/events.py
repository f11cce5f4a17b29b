"""The event envelope the collection tier moves, its batch encoding and its ids.

Batches cross Ray and LevelDB as one msgpack blob: one serialisation per batch instead
of pickling many small objects, which is what keeps the data plane off the control
plane's per-call costs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec


class Event(msgspec.Struct, frozen=True, array_like=True):
    """One accepted event; `id` is its identity everywhere (log key, Nats-Msg-Id)."""

    id: str
    stream: str
    subject: str
    data: bytes
    received_ms: int
    processed: bool = False
    token: str = ""


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[Event])
_event_decoder = msgspec.msgpack.Decoder(Event)


def encode_batch(events: Sequence[Event]) -> bytes:
    return _encoder.encode(events)


def decode_batch(data: bytes) -> list[Event]:
    return _batch_decoder.decode(data)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> Event:
    return _event_decoder.decode(data)


_lock = threading.Lock()
_last_ms = 0
_seq = 0


def new_event_id() -> str:
    """A time-ordered id (UUIDv7 layout): 48-bit ms clock, 12-bit counter, 62 random bits.

    Hand-written because Python 3.11's uuid module has no uuid7. Ids from one process
    sort by creation; the random bits keep processes apart.
    """
    global _last_ms, _seq
    with _lock:
        now = time.time_ns() // 1_000_000
        if now <= _last_ms:
            _seq += 1
            if _seq > 0xFFF:  # counter exhausted within one ms: borrow the next ms
                _last_ms += 1
                _seq = 0
        else:
            _last_ms, _seq = now, 0
        ms, seq = _last_ms, _seq
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (seq << 64) | (0b10 << 62) | rand
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def json_kind(value: Any) -> str:
    """A decoded JSON value's kind as JSON names it, for messages about unexpected input."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"
