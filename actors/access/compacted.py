"""Reads of compacted streams (`[streams.X.compact]`, runtime/compaction.py) by key.

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
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from nats.js.errors import NotFoundError

from actors.access.auth import request_token
from actors.access.messages import StreamMessage
from actors.access.plane import DataPlane
from actors.access.protocol import Problem, StreamRef, int_param, refusal, reply
from actors.access.reader import stored_message
from runtime.compaction import key_filters, key_token, lookup_subjects, token_key, token_of
from runtime.config import StreamConfig

__all__ = ["CompactedRoutes", "MAX_KEYS_PAGE"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_KEYS_PAGE = 1000
DEFAULT_KEYS_PAGE = 100
_SUBJECTS_PAGE_LIMIT = 1000  # pages of STREAM.INFO subjects read for one request at most
_json = msgspec.json.Encoder()


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
        found: Any = None
        for subject in lookup_subjects(sc.subjects, token):  # the newest over the subjects
            try:
                raw = await self.plane.js.get_last_msg(ref.js, subject)
            except NotFoundError:
                continue
            if found is None or raw.seq > found.seq:
                found = raw
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
        counts: dict[str, int] = {}
        for pattern in key_filters(sc.subjects):
            for subject, n in (await self._subjects(ref.js, pattern)).items():
                tok = token_of(subject)
                counts[tok] = counts.get(tok, 0) + n
        tokens = sorted(t for t in counts if t > after)
        page = tokens[:limit]
        out = []
        for tok in page:
            known, value = token_key(tok)
            out.append({"key": value if known else None, "token": tok, "count": counts[tok]})
        nxt = page[-1] if len(tokens) > limit else None
        return reply(200, {"stream": ref.public, "keys": out, "next": nxt})

    async def _subjects(self, js_name: str, pattern: str) -> dict[str, int]:
        """Every subject of the stream matching `pattern`, with its message count."""
        out: dict[str, int] = {}
        offset = 0
        api = getattr(self.plane.js, "_prefix", "$JS.API")  # a JetStream domain's, if any
        for _ in range(_SUBJECTS_PAGE_LIMIT):
            msg = await self.plane.nc.request(
                f"{api}.STREAM.INFO.{js_name}",
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


def _key_param(query: Any) -> str | int | float | bool:
    """`?key=` is a string; `?key_json=` a JSON scalar (numbers, booleans, strings)."""
    if "key_json" in query:
        try:
            value = msgspec.json.decode(query["key_json"])
        except msgspec.DecodeError:
            raise Problem(400, 'key_json must be a JSON value, e.g. 42, true or "a"') from None
        if value is None or isinstance(value, dict | list):
            raise Problem(400, "key_json must be a string, number or boolean")
        return value
    return query["key"]
