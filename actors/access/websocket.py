"""How a WebSocket client is served: `/v1/ws` (subscriptions) and `/streaming` (top-N).

`/v1/ws` multiplexes subscriptions over one connection. The client sends JSON text frames
(protocol.py): `subscribe` (stream, filter, start, client id for a server cursor, `ack`,
overflow policy), `ack` (cumulative, with `"ack": true`), `slow_down` (a rate limit) and
`unsubscribe`; `?stream=` on the URL subscribes at once. The server sends `subscribed`,
`event` (`id`, `seq`, `subject`, `data`), `lag`, `dropped`, `unsubscribed` and `error`.

Errors: an `{"op":"error","id"?,"code","reason"}` frame always comes first. A malformed
frame (not JSON, unknown op, wrong field types) closes with 4400; a missing or invalid
token with 4401. A subscription refused (400 bad filter or start, 403 forbidden, 404
unknown stream, 410 no such cursor) closes the connection with 4000 + the code only if it
has no other active subscription; otherwise the connection goes on. A client too slow
under the disconnect policy is closed with 4408; a replica that shuts down closes with
1001 after flushing the connection's cursors (automatic close is off for that reason).

An `event` frame is built once per event and frame shape (subscription id, filter) and the
same bytes go to every socket that wants them (`EventFrames`); a socket that can take a
batch now gets it as one write during the feed's pass (`WsSink.deliver_now`), one that
cannot (flow control paused) gets it from its own pump through aiohttp's writer.

`/streaming` is the book's endpoint: the latest top-N list (the `top` of the newest
message on `topn_subject`) as one JSON text frame on every change; 4404 when no top-N
subject is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from typing import Any

import msgspec
import nats.errors
from aiohttp import WSMsgType, web
from nats.js.errors import NotFoundError

from actors.access.auth import request_token
from actors.access.fanout import Feed, LagPolicy, Subscriber, TokenBucket
from actors.access.messages import StreamMessage
from actors.access.plane import DataPlane
from actors.access.protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_TOO_SLOW,
    MAX_ID,
    OPS_HINT,
    Ack,
    Problem,
    SlowDown,
    StreamRef,
    Subscribe,
    Unsubscribe,
    close_reason,
    decode_op,
    filter_problem,
    id_of,
    int_param,
    no_cursor,
)
from actors.access.reader import stored_message
from runtime.data.query import Filter, FilterError, compile_filter

log = logging.getLogger(__name__)

__all__ = ["EventFrames", "WebSocketRoutes", "WsSession", "WsSink", "event_payload", "ws_frame"]

_json = msgspec.json.Encoder()
_LEN2 = struct.Struct("!BBH").pack
_LEN3 = struct.Struct("!BBQ").pack
_FIN_TEXT = 0x81


def event_payload(prefix: bytes, ev: StreamMessage, body: bytes) -> bytes:
    """An `event` frame's JSON (docs/contracts.md): `prefix` is `{"op":"event","id":<sid>,
    "seq":`, `body` the data as the subscription's filter selects it."""
    return b'%s%d,"subject":%s,"data":%s}' % (prefix, ev.seq, _json.encode(ev.subject), body)


def ws_frame(payload: bytes) -> bytes:
    """`payload` as one whole server-to-client text frame (RFC 6455: FIN, no mask, no
    compression), the bytes aiohttp's writer would put on the wire for it."""
    n = len(payload)
    if n < 126:
        return bytes((_FIN_TEXT, n)) + payload
    if n < 65536:
        return _LEN2(_FIN_TEXT, 126, n) + payload
    return _LEN3(_FIN_TEXT, 127, n) + payload


class EventFrames:
    """One subscription's `event` frames, built once per (event, shape) and shared: every
    subscription with the same id and projection gets the very same bytes (a frame is only
    asked for an event its subscription's filter passes)."""

    __slots__ = ("filter", "prefix", "shape")

    def __init__(self, sid: str, flt: Filter) -> None:
        self.filter = flt
        self.prefix = b'{"op":"event","id":%s,"seq":' % _json.encode(sid)
        # every filter that keeps whole events renders the same data bytes (the event's)
        self.shape = ("ws", self.prefix, None if flt.select_all else flt)

    def _build(self, ev: StreamMessage) -> tuple[bytes, bytes]:
        body = ev.view(self.filter)
        assert body is not None, "a frame is built only for an event the filter passes"
        payload = event_payload(self.prefix, ev, body)
        return payload, ws_frame(payload)

    def payload(self, ev: StreamMessage) -> bytes:
        """The frame's JSON (for aiohttp's writer)."""
        return ev.frame(self.shape, self._build)[0]

    def wire(self, ev: StreamMessage) -> bytes:
        """The whole frame, header included (for a direct write)."""
        return ev.frame(self.shape, self._build)[1]


class WsSink:
    """Where one subscription's events go: `deliver` (the pump's path, aiohttp's writer and
    its flow control) and `deliver_now` (the feed's pass: one write of the whole batch if
    the socket takes it now, else False and nothing written)."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        request: web.Request,
        frames: EventFrames,
        counters: dict[str, int],
    ) -> None:
        self.ws = ws
        self.request = request
        self.frames = frames
        self.counters = counters

    async def deliver(self, batch: list[tuple[StreamMessage, bytes]]) -> None:
        payload = self.frames.payload
        for ev, _ in batch:
            await self.ws.send_frame(payload(ev), WSMsgType.TEXT)
        self.counters["events_sent"] += len(batch)

    def deliver_now(self, batch: list[tuple[StreamMessage, bytes]]) -> bool:
        transport = self.request.transport
        if (
            self.ws.closed
            or transport is None
            or transport.is_closing()
            or self.request.protocol.writing_paused
        ):
            return False
        wire = self.frames.wire
        transport.write(
            wire(batch[0][0]) if len(batch) == 1 else b"".join(wire(e) for e, _ in batch)
        )
        self.counters["events_sent"] += len(batch)
        return True


class WebSocketRoutes:
    """The WebSocket endpoints of one replica."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    async def ws(self, request: web.Request) -> web.StreamResponse:
        """`/v1/ws`: subscriptions, acks and slow-down requests over one connection."""
        plane = self.plane
        # autoclose off: a client's close is answered only after its cursors are flushed,
        # so a client that closed cleanly and reconnects anywhere finds them up to date
        ws = web.WebSocketResponse(
            compress=False,
            heartbeat=30,
            max_msg_size=plane.options.ws_max_message,
            autoclose=False,
        )
        await ws.prepare(request)
        plane.tune_socket(request)
        plane.counters["ws_connections"] += 1
        plane.open["ws"] += 1
        conn = WsSession(plane, ws, request, request_token(request))
        plane.closers.add(conn.going_away)
        try:
            try:
                plane.access.authenticate(conn.token)
            except Problem as p:
                plane.count(p)
                await conn.fail(None, p, close=True)
                return ws
            auto = request.query.get("stream")
            if auto:
                await conn.subscribe(
                    Subscribe(
                        id=request.query.get("id", "default"),
                        stream=auto,
                        filter=request.query.get("filter", ""),
                        start=request.query.get("from"),
                        after=int_param(request, "after", None),
                        client=request.query.get("client"),
                    )
                )
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await conn.handle(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    plane.counters["malformed"] += 1
                    reason = "binary frames are not part of the protocol: send JSON text"
                    await conn.fail(None, Problem(400, reason), close=True)
                else:
                    break
        except Problem as p:
            plane.count(p)
            await conn.fail(None, p, close=True)
        except Exception:
            log.exception("websocket connection failed")
            await conn.close(1011, "internal error")
        finally:
            plane.closers.discard(conn.going_away)
            await conn.end()
            plane.open["ws"] -= 1
        return ws

    async def streaming(self, request: web.Request) -> web.StreamResponse:
        """The book's endpoint: the latest top-N list as a JSON array, on every change."""
        plane = self.plane
        ws = web.WebSocketResponse(compress=False, heartbeat=30, max_msg_size=4096)
        await ws.prepare(request)
        plane.counters["ws_connections"] += 1
        plane.open["ws"] += 1
        conn = WsSession(plane, ws, request, request_token(request))
        plane.closers.add(conn.going_away)
        try:
            plane.access.authenticate(conn.token)
            await conn.topn(plane.options.topn_stream, plane.options.topn_subject)
            async for msg in ws:
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    break  # the client only listens; anything it sends is ignored
        except Problem as p:
            plane.count(p)
            await conn.fail(None, p, close=True)
        finally:
            plane.closers.discard(conn.going_away)
            await conn.end()
            plane.open["ws"] -= 1
        return ws


class _Active(msgspec.Struct):
    sub: Subscriber
    feed: Feed
    task: asyncio.Task[None]
    client: str | None


class WsSession:
    """One WebSocket client: its subscriptions and the frames it is sent."""

    def __init__(
        self, plane: DataPlane, ws: web.WebSocketResponse, request: web.Request, token: str | None
    ) -> None:
        self.plane = plane
        self.ws = ws
        self.request = request
        self.token = token
        self.owner = plane.access.owner(token)
        self.subs: dict[str, _Active] = {}
        self.closing = False

    # ---- frames -----------------------------------------------------------------------

    async def send(self, body: dict[str, Any]) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.send_frame(_json.encode(body), WSMsgType.TEXT)

    def send_soon(self, body: dict[str, Any]) -> None:
        self.plane.spawn(self.send(body))

    async def close(self, code: int, reason: str) -> None:
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
            await asyncio.wait_for(
                self.ws.close(code=code, message=close_reason(reason)),
                self.plane.options.close_timeout_s,
            )

    async def fail(self, sid: str | None, p: Problem, *, close: bool = False) -> None:
        """An error frame; then close (4000 + status) if asked or if nothing else runs."""
        frame: dict[str, Any] = {"op": "error"}
        if sid is not None:
            frame["id"] = sid
        frame.update(code=p.status, reason=p.reason, **p.extra)
        await self.send(frame)
        if close or not self.subs:
            await self.close(1013 if p.status == 503 else 4000 + p.status, p.reason)

    async def going_away(self) -> None:
        await self.close(CLOSE_GOING_AWAY, "gateway shutting down")

    # ---- client messages --------------------------------------------------------------

    async def handle(self, text: str) -> None:
        try:
            op = decode_op(text)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            self.plane.counters["malformed"] += 1
            what = "not JSON" if isinstance(err, msgspec.DecodeError) else "bad message"
            problem = Problem(400, f"{what}: {err}; {OPS_HINT}")
            await self.fail(id_of(text), problem, close=True)
            return
        if isinstance(op, Subscribe):
            await self.subscribe(op)
            return
        active = self.subs.get(op.id)
        if active is None:
            self.plane.counters["bad_requests"] += 1
            await self.send(
                {"op": "error", "id": op.id, "code": 400, "reason": f"no subscription {op.id!r}"}
            )
            return
        if isinstance(op, Ack):
            if active.sub.ack_window is None:
                reason = 'this subscription was made without "ack": true'
                await self.send({"op": "error", "id": op.id, "code": 400, "reason": reason})
                return
            if not active.sub.ack(op.seq):
                self.plane.counters["bad_requests"] += 1
                limit = active.sub.ack_limit
                reason = f"ack of seq {op.seq} refused: the last seq delivered is {limit}"
                frame = {"op": "error", "id": op.id, "code": 400, "reason": reason}
                await self.send({**frame, "delivered_seq": limit})
        elif isinstance(op, SlowDown):
            rate = op.max_rate
            active.sub.limiter = TokenBucket(rate) if rate and rate > 0 else None
        elif isinstance(op, Unsubscribe):
            await self.drop(op.id)
            await self.send({"op": "unsubscribed", "id": op.id})

    async def subscribe(self, op: Subscribe) -> None:
        plane = self.plane
        sid = op.id
        try:
            if not sid or len(sid) > MAX_ID:
                raise Problem(400, f"id must be 1 to {MAX_ID} characters")
            if op.client is not None and not 0 < len(op.client) <= MAX_ID:
                raise Problem(400, f"client must be 1 to {MAX_ID} characters")
            if sid in self.subs:
                raise Problem(400, f"subscription {sid!r} is already active; unsubscribe first")
            if len(self.subs) >= plane.options.max_subscriptions:
                raise Problem(400, f"at most {plane.options.max_subscriptions} subscriptions")
            stream, filter_text = op.stream, op.filter
            if op.start == "cursor" and op.client and not stream:
                cursor = await plane.cursors.get(op.client, sid, self.owner)
                if cursor is None:
                    raise no_cursor(op.client, sid, None)
                stream, filter_text = cursor.stream, filter_text or cursor.filter
            ref, state = await plane.stream(stream or "", self.token)
            flt = plane.filter(filter_text)
            start_seq, resumed = await plane.start_seq(
                ref, state, op.start, op.after, op.client, sid, self.owner
            )
        except FilterError as err:
            p = filter_problem(err)
            plane.count(p)
            await self.fail(sid, p)
            return
        except Problem as p:
            plane.count(p)
            await self.fail(sid, p)
            return
        except (nats.errors.Error, TimeoutError) as err:
            await self.fail(sid, Problem(503, f"NATS unavailable, retry later: {err!r}"))
            return
        policy = plane.policy(ref, op.policy)
        sink = WsSink(self.ws, self.request, EventFrames(sid, flt), plane.counters)

        def on_overflow(behind: int) -> None:
            plane.counters["slow_disconnects"] += 1
            reason = f"too slow: {behind} messages behind (limit {policy.max_lag})"
            plane.spawn(self.close(CLOSE_TOO_SLOW, reason))
            plane.abort_later(self.request)

        sub = plane.subscriber(
            sid,
            flt,
            policy,
            sink.deliver,
            deliver_now=sink.deliver_now,
            on_lag=lambda behind: self.send_soon(plane.lag_body(sid, behind, policy)),
            on_dropped=lambda n, a, b: self.send_soon(
                {"op": "dropped", "id": sid, "count": n, "from_seq": a, "to_seq": b}
            ),
            on_overflow=on_overflow,
            on_progress=plane.track_cursor(op.client, sid, ref, flt.text, op.ack, self.owner),
            ack_window=plane.options.ack_window if op.ack else None,
        )
        hello: dict[str, Any] = {
            "op": "subscribed",
            "id": sid,
            "stream": ref.public,
            "from_seq": start_seq,
            "cursor": resumed,
            "policy": policy.overflow,
            "max_lag": policy.max_lag,
        }
        if state.messages and start_seq < state.first_seq:
            hello["gap"] = state.first_seq - start_seq  # aged out of the stream
        await self.send(hello)
        feed = plane.hub.feed(ref.js)
        feed.attach(sub, start_seq)
        task = asyncio.get_running_loop().create_task(self._pump(sub, feed, ref))
        self.subs[sid] = _Active(sub, feed, task, op.client)
        plane.counters["subscriptions"] += 1
        plane.open["subscriptions"] += 1

    async def _pump(self, sub: Subscriber, feed: Feed, ref: StreamRef) -> None:
        try:
            await sub.pump(feed, self.plane.history(ref))
        except (ConnectionError, RuntimeError):
            pass  # the socket closed under a send
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("subscription %s on %s failed", sub.sid, ref.public)
            await self.close(1011, "internal error")

    async def topn(self, stream: str, subject: str) -> None:
        """`/streaming`: the current top list at once, then each new one that differs."""
        plane = self.plane
        if not subject:
            raise Problem(404, "no top-N result is configured: set gateway.options.topn_subject")
        ref, state = await plane.stream(stream, self.token)
        start_seq = state.last_seq + 1
        last: list[bytes] = [b""]

        async def send_top(ev: StreamMessage) -> None:
            data = ev.data
            top = data.get("top") if isinstance(data, dict) else None
            if top is None:
                return
            frame = _json.encode(top)
            if frame != last[0]:
                last[0] = frame
                await self.ws.send_frame(frame, WSMsgType.TEXT)
                plane.counters["events_sent"] += 1

        with contextlib.suppress(NotFoundError):
            raw = await plane.js.get_last_msg(ref.js, subject)
            start_seq = raw.seq + 1
            await send_top(stored_message(raw, ref.kv))

        async def deliver(batch: list[tuple[StreamMessage, bytes]]) -> None:
            await send_top(batch[-1][0])  # only the newest list matters

        opts = plane.options
        policy = LagPolicy(opts.max_lag, min(opts.warn_lag, opts.max_lag), overflow="drop_oldest")
        sub = plane.subscriber(
            "streaming",
            compile_filter(f"WHERE _subject = '{subject}'"),
            policy,
            deliver,
            on_lag=lambda behind: None,
            on_dropped=lambda n, a, b: None,
        )
        feed = plane.hub.feed(ref.js)
        feed.attach(sub, start_seq)
        task = asyncio.get_running_loop().create_task(self._pump(sub, feed, ref))
        self.subs["streaming"] = _Active(sub, feed, task, None)
        plane.open["subscriptions"] += 1

    # ---- ending -----------------------------------------------------------------------

    async def drop(self, sid: str) -> None:
        active = self.subs.pop(sid, None)
        if active is None:
            return
        active.feed.detach(active.sub)
        active.task.cancel()
        await asyncio.gather(active.task, return_exceptions=True)
        self.plane.open["subscriptions"] -= 1
        if active.client:
            with contextlib.suppress(Exception):
                await self.plane.cursors.flush([(active.client, sid, self.owner)])

    async def end(self) -> None:
        for sid in list(self.subs):
            await self.drop(sid)
        if not self.ws.closed:
            await self.close(1000, "")
