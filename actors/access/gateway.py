"""Gateway: the data access tier (book ch. 7-9), one Ray actor per replica.

Serves any JetStream stream (raw events, results) and KV bucket to clients, per the wire
protocol in docs/contracts.md:

- WebSocket `/v1/ws`: subscribe (stream, filter, start), client acks, slow-down requests,
  several subscriptions per connection; the book's `/streaming` (the latest top-N list
  as one JSON text frame on every change);
- SSE `/v1/sse/{stream}` (`id:` is the stream sequence, `Last-Event-ID` resumes);
- long polling `/v1/poll/{stream}?after=SEQ&timeout=S` (`next` is the `after` of the next
  poll: nothing is lost between polls);
- simple messaging `/v1/streams/{stream}/latest`, `/v1/streams/{stream}?since=SEQ`;
- data sync `/v1/kv/{bucket}` (snapshot with its revision; then deltas over the WebSocket
  from `kv:<bucket>`);
- webhooks `/v1/webhooks` (see actors/access/webhooks.py).

Positions are stream sequences. `"from": N` (and `from=N`) is inclusive: delivery starts AT
N; `"after": N` (and `after=N`, `Last-Event-ID: N`) starts after N. So a client that kept
the seq L of the last event it processed resumes with `"after": L` (or `"from": L+1`) and
gets no gap and no repeat, on any replica. `"from": "cursor"` resumes from the server-side
cursor (actors/access/cursors.py), which belongs to the token that made it (client and
subscription ids are the client's choice, not an identity): with client acks,
at-least-once (repeats limited to what was acknowledged in the last flush interval before a
crash; an ack past the last seq delivered is refused); without acks the cursor is the last
seq written to the connection, so a crash may also skip what was still in flight (the
exact contract is in docs/contracts.md). A cursor that is named but missing (another
token's, never flushed, expired) is a 410 naming the oldest sequence still held, never a
silent "new".

Every client of a stream on this replica is fed by one JetStream consumer (actors/access/fanout.py):
a bounded lag per client, in-stream lag warnings, then the stream's policy (`drop_oldest`
or disconnect with 4408); other clients never wait for a slow one.

WebSocket errors: an `{"op":"error","id"?,"code","reason"}` frame always comes first.
A malformed frame (not JSON, unknown op, wrong field types) closes with 4400; a missing or
invalid token with 4401. A subscription refused (400 bad filter or start, 403 forbidden,
404 unknown stream, 410 no such cursor) closes the connection with 4000 + the code only if
it has no other active subscription; otherwise the connection goes on. A client too slow
under the disconnect policy is closed with 4408.

Auth: `Authorization: Bearer <token>` or `?token=`; tokens are `auth.consumer_tokens`
(empty: auth off); `token_streams` may restrict a token to some streams (403 otherwise).
The gateway's own buckets (cursors, webhooks) are never served (403). Webhooks are seen
and deleted only by the token that registered them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hmac
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec
import nats.errors
from aiohttp import WSMsgType, web

from actors.access.cursors import BUCKET as CURSOR_BUCKET
from actors.access.cursors import CursorRecord, CursorStore, FlushPolicy, owner_of
from actors.access.fanout import (
    KV_PREFIX,
    Event,
    Feed,
    Hub,
    JetStreamReader,
    LagPolicy,
    Subscriber,
    TokenBucket,
    jetstream_opener,
)
from actors.access.webhooks import (
    Registration,
    TargetPolicy,
    WebhookError,
    WebhookOptions,
    Webhooks,
)
from runtime.config import Config, validate
from runtime.loop_thread import LoopThread
from runtime.query import Filter, FilterError, compile_filter, compile_named
from runtime.ray_supervisor import SupervisedActor
from runtime.services import connect_nats
from runtime.tls import http_scheme, server_ssl_context

log = logging.getLogger(__name__)

__all__ = [
    "CLOSE_BAD_MESSAGE",
    "CLOSE_FORBIDDEN",
    "CLOSE_TOO_SLOW",
    "CLOSE_UNAUTHORIZED",
    "CLOSE_UNKNOWN_STREAM",
    "Access",
    "Gateway",
    "GatewayOptions",
    "StreamRef",
    "stream_ref",
]

CLOSE_BAD_MESSAGE = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_UNKNOWN_STREAM = 4404
CLOSE_TOO_SLOW = 4408
CLOSE_GOING_AWAY = 1001
SUPERVISOR = "gateways"

Overflow = Literal["drop_oldest", "disconnect"]
_json = msgspec.json.Encoder()
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
_MAX_ID = 200


class GatewayOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tuning; every field has a default that serves a dashboard-sized load."""

    ring_size: int = 8192  # recent events kept per stream (resume/poll from memory)
    backfill: int = 4096  # a new feed starts this far before its first subscriber
    fetch_batch: int = 512
    send_batch: int = 64
    max_lag: int = 2048  # per-client bound, in stream messages
    warn_lag: int = 1024
    warn_every_s: float = 1.0
    default_overflow: Overflow = "disconnect"
    overflow: dict[str, Overflow] = msgspec.field(  # by public stream name
        default_factory=lambda: {"results": "drop_oldest"}
    )
    ack_window: int = 256
    feed_idle_s: float = 30.0
    cursor_bucket: str = CURSOR_BUCKET
    cursor_replicas: int = 0  # 0: min(3, cluster size)
    cursor_flush_s: float = 0.1
    cursor_flush_max: int = 256
    poll_timeout_s: float = 25.0
    poll_max_timeout_s: float = 60.0
    poll_limit: int = 1000
    ws_max_message: int = 64 << 10
    max_subscriptions: int = 64
    sse_keepalive_s: float = 15.0
    close_timeout_s: float = 5.0
    abort_after_s: float = 30.0  # a closed slow client that never reads is cut after this
    idle_timeout_s: float = 15.0  # a connection idle, or still sending its request head
    socket_sndbuf: int = 0  # SO_SNDBUF per client socket; 0 = the OS default
    topn_stream: str = "results"
    topn_subject: str = "results.meetup_topn"
    internal_streams: list[str] = msgspec.field(
        default_factory=lambda: ["KV_tierflow_cursors", "KV_tierflow_webhooks", "buffer"]
    )
    webhooks: WebhookOptions = msgspec.field(default_factory=WebhookOptions)


