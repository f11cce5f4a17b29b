"""Who still needs an archived stream's events, besides its archive: the holds retention
(jobs/retention.py) never purges past.

- **Copies on other sites** (`[streams.X.replicate]`, docs/geo.md): each other site's copy
  sources this copy's local writes; its hold is the first of them it has not stored
  (runtime/geo/replication.py `sourced_next`). A site that does not answer (down, or the
  link cut) holds at the last position it confirmed, kept per copy in ``<checkpoint
  root>/.retention-floors/<stream>.json`` so that a restarted driver holds there too; a
  site never heard from holds everything. A site's floor only moves forward (`confirm`).
- **Readers** (jobs/read_lease.py): each live lease holds from the sequence it reads from.

Pure: `confirm`. Files and I/O: `SiteFloors`, `site_holds`, `reader_holds`, `holds_for`,
and `trim`, one retention pass over one stream (what the analysis driver runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from jobs.copies import CopyId
from jobs.read_lease import live_floor, read_leases
from jobs.retention import Hold, Purge, enforce
from runtime.geo.replication import local_site, sourced_next
from runtime.state.files import write_atomic

if TYPE_CHECKING:
    from nats.aio.client import Client

    from runtime.config import StreamConfig

__all__ = [
    "FLOORS_DIR",
    "SiteFloors",
    "confirm",
    "holds_for",
    "reader_holds",
    "site_holds",
    "trim",
]

FLOORS_DIR = ".retention-floors"


def confirm(floors: Mapping[str, int], site: str, seq: int | None) -> dict[str, int]:
    """`floors` with `site`'s confirmed position `seq` (None: it did not answer, and its
    last confirmed position holds). Never lower than before: a copy that once stored an
    event keeps it, and a late answer from before the last one must not undo it."""
    out = dict(floors)
    if seq is not None:
        out[site] = max(seq, out.get(site, 0))
    return out


class SiteFloors(msgspec.Struct, kw_only=True):
    """The last position each other site's copy confirmed, for one copy of one stream."""

    copy: CopyId
    sites: dict[str, int] = {}

    @staticmethod
    def path(root: str | Path, stream: str) -> Path:
        return Path(root) / FLOORS_DIR / f"{stream}.json"

    @classmethod
    def load(cls, root: str | Path, stream: str, copy: CopyId) -> SiteFloors:
        """The recorded floors of `copy` (none if nothing was recorded for this copy: the
        stream was made again, or this is another site's copy)."""
        try:
            got = msgspec.json.decode(cls.path(root, stream).read_bytes(), type=cls)
        except (OSError, msgspec.DecodeError):
            return cls(copy=copy)
        return got if got.copy == copy else cls(copy=copy)

    def save(self, root: str | Path, stream: str) -> None:
        write_atomic(self.path(root, stream), msgspec.json.encode(self))


async def site_holds(
    nc: Client, stream: str, s: StreamConfig, root: str | Path, copy: CopyId
) -> list[Hold]:
    """One hold per other site of the stream's replication group (none unreplicated)."""
    rep = s.replicate
    if rep is None:
        return []
    here = await local_site(nc, rep.site)
    floors = SiteFloors.load(root, stream, copy)
    sites = dict(floors.sites)
    for site in rep.sites:
        if site != here:
            sites = confirm(sites, site, await sourced_next(nc, stream, here, site))
    if sites != floors.sites:
        floors.sites = sites
        floors.save(root, stream)
    return [Hold(sites.get(site, 0), site=site) for site in rep.sites if site != here]


def reader_holds(root: str | Path, stream: str, now: float | None = None) -> list[Hold]:
    """The lowest live reader lease of `stream`, as a hold (none without one)."""
    now = time.time() if now is None else now
    lease = live_floor(read_leases(root, stream, now), now)
    return [] if lease is None else [Hold(lease.next_seq, reader=lease.reader or lease.id)]


async def holds_for(
    nc: Client, stream: str, s: StreamConfig, root: str | Path, copy: CopyId
) -> list[Hold]:
    """Every hold on `stream` but its archive's. Read after the archive's position (see
    jobs/read_lease.py for why the order matters)."""
    return [*await site_holds(nc, stream, s, root, copy), *reader_holds(root, stream)]


async def trim(
    nc: Client,
    stream: str,
    s: StreamConfig,
    root: str | Path,
    copy: CopyId,
    archived_next: Callable[[], int],
) -> Purge:
    """One retention pass over `stream` (copy `copy`, the one `nc` reaches): the archive's
    position (`archived_next()`, read first), then the other holds, then `enforce`."""
    archived = archived_next()
    holds = await holds_for(nc, stream, s, root, copy)
    return await enforce(
        nc.jetstream(),
        stream,
        archived,
        max_age_s=s.max_age_s,
        max_bytes=s.max_bytes,
        holds=holds,
    )
