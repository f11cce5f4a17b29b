"""Which copy of a stream an analysis position belongs to (geo replication, docs/geo.md).

A query's checkpoint holds stream sequences, and sequences are per copy: the same event has
different sequences on site A's copy and site B's, and B interleaves its own writes with
those it sources from A. A position of one copy applied to another silently counts events
twice or skips them. So every checkpoint of the analysis driver (each job generation, the
dead-letter queries, the archive) has its copy recorded next to it when its query first
starts (`record_copy`, ``<checkpoint>/tierflow-copy.json``), and each start compares the
recorded copy with the one the driver reads now (`decide`).

A copy is named by the site's JetStream domain, the stream's name and the stream's creation
time (STREAM.INFO ``created``, nanoseconds as the server gives it). The creation time changes
when a stream is deleted and made again, so a recreated single-site stream (sequences
starting over at 1) is a different copy too.

Pure: `CopyId`, `Action`, `decide`. Files: `read_copy`, `record_copy`. I/O: `acurrent_copy`,
`current_copy` (one STREAM.INFO and one account INFO).
"""

from __future__ import annotations

import asyncio
import enum
import json
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from runtime.errors import TierflowError
from runtime.state.files import write_atomic

if TYPE_CHECKING:
    from nats.aio.client import Client

    from runtime.nats.server import NatsEndpoint

__all__ = [
    "COPY_FILE",
    "MERGEABLE",
    "Action",
    "CopyError",
    "CopyId",
    "acurrent_copy",
    "current_copy",
    "decide",
    "read_copy",
    "record_copy",
]

COPY_FILE = "tierflow-copy.json"
MERGEABLE = ("topn", "count", "distinct")  # kinds a batch view can rebuild (jobs/batch_view.py)
ARCHIVE = "archive"
DEADLETTER = "deadletter"
API_TIMEOUT_S = 5.0


class CopyError(TierflowError, RuntimeError):
    """The copy a position belongs to cannot be read or does not match; the message says why
    and what to do."""


class CopyId(msgspec.Struct, frozen=True, kw_only=True):
    """One copy of one stream: the site (JetStream domain, '' without one), the stream, and
    when that stream was created."""

    domain: str
    stream: str
    created: str

    def describe(self) -> str:
        site = self.domain or "(no domain)"
        return f"{self.stream} on {site}, created {self.created}"


class Action(enum.Enum):
    """What a query's start does with its checkpoint, given the recorded and current copy."""

    RECORD = "record"  # nothing recorded yet: record the current copy and start
    RESUME = "resume"  # same copy: resume the checkpoint's positions
    RECOMPUTE = "recompute"  # another copy, a kind that merges: batch view over the new copy
    FRESH = "fresh"  # another copy, a kind that does not merge: a fresh start on the new copy
    REFUSE = "refuse"  # another copy, the archive: never resumed on another copy's positions


def decide(kind: str, recorded: CopyId | None, current: CopyId) -> Action:
    """The start's action for a query of `kind` (a job kind, ``archive`` or ``deadletter``).

    Never RESUME across copies: a position (a sequence) of one copy means nothing on another.
    Nothing recorded means a checkpoint that is new, or older than copy tracking; it is
    taken to be of the current copy (the only copy such a deployment has read)."""
    if recorded is None:
        return Action.RECORD
    if recorded == current:
        return Action.RESUME
    if kind == ARCHIVE:
        return Action.REFUSE
    if kind in MERGEABLE:
        return Action.RECOMPUTE
    return Action.FRESH  # sample, custom, and the dead-letter queries


def copy_path(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / COPY_FILE


def read_copy(checkpoint: str | Path) -> CopyId | None:
    """The copy recorded in a checkpoint directory, or None. An unreadable record is an
    error, not None: treating it as absent would resume positions of an unknown copy."""
    try:
        blob = copy_path(checkpoint).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(blob, type=CopyId)
    except msgspec.DecodeError as err:
        raise CopyError(
            f"{copy_path(checkpoint)} is unreadable ({err}): it names the copy the checkpoint's "
            "positions belong to; restore it or remove the checkpoint"
        ) from None


def record_copy(checkpoint: str | Path, copy: CopyId) -> None:
    """Record `copy` for a checkpoint directory (atomically: old record or new, never half)."""
    write_atomic(copy_path(checkpoint), msgspec.json.encode(copy))


async def _api(nc: Client, subject: str) -> dict[str, object]:
    msg = await nc.request(subject, b"", timeout=API_TIMEOUT_S)
    body = json.loads(msg.data or b"{}")
    if "error" in body:
        raise CopyError(f"{subject}: {body['error'].get('description') or body['error']}")
    return body


async def acurrent_copy(nc: Client, stream: str) -> CopyId:
    """The copy of `stream` the connection's own JetStream (its site) holds."""
    account = await _api(nc, "$JS.API.INFO")
    info = await _api(nc, f"$JS.API.STREAM.INFO.{stream}")
    created = info.get("created")
    if not created:
        raise CopyError(f"stream {stream!r}: STREAM.INFO has no creation time")
    return CopyId(domain=str(account.get("domain") or ""), stream=stream, created=str(created))


def current_copy(nats: NatsEndpoint, stream: str) -> CopyId:
    """`acurrent_copy` on a connection of its own (from sync code without a running loop)."""

    async def go() -> CopyId:
        nc = await nats.connect(name="analysis-copy")
        try:
            return await acurrent_copy(nc, stream)
        finally:
            await nc.close()

    return asyncio.run(go())