# --------------------------------------------------------------------------- policy


class Problem(Exception):
    """A request refused: HTTP `status` (WebSocket close 4000+status) and the reason."""

    def __init__(self, status: int, reason: str, **extra: Any) -> None:
        self.status = status
        self.reason = reason
        self.extra = extra
        super().__init__(reason)


class StreamRef(msgspec.Struct, frozen=True):
    """A stream as clients name it (`results`, `kv:results`) and as JetStream does."""

    public: str
    js: str
    kv: bool


def stream_ref(name: str) -> StreamRef:
    """`kv:<bucket>` (or `KV_<bucket>`) is a KV bucket's change stream; else a stream."""
    if not isinstance(name, str) or not name:
        raise Problem(400, "stream is required")
    if name.startswith("kv:"):
        js, public = KV_PREFIX + name[3:], name
    elif name.startswith(KV_PREFIX):
        js, public = name, "kv:" + name[len(KV_PREFIX) :]
    else:
        js, public = name, name
    if not _STREAM_NAME.match(js):
        raise Problem(404, f"unknown stream {name!r}: not a valid stream name")
    return StreamRef(public, js, js.startswith(KV_PREFIX))


class Access:
    """Consumer auth (pure): 401 without a valid token, 403 for a stream it may not read."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_streams: Mapping[str, Sequence[str]] | None = None,
        internal: Iterable[str] = (),
    ) -> None:
        self.tokens = [t for t in tokens if t]
        self.token_streams = {k: list(v) for k, v in (token_streams or {}).items()}
        self.internal = frozenset(internal)

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def authenticate(self, token: str | None) -> None:
        if not self.tokens:
            return
        if not token:
            raise Problem(
                401, "missing token: send 'Authorization: Bearer <token>' or '?token=<token>'"
            )
        if not any(hmac.compare_digest(token.encode(), t.encode()) for t in self.tokens):
            raise Problem(401, "invalid token")

    def owner(self, token: str | None) -> str:
        """Who owns what this token makes (cursors, webhooks): one identity per token, or
        "anon" for everyone when auth is off."""
        return owner_of(token if self.enabled else None)

    def may_read(self, token: str | None, ref: StreamRef) -> bool:
        try:
            self.authorize(token, ref)
        except Problem:
            return False
        return True

    def authorize(self, token: str | None, ref: StreamRef) -> None:
        if ref.js in self.internal:
            raise Problem(403, f"stream {ref.public!r} is internal to tierflow")
        allowed = self.token_streams.get(token or "")
        if allowed is not None and not any(
            fnmatch.fnmatchcase(ref.public, p) or fnmatch.fnmatchcase(ref.js, p) for p in allowed
        ):
            raise Problem(403, f"this token may not read stream {ref.public!r}")


def request_token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.query.get("token") or None


def parse_start(value: Any) -> int | str:
    """A start position: "new" | "all" | "last" | "cursor" | a sequence >= 0 (inclusive)."""
    if isinstance(value, bool):
        raise Problem(400, f"from must be new, all, last, cursor or a sequence, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise Problem(400, f"from must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        if value in ("new", "all", "last", "cursor"):
            return value
        if value.isdigit():
            return int(value)
    raise Problem(400, f"from must be new, all, last, cursor or a sequence, got {value!r}")


def resolve_start(start: int | str, first_seq: int, last_seq: int) -> int:
    """The first sequence to deliver (pure): new = after the last, all = the first,
    last = the last one, N = N (a sequence that aged out starts at the first held)."""
    if start == "new":
        return last_seq + 1
    if start == "all":
        return max(1, first_seq)
    if start == "last":
        return max(1, last_seq)
    assert isinstance(start, int)
    return max(1, start)


def _int_param(request: web.Request, name: str, default: int | None, lo: int = 0) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise Problem(400, f"{name} must be an integer, got {raw!r}") from None
    if value < lo:
        raise Problem(400, f"{name} must be >= {lo}, got {value}")
    return value


def _reply(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=_json.encode(body), content_type="application/json", headers=headers
    )


def _problem(p: Problem) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if p.status == 401 else None
    return _reply(p.status, {"error": p.reason, **p.extra}, headers)


def _filter_problem(err: FilterError) -> Problem:
    return Problem(400, f"bad filter: {err.reason}", line=err.line, column=err.column)


# --------------------------------------------------------------------------- WS messages


class _Op(msgspec.Struct, tag_field="op", forbid_unknown_fields=False):
    pass


class Subscribe(_Op, tag="subscribe"):
    id: str
    stream: str | None = None
    filter: str = ""
    start: int | str | None = msgspec.field(default=None, name="from")
    after: int | None = None
    client: str | None = None
    ack: bool = False
    policy: Overflow | None = None


class Ack(_Op, tag="ack"):
    id: str
    seq: int


class SlowDown(_Op, tag="slow_down"):
    id: str
    max_rate: float | None = None


class Unsubscribe(_Op, tag="unsubscribe"):
    id: str


_ops = msgspec.json.Decoder(Subscribe | Ack | SlowDown | Unsubscribe)
_OPS_HINT = "expected {'op': 'subscribe'|'ack'|'slow_down'|'unsubscribe', 'id': ...}"


def _id_of(text: str) -> str | None:
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    sid = raw.get("id") if isinstance(raw, dict) else None
    return sid if isinstance(sid, str) else None


# --------------------------------------------------------------------------- the actor


class Gateway(SupervisedActor):
    """Ray actor: one data-access replica. Replicas share a port with SO_REUSEPORT; a
    restarted replica serves again by itself (the data plane starts in `__init__`)."""

    def __init__(
        self,
        state_dir: str,
        *,
        name: str,
        config: dict[str, Any],
        nats_url: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        named_filters: Mapping[str, str] | None = None,
        token_streams: Mapping[str, Sequence[str]] | None = None,
        options: Mapping[str, Any] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(state_dir, name=name)
        self.cfg: Config = validate(config)
        self.nats_url = nats_url
        self.host = host
        self.port = self.cfg.roles.gateway.port if port is None else port
        self.options = msgspec.convert(dict(options or {}), GatewayOptions)
        o = self.options
        if o.ring_size < o.max_lag + 2 * o.fetch_batch:
            raise ValueError(
                f"ring_size {o.ring_size} must be >= max_lag + 2 * fetch_batch "
                f"({o.max_lag + 2 * o.fetch_batch}): a client within its lag bound must "
                "still find its events in memory"
            )
        TargetPolicy.from_networks(o.webhooks.allow_networks)  # a bad CIDR fails the start
        self.named_texts = dict(named_filters or {})
        self.named = compile_named(self.named_texts)
        self.access = Access(
            self.cfg.auth.consumer_tokens, token_streams, self.options.internal_streams
        )
        self.instance = f"{name}:{self.incarnation[:8]}"
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
        }
        self.open = {"ws": 0, "sse": 0, "subscriptions": 0}
        self._closers: set[Callable[[], Awaitable[None]]] = set()
        self._dataplane = LoopThread(f"{name}-dataplane")
        self._dataplane.start(self._serve, start_timeout_s)

    def restore(self, store: Any) -> None:
        """Stateless: positions live in the cursor bucket, webhooks in theirs."""

    # ------------------------------------------------------------------ control plane

    def endpoints(self) -> dict[str, Any]:
        url = f"{http_scheme(self.cfg)}://{self.host}:{self.port}"
        return {"host": self.host, "port": self.port, "url": url}

    def stats(self) -> dict[str, Any]:
        return self._dataplane.call(self._stats()).result(10)

    def shutdown(self) -> bool:
        """Close every client (1001, cursors flushed), hand webhook leases over, stop."""
        return self._dataplane.stop()

    async def _stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "instance": self.instance,
            "pid": self.pid,
            "port": self.port,
            **self.counters,
            "open": dict(self.open),
            "feeds": self.hub.stats(),
            "cursors": self.cursors.stats(),
            "webhooks": self.webhooks.stats(),
        }

    # ------------------------------------------------------------------ data plane

    async def _serve(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
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
            ring_size=opts.ring_size,
            backfill=opts.backfill,
            batch=opts.fetch_batch,
            idle_s=opts.feed_idle_s,
        )
        self.webhooks = Webhooks(
            self.js,
            owner=self.instance,
            cursors=self.cursors,
            open_reader=lambda js_name: jetstream_opener(self.js, js_name),
            stream_name=lambda public: stream_ref(public).js,
            compile_filter=self._filter,
            options=opts.webhooks,
        )
        await self.webhooks.start()
        flush_stop = asyncio.Event()
        flusher = asyncio.get_running_loop().create_task(self.cursors.run(flush_stop))
        app = web.Application(client_max_size=1 << 20, middlewares=[_errors])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/v1/ws", self.ws_handler)
        app.router.add_get("/streaming", self.streaming)
        app.router.add_get("/v1/sse/{stream}", self.sse)
        app.router.add_get("/v1/poll/{stream}", self.poll)
        app.router.add_get("/v1/streams", self.list_streams)
        app.router.add_get("/v1/streams/{stream}", self.since)
        app.router.add_get("/v1/streams/{stream}/latest", self.latest)
        app.router.add_get("/v1/kv/{bucket}", self.kv_snapshot)
        app.router.add_post("/v1/webhooks", self.webhook_register)
        app.router.add_get("/v1/webhooks", self.webhook_list)
        app.router.add_get("/v1/webhooks/{id}", self.webhook_get)
        app.router.add_delete("/v1/webhooks/{id}", self.webhook_delete)
        app.router.add_get("/v1/stats", self.http_stats)
        _mount_dashboard(app)
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=5,
            keepalive_timeout=opts.idle_timeout_s,
        )
        await runner.setup()
        site = web.TCPSite(
            runner, self.host, self.port, reuse_port=True, ssl_context=server_ssl_context(self.cfg)
        )
        await site.start()
        self.port = runner.addresses[0][1]
        ready()
        try:
            await stop.wait()
        finally:
            for close in list(self._closers):
                with contextlib.suppress(Exception):
                    await close()
            await self.webhooks.stop()
            await self.hub.stop()
            await runner.cleanup()
            flush_stop.set()
            await flusher
            await self.nc.drain()

    # ------------------------------------------------------------------ shared steps

    def _filter(self, text: str) -> Filter:
        """A named (static) filter by its name, else the text compiled as SQL."""
        named = self.named.get(text)
        return named if named is not None else compile_filter(text)

    def _count(self, p: Problem) -> None:
        key = {401: "unauthorized", 403: "forbidden", 404: "not_found"}.get(p.status)
        self.counters[key or "bad_requests"] += 1

    async def _stream(self, name: str, token: str | None) -> tuple[StreamRef, Any]:
        """The stream and its current state, or Problem 403/404."""
        from nats.js.errors import NotFoundError

        ref = stream_ref(name)
        self.access.authorize(token, ref)
        try:
            info = await self.js.stream_info(ref.js)
        except NotFoundError:
            raise Problem(404, f"unknown stream {ref.public!r}") from None
        return ref, info.state

    def _policy(self, ref: StreamRef, wanted: Overflow | None = None) -> LagPolicy:
        o = self.options
        overflow = wanted or o.overflow.get(ref.public, o.default_overflow)
        return LagPolicy(o.max_lag, min(o.warn_lag, o.max_lag), o.warn_every_s, overflow)

    def _history(self, ref: StreamRef) -> Callable[[int], Awaitable[Any]]:
        return jetstream_opener(self.js, ref.js)

    def _track_cursor(
        self,
        client: str | None,
        sid: str,
        ref: StreamRef,
        filter_text: str,
        ack: bool,
        owner: str,
    ) -> Callable[[int], None]:
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
                    updated_ms=int(time.time() * 1000),
                    owner=owner,
                )
            )

        return progress

    def _tune_socket(self, request: web.Request) -> None:
        if not self.options.socket_sndbuf or request.transport is None:
            return
        sock = request.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.options.socket_sndbuf)

    # ------------------------------------------------------------------ HTTP basics

    async def healthz(self, _: web.Request) -> web.Response:
        return _reply(200, {"ok": True, "name": self.name, "instance": self.instance})

    async def http_stats(self, request: web.Request) -> web.Response:
        try:
            self.access.authenticate(request_token(request))
        except Problem as p:
            self._count(p)
            return _problem(p)
        return _reply(200, await self._stats())

    async def list_streams(self, request: web.Request) -> web.Response:
        token = request_token(request)
        try:
            self.access.authenticate(token)
        except Problem as p:
            self._count(p)
            return _problem(p)
        out = []
        for name in await self.js.streams_info():
            ref = stream_ref(name.config.name)
            try:
                self.access.authorize(token, ref)
            except Problem:
                continue
            s = name.state
            out.append({"stream": ref.public, "first_seq": s.first_seq, "last_seq": s.last_seq})
        return _reply(200, {"streams": sorted(out, key=lambda d: d["stream"])})

    # ------------------------------------------------------------------ WebSocket

    async def ws_handler(self, request: web.Request) -> web.StreamResponse:
        # autoclose off: a client's close is answered only after its cursors are flushed,
        # so a client that closed cleanly and reconnects anywhere finds them up to date
        ws = web.WebSocketResponse(
            compress=False,
            heartbeat=30,
            max_msg_size=self.options.ws_max_message,
            autoclose=False,
        )
        await ws.prepare(request)
        self._tune_socket(request)
        self.counters["ws_connections"] += 1
        self.open["ws"] += 1
        conn = _WsConnection(self, ws, request, request_token(request))
        self._closers.add(conn.going_away)
        try:
            try:
                self.access.authenticate(conn.token)
            except Problem as p:
                self._count(p)
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
                        after=_int_param(request, "after", None),
                        client=request.query.get("client"),
                    )
                )
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await conn.handle(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    self.counters["malformed"] += 1
                    reason = "binary frames are not part of the protocol: send JSON text"
                    await conn.fail(None, Problem(400, reason), close=True)
                else:
                    break
        except Problem as p:
            self._count(p)
            await conn.fail(None, p, close=True)
        except Exception:
            log.exception("websocket connection failed")
            await conn.close(1011, "internal error")
        finally:
            self._closers.discard(conn.going_away)
            await conn.end()
            self.open["ws"] -= 1
        return ws

    async def streaming(self, request: web.Request) -> web.StreamResponse:
        """The book's endpoint: the latest top-N list as a JSON array, on every change."""
        ws = web.WebSocketResponse(compress=False, heartbeat=30, max_msg_size=4096)
        await ws.prepare(request)
        self.counters["ws_connections"] += 1
        self.open["ws"] += 1
        conn = _WsConnection(self, ws, request, request_token(request))
        self._closers.add(conn.going_away)
        try:
            self.access.authenticate(conn.token)
            await conn.topn(self.options.topn_stream, self.options.topn_subject)
            async for msg in ws:
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    break  # the client only listens; anything it sends is ignored
        except Problem as p:
            self._count(p)
            await conn.fail(None, p, close=True)
        finally:
            self._closers.discard(conn.going_away)
            await conn.end()
            self.open["ws"] -= 1
        return ws

    # ------------------------------------------------------------------ SSE

    async def sse(self, request: web.Request) -> web.StreamResponse:
        token = request_token(request)
        try:
            self.access.authenticate(token)
            ref, state = await self._stream(request.match_info["stream"], token)
            flt = self._filter(request.query.get("filter", ""))
            client = request.query.get("client") or None
            sid = request.query.get("sub") or f"sse:{ref.public}"
            last_id = request.headers.get("Last-Event-ID", "").strip()
            after = int(last_id) if last_id.isdigit() else _int_param(request, "after", None)
            owner = self.access.owner(token)
            start_seq, resumed = await self._resolve(
                ref, state, request.query.get("from"), after, client, sid, owner
            )
        except FilterError as err:
            p = _filter_problem(err)
            self._count(p)
            return _problem(p)
        except Problem as p:
            self._count(p)
            return _problem(p)
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )
        await resp.prepare(request)
        self._tune_socket(request)
        self.counters["sse_connections"] += 1
        self.open["sse"] += 1
        closed = asyncio.Event()
        sent = [time.monotonic()]

        async def write(chunk: bytes) -> None:
            await resp.write(chunk)
            sent[0] = time.monotonic()

        def control(event: str, body: dict[str, Any]) -> None:
            self._spawn(write(b"event: %s\ndata: %s\n\n" % (event.encode(), _json.encode(body))))

        async def deliver(batch: list[tuple[Event, bytes]]) -> None:
            await write(
                b"".join(b"id: %d\nevent: message\ndata: %s\n\n" % (e.seq, b) for e, b in batch)
            )
            self.counters["events_sent"] += len(batch)

        policy = self._policy(ref)

        cut_off: list[str] = []

        def on_overflow(behind: int) -> None:
            self.counters["slow_disconnects"] += 1
            cut_off.append(f"too slow: {behind} messages behind (limit {policy.max_lag})")
            self._abort_later(request)
            closed.set()

        sub = self._subscriber(
            sid,
            flt,
            policy,
            deliver,
            on_lag=lambda behind: control("lag", self._lag_body(None, behind, policy)),
            on_dropped=lambda n, a, b: control("dropped", {"count": n, "from_seq": a, "to_seq": b}),
            on_overflow=on_overflow,
            on_progress=self._track_cursor(client, sid, ref, flt.text, False, owner),
        )
        hello = {"stream": ref.public, "from_seq": start_seq, "cursor": resumed}
        await write(b"retry: 1000\nevent: subscribed\ndata: %s\n\n" % _json.encode(hello))
        feed = self.hub.feed(ref.js)  # no await between getting a feed and joining it
        feed.attach(sub, start_seq)
        self.open["subscriptions"] += 1
        self.counters["subscriptions"] += 1
        pump = asyncio.get_running_loop().create_task(sub.pump(feed, self._history(ref)))
        ender = asyncio.get_running_loop().create_task(closed.wait())
        self._closers.add(_setter(closed))
        try:
            while not pump.done() and not closed.is_set():
                await asyncio.wait({pump, ender}, timeout=min(1.0, self.options.sse_keepalive_s))
                if request.transport is None or request.transport.is_closing():
                    break  # the client went away: stop serving it now, not at the next write
                if time.monotonic() - sent[0] >= self.options.sse_keepalive_s:
                    await write(b": keepalive\n\n")
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            self._closers.discard(_setter(closed))
            feed.detach(sub)
            for t in (pump, ender):
                t.cancel()
            await asyncio.gather(pump, ender, return_exceptions=True)
            if cut_off:  # queued behind what the client has not read yet
                error = {"code": CLOSE_TOO_SLOW, "reason": cut_off[0]}
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        write(b"event: error\ndata: %s\n\n" % _json.encode(error)),
                        self.options.close_timeout_s,
                    )
            self.open["subscriptions"] -= 1
            self.open["sse"] -= 1
            if client:
                with contextlib.suppress(Exception):
                    await self.cursors.flush([(client, sid, owner)])
        return resp

    # ------------------------------------------------------------------ polling, latest

    async def poll(self, request: web.Request) -> web.Response:
        self.counters["polls"] += 1
        opts = self.options
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
        self.counters["requests"] += 1
        token = request_token(request)
        try:
            self.access.authenticate(token)
            ref, state = await self._stream(request.match_info["stream"], token)
            flt = self._filter(request.query.get("filter", ""))
            after = _int_param(request, after_param, None)
            limit = _int_param(request, "limit", self.options.poll_limit, lo=1)
        except FilterError as err:
            return self._refuse(_filter_problem(err))
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
        self.counters["events_sent"] += len(events)
        return web.Response(body=body, content_type="application/json")

    async def _collect(
        self,
        ref: StreamRef,
        flt: Filter,
        after: int,
        limit: int,
        timeout: float,
        known_last: int,
    ) -> tuple[list[tuple[Event, bytes]], int]:
        """Matching events after `after` (at most `limit`), and the last seq examined: from
        the feed's ring, from a history read if older, waiting up to `timeout` for some.
        What the stream held when the request came (`known_last`) is always looked at,
        even with timeout 0 (a feed that just started needs a moment to read it)."""
        feed = self.hub.feed(ref.js)
        now = time.monotonic()
        deadline = now + timeout
        catch_up = now + max(timeout, 10.0)
        scan_cap = 10 * limit
        with feed.poller():
            feed.start(after + 1)
            while True:
                if after + 1 < feed.ring.base:
                    return await self._collect_history(ref, flt, after, limit, feed)
                found: list[tuple[Event, bytes]] = []
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
    ) -> tuple[list[tuple[Event, bytes]], int]:
        reader = await feed.open_history(self._history(ref), after + 1)
        found: list[tuple[Event, bytes]] = []
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
        from nats.js.errors import NotFoundError

        self.counters["requests"] += 1
        token = request_token(request)
        try:
            self.access.authenticate(token)
            ref, state = await self._stream(request.match_info["stream"], token)
            flt = self._filter(request.query.get("filter", ""))
        except FilterError as err:
            return self._refuse(_filter_problem(err))
        except Problem as p:
            return self._refuse(p)
        subject = request.query.get("subject")
        try:
            if subject:
                raw = await self.js.get_last_msg(ref.js, subject)
            elif state.last_seq:
                raw = await self.js.get_msg(ref.js, state.last_seq)
            else:
                return self._refuse(Problem(404, f"stream {ref.public!r} is empty"))
        except NotFoundError:
            return self._refuse(Problem(404, f"no message in {ref.public!r} for that subject"))
        ev = _raw_event(ref, raw)
        view = ev.view(flt)
        if view is None:
            return self._refuse(Problem(404, "the latest message does not match the filter"))
        body = b'{"seq":%d,"subject":%s,"data":%s}' % (ev.seq, _json.encode(ev.subject), view)
        return web.Response(body=body, content_type="application/json")

    def _refuse(self, p: Problem) -> web.Response:
        self._count(p)
        return _problem(p)

    # ------------------------------------------------------------------ data sync

    async def kv_snapshot(self, request: web.Request) -> web.Response:
        """Every live key with its value, and the revision to follow deltas after."""
        self.counters["requests"] += 1
        token = request_token(request)
        try:
            self.access.authenticate(token)
            ref, state = await self._stream("kv:" + request.match_info["bucket"], token)
            flt = self._filter(request.query.get("filter", ""))
        except FilterError as err:
            return self._refuse(_filter_problem(err))
        except Problem as p:
            return self._refuse(p)
        revision = state.last_seq
        entries: list[bytes] = []
        reader = await JetStreamReader(self.js, ref.js, last_per_subject=True).open()
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
        self.counters["requests"] += 1
        token = request_token(request)
        try:
            self.access.authenticate(token)
            try:
                body = msgspec.json.decode(await request.read())
            except msgspec.DecodeError as err:
                raise Problem(400, f"body is not JSON: {err}") from None
            if not isinstance(body, dict):
                raise Problem(400, "body must be a JSON object {url, stream, filter?, secret?}")
            ref, state = await self._stream(body.get("stream") or "", token)
            filter_text = body.get("filter") or ""
            if not isinstance(filter_text, str):
                raise Problem(400, "filter must be a string")
            self._filter(filter_text)
            start = parse_start(body.get("from", "new"))
            if start == "cursor":
                raise Problem(400, "a new webhook has no cursor: use new, all, last or a seq")
            start_seq = resolve_start(start, state.first_seq, state.last_seq)
            reg = await self.webhooks.register(
                url=body.get("url"),
                stream=ref.public,
                filter_text=filter_text,
                secret=body.get("secret"),
                start_seq=start_seq,
                owner=self.access.owner(token),
            )
        except FilterError as err:
            return self._refuse(_filter_problem(err))
        except WebhookError as err:
            return self._refuse(Problem(err.status, err.reason))
        except Problem as p:
            return self._refuse(p)
        return _reply(201, {**reg.public(), "secret": reg.secret})

    def _owns(self, token: str | None, reg: Registration) -> bool:
        """A webhook is seen and deleted only by the token that registered it (one made
        before owners existed: by any token that may read its stream)."""
        if reg.owner and reg.owner != self.access.owner(token):
            return False
        try:
            return self.access.may_read(token, stream_ref(reg.stream))
        except Problem:
            return False

    async def _own_webhook(self, request: web.Request) -> tuple[str, Registration]:
        """The webhook named in the path if this token owns it; else 404 (not 403: another
        token's webhook ids are not confirmed)."""
        token = request_token(request)
        self.access.authenticate(token)
        wid = request.match_info["id"]
        reg = await self.webhooks.get(wid)
        if reg is None or not self._owns(token, reg):
            raise Problem(404, "unknown webhook")
        return wid, reg

    async def webhook_list(self, request: web.Request) -> web.Response:
        token = request_token(request)
        try:
            self.access.authenticate(token)
        except Problem as p:
            return self._refuse(p)
        regs = sorted(
            (r for r in self.webhooks.registrations.values() if self._owns(token, r)),
            key=lambda r: r.created_ms,
        )
        return _reply(200, {"webhooks": [r.public() for r in regs]})

    async def webhook_get(self, request: web.Request) -> web.Response:
        try:
            wid, _ = await self._own_webhook(request)
        except Problem as p:
            return self._refuse(p)
        status = await self.webhooks.status(wid)
        if status is None:
            return self._refuse(Problem(404, "unknown webhook"))
        return _reply(200, status)

    async def webhook_delete(self, request: web.Request) -> web.Response:
        try:
            wid, _ = await self._own_webhook(request)
        except Problem as p:
            return self._refuse(p)
        if not await self.webhooks.remove(wid):
            return self._refuse(Problem(404, "unknown webhook"))
        return web.Response(status=204)

    # ------------------------------------------------------------------ subscriptions

    async def _resolve(
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
                raise _no_cursor(client, sid, state.first_seq)
            if cursor.stream != ref.public:
                raise Problem(400, f"the cursor of {sid!r} is for stream {cursor.stream!r}")
            return cursor.seq + 1, True
        return resolve_start(position, state.first_seq, state.last_seq), False

    def _subscriber(
        self,
        sid: str,
        flt: Filter,
        policy: LagPolicy,
        deliver: Callable[[list[tuple[Event, bytes]]], Awaitable[None]],
        **callbacks: Any,
    ) -> Subscriber:
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

    def _lag_body(self, sid: str | None, behind: int, policy: LagPolicy) -> dict[str, Any]:
        """How far behind, and what happens past `limit` (WS frame with op/id; SSE data)."""
        body = {"behind": behind, "policy": policy.overflow, "limit": policy.max_lag}
        return body if sid is None else {"op": "lag", "id": sid, **body}

    def _abort_later(self, request: web.Request) -> None:
        """A client cut off for slowness that never reads its close is dropped after a while."""
        transport = request.transport
        if transport is not None:
            asyncio.get_running_loop().call_later(self.options.abort_after_s, transport.abort)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_quiet)


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Nothing unexpected leaves as a bare 500 page: NATS trouble is a 503 to retry, a bug a
    JSON 500 (and a log line); the gateway itself stays up either way."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (nats.errors.Error, TimeoutError) as err:
        log.warning("%s %s: NATS: %r", request.method, request.path, err)
        return _reply(
            503, {"error": f"NATS unavailable, retry later: {err!r}"}, {"Retry-After": "1"}
        )
    except Exception as err:
        log.exception("%s %s failed", request.method, request.path)
        return _reply(500, {"error": f"internal error: {type(err).__name__}"})


