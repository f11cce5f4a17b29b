"""The decision behind `tierflow site promote SITE` (docs/geo.md): pure, from the config,
the sites' state file and the replication rows (runtime/geo/replication.py `replication_lag`).

Promotion changes nothing in JetStream's replication, which needs no command: every copy
takes writes all along and sources the others as they come and go. What promotion decides
is that the runtime (analysis, gateways, producers' `nats.url`) now serves from SITE's
copies: it refuses when a replicated stream has no answering copy there, and says what
the lost site still holds that SITE will only get when that site returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.config import Config


@dataclass(frozen=True)
class Promotion:
    site: str
    url: str
    streams: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def site_url(state: Mapping[str, Any] | None, site: str) -> str:
    """SITE's comma-joined client URLs from a sites.json (runtime/geo/sites.py), or ''."""
    for s in (state or {}).get("sites") or []:
        if s.get("name") == site:
            return ",".join(s.get("urls") or [])
    return ""


def replicated_to(cfg: Config, site: str) -> list[str]:
    """The streams with a copy on `site`."""
    return [n for n, s in cfg.streams.items() if s.replicate and site in s.replicate.sites]


def plan_promotion(
    cfg: Config, site: str, url: str, rows: Sequence[Mapping[str, Any]]
) -> Promotion:
    """Whether SITE can serve the runtime now, and what the operator should know."""
    streams = replicated_to(cfg, site)
    problems: list[str] = []
    notes: list[str] = []
    if not url:
        problems.append(f"no client URL for {site} (pass --url, or run `nats up --sites`)")
    if not streams:
        problems.append(f"no stream is replicated to {site} ([streams.X.replicate] to = ...)")
    for name in streams:
        mine = [r for r in rows if r.get("stream") == name and r.get("site") == site]
        if not mine or not all(r.get("up") for r in mine):
            problems.append(f"{name}: the copy on {site} does not answer")
            continue
        for r in mine:
            origin = r.get("from")
            origin_up = any(
                o.get("up") for o in rows if o.get("stream") == name and o.get("site") == origin
            )
            if not origin_up or r.get("error"):
                notes.append(
                    f"{name}: {origin} is not reachable; what it acknowledged and had not "
                    f"copied yet (lag last seen: {r.get('lag')}) reaches {site} by itself "
                    f"when {origin} returns"
                )
            elif r.get("lag"):
                notes.append(f"{name}: {site} is {r['lag']} events behind {origin} (catching up)")
    if not problems:
        notes.append(
            f"point producers and the runtime at {site}: TIERFLOW_NATS__URL={url}; "
            "the analysis driver started there recomputes count, topn and distinct jobs over "
            f"{site}'s copy, starts the others over on it, and leaves an archive of the other "
            "copy alone until you move it aside (docs/geo.md, Analysis on another copy)"
        )
    return Promotion(site=site, url=url, streams=streams, problems=problems, notes=notes)


__all__ = ["Promotion", "plan_promotion", "replicated_to", "site_url"]
