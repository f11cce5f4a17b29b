"""One gateway replica's data plane: what every protocol handler shares.

The NATS connection, the fan-out hub (one feed per stream), the cursor store and the
webhooks, plus the steps each request takes whatever its protocol: authenticate, look the
stream up (403/404), compile the filter (a named one by its name), resolve the start
position (410 for a cursor that is not there), wire a `Subscriber` to a lag policy and to
its cursor, and count what happened. The handlers (websocket.py, sse.py, rest.py) are the
protocols; the actor (gateway.py) starts and stops this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web
from nats.js.errors import NotFoundError

from actors.access.auth import Access, internal_buckets
from actors.access.cursors import CursorRecord, CursorStore, FlushPolicy
from actors.access.fanout import Hub, LagPolicy, Subscriber
from actors.access.messages import StreamMessage
from actors.access.protocol import (
    Problem,
    StreamRef,
    first_seq_to_deliver,
    no_cursor,
    parse_start,
    stream_ref,
)
from actors.access.reader import jetstream_opener
from actors.access.webhooks import Registration, Webhooks
from runtime.clock import now_ms
from runtime.config import Config, GatewayOptions, Overflow
from runtime.data.query import Filter, compile_filter, compile_named
from runtime.engines.services import connect_nats

log = logging.getLogger(__name__)

__all__ = ["DataPlane", "Deliver"]

Deliver = Callable[[list[tuple[StreamMessage, bytes]]], Awaitable[None]]
Closer = Callable[[], Awaitable[None]]


class DataPlane:
    """The serving state of one replica and the request steps every protocol shares.

    Built in the actor's process (named filters compile at once: a bad one fails the
    start); `start()` opens NATS, the cursors, the hub and the webhooks on the serving loop.
    """

    def __init__(
        self,
        cfg: Config,
        options: GatewayOptions,
        *,
        name: str,
        instance: str,
        nats_url: str,
        named_filters: Mapping[str, str] | None = None,
        token_streams: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.options = options
        self.name = name
        self.instance = instance
        self.nats_url = nats_url
        self.named = compile_named(dict(named_filters or {}))
        self.access = Access(
            cfg.auth.consumer_tokens,
            token_streams,
            {*options.internal_streams, *internal_buckets(options)},
        )
        self.counters: dict[str, int] = {
            "ws_connections": 0,
            "sse_connections": 0,
            "polls": 0,
            "requests": 0,
            "subscriptions": 0,
            "events_sent": 0,
            "lag_warnings": 0,
            "dropped": 0,
            "slow_disconnects": 0,
            "unauthorized": 0,
            "forbidden": 0,
            "bad_requests": 0,
            "not_found": 0,
            "malformed": 0,
            "refused_browser": 0,  # runtime/browsers.py: another Host, Origin or body type
        }
        self.open = {"ws": 0, "sse": 0, "subscriptions": 0}
        # how to end each open client at shutdown (WebSocket: 1001; SSE: end the response)
        self.closers: set[Closer] = set()
        self.nc: Any = None
        self.js: Any = None
        self.cursors: CursorStore
        self.hub: Hub
        self.webhooks: Webhooks
        self._flush_stop: asyncio.Event | None = None
        self._flusher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        opts = self.options
        self.nc = await connect_nats(
            self.cfg, self.nats_url, name=f"tierflow-{self.name}", role="gateway"
        )
        self.js = self.nc.jetstream()
        self.cursors = await CursorStore.open(
            self.js,
            bucket=opts.cursor_bucket,
            replicas=opts.cursor_replicas or None,
            policy=FlushPolicy(opts.cursor_flush_s, opts.cursor_flush_max),
        )
        self.hub = Hub(
            lambda js_name: jetstream_opener(self.js, js_name),
            keep_of=self.compact_keep,
            ring_size=opts.ring_size,
            backfill=opts.backfill,
            batch=opts.fetch_batch,
            idle_s=opts.feed_idle_s,
        )
        self.webhooks = Webhooks(
            self.nc,
            owner=self.instance,
            cursors=self.cursors,
            open_reader=lambda js_name: jetstream_opener(self.js, js_name),
            stream_name=lambda public: stream_ref(public).js,
            compile_filter=self.filter,
            options=opts.webhooks,
        )
        await self.webhooks.start()
        self._flush_stop = asyncio.Event()
        self._flusher = asyncio.get_running_loop().create_task(self.cursors.run(self._flush_stop))

    async def close_clients(self) -> None:
        """Close every client (cursors flushed), hand webhook leases over, stop the feeds."""
        for close in list(self.closers):
            with contextlib.suppress(Exception):
                await close()
        await self.webhooks.stop()
        await self.hub.stop()

    async def stop(self) -> None:
        """After the clients and the HTTP server: the last cursor flush, then NATS."""
        if self._flush_stop is not None and self._flusher is not None:
            self._flush_stop.set()
            await self._flusher
        await self.nc.drain()

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "open": dict(self.open),
            "feeds": self.hub.stats(),
            "cursors": self.cursors.stats(),
            "webhooks": self.webhooks.stats(),
        }

    def visible_stats(self, token: str | None) -> dict[str, Any]:
        """`stats()` as a token may see it over HTTP: the feeds of streams it may read and
        the webhooks it owns; other tokens' webhook ids are never shown, only counted."""
        out = self.stats()
        out["feeds"] = {
            name: feed for name, feed in out["feeds"].items() if self._may_read(token, name)
        }
        hooks = dict(out["webhooks"])
        regs = self.webhooks.registrations
        hooks["holding"] = [
            wid for wid in hooks["holding"] if wid in regs and self.owns(token, regs[wid])
        ]
        out["webhooks"] = hooks
        return out

    def owns(self, token: str | None, reg: Registration) -> bool:
        """A webhook is seen and deleted only by the token that registered it (one made
        before owners existed: by any token that may read its stream)."""
        if reg.owner and reg.owner != self.access.owner(token):
            return False
        return self._may_read(token, reg.stream)

    def _may_read(self, token: str | None, name: str) -> bool:
        try:
            return self.access.may_read(token, stream_ref(name))
        except Problem:
            return False

    # ------------------------------------------------------------------ request steps

    def filter(self, text: str) -> Filter:
        """A named (static) filter by its name, else the text compiled as SQL."""
        named = self.named.get(text)
        return named if named is not None else compile_filter(text)

    def compact_keep(self, js_name: str) -> int | None:
        """Messages kept per subject by compacted stream `js_name`; None if not compacted."""
        sc = self.cfg.streams.get(js_name)  # a stream's JetStream name is its config name
        return sc.compact.keep if sc is not None and sc.compact is not None else None

    def count(self, p: Problem) -> None:
        key = {401: "unauthorized", 403: "forbidden", 404: "not_found"}.get(p.status)
        self.counters[key or "bad_requests"] += 1

    async def stream(self, name: str, token: str | None) -> tuple[StreamRef, Any]:
        """The stream and its current state, or Problem 403/404."""
        ref = stream_ref(name)
        self.access.authorize(token, ref)
        try:
            info = await self.js.stream_info(ref.js)
        except NotFoundError:
            raise Problem(404, f"unknown stream {ref.public!r}") from None
        return ref, info.state

    async def start_seq(
        self,
        ref: StreamRef,
        state: Any,
        start: Any,
        after: int | None,
        client: str | None,
        sid: str,
        owner: str,
    ) -> tuple[int, bool]:
        """(first seq to deliver, resumed from a stored cursor). A cursor named but not
        found (never made by this token, or expired) is a 410 naming the oldest sequence
        still held: starting "new" instead would silently skip what came since."""
        if after is not None:
            if after < 0:
                raise Problem(400, f"after must be >= 0, got {after}")
            return after + 1, False
        position = parse_start("new" if start is None else start)
        if position == "cursor":
            if not client:
                raise Problem(400, 'from "cursor" needs a client id')
            try:
                cursor = await self.cursors.get(client, sid, owner)
            except ValueError as err:
                raise Problem(400, str(err)) from None
            if cursor is None:
                raise no_cursor(client, sid, state.first_seq)
            if cursor.stream != ref.public:
                raise Problem(400, f"the cursor of {sid!r} is for stream {cursor.stream!r}")
            return cursor.seq + 1, True
        return first_seq_to_deliver(position, state.first_seq, state.last_seq), False

    def policy(self, ref: StreamRef, wanted: Overflow | None = None) -> LagPolicy:
        o = self.options
        overflow = wanted or o.overflow.get(ref.public, o.default_overflow)
        return LagPolicy(o.max_lag, min(o.warn_lag, o.max_lag), o.warn_every_s, overflow)

    def history(self, ref: StreamRef) -> Callable[[int], Awaitable[Any]]:
        return jetstream_opener(self.js, ref.js)

    def track_cursor(
        self,
        client: str | None,
        sid: str,
        ref: StreamRef,
        filter_text: str,
        ack: bool,
        owner: str,
    ) -> Callable[[int], None]:
        """`on_progress` for a subscription: its cursor moves with it when it has a client id."""
        if not client:
            return lambda seq: None

        def progress(seq: int) -> None:
            self.cursors.update(
                CursorRecord(
                    client=client,
                    sub=sid,
                    stream=ref.public,
                    seq=seq,
                    filter=filter_text,
                    ack=ack,
                    gateway=self.instance,
                    updated_ms=now_ms(),
                    owner=owner,
                )
            )

        return progress

    def subscriber(
        self,
        sid: str,
        flt: Filter,
        policy: LagPolicy,
        deliver: Deliver,
        **callbacks: Any,
    ) -> Subscriber:
        """A Subscriber whose lag warnings and drops are counted here too."""
        on_lag = callbacks.pop("on_lag")
        on_dropped = callbacks.pop("on_dropped")

        def lagging(behind: int) -> None:
            self.counters["lag_warnings"] += 1
            on_lag(behind)

        def dropped(count: int, first: int, last: int) -> None:
            self.counters["dropped"] += count
            on_dropped(count, first, last)

        return Subscriber(
            sid,
            flt,
            policy,
            deliver=deliver,
            on_lag=lagging,
            on_dropped=dropped,
            batch=self.options.send_batch,
            **callbacks,
        )

    def lag_body(self, sid: str | None, behind: int, policy: LagPolicy) -> dict[str, Any]:
        """How far behind, and what happens past `limit` (WS frame with op/id; SSE data)."""
        body = {"behind": behind, "policy": policy.overflow, "limit": policy.max_lag}
        return body if sid is None else {"op": "lag", "id": sid, **body}

    # ------------------------------------------------------------------ connections

    def tune_socket(self, request: web.Request) -> None:
        if not self.options.socket_sndbuf or request.transport is None:
            return
        sock = request.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.options.socket_sndbuf)

    def abort_later(self, request: web.Request) -> None:
        """A client cut off for slowness that never reads its close is dropped after a while."""
        transport = request.transport
        if transport is not None:
            asyncio.get_running_loop().call_later(self.options.abort_after_s, transport.abort)

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run a send in the background (a control frame must not wait for the pump)."""
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_quiet)


def _quiet(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("background send failed: %r", task.exception())
