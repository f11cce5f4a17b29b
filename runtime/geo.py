"""Geo replication of streams between sites (JetStream domains joined by leaf nodes).

Each site of a `[streams.X.replicate]` group keeps a full copy of X named X. A copy takes
its own site's writes on X's subjects and *sources* every other copy, filtered to that
copy's local writes and stored under `geo.<origin site>.<subject>`: so a copy never
re-sources what it got from elsewhere (no cycle), and the origin of every event stays
visible. Sourced messages keep their headers, and JetStream checks a sourced message's
Nats-Msg-Id against the copy's duplicate window like a publish: an event acknowledged on
both sites (a producer's retry after a failover) is stored once in each copy.

Pure: `origin_subject`, `origin_transform`, `origin_patterns`, `copy_sources`, `copy_config`,
`link_deny`, `lag_rows`.
I/O (one nats-py connection to any site, other sites reached by their domain's API
prefix `$JS.<site>.API` across the leaf links): `local_site`, `ensure_copies`,
`with_local_sources`, `stream_copy_info`, `replication_lag`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from runtime.geo_config import ReplicateConfig

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.api import StreamConfig as JsStreamConfig

    from runtime.config import Config

log = logging.getLogger(__name__)
ORIGIN_PREFIX = "geo"
API_TIMEOUT_S = 2.0


def origin_subject(site: str, subject: str) -> str:
    """Where a copy stores an event sourced from `site` that was written on `subject`."""
    return f"{ORIGIN_PREFIX}.{site}.{subject}"


def origin_transform(site: str, subject: str) -> str:
    """The subject transform destination for a source filtered on `subject`: `origin_subject`
    with each `*` written as the `{{wildcard(n)}}` it stands for (nats-server refuses a
    bare `*` in a destination: "source transform: invalid subject"; a `>` is kept)."""
    out, n = [], 0
    for token in subject.split("."):
        if token == "*":
            n += 1
            token = f"{{{{wildcard({n})}}}}"
        out.append(token)
    return origin_subject(site, ".".join(out))


def origin_patterns(subjects: Iterable[str]) -> list[str]:
    """Subject filters matching what every origin's events on `subjects` are stored under
    in a copy (`geo.*.<subject>`), for readers that want every site's writes."""
    return [origin_subject("*", s) for s in subjects]


def copy_sources(name: str, subjects: Iterable[str], site: str, rep: ReplicateConfig) -> list[Any]:
    """The `sources` of `site`'s copy of stream `name`: every other site's copy, only its
    local writes (its own `subjects`), each moved under that origin's prefix."""
    from nats.js.api import ExternalStream, StreamSource, SubjectTransform

    return [
        StreamSource(
            name=name,
            external=ExternalStream(api=f"$JS.{other}.API"),
            subject_transforms=[
                SubjectTransform(src=s, dest=origin_transform(other, s)) for s in subjects
            ],
        )
        for other in rep.sites
        if other != site
    ]


def copy_config(base: JsStreamConfig, site: str, rep: ReplicateConfig) -> JsStreamConfig:
    """`site`'s copy: the stream's own config (subjects, limits, dedup window, replicas)
    plus the sources from the other sites."""
    return dataclasses.replace(
        base, sources=copy_sources(base.name or "", base.subjects or [], site, rep)
    )


def link_deny(cfg: Config) -> list[str]:
    """Subjects the leaf links between sites must not carry: every configured stream's
    subjects, as configured and as JetStream captures them (a compacted stream's have one
    more token, the key); a stream would otherwise also capture the other site's publishes."""
    from runtime.compaction import stream_subjects

    out: list[str] = []
    for name, stream in cfg.streams.items():
        for subj in [*stream.subjects, *stream_subjects(stream, name)]:
            if subj not in out:
                out.append(subj)
    return out


async def local_site(nc: Client, default: str) -> str:
    """The JetStream domain of the site `nc` is connected to (`default` if it has none)."""
    info = await nc.jetstream(timeout=API_TIMEOUT_S).account_info()
    return info.domain or default


