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
_last_slot = -1  # the last (ms << 12 | counter) handed out in this process
_SEQ_BITS = 12
_SEQ_HEX = [f"-7{seq:03x}-" for seq in range(1 << _SEQ_BITS)]  # version 7 nibble + counter
_RAND_MASK = b"\x3f" + b"\xff" * 7  # keep 62 random bits ...
_RAND_VARIANT = b"\x80" + b"\x00" * 7  # ... under the variant bits 10


def new_event_id() -> str:
    """A time-ordered id (UUIDv7 layout): 48-bit ms clock, 12-bit counter, 62 random bits.

    Hand-written because Python 3.11's uuid module has no uuid7. Ids from one process
    sort by creation; the random bits keep processes apart.
    """
    return new_event_ids(1)[0]


def new_event_ids(n: int) -> list[str]:
    """`n` ids as `new_event_id` makes them, in creation order, for the price of one.

    One lock, one clock read and one `os.urandom` for the whole batch: the ids take the
    next `n` (ms, counter) slots after the last one handed out (a counter exhausted within
    one ms borrows the next ms), so they sort exactly as `n` calls would.
    """
    global _last_slot
    if n <= 0:
        return []
    with _lock:
        now_slot = (time.time_ns() // 1_000_000) << _SEQ_BITS
        first = now_slot if now_slot > _last_slot else _last_slot + 1
        _last_slot = first + n - 1
    rand = int.from_bytes(os.urandom(8 * n), "big") & int.from_bytes(
        _RAND_MASK * n, "big"
    ) | int.from_bytes(_RAND_VARIANT * n, "big")
    hexed = rand.to_bytes(8 * n, "big").hex()
    out: list[str] = []
    append = out.append
    ms_prefix, prefix_of = "", -1
    seq_hex = _SEQ_HEX
    for i, slot in enumerate(range(first, first + n)):
        ms = slot >> _SEQ_BITS
        if ms != prefix_of:
            h = f"{ms:012x}"
            ms_prefix, prefix_of = f"{h[:8]}-{h[8:]}", ms
        j = 16 * i
        append(ms_prefix + seq_hex[slot & 0xFFF] + hexed[j : j + 4] + "-" + hexed[j + 4 : j + 16])
    return out


# Skipping a value checks less than decoding it: bad UTF-8 inside a string and numbers
# out of range (a float past 1.8e308, an integer of over 4,300 digits) pass a skip but
# fail a decode. So a body is skipped (not decoded) only if it is valid UTF-8 and has no
# number that could be out of range: no positive exponent of 3 or more digits and no run
# of 200 digits (a float of fewer integer digits and a 2-digit exponent stays below
# 1e299; a negative exponent underflows to 0.0, which decodes).
# Text that merely looks like it (an id "e2e-50000", a UUID "550e8400-...") is common, so
# a body the byte scan flags is decoded, values dropped: a decode that succeeds is the
# proof (what decodes, a skip accepts too). Measured on events with ids like "e2e-50000":
# ~6 us an event, where a regex looking for a number token of that shape took 31-45 us.
_SHAPES = bytearray(b"x" * 256)
_SHAPES[ord("0") : ord("9") + 1] = b"0" * 10
_SHAPES[ord("e")] = _SHAPES[ord("E")] = ord("e")
_NUMBER_SHAPES = bytes(_SHAPES)
_BIG_EXPONENT = b"0e000"
_LONG_DIGITS = b"0" * 200
_check = msgspec.json.Decoder().decode
_NOT_DECODED = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def skippable_json(body: bytes) -> bool:
    """True if skipping `body`'s values accepts exactly what decoding them would. `body` is
    one JSON text or NDJSON (one per line)."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            return False
    shapes = body.translate(_NUMBER_SHAPES, b"+")  # "-" stays: 1e-500 is 0.0
    if _BIG_EXPONENT not in shapes and _LONG_DIGITS not in shapes:
        return True
    return _decodes(body)


def _decodes(body: bytes) -> bool:
    """Every JSON text in `body` decodes: the whole of it, else each line (NDJSON)."""
    try:
        _check(body)
        return True
    except _NOT_DECODED:
        pass
    try:
        for line in body.split(b"\n"):
            if line.strip():
                _check(line)
    except _NOT_DECODED:
        return False
    return True


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
