"""Cutting a Ray call's bytes argument into parts Ray sends inline in the call.

Ray sends an argument up to 100 KiB inline (`max_direct_call_object_size`) and copies a
bigger one into the object store, whose raylet work (create, seal, fetch by the callee,
free) costs CPU on every call. The limit is per argument, so a batch sent as parts of at
most `INLINE_PART_BYTES`, each an argument of its own, travels in the call itself and the
callee joins them. A call inlines at most 10 MiB (`task_rpc_inlined_bytes_limit`); a blob
past `INLINE_CALL_BYTES` stays one part (Ray puts it in the object store).
"""

from __future__ import annotations

INLINE_PART_BYTES = 96 * 1024
INLINE_CALL_BYTES = 8 << 20


def inline_parts(blob: bytes) -> tuple[bytes, ...]:
    """`blob` cut into parts Ray sends inline (`INLINE_PART_BYTES`; one part if it is
    small, or too big for one call's inline bytes); `b"".join(parts) == blob`."""
    if len(blob) <= INLINE_PART_BYTES or len(blob) > INLINE_CALL_BYTES:
        return (blob,)
    step = INLINE_PART_BYTES
    return tuple(blob[i : i + step] for i in range(0, len(blob), step))


def join_parts(first: bytes, more: tuple[bytes, ...]) -> bytes:
    """The blob `inline_parts` cut, from its first part and the rest (no copy for one)."""
    return b"".join((first, *more)) if more else first