def _no_cursor(client: str, sid: str, first_seq: int | None) -> Problem:
    """410: the named cursor does not exist (for this token) or expired."""
    why = (
        f"no cursor for subscription {sid!r} of client {client!r} "
        "(none made with this token, or it expired)"
    )
    if first_seq is None:
        return Problem(410, f"{why}; give the stream to learn its oldest sequence")
    return Problem(
        410,
        f"{why}; the oldest sequence still available is {first_seq}: subscribe from it "
        "(or from a seq of your own) to read on",
        first_seq=first_seq,
    )


def _mount_dashboard(app: web.Application) -> None:
    """The live dashboard (`/`, `/static/*`) when its module is present."""
    try:
        from actors.access.dashboard_server import dashboard_routes
    except ImportError:
        log.info("no dashboard module: serving the API only")
        return
    dashboard_routes(app)


def _close_reason(reason: str) -> bytes:
    """A close frame carries at most 123 bytes of reason; cut on a character boundary."""
    return reason.encode()[:123].decode("utf-8", "ignore").encode()


def _quiet(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("background send failed: %r", task.exception())


class _setter:
    """An awaitable closer that sets an event (hashable by the event, for discard)."""

    def __init__(self, event: asyncio.Event) -> None:
        self.event = event

    async def __call__(self) -> None:
        self.event.set()

    def __hash__(self) -> int:
        return hash(self.event)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _setter) and other.event is self.event