async def with_local_sources(
    nc: Client, base: JsStreamConfig, rep: ReplicateConfig | None
) -> JsStreamConfig:
    """`base` as the copy on the site `nc` is connected to (unchanged without `rep`)."""
    if rep is None:
        return base
    return copy_config(base, await local_site(nc, rep.site), rep)


async def _ensure_on(nc: Client, site: str, sc: JsStreamConfig) -> None:
    from nats.js.errors import NotFoundError

    js = nc.jetstream(domain=site, timeout=API_TIMEOUT_S)
    try:
        await js.stream_info(sc.name or "")
        await js.update_stream(sc)
    except NotFoundError:
        await js.add_stream(sc)


async def ensure_copies(
    nc: Client, base: JsStreamConfig, rep: ReplicateConfig | None
) -> dict[str, str]:
    """Create or update the copy on every other site of the group reachable now; a lost
    site is skipped (logged) and gets its copy when it returns and this runs again.
    Returns {site: "ok" | "unreachable: ..."}; the local site is left to the caller."""
    if rep is None:
        return {}
    here = await local_site(nc, rep.site)
    out: dict[str, str] = {}
    for site in rep.sites:
        if site == here:
            continue
        try:
            await _ensure_on(nc, site, copy_config(base, site, rep))
            out[site] = "ok"
        except Exception as err:  # a lost site: no responders or a timeout
            log.warning("stream %s: copy on %s not ensured: %r", base.name, site, err)
            out[site] = f"unreachable: {err!r}"
    return out


async def stream_copy_info(nc: Client, site: str, name: str) -> dict[str, Any] | None:
    """The raw STREAM.INFO of `site`'s copy (None if the site or the copy does not answer).
    Raw JSON, because it names each source's origin (`external.api`)."""
    try:
        msg = await nc.request(f"$JS.{site}.API.STREAM.INFO.{name}", b"", timeout=API_TIMEOUT_S)
    except Exception:
        return None
    body = json.loads(msg.data or b"{}")
    return None if "error" in body else body


def _origin(source: Mapping[str, Any]) -> str:
    api = ((source.get("external") or {}).get("api")) or ""
    parts = api.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "$JS" else "?"


def lag_rows(stream: str, site: str, info: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One row per (copy on `site`, origin site): events not yet sourced (`lag`), seconds
    since the source last heard from its origin (`active_s`), and whether the copy answers."""
    if info is None:
        return [{"stream": stream, "site": site, "from": "-", "lag": None, "up": False}]
    rows = []
    for src in info.get("sources") or []:
        active = src.get("active")
        rows.append(
            {
                "stream": stream,
                "site": site,
                "from": _origin(src),
                "lag": int(src.get("lag") or 0),
                "active_s": round(active / 1e9, 3) if isinstance(active, int | float) else None,
                "error": (src.get("error") or {}).get("description"),
                "up": True,
                "messages": int((info.get("state") or {}).get("messages") or 0),
            }
        )
    return rows


async def replication_lag(nc: Client, cfg: Config) -> list[dict[str, Any]]:
    """Every replicated stream's copies and their lag behind each origin (for
    `tierflow status` and /metrics); a site that does not answer is a row with up=False."""
    jobs = [
        (name, site)
        for name, s in cfg.streams.items()
        if s.replicate is not None
        for site in s.replicate.sites
    ]
    infos = await asyncio.gather(*(stream_copy_info(nc, site, name) for name, site in jobs))
    return [
        row
        for (name, site), info in zip(jobs, infos, strict=True)
        for row in lag_rows(name, site, info)
    ]


__all__ = [
    "ORIGIN_PREFIX",
    "copy_config",
    "copy_sources",
    "ensure_copies",
    "lag_rows",
    "link_deny",
    "local_site",
    "origin_patterns",
    "origin_subject",
    "origin_transform",
    "replication_lag",
    "stream_copy_info",
    "with_local_sources",
]
