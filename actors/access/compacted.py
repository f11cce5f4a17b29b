"""Reads of compacted streams (`[streams.X.compact]`, runtime/data/compaction.py) by key.

- `GET /v1/streams/{stream}/latest?key=K` (K a string) or `?key_json=V` (V a JSON scalar,
  for numbers and booleans: `?key_json=42`): the stream's latest event for that key, as
  `/latest` answers (`{"seq", "subject", "data"}`, and `"key"`); 404 when the stream holds
  none, 400 on a stream that is not compacted. Without either parameter the route is the
  plain `/latest` (actors/access/rest.py).
- `GET /v1/streams/{stream}/keys?limit=N&after=TOKEN`: the keys the stream holds, in token
  order, `limit` at a time (default 100, at most 1000): `{"keys": [{"key", "token",
  "count"}], "next": TOKEN or null}`; `next` is the `after` of the next page, null on the
  last. `key` is null for a hashed token (a key too long to read back).

Same token and stream rules as every other stream read (`plane.stream`: 401, 403, 404).
Listing keys asks JetStream for the stream's subjects (`STREAM.INFO` with a subject
filter, 100,000 subjects a response): it costs what the stream's key count is, per page.

A replicated stream (`[streams.X.replicate]`, runtime/geo/replication.py) holds the keys written on
other sites under `geo.<origin>.<subject>`: both routes read every origin as well as the
local subjects (`read_subjects`, `list_filters`), so each site answers for every site's
writes. `latest_message` says which one is the latest (the last stored in this copy).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from nats.js.errors import NotFoundError

from actors.access.auth import request_token
from actors.access.messages import StreamMessage
from actors.access.plane import DataPlane
from actors.access.protocol import Problem, StreamRef, int_param, refusal
from actors.access.reader import stored_message
from runtime.config import StreamConfig
from runtime.data.compaction import (
    Scalar,
    decode_exact,
    key_filters,
    key_token,
    lookup_subjects,
    token_key,
    token_of,
)
from runtime.geo.replication import origin_patterns

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.api import RawStreamMsg
    from nats.js.client import JetStreamContext

__all__ = [
    "CompactedRoutes",
    "MAX_KEYS_PAGE",
    "key_counts",
    "latest_message",
    "list_filters",
    "read_subjects",
]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_KEYS_PAGE = 1000
DEFAULT_KEYS_PAGE = 100
_SUBJECTS_PAGE_LIMIT = 1000  # pages of STREAM.INFO subjects read for one request at most
_json = msgspec.json.Encoder(decimal_format="number")  # keys past a float's digits, exact


class CompactedRoutes:
    """`/latest?key=` and `/keys` of one replica; `plain_latest` answers `/latest` without
    a key."""

    def __init__(self, plane: DataPlane, plain_latest: Handler) -> None:
        self.plane = plane
        self.plain_latest = plain_latest

    def _refuse(self, p: Problem) -> web.Response:
        self.plane.count(p)
        return refusal(p)

    async def _compacted(self, request: web.Request) -> tuple[StreamRef, StreamConfig]:
        plane = self.plane
        plane.counters["requests"] += 1
        token = request_token(request)
        plane.access.authenticate(token)
        ref, _ = await plane.stream(request.match_info["stream"], token)
        sc = None if ref.kv else plane.cfg.streams.get(ref.public)
        if sc is None or sc.compact is None:
            raise Problem(
                400,
                f"stream {ref.public!r} is not compacted: only a stream with "
                "[streams.<name>.compact] is read by key",
            )
        return ref, sc

    async def latest(self, request: web.Request) -> web.StreamResponse:
        """The latest event of `?key=` / `?key_json=`, else the plain `/latest`."""
        query = request.query
        if "key" not in query and "key_json" not in query:
            return await self.plain_latest(request)
        try:
            ref, sc = await self._compacted(request)
            value = _key_param(query)
        except Problem as p:
            return self._refuse(p)
        token = key_token(value)
        found = await latest_message(self.plane.js, ref.js, read_subjects(sc, token))
        if found is None:
            return self._refuse(Problem(404, f"no event in {ref.public!r} for key {value!r}"))
        ev: StreamMessage = stored_message(found, False)
        body = b'{"seq":%d,"subject":%s,"key":%s,"token":%s,"data":%s}' % (
            ev.seq,
            _json.encode(ev.subject),
            _json.encode(value),
            _json.encode(token),
            ev.raw or b"null",
        )
        return web.Response(body=body, content_type="application/json")

    async def keys(self, request: web.Request) -> web.Response:
        """One page of the keys the stream holds, in token order."""
        try:
            ref, sc = await self._compacted(request)
            limit = int_param(request, "limit", DEFAULT_KEYS_PAGE, lo=1)
        except Problem as p:
            return self._refuse(p)
        assert limit is not None
        limit = min(limit, MAX_KEYS_PAGE)
        after = request.query.get("after", "")
        api = getattr(self.plane.js, "_prefix", "$JS.API")  # a JetStream domain's, if any
        counts = await key_counts(self.plane.nc, api, ref.js, list_filters(sc))
        tokens = sorted(t for t in counts if t > after)
        page = tokens[:limit]
        out = []
        for tok in page:
            known, value = token_key(tok)
            out.append({"key": value if known else None, "token": tok, "count": counts[tok]})
        nxt = page[-1] if len(tokens) > limit else None
        body = _json.encode({"stream": ref.public, "keys": out, "next": nxt})
        return web.Response(body=body, content_type="application/json")


def read_subjects(sc: StreamConfig, token: str) -> list[str]:
    """The subjects (patterns, with wildcards) a key's events are on in this copy: the local
    ones and, for a replicated stream, every origin's (`geo.*.<subject>`)."""
    local = lookup_subjects(sc.subjects, token)
    return local + (origin_patterns(local) if sc.replicate is not None else [])