def _raw_event(ref: StreamRef, raw: Any) -> Event:
    from actors.access.fanout import kv_event

    data = raw.data or b""
    if ref.kv:
        return kv_event(raw.seq, raw.subject, data, raw.headers)
    return Event(raw.seq, raw.subject, data)


class _Active(msgspec.Struct):
    sub: Subscriber
    feed: Feed
    task: asyncio.Task[None]
    client: str | None


class _WsConnection:
    """One WebSocket client: its subscriptions and the frames it is sent."""

    def __init__(
        self, gw: Gateway, ws: web.WebSocketResponse, request: web.Request, token: str | None
    ) -> None:
        self.gw = gw
        self.ws = ws
        self.request = request
        self.token = token
        self.owner = gw.access.owner(token)
        self.subs: dict[str, _Active] = {}
        self.closing = False

    # ---- frames -----------------------------------------------------------------------

    async def send(self, body: dict[str, Any]) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.send_frame(_json.encode(body), WSMsgType.TEXT)

    def send_soon(self, body: dict[str, Any]) -> None:
        self.gw._spawn(self.send(body))

    async def close(self, code: int, reason: str) -> None:
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
            await asyncio.wait_for(
                self.ws.close(code=code, message=_close_reason(reason)),
                self.gw.options.close_timeout_s,
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
            op = _ops.decode(text)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            self.gw.counters["malformed"] += 1
            what = "not JSON" if isinstance(err, msgspec.DecodeError) else "bad message"
            problem = Problem(400, f"{what}: {err}; {_OPS_HINT}")
            await self.fail(_id_of(text), problem, close=True)
            return
        if isinstance(op, Subscribe):
            await self.subscribe(op)
            return
        active = self.subs.get(op.id)
        if active is None:
            self.gw.counters["bad_requests"] += 1
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
                self.gw.counters["bad_requests"] += 1
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
        gw = self.gw
        sid = op.id
        try:
            if not sid or len(sid) > _MAX_ID:
                raise Problem(400, f"id must be 1 to {_MAX_ID} characters")
            if op.client is not None and not 0 < len(op.client) <= _MAX_ID:
                raise Problem(400, f"client must be 1 to {_MAX_ID} characters")
            if sid in self.subs:
                raise Problem(400, f"subscription {sid!r} is already active; unsubscribe first")
            if len(self.subs) >= gw.options.max_subscriptions:
                raise Problem(400, f"at most {gw.options.max_subscriptions} subscriptions")
            stream, filter_text = op.stream, op.filter
            if op.start == "cursor" and op.client and not stream:
                cursor = await gw.cursors.get(op.client, sid, self.owner)
                if cursor is None:
                    raise _no_cursor(op.client, sid, None)
                stream, filter_text = cursor.stream, filter_text or cursor.filter
            ref, state = await gw._stream(stream or "", self.token)
            flt = gw._filter(filter_text)
            start_seq, resumed = await gw._resolve(
                ref, state, op.start, op.after, op.client, sid, self.owner
            )
        except FilterError as err:
            p = _filter_problem(err)
            gw._count(p)
            await self.fail(sid, p)
            return
        except Problem as p:
            gw._count(p)
            await self.fail(sid, p)
            return
        except (nats.errors.Error, TimeoutError) as err:
            await self.fail(sid, Problem(503, f"NATS unavailable, retry later: {err!r}"))
            return
        policy = gw._policy(ref, op.policy)
        prefix = b'{"op":"event","id":%s,"seq":' % _json.encode(sid)
        ws = self.ws

        async def deliver(batch: list[tuple[Event, bytes]]) -> None:
            for ev, body in batch:
                await ws.send_frame(
                    b'%s%d,"subject":%s,"data":%s}'
                    % (prefix, ev.seq, _json.encode(ev.subject), body),
                    WSMsgType.TEXT,
                )
            gw.counters["events_sent"] += len(batch)

        def on_overflow(behind: int) -> None:
            gw.counters["slow_disconnects"] += 1
            reason = f"too slow: {behind} messages behind (limit {policy.max_lag})"
            gw._spawn(self.close(CLOSE_TOO_SLOW, reason))
            gw._abort_later(self.request)

        sub = gw._subscriber(
            sid,
            flt,
            policy,
            deliver,
            on_lag=lambda behind: self.send_soon(gw._lag_body(sid, behind, policy)),
            on_dropped=lambda n, a, b: self.send_soon(
                {"op": "dropped", "id": sid, "count": n, "from_seq": a, "to_seq": b}
            ),
            on_overflow=on_overflow,
            on_progress=gw._track_cursor(op.client, sid, ref, flt.text, op.ack, self.owner),
            ack_window=gw.options.ack_window if op.ack else None,
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
        feed = gw.hub.feed(ref.js)
        feed.attach(sub, start_seq)
        task = asyncio.get_running_loop().create_task(self._pump(sub, feed, ref))
        self.subs[sid] = _Active(sub, feed, task, op.client)
        gw.counters["subscriptions"] += 1
        gw.open["subscriptions"] += 1

    async def _pump(self, sub: Subscriber, feed: Feed, ref: StreamRef) -> None:
        try:
            await sub.pump(feed, self.gw._history(ref))
        except (ConnectionError, RuntimeError):
            pass  # the socket closed under a send
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("subscription %s on %s failed", sub.sid, ref.public)
            await self.close(1011, "internal error")

    async def topn(self, stream: str, subject: str) -> None:
        """`/streaming`: the current top list at once, then each new one that differs."""
        from nats.js.errors import NotFoundError

        gw = self.gw
        ref, state = await gw._stream(stream, self.token)
        start_seq = state.last_seq + 1
        last: list[bytes] = [b""]

        async def send_top(ev: Event) -> None:
            data = ev.data
            top = data.get("top") if isinstance(data, dict) else None
            if top is None:
                return
            frame = _json.encode(top)
            if frame != last[0]:
                last[0] = frame
                await self.ws.send_frame(frame, WSMsgType.TEXT)
                gw.counters["events_sent"] += 1

        with contextlib.suppress(NotFoundError):
            raw = await gw.js.get_last_msg(ref.js, subject)
            start_seq = raw.seq + 1
            await send_top(_raw_event(ref, raw))

        async def deliver(batch: list[tuple[Event, bytes]]) -> None:
            await send_top(batch[-1][0])  # only the newest list matters

        policy = LagPolicy(
            gw.options.max_lag, min(gw.options.warn_lag, gw.options.max_lag), overflow="drop_oldest"
        )
        sub = gw._subscriber(
            "streaming",
            compile_filter(f"WHERE _subject = '{subject}'"),
            policy,
            deliver,
            on_lag=lambda behind: None,
            on_dropped=lambda n, a, b: None,
        )
        feed = gw.hub.feed(ref.js)
        feed.attach(sub, start_seq)
        task = asyncio.get_running_loop().create_task(self._pump(sub, feed, ref))
        self.subs["streaming"] = _Active(sub, feed, task, None)
        gw.open["subscriptions"] += 1

    # ---- ending -----------------------------------------------------------------------

    async def drop(self, sid: str) -> None:
        active = self.subs.pop(sid, None)
        if active is None:
            return
        active.feed.detach(active.sub)
        active.task.cancel()
        await asyncio.gather(active.task, return_exceptions=True)
        self.gw.open["subscriptions"] -= 1
        if active.client:
            with contextlib.suppress(Exception):
                await self.gw.cursors.flush([(active.client, sid, self.owner)])

    async def end(self) -> None:
        for sid in list(self.subs):
            await self.drop(sid)
        if not self.ws.closed:
            await self.close(1000, "")


# --------------------------------------------------------------------------- starting
