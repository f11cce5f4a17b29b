"""The Python consumer of the gateway (book ch. 8): resumable subscriptions and exactly-once work.

`TierflowClient.subscribe` speaks the gateway's WebSocket protocol (docs/contracts.md) and
yields each matching message of a stream once, in stream order, across reconnects and gateway
failovers. The client, not the server, owns the position: it remembers the seq of the last
delivery it handed out and resubscribes from the next one (to the next gateway URL after a
failure), and it drops anything at or below that seq a server sends again.

    async with TierflowClient("http://127.0.0.1:8080", token="t") as client:
        async for d in client.subscribe("orders", filter="SELECT id WHERE qty > 0"):
            print(d.seq, d.data)

`ExactlyOnce` is the book's "processed" store on LevelDB: a handler runs only for a message
id not yet recorded, and the record is written in the same atomic batch as the handler's own
writes to that store, so a crash at any point leaves the message either fully processed and
recorded or neither: it is paid once, never twice and never lost.

    eo = ExactlyOnce(".royalties", key=lambda d: d.data["play_id"])
    async for d in client.subscribe("plays", start=eo.resume_from("plays")):
        await eo.process(d, lambda d, batch: batch.put("ledger", ..., ...))

What a client cannot get back: messages the gateway dropped under its `drop_oldest` lag policy
(counted in `ClientStats.dropped` and reported to `on_notice`), and side effects outside the
store (a third party's API) which need their own idempotency key, e.g. the message id.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import msgspec

from runtime.errors import TierflowError
from runtime.nats.publisher import jittered
from runtime.state.checkpoint import Batch, CheckpointStore

__all__ = [
    "ClientStats",
    "Delivery",
    "ExactlyOnce",
    "GatewayError",
    "GatewayUnavailable",
    "TierflowClient",
    "resume_frame_from",
    "ws_url",
]

log = logging.getLogger(__name__)

WS_PATH = "/v1/ws"
#: Close codes and error codes after which retrying cannot help (bad request, auth, unknown).
FATAL_CLOSE_CODES = frozenset({4400, 4401, 4403, 4404, 4410})
#: 410: the named server cursor does not exist (for this token) or expired; the error
#: frame's `first_seq` is the oldest sequence the stream still holds.
FATAL_ERROR_CODES = frozenset({400, 401, 403, 404, 410})
_SEQ = struct.Struct(">Q")
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

Start = str | int  # "new" | "all" | "last" | "cursor" | a stream sequence (first to deliver)


class GatewayError(TierflowError):
    """The gateway refused the subscription (bad filter, auth, unknown stream): not retried."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"gateway refused ({code}): {reason}")
        self.code = code
        self.reason = reason


class GatewayUnavailable(TierflowError, ConnectionError):
    """No gateway URL accepted the subscription within `give_up_after` seconds."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message of a stream: `seq` is its stream sequence, unique and increasing."""

    seq: int
    subject: str
    data: Any
    stream: str = ""


@dataclass
class ClientStats:
    """What happened on the wire. `dropped` (discarded by the gateway's lag policy) and
    `aged_out` (gone from the stream before a resume reached them) count messages lost."""

    connects: int = 0
    reconnects: int = 0
    duplicates: int = 0
    lag_warnings: int = 0
    dropped: int = 0
    aged_out: int = 0
    last_lag: dict[str, Any] | None = None
    last_error: str = ""  # why the last connection ended, when it was not asked to


def ws_url(url: str) -> str:
    """The WebSocket endpoint for a gateway base URL (`http://h:p`) or a ws URL as given."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"gateway URL must be http(s):// or ws(s)://, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else WS_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def resume_frame_from(start: Start, from_seq: int | None, last_seq: int) -> Start:
    """Where a (re)subscription starts: after the last delivery, else where the first
    subscription started (the server's `from_seq`, so "new" does not skip what arrived
    while disconnected), else the caller's original `start`."""
    if last_seq > 0:
        return last_seq + 1
    if from_seq is not None and from_seq > 0:
        return from_seq
    return start


class _Retry(Exception):
    """The connection ended in a way a reconnect can fix."""


@dataclass
class _Sub:
    stream: str
    filter: str | None
    start: Start
    client_id: str
    sub_id: str
    ack: bool
    max_rate: float | None
    last_seq: int = 0
    from_seq: int | None = None
    subscribed: bool = False

    def subscribe_frame(self) -> dict[str, Any]:
        frame: dict[str, Any] = {
            "op": "subscribe",
            "id": self.sub_id,
            "stream": self.stream,
            "from": resume_frame_from(self.start, self.from_seq, self.last_seq),
            "client": self.client_id,
            "ack": self.ack,
        }
        if self.filter:
            frame["filter"] = self.filter
        return frame


