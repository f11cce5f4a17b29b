"""How a Server-Sent Events client is served: `GET /v1/sse/{stream}`.

One subscription per request, fed by the stream's shared feed like a WebSocket one. Each
event is `id: <seq>`, `event: message`, `data: <payload as the filter selects it>`; the
first is `event: subscribed` (stream, from_seq, cursor) with `retry: 1000`. A browser's
`EventSource` reconnects with `Last-Event-ID`, which resumes right after that sequence
(so do `?after=SEQ`, `?from=SEQ|new|all|last|cursor` with `?client=`). Lag warnings and
drops are `event: lag` / `event: dropped`; a client too slow under the disconnect policy
gets `event: error` with code 4408 and the response ends. Comment lines keep an idle
connection alive every `sse_keepalive_s`.

An event's bytes are built once per (event, filter) and shared by every SSE client with
that filter (`sse_event`). SSE clients are served by their own pumps, one write per batch:
aiohttp's response writer has no synchronous write, so the feed cannot serve them in its
pass as it does WebSocket clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from aiohttp import web

from actors.access.auth import request_token
from actors.access.messages import StreamMessage
from actors.access.plane import DataPlane
from actors.access.protocol import CLOSE_TOO_SLOW, Problem, filter_problem, int_param, refusal
from runtime.data.query import FilterError

__all__ = ["SseRoutes", "sse_event"]

_json = msgspec.json.Encoder()


def sse_event(seq: int, body: bytes) -> bytes:
    """One event as the stream carries it; built once per (event, filter) for all clients."""
    return b"id: %d\nevent: message\ndata: %s\n\n" % (seq, body)


class SseRoutes:
    """The SSE endpoint of one replica."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    async def sse(self, request: web.Request) -> web.StreamResponse:
        plane = self.plane
        token = request_token(request)
        try:
            plane.access.authenticate(token)
            ref, state = await plane.stream(request.match_info["stream"], token)
            flt = plane.filter(request.query.get("filter", ""))
            client = request.query.get("client") or None
            sid = request.query.get("sub") or f"sse:{ref.public}"
            last_id = request.headers.get("Last-Event-ID", "").strip()
            after = int(last_id) if last_id.isdigit() else int_param(request, "after", None)
            owner = plane.access.owner(token)
            start_seq, resumed = await plane.start_seq(
                ref, state, request.query.get("from"), after, client, sid, owner
            )
        except FilterError as err:
            p = filter_problem(err)
            plane.count(p)
            return refusal(p)
        except Problem as p:
            plane.count(p)
            return refusal(p)
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )
        await resp.prepare(request)
        plane.tune_socket(request)
        plane.counters["sse_connections"] += 1
        plane.open["sse"] += 1
        closed = asyncio.Event()
        sent = [time.monotonic()]

        async def write(chunk: bytes) -> None:
            await resp.write(chunk)
            sent[0] = time.monotonic()

        def control(event: str, body: dict[str, Any]) -> None:
            plane.spawn(write(b"event: %s\ndata: %s\n\n" % (event.encode(), _json.encode(body))))

        shape = ("sse", flt)

        def build(ev: StreamMessage) -> bytes:
            return sse_event(ev.seq, ev.view(flt) or b"")

        async def deliver(batch: list[tuple[StreamMessage, bytes]]) -> None:
            await write(b"".join(e.frame(shape, build) for e, _ in batch))
            plane.counters["events_sent"] += len(batch)

        policy = plane.policy(ref)

        cut_off: list[str] = []

        def on_overflow(behind: int) -> None:
            plane.counters["slow_disconnects"] += 1
            cut_off.append(f"too slow: {behind} messages behind (limit {policy.max_lag})")
            plane.abort_later(request)
            closed.set()

        sub = plane.subscriber(
            sid,
            flt,
            policy,
            deliver,
            on_lag=lambda behind: control("lag", plane.lag_body(None, behind, policy)),
            on_dropped=lambda n, a, b: control("dropped", {"count": n, "from_seq": a, "to_seq": b}),
            on_overflow=on_overflow,
            on_progress=plane.track_cursor(client, sid, ref, flt.text, False, owner),
        )
        hello = {"stream": ref.public, "from_seq": start_seq, "cursor": resumed}
        await write(b"retry: 1000\nevent: subscribed\ndata: %s\n\n" % _json.encode(hello))
        feed = plane.hub.feed(ref.js)  # no await between getting a feed and joining it
        feed.attach(sub, start_seq)
        plane.open["subscriptions"] += 1
        plane.counters["subscriptions"] += 1
        pump = asyncio.get_running_loop().create_task(sub.pump(feed, plane.history(ref)))
        ender = asyncio.get_running_loop().create_task(closed.wait())
        keepalive_s = plane.options.sse_keepalive_s
        plane.closers.add(_Setter(closed))
        try:
            while not pump.done() and not closed.is_set():
                await asyncio.wait({pump, ender}, timeout=min(1.0, keepalive_s))
                if request.transport is None or request.transport.is_closing():
                    break  # the client went away: stop serving it now, not at the next write
                if time.monotonic() - sent[0] >= keepalive_s:
                    await write(b": keepalive\n\n")
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            plane.closers.discard(_Setter(closed))
            feed.detach(sub)
            for t in (pump, ender):
                t.cancel()
            await asyncio.gather(pump, ender, return_exceptions=True)
            if cut_off:  # queued behind what the client has not read yet
                error = {"code": CLOSE_TOO_SLOW, "reason": cut_off[0]}
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        write(b"event: error\ndata: %s\n\n" % _json.encode(error)),
                        plane.options.close_timeout_s,
                    )
            plane.open["subscriptions"] -= 1
            plane.open["sse"] -= 1
            if client:
                with contextlib.suppress(Exception):
                    await plane.cursors.flush([(client, sid, owner)])
        return resp


class _Setter:
    """An awaitable closer that sets an event (hashable by the event, for discard)."""

    def __init__(self, event: asyncio.Event) -> None:
        self.event = event

    async def __call__(self) -> None:
        self.event.set()

    def __hash__(self) -> int:
        return hash(self.event)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Setter) and other.event is self.event
