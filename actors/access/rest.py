"""The request/response endpoints: streams, long polling, latest, KV snapshots, webhooks.

- `GET /v1/streams`: the streams this token may read, with their first and last seq and,
  for a compacted one, its key and the events kept per key (`"compact": {"key", "keep"}`,
  else null);
- long polling `GET /v1/poll/{stream}?after=SEQ&timeout=S`: matching events after SEQ
  (waiting up to S for some); `next` is the `after` of the next poll, so nothing is lost
  between polls;
- simple messaging `GET /v1/streams/{stream}/latest` (the last message, or of
  `?subject=`) and `GET /v1/streams/{stream}?since=SEQ` (a poll that does not wait);
- data sync `GET /v1/kv/{bucket}`: every live key with the revision it is current at; the
  deltas after it come over the WebSocket from `kv:<bucket>`;
- webhooks `POST/GET /v1/webhooks`, `GET/DELETE /v1/webhooks/{id}` (actors/access/webhooks.py):
  seen and deleted only by the token that registered them.

Every refusal is a JSON `{"error", ...}` with its status (protocol.refusal).
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web
from nats.js.errors import NotFoundError

from actors.access.auth import request_token
from actors.access.fanout import Feed
from actors.access.messages import StreamMessage
from actors.access.plane import DataPlane
from actors.access.protocol import (
    Problem,
    StreamRef,
    filter_problem,
    first_seq_to_deliver,
    int_param,
    parse_start,
    refusal,
    reply,
    stream_ref,
)
from actors.access.reader import JetStreamReader, stored_message
from actors.access.webhooks import Registration, WebhookError
from runtime.data.query import Filter, FilterError

__all__ = ["RestRoutes"]

_json = msgspec.json.Encoder()
Found = list[tuple[StreamMessage, bytes]]


class RestRoutes:
    """The request/response endpoints of one replica."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def _refuse(self, p: Problem) -> web.Response:
        self.plane.count(p)
        return refusal(p)

    # ------------------------------------------------------------------ streams

    async def list_streams(self, request: web.Request) -> web.Response:
        plane = self.plane
        token = request_token(request)
        try:
            plane.access.authenticate(token)
        except Problem as p:
            return self._refuse(p)
        out = []
        for name in await plane.js.streams_info():
            ref = stream_ref(name.config.name)
            try:
                plane.access.authorize(token, ref)
            except Problem:
                continue
            s = name.state
            sc = None if ref.kv else plane.cfg.streams.get(ref.public)
            c = sc.compact if sc is not None else None
            compact = None if c is None else {"key": c.key, "keep": c.keep}
            out.append(
                {
                    "stream": ref.public,
                    "first_seq": s.first_seq,
                    "last_seq": s.last_seq,
                    "compact": compact,
                }
            )
        return reply(200, {"streams": sorted(out, key=lambda d: d["stream"])})

    # ------------------------------------------------------------------ polling, latest

    async def poll(self, request: web.Request) -> web.Response:
        self.plane.counters["polls"] += 1
        opts = self.plane.options
        try:
            timeout = float(request.query.get("timeout", opts.poll_timeout_s))
        except ValueError:
            return self._refuse(Problem(400, "timeout must be a number of seconds"))
        return await self._poll(request, max(0.0, min(timeout, opts.poll_max_timeout_s)))

    async def since(self, request: web.Request) -> web.Response:
        if "since" not in request.query:
            return self._refuse(Problem(400, "give ?since=SEQ (or use /latest)"))
        return await self._poll(request, 0.0, after_param="since")

    async def _poll(
        self, request: web.Request, timeout: float, after_param: str = "after"
    ) -> web.Response:
        plane = self.plane
        plane.counters["requests"] += 1
        token = request_token(request)
        try:
            plane.access.authenticate(token)
            ref, state = await plane.stream(request.match_info["stream"], token)
            flt = plane.filter(request.query.get("filter", ""))
            after = int_param(request, after_param, None)
            limit = int_param(request, "limit", plane.options.poll_limit, lo=1)
        except FilterError as err:
            return self._refuse(filter_problem(err))
        except Problem as p:
            return self._refuse(p)
        assert limit is not None
        if after is None:
            after = state.last_seq  # no position yet: wait for what comes next
        events, next_seq = await self._collect(
            ref, flt, after, min(limit, 10_000), timeout, state.last_seq
        )
        body = b'{"events":[%s],"next":%d}' % (
            b",".join(
                b'{"seq":%d,"subject":%s,"data":%s}' % (e.seq, _json.encode(e.subject), v)
                for e, v in events
            ),
            next_seq,
        )
        plane.counters["events_sent"] += len(events)
        return web.Response(body=body, content_type="application/json")

    async def _collect(
        self,
        ref: StreamRef,
        flt: Filter,
        after: int,
        limit: int,
        timeout: float,
        known_last: int,
    ) -> tuple[Found, int]:
        """Matching events after `after` (at most `limit`), and the last seq examined: from
        the feed's ring, from a history read if older, waiting up to `timeout` for some.
        What the stream held when the request came (`known_last`) is always looked at,
        even with timeout 0 (a feed that just started needs a moment to read it)."""
        feed = self.plane.hub.feed(ref.js)
        now = time.monotonic()
        deadline = now + timeout
        catch_up = now + max(timeout, 10.0)
        scan_cap = 10 * limit
        with feed.poller():
            feed.start(after + 1)
            while True:
                if after + 1 < feed.ring.base:
                    return await self._collect_history(ref, flt, after, limit, feed)
                found: Found = []
                scanned = 0
                for ev in feed.ring.read(after + 1, scan_cap):
                    scanned += 1
                    after = ev.seq
                    view = ev.view(flt)
                    if view is not None:
                        found.append((ev, view))
                        if len(found) >= limit:
                            break
                if found or scanned >= scan_cap:
                    return found, after
                until = catch_up if feed.position <= known_last else deadline
                remaining = until - time.monotonic()
                if remaining <= 0 or not await feed.wait_change(after + 1, remaining):
                    return [], after

    async def _collect_history(
        self, ref: StreamRef, flt: Filter, after: int, limit: int, feed: Feed
    ) -> tuple[Found, int]:
        reader = await feed.open_history(self.plane.history(ref), after + 1)
        found: Found = []
        try:
            for _ in range(10):
                events = await reader.fetch(1000, 1.0)
                if not events:
                    break
                for ev in events:
                    after = ev.seq
                    view = ev.view(flt)
                    if view is not None:
                        found.append((ev, view))
                if len(found) >= limit or after + 1 >= feed.ring.base:
                    break
        finally:
            await feed.close_history(reader)
        return found[:limit], found[limit - 1][0].seq if len(found) > limit else after

    async def latest(self, request: web.Request) -> web.Response:
        """The last message of the stream (or of `?subject=`); `?since=SEQ` lists instead."""
        if "since" in request.query:
            return await self._poll(request, 0.0, after_param="since")
        plane = self.plane
        plane.counters["requests"] += 1
        token = request_token(request)
        try:
            plane.access.authenticate(token)
            ref, state = await plane.stream(request.match_info["stream"], token)
            flt = plane.filter(request.query.get("filter", ""))
        except FilterError as err:
            return self._refuse(filter_problem(err))
        except Problem as p:
            return self._refuse(p)
        subject = request.query.get("subject")
        try:
            if subject:
                raw = await plane.js.get_last_msg(ref.js, subject)
            elif state.last_seq:
                raw = await plane.js.get_msg(ref.js, state.last_seq)
            else:
                return self._refuse(Problem(404, f"stream {ref.public!r} is empty"))
        except NotFoundError:
            return self._refuse(Problem(404, f"no message in {ref.public!r} for that subject"))
        ev = stored_message(raw, ref.kv)
        view = ev.view(flt)
        if view is None:
            return self._refuse(Problem(404, "the latest message does not match the filter"))
        body = b'{"seq":%d,"subject":%s,"data":%s}' % (ev.seq, _json.encode(ev.subject), view)
        return web.Response(body=body, content_type="application/json")

    # ------------------------------------------------------------------ data sync

    async def kv_snapshot(self, request: web.Request) -> web.Response:
        """Every live key with its value, and the revision to follow deltas after."""
        plane = self.plane
        plane.counters["requests"] += 1
        token = request_token(request)
        try:
            plane.access.authenticate(token)
            ref, state = await plane.stream("kv:" + request.match_info["bucket"], token)
            flt = plane.filter(request.query.get("filter", ""))
        except FilterError as err:
            return self._refuse(filter_problem(err))
        except Problem as p:
            return self._refuse(p)
        revision = state.last_seq
        entries: list[bytes] = []
        reader = await JetStreamReader(plane.js, ref.js, last_per_subject=True).open()
        try:
            pending = reader.num_pending
            deadline = time.monotonic() + 30
            while pending and time.monotonic() < deadline:
                events = await reader.fetch(1000, 1.0)
                for ev in events:
                    revision = max(revision, ev.seq)
                    if ev.data["op"] == "put":
                        view = ev.view(flt)
                        if view is not None:
                            entries.append(view)
                pending = reader.num_pending if events else pending
        finally:
            await reader.close()
        body = b'{"bucket":%s,"stream":%s,"revision":%d,"entries":[%s]}' % (
            _json.encode(request.match_info["bucket"]),
            _json.encode(ref.public),
            revision,
            b",".join(entries),
        )
        return web.Response(body=body, content_type="application/json")

    # ------------------------------------------------------------------ webhooks

    async def webhook_register(self, request: web.Request) -> web.Response:
        plane = self.plane
        plane.counters["requests"] += 1
        token = request_token(request)
        try:
            plane.access.authenticate(token)
            try:
                body = msgspec.json.decode(await request.read())
            except (msgspec.DecodeError, UnicodeDecodeError) as err:  # bad UTF-8: the latter
                raise Problem(400, f"body is not JSON: {err}") from None
            if not isinstance(body, dict):
                raise Problem(400, "body must be a JSON object {url, stream, filter?, secret?}")
            ref, state = await plane.stream(body.get("stream") or "", token)
            filter_text = body.get("filter") or ""
            if not isinstance(filter_text, str):
                raise Problem(400, "filter must be a string")
            plane.filter(filter_text)
            start = parse_start(body.get("from", "new"))
            if start == "cursor":
                raise Problem(400, "a new webhook has no cursor: use new, all, last or a seq")
            start_seq = first_seq_to_deliver(start, state.first_seq, state.last_seq)
            reg = await plane.webhooks.register(
                url=body.get("url"),
                stream=ref.public,
                filter_text=filter_text,
                secret=body.get("secret"),
                start_seq=start_seq,
                owner=plane.access.owner(token),
            )
        except FilterError as err:
            return self._refuse(filter_problem(err))
        except WebhookError as err:
            return self._refuse(Problem(err.status, err.reason))
        except Problem as p:
            return self._refuse(p)
        return reply(201, {**reg.public(), "secret": reg.secret})

    def _owns(self, token: str | None, reg: Registration) -> bool:
        return self.plane.owns(token, reg)

    async def _own_webhook(self, request: web.Request) -> tuple[str, Registration]:
        """The webhook named in the path if this token owns it; else 404 (not 403: another
        token's webhook ids are not confirmed)."""
        token = request_token(request)
        self.plane.access.authenticate(token)
        wid = request.match_info["id"]
        reg = await self.plane.webhooks.get(wid)
        if reg is None or not self._owns(token, reg):
            raise Problem(404, "unknown webhook")
        return wid, reg

    async def webhook_list(self, request: web.Request) -> web.Response:
        token = request_token(request)
        try:
            self.plane.access.authenticate(token)
        except Problem as p:
            return self._refuse(p)
        regs = sorted(
            (r for r in self.plane.webhooks.registrations.values() if self._owns(token, r)),
            key=lambda r: r.created_ms,
        )
        return reply(200, {"webhooks": [r.public() for r in regs]})

    async def webhook_get(self, request: web.Request) -> web.Response:
        try:
            wid, _ = await self._own_webhook(request)
        except Problem as p:
            return self._refuse(p)
        status = await self.plane.webhooks.status(wid)
        if status is None:
            return self._refuse(Problem(404, "unknown webhook"))
        return reply(200, status)

    async def webhook_delete(self, request: web.Request) -> web.Response:
        try:
            wid, _ = await self._own_webhook(request)
        except Problem as p:
            return self._refuse(p)
        if not await self.plane.webhooks.remove(wid):
            return self._refuse(Problem(404, "unknown webhook"))
        return web.Response(status=204)