@dataclass
class TierflowClient:
    """A gateway client; `url` may list several gateway replicas to fail over between.

    Reconnects use jittered exponential backoff (`backoff_base`..`backoff_cap` seconds) and
    rotate through the URLs; a subscription gives up with `GatewayUnavailable` once no attempt
    has succeeded for `give_up_after` seconds. `on_notice` sees every `lag` and `dropped`
    frame (the book's in-stream warning to a lagging consumer) and a `subscribed` frame
    reporting a `gap`.
    """

    url: str | Sequence[str]
    token: str | None = None
    backoff_base: float = 0.05
    backoff_cap: float = 2.0
    give_up_after: float = 30.0
    heartbeat: float = 10.0
    # a gateway's host cut off answers no SYN: without a bound, connecting to it waits out
    # the kernel's retries (about two minutes) before the next URL is tried
    connect_timeout: float = 5.0
    on_notice: Callable[[dict[str, Any]], None] | None = None
    rng: random.Random = field(default_factory=random.Random)
    stats: ClientStats = field(default_factory=ClientStats)
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        urls = [self.url] if isinstance(self.url, str) else list(self.url)
        if not urls:
            raise ValueError("TierflowClient needs at least one gateway URL")
        self._urls = [ws_url(u) for u in urls]
        self._next_url = 0

    async def __aenter__(self) -> TierflowClient:
        return self

    async def __aexit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            bound = self.connect_timeout
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=bound, sock_connect=bound)
            )
        return self._session

    async def subscribe(
        self,
        stream: str,
        *,
        filter: str | None = None,  # noqa: A002 - the protocol's word
        start: Start = "new",
        client_id: str | None = None,
        sub_id: str | None = None,
        ack: bool = False,
        max_rate: float | None = None,
    ) -> AsyncIterator[Delivery]:
        """Deliveries of `stream` matching `filter`, each once and in seq order, from `start`
        ("new", "all", "last", or the first seq wanted) until the caller stops iterating.

        With `ack`, a delivery is acknowledged to the gateway when the caller asks for the
        next one, i.e. after processing it; `max_rate` asks the gateway to send at most that
        many messages a second (the book's slow-down request). Raises `GatewayError` when
        the gateway refuses the subscription and `GatewayUnavailable` when no gateway is
        reachable in time.
        """
        sub = _Sub(
            stream=stream,
            filter=filter,
            start=start,
            client_id=client_id or f"py-{uuid.uuid4().hex[:12]}",
            sub_id=sub_id or f"{stream}-{uuid.uuid4().hex[:8]}",
            ack=ack,
            max_rate=max_rate,
        )
        backoff = jittered(self.backoff_base, self.backoff_cap, self.rng)
        failures = 0
        down_since: float | None = None
        while True:  # bounded: every failure moves toward the give_up_after deadline
            url = self._urls[self._next_url % len(self._urls)]
            sub.subscribed = False
            try:
                async with contextlib.aclosing(self._session_once(url, sub)) as deliveries:
                    async for delivery in deliveries:
                        yield delivery
            except _Retry as exc:
                self.stats.last_error = f"{url}: {exc}"
                log.info(
                    "gateway %s: %s; resuming %s after seq %d", url, exc, sub.sub_id, sub.last_seq
                )
            if sub.subscribed:  # that connection worked: start a fresh backoff sequence
                failures, down_since = 0, None
            now = time.monotonic()
            down_since = now if down_since is None else down_since
            if now - down_since > self.give_up_after:
                raise GatewayUnavailable(
                    f"no gateway of {self._urls} served {stream!r} for {self.give_up_after} s"
                )
            failures += 1
            self._next_url += 1
            self.stats.reconnects += 1
            await asyncio.sleep(backoff(failures))

    async def _session_once(self, url: str, sub: _Sub) -> AsyncIterator[Delivery]:
        """One connection's worth of deliveries; raises _Retry when reconnecting can help."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            async with self._http().ws_connect(
                url, headers=headers, heartbeat=self.heartbeat, autoping=True
            ) as ws:
                await ws.send_str(_encode(sub.subscribe_frame()).decode())
                if sub.max_rate:
                    slow = {"op": "slow_down", "id": sub.sub_id, "max_rate": sub.max_rate}
                    await ws.send_str(_encode(slow).decode())
                self.stats.connects += 1
                async for msg in ws:
                    if msg.type is not aiohttp.WSMsgType.TEXT:
                        if msg.type is aiohttp.WSMsgType.ERROR:
                            raise _Retry(f"websocket error {ws.exception()!r}")
                        continue
                    delivery = self._on_frame(_decode(msg.data), sub)
                    if delivery is None:
                        continue
                    yield delivery
                    if sub.ack:
                        ack = {"op": "ack", "id": sub.sub_id, "seq": delivery.seq}
                        await ws.send_str(_encode(ack).decode())
                code = ws.close_code
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in FATAL_ERROR_CODES:
                raise GatewayError(exc.status, exc.message) from exc
            raise _Retry(f"handshake failed: {exc.status} {exc.message}") from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _Retry(repr(exc)) from exc
        except msgspec.DecodeError as exc:
            raise _Retry(f"undecodable frame: {exc}") from exc
        if code in FATAL_CLOSE_CODES:
            raise GatewayError(code - 4000, f"connection closed with code {code}")
        raise _Retry(f"connection closed (code {code})")

    def _on_frame(self, frame: Any, sub: _Sub) -> Delivery | None:
        """Apply one server frame to the subscription; a Delivery when it is new data."""
        if not isinstance(frame, dict):
            return None
        op = frame.get("op")
        if frame.get("id") not in (None, sub.sub_id):
            return None
        if op == "event":
            seq = int(frame["seq"])
            if seq <= sub.last_seq:
                self.stats.duplicates += 1
                return None
            sub.last_seq = seq
            return Delivery(seq, str(frame.get("subject", "")), frame.get("data"), sub.stream)
        if op == "subscribed":
            sub.subscribed = True
            if sub.from_seq is None and isinstance(frame.get("from_seq"), int):
                sub.from_seq = frame["from_seq"]
            if frame.get("gap"):  # what we asked for had aged out of the stream: lost
                self.stats.aged_out += int(frame["gap"])
                log.warning("%s: %s messages aged out before delivery", sub.sub_id, frame["gap"])
                if self.on_notice is not None:
                    self.on_notice(frame)
        elif op in ("lag", "dropped"):
            if op == "lag":
                self.stats.lag_warnings += 1
                self.stats.last_lag = frame
            else:
                self.stats.dropped += int(frame.get("count", 0))
                log.warning("gateway dropped %s messages of %s", frame.get("count"), sub.sub_id)
            if self.on_notice is not None:
                self.on_notice(frame)
        elif op == "error":
            code = int(frame.get("code", 0))
            reason = str(frame.get("reason", ""))
            if code in FATAL_ERROR_CODES:
                raise GatewayError(code, reason)
            raise _Retry(f"gateway error {code}: {reason}")
        return None


Handler = Callable[[Delivery, Batch], Awaitable[None] | None]


def default_key(delivery: Delivery) -> str:
    """A message's id: its stream and sequence (unique and stable in a JetStream stream)."""
    return f"{delivery.stream}:{delivery.seq}"


