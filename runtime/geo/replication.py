"""Geo replication of streams between sites (JetStream domains joined by leaf nodes).

Each site of a `[streams.X.replicate]` group keeps a full copy of X named X. A copy takes
its own site's writes on X's subjects and *sources* every other copy, filtered to that
copy's local writes and stored under `geo.<origin site>.<subject>`: so a copy never
re-sources what it got from elsewhere (no cycle), and the origin of every event stays
visible. Sourced messages keep their headers, and JetStream checks a sourced message's
Nats-Msg-Id against the copy's duplicate window like a publish: an event acknowledged on
both sites (a producer's retry after a failover) is stored once in each copy.

A copy that lost its origin (the origin's site down, or the link) gets it back by itself,
but late: nats-server retries a source on a backoff that grows by 10 s with every failed
try during the outage, up to 2 minutes, and only the site that *accepts* a leaf connection
retries at once when it comes back. `SourceWatch` (run by the tierflow runtime) asks the
copy's stream leader to step down once the origin answers again: the new leader sets its
sources up at once, from where the copy stands (the same path as any leader change, so
nothing is copied twice or skipped).

Retention (jobs/retention.py) asks `sourced_next` how far another site's copy has sourced
this one: the origin sequence a sourced message carries in its `Nats-Stream-Source`
header, read from the newest message that copy stored from here, is a position that
copy has confirmed.

Pure: `origin_subject`, `origin_transform`, `origin_patterns`, `copy_sources`, `copy_config`,
`link_deny`, `lag_rows`, `stalled_copies`, `kick_due`, `source_header_seq`.
I/O (one nats-py connection to any site, other sites reached by their domain's API
prefix `$JS.<site>.API` across the leaf links): `local_site`, `ensure_copies`,
`with_local_sources`, `stream_copy_info`, `replication_lag`, `kick_copy`, `SourceWatch`,
`sourced_next`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from runtime.geo.config import ReplicateConfig

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.api import StreamConfig as JsStreamConfig

    from runtime.config import Config

log = logging.getLogger(__name__)
ORIGIN_PREFIX = "geo"
API_TIMEOUT_S = 2.0
# Creating or updating another site's copy is a replicated stream's creation there (R3: its
# nodes elect a leader), relayed over the leaf link: under `make bench`'s load it outlasted
# 2 s once, and the copy was missing when that site's producer started. A lost site answers
# at once (no responders); only a partitioned one that still looks connected waits this out.
COPY_ADMIN_TIMEOUT_S = 10.0
# A source hears from its origin at least every second (nats-server's source heartbeat),
# so five seconds of silence while the origin answers means it is waiting on a retry.
STALL_S = 5.0
KICK_AFTER_S = 15.0  # between kicks of one copy, doubling while it stays stalled
KICK_MAX_S = 300.0


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
    from runtime.data.compaction import stream_subjects

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

    js = nc.jetstream(domain=site, timeout=COPY_ADMIN_TIMEOUT_S)
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
                # nats-server says -1 for a source that never heard from its origin
                "active_s": round(active / 1e9, 3)
                if isinstance(active, int | float) and active >= 0
                else None,
                "error": (src.get("error") or {}).get("description"),
                "up": True,
                "messages": int((info.get("state") or {}).get("messages") or 0),
                "replicas": int((info.get("config") or {}).get("num_replicas") or 1),
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


def stalled_copies(
    rows: Iterable[Mapping[str, Any]], stall_s: float = STALL_S
) -> list[tuple[str, str]]:
    """(stream, site) of each copy that answers and has a source silent for `stall_s` or
    more (or never heard) while that source's origin copy answers too: a copy waiting on
    nats-server's retry backoff. A copy whose origin is down is left alone (nothing to
    kick it towards), and so is an R1 copy: it has no raft group, so nats-server answers
    a leader change with success and does nothing; it waits out the backoff."""
    rows = list(rows)
    answering = {(r["stream"], r["site"]) for r in rows if r.get("up")}
    out: list[tuple[str, str]] = []
    for r in rows:
        if not r.get("up") or (r["stream"], r.get("from")) not in answering:
            continue
        if int(r.get("replicas") or 1) < 2:
            continue
        active = r.get("active_s")
        key = (r["stream"], r["site"])
        if (active is None or active >= stall_s) and key not in out:
            out.append(key)
    return out


def kick_due(kicks: int, last_at: float | None, now: float) -> bool:
    """Whether a stalled copy kicked `kicks` times so far (the last at `last_at`) is kicked
    again now: at once the first time, then after 15 s, 30 s, 60 s... up to 5 minutes, so a
    source that stays broken for another reason (a denied subject, a wrong domain) costs a
    leader change only now and then."""
    if kicks == 0 or last_at is None:
        return True
    return now - last_at >= min(KICK_MAX_S, KICK_AFTER_S * 2 ** (kicks - 1))


async def kick_copy(nc: Client, site: str, stream: str) -> str | None:
    """Ask `site`'s copy of `stream` to change its leader; returns None, or why not."""
    msg = await nc.request(
        f"$JS.{site}.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=API_TIMEOUT_S
    )
    body = json.loads(msg.data or b"{}")
    err = body.get("error")
    return None if not err else str(err.get("description") or err)


SOURCE_HEADER = "Nats-Stream-Source"
NO_MESSAGE = 10037  # JetStream's "no message found"