def list_filters(sc: StreamConfig) -> list[str]:
    """Subject filters matching every key of the stream in this copy, from every origin."""
    local = key_filters(sc.subjects)
    return local + (origin_patterns(local) if sc.replicate is not None else [])


async def latest_message(
    js: JetStreamContext, stream: str, subjects: Sequence[str]
) -> RawStreamMsg | None:
    """The latest message of `stream` over `subjects`: the one this copy stored last (the
    highest sequence), whatever its origin; None when none of them holds one.

    Why "stored last" and not "published last at its origin": a sourced message is stamped
    with the time this copy stored it, not its origin's (nats-server 2.15.1), and tierflow's
    events carry no time of their own, so the origin's time is not here to compare; asking
    the origin for it would make every read wait on the other site, and fail while it is
    lost. The last stored is what this copy can decide alone, the same rule as for a stream
    on one site. With the sites in touch (replication lag in milliseconds) it is the last
    written; a key written on two sites within the lag of each other, or on both while the
    link was down, may have a different latest on each site until it is written again."""

    async def last(subject: str) -> RawStreamMsg | None:
        try:
            return await js.get_last_msg(stream, subject)
        except NotFoundError:
            return None

    found = [m for m in await asyncio.gather(*(last(s) for s in subjects)) if m is not None]
    return max(found, key=lambda m: m.seq or 0, default=None)


async def key_counts(nc: Client, api: str, stream: str, filters: Sequence[str]) -> dict[str, int]:
    """{key token: messages held for it} over `filters`: a key held under several subjects
    (routed subjects, other sites' origins) is one key, its counts added."""
    counts: dict[str, int] = {}
    for pattern in filters:
        for subject, n in (await _subjects(nc, api, stream, pattern)).items():
            tok = token_of(subject)
            counts[tok] = counts.get(tok, 0) + n
    return counts


async def _subjects(nc: Client, api: str, stream: str, pattern: str) -> dict[str, int]:
    """Every subject of the stream matching `pattern`, with its message count."""
    out: dict[str, int] = {}
    offset = 0
    for _ in range(_SUBJECTS_PAGE_LIMIT):
        msg = await nc.request(
            f"{api}.STREAM.INFO.{stream}",
            json.dumps({"subjects_filter": pattern, "offset": offset}).encode(),
            timeout=10.0,
        )
        body = json.loads(msg.data)
        if "error" in body:
            raise Problem(503, f"JetStream: {body['error'].get('description')}")
        subjects = (body.get("state") or {}).get("subjects") or {}
        out.update(subjects)
        offset += len(subjects)
        if not subjects or offset >= int(body.get("total") or 0):
            break
    return out


def _key_param(query: Any) -> Scalar:
    """`?key=` is a string; `?key_json=` a JSON scalar (numbers, booleans, strings)."""
    if "key_json" in query:
        try:
            value = decode_exact(query["key_json"])
        except msgspec.DecodeError:
            raise Problem(400, 'key_json must be a JSON value, e.g. 42, true or "a"') from None
        if value is None or isinstance(value, dict | list):
            raise Problem(400, "key_json must be a string, number or boolean")
        return value
    return query["key"]