class ExactlyOnce:
    """Exactly-once processing of deliveries against one LevelDB store (book ch. 8).

    `process` runs a handler only for an id not yet recorded and commits the record, the
    stream cursor and every write the handler made to the given batch as one synced atomic
    batch. Handlers keep their state in the same store (`self.store`, e.g. a namespace
    `ledger`) and write it only through the batch; a handler that raises records nothing.
    `key` picks the message id; use a producer's id (say a play id) to also absorb
    duplicates a producer published twice.
    """

    def __init__(
        self,
        store_path: str | Path,
        *,
        key: Callable[[Delivery], str] = default_key,
        name: str = "exactly_once",
    ) -> None:
        self.store = CheckpointStore(store_path)
        self.key = key
        self._done = self.store.namespace(f"{name}.done")
        self._cursor = self.store.namespace(f"{name}.cursor")
        self._lock = asyncio.Lock()

    def processed(self, delivery: Delivery) -> bool:
        return self._done.get(self.key(delivery).encode()) is not None

    def last_seq(self, stream: str) -> int:
        """The highest seq of `stream` processed so far (0 if none)."""
        raw = self._cursor.get(stream.encode())
        return _SEQ.unpack(raw)[0] if raw is not None else 0

    def resume_from(self, stream: str) -> Start:
        """Where a restarted consumer subscribes: right after its last processed message."""
        last = self.last_seq(stream)
        return last + 1 if last else "all"

    async def process(self, delivery: Delivery, handler: Handler) -> bool:
        """Run `handler(delivery, batch)` unless already done; True if it ran (and committed)."""
        key = self.key(delivery).encode()
        async with self._lock:
            if self._done.get(key) is not None:
                return False
            with self.store.write_batch() as batch:
                result = handler(delivery, batch)
                if inspect.isawaitable(result):
                    await result
                batch.put(self._done, key, _SEQ.pack(delivery.seq))
                if delivery.stream and delivery.seq > self.last_seq(delivery.stream):
                    batch.put(self._cursor, delivery.stream.encode(), _SEQ.pack(delivery.seq))
            return True

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> ExactlyOnce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