def source_header_seq(headers: bytes) -> int | None:
    """The origin's stream sequence in a sourced message's raw NATS headers: nats-server
    writes `Nats-Stream-Source: <origin stream>[:<api hash>] <sequence> <filter> ...`."""
    for line in headers.decode("utf-8", "replace").split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == SOURCE_HEADER.lower():
            parts = value.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1])
    return None


async def _msg_get(nc: Client, site: str | None, stream: str, req: dict[str, Any]) -> Any:
    prefix = f"$JS.{site}.API" if site else "$JS.API"
    msg = await nc.request(
        f"{prefix}.STREAM.MSG.GET.{stream}", json.dumps(req).encode(), timeout=API_TIMEOUT_S
    )
    return json.loads(msg.data or b"{}")


async def sourced_next(nc: Client, stream: str, origin: str, site: str) -> int | None:
    """The first sequence of `origin`'s copy of `stream` (the one `nc` is connected to)
    that `site`'s copy has not sourced yet and needs: `origin`'s next local write (on one
    of its own subjects, what `site` sources) after the last one `site` stored. None when
    `site`'s copy does not answer (down, cut off, or missing): the caller holds at the
    last position it had.

    Order matters: `origin`'s last sequence is read first, so an event written while this
    runs is never below the answer; and `site` is asked before `origin`'s next local write
    is looked up, so what `site` stores meanwhile only makes the answer low (safe)."""
    from base64 import b64decode

    try:
        own = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=API_TIMEOUT_S)
        body = json.loads(own.data or b"{}")
        if "error" in body:
            return None
        last = int((body.get("state") or {}).get("last_seq") or 0)
        subjects = list((body.get("config") or {}).get("subjects") or [])
        got = await _msg_get(nc, site, stream, {"last_by_subj": origin_subject(origin, ">")})
    except Exception as err:  # no responders, a timeout: that site is out of reach
        log.debug("geo: %s's copy of %s does not answer: %r", site, stream, err)
        return None
    err = got.get("error")
    if err and err.get("err_code") != NO_MESSAGE:
        return None  # no copy there (yet): nothing confirmed
    sourced = 0
    if not err:
        hdrs = (got.get("message") or {}).get("hdrs")
        seq = source_header_seq(b64decode(hdrs)) if hdrs else None
        if seq is None:
            return None  # not a sourced message: no position to trust
        sourced = seq
    nexts = [last + 1]
    for subject in subjects:
        try:
            found = await _msg_get(nc, None, stream, {"seq": sourced + 1, "next_by_subj": subject})
        except Exception:
            return None
        if "error" not in found:
            nexts.append(int(found["message"]["seq"]))
        elif found["error"].get("err_code") != NO_MESSAGE:
            return None
    return min(nexts)


@dataclasses.dataclass
class SourceWatch:
    """Kicks copies stalled on nats-server's source retry backoff (`stalled_copies`) on the
    schedule of `kick_due`; forgets a copy once its sources hear from their origins."""

    sites: frozenset[str] | None = None  # the copies on these sites only (None: every site)
    stall_s: float = STALL_S
    kicks: dict[tuple[str, str], tuple[int, float]] = dataclasses.field(default_factory=dict)
    kicked: int = 0  # leader changes asked for, for status

    async def tick(self, nc: Client, rows: list[dict[str, Any]], now: float) -> list[str]:
        """One look at `rows` (`replication_lag`); returns the copies kicked, as site/stream."""
        stalled = [
            (stream, site)
            for stream, site in stalled_copies(rows, self.stall_s)
            if self.sites is None or site in self.sites
        ]
        for key in [k for k in self.kicks if k not in stalled]:
            del self.kicks[key]  # its sources hear from their origins again
        done = []
        for stream, site in stalled:
            n, last = self.kicks.get((stream, site), (0, None))
            if not kick_due(n, last, now):
                continue
            self.kicks[(stream, site)] = (n + 1, now)
            try:
                why = await kick_copy(nc, site, stream)
            except Exception as err:  # the copy stopped answering meanwhile
                why = repr(err)
            if why is None:
                self.kicked += 1
                done.append(f"{site}/{stream}")
                log.info(
                    "geo: %s's copy of %s waited on its source retry: leader changed", site, stream
                )
            else:
                log.warning(
                    "geo: %s's copy of %s is stalled, no leader change: %s", site, stream, why
                )
        return done

    async def run(
        self, nc: Client, cfg: Config, stop: asyncio.Event, interval_s: float = 1.0
    ) -> None:
        """Until `stop`: look every `interval_s` (a `replication_lag` round, bounded by its
        2-s API timeout)."""
        while not stop.is_set():
            try:
                await self.tick(nc, await replication_lag(nc, cfg), time.monotonic())
            except Exception:
                log.exception("geo: source watch")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


__all__ = [
    "ORIGIN_PREFIX",
    "SourceWatch",
    "copy_config",
    "copy_sources",
    "ensure_copies",
    "kick_copy",
    "kick_due",
    "lag_rows",
    "link_deny",
    "local_site",
    "origin_patterns",
    "origin_subject",
    "origin_transform",
    "replication_lag",
    "source_header_seq",
    "sourced_next",
    "stalled_copies",
    "stream_copy_info",
    "with_local_sources",
]
