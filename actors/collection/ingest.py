"""The Collector's one ingest path: every transport's events take it, so the data path of
the collection tier reads top to bottom here.

    check_stream (404, 403) -> parse: ids, the body kept as received (parsing.py)
      -> fit: 413 for an event JetStream could never take
      -> log per `logging.mode`, with the stream's logic (validate, enrich, filter, route):
           rbml  group commit of the raw events to the MessageLogger, then the logic
           sbml  the logic, then group commit of what goes out
           hml   the raw events join the group commit's batch, the logic runs meanwhile
           none  no log: the logic, then the bridge's ack is the only persistence
      -> the producer is answered (by its transport) -> hand-off to the BrokerBridge

HTTP, WebSocket, NATS `ingest.*`, UDP and the stream pattern's buffer differ only in how
they read events and answer (http_routes.py, websocket.py, nats_ingest.py, udp.py,
buffer_ingest.py); what they accept, refuse and when they may answer is decided here.

A refusal is `BadInput` (a status and a reason: nothing taken) or, once ids were assigned,
any other error: `refused` turns it into the reason of a 503 that names the ids, so the
producer resends exactly those, and adopts the log's new epoch after a fenced write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any

from actors.collection.buffer_consumer import BufferedFrame
from actors.collection.group_commit import GroupCommitter, Overloaded
from actors.collection.handoff import BridgeHandoff
from actors.collection.parsing import MAX_ID_CHARS, BadInput, parse_events
from actors.queue.logger import LogFull, LoggerGroup, LogUnavailable
from runtime.clock import now_ms
from runtime.config import Config, system_streams
from runtime.data.compaction import CompactingLogic, stream_logic
from runtime.data.event_schema import EventSchema
from runtime.data.events import Event
from runtime.data.logic import StreamLogic
from runtime.errors import TierflowError
from runtime.nats.publisher import MSG_ID_HEADER, header_bytes
from runtime.state.replication import FencedError

log = logging.getLogger(__name__)

__all__ = [
    "COUNTERS",
    "HEADER_RESERVE",
    "SYSTEM_STREAMS",
    "IngestPath",
    "QueueRefused",
    "is_system_stream",
    "refusal",
    "wire_overhead",
]

# What a Collector counts (its `stats`), in that order; every transport counts here.
COUNTERS = (
    "requests",
    "accepted",
    "rejected",
    "overloaded",
    "oneway_accepted",
    "oneway_lost",
    "udp",
    "nats",
    "bridge_errors",
    "buffered",
    "handoffs_deferred",
    "unauthorized",
    "handoffs",
    "fenced",
    "too_big",
    "errors",
    "refused_browser",
)

# The NATS server counts a message's headers in `max_payload` (the subject travels in the
# control line, outside it). The bridge sends `Nats-Msg-Id: <id>`; the reserve leaves room
# for the headers it adds when it dead-letters an event (`Tf-Error`, up to 200 characters
# of UTF-8) or others it may add, so an accepted event can always be published somewhere.
HEADER_RESERVE = 1024


def wire_overhead(event_id: str) -> int:
    """Bytes besides the event's JSON that count against the server's `max_payload`: the
    headers the bridge sends (counted as the publisher counts them) and a reserve."""
    return header_bytes({MSG_ID_HEADER: event_id}) + HEADER_RESERVE


_LONGEST_ID_OVERHEAD = wire_overhead("x" * MAX_ID_CHARS)

# Streams the runtime writes (analysis results, dead letters): no producer path may.
SYSTEM_STREAMS = frozenset(system_streams())
_SYSTEM_PREFIXES = tuple(
    subj.removesuffix(">") for sc in system_streams().values() for subj in sc["subjects"]
)


def is_system_stream(cfg: Config, stream: str) -> bool:
    """A stream the runtime owns: by name, or by capturing a system subject."""
    sc = cfg.streams.get(stream)
    subjects = sc.subjects if sc is not None else []
    return stream in SYSTEM_STREAMS or any(s.startswith(_SYSTEM_PREFIXES) for s in subjects)


class QueueRefused(TierflowError):
    """Mode none only: JetStream did not acknowledge, and no log holds the events."""


def refusal(err: Exception) -> tuple[str, str]:
    """(counter, reason) of an error from logging or queueing: every one is a 503 the
    producer answers by resending the same ids later (nothing was acknowledged)."""
    if isinstance(err, LogFull | Overloaded):
        return "overloaded", f"overloaded, resend with the same ids later: {err}"
    if isinstance(err, FencedError):
        return "fenced", f"message log changed primary ({err}); resend with the same ids"
    if isinstance(err, LogUnavailable | QueueRefused):
        return "overloaded", f"not persisted, resend with the same ids later: {err}"
    log.error("unexpected error while logging events", exc_info=err)
    return "errors", f"not acknowledged ({type(err).__name__}); resend with the same ids later"


class IngestPath:
    """Parse, log (group commit) with the stream's logic, hand off: for every transport.

    Built in the actor's `__init__` with everything it holds; it runs on the data plane's
    loop. The only thing that comes later is the NATS connection, which tells the
    server's `max_payload` (`fit`): until the data plane connected, `nats` is None and
    nothing is checked against it.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        logger: LoggerGroup,
        committer: GroupCommitter[Any],
        bridge: BridgeHandoff,
        counters: dict[str, int],
        max_events: int = 10_000,
        max_event_bytes: int = 1 << 20,
    ) -> None:
        self.cfg = cfg
        self.mode = cfg.logging.mode
        self.logger = logger
        self.committer = committer
        self.bridge = bridge
        self.counters = counters
        self.max_events, self.max_event_bytes = max_events, max_event_bytes
        self.logic: Mapping[str, StreamLogic | CompactingLogic] = {
            s: stream_logic(s, sc) for s, sc in cfg.streams.items()
        }
        # a stream that declares its fields' types refuses an event that breaks them: Spark
        # would read such a field as null, silently (runtime/data/event_schema.py)
        self.schemas: Mapping[str, EventSchema] = {
            s: EventSchema(sc.schema) for s, sc in cfg.streams.items() if sc.schema
        }
        self.nats: Any = None  # the collector's NATS connection, once the data plane has it
        self._refreshing: asyncio.Future[Any] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ read and identify

    def check_stream(self, stream: str) -> None:
        """404 for an unknown stream, 403 for one only the runtime writes."""
        if stream not in self.cfg.streams:
            raise BadInput(404, f"unknown stream {stream!r}")
        if is_system_stream(self.cfg, stream):
            raise BadInput(403, f"{stream!r} is a system stream: producers may not write to it")

    def parse(
        self, content_type: str | None, body: bytes, stream: str, *, max_events: int = 0
    ) -> list[Event]:
        """A checked stream's body to events with ids, each one JetStream can take; every
        refusal is a BadInput. `max_events` 0: the collector's limit."""
        events = parse_events(
            content_type,
            body,
            stream,
            self.cfg.streams[stream].subjects[0],
            now_ms(),
            max_events=max_events or self.max_events,
            max_event_bytes=self.max_event_bytes,
        )
        schema = self.schemas.get(stream)
        if schema is not None:
            for i, e in enumerate(events):
                why = schema.problem(e.data)
                if why is not None:
                    raise BadInput(
                        400, f"event at index {i} does not fit stream {stream!r}'s schema: {why}"
                    )
        return self.fit(events)

    @property
    def max_payload(self) -> int:
        """The NATS server's `max_payload` (headers included); 0 before it is known."""
        nc = self.nats
        return int(getattr(nc, "max_payload", 0) or 0) if nc is not None else 0

    def fit(self, events: list[Event]) -> list[Event]:
        """413 for an event JetStream could never take: the NATS server counts headers in
        its `max_payload` and resets the connection (failing every publish in flight)
        for a message over it, so the limit is read from the server, less the headers."""
        max_payload = self.max_payload
        if not max_payload:
            return events
        # The headers grow with the id, and ids are at most MAX_ID_CHARS ASCII characters:
        # a batch whose largest event fits beside the longest id needs no check per event.
        if max((len(e.data) for e in events), default=0) <= max_payload - _LONGEST_ID_OVERHEAD:
            return events
        for e in events:
            limit = max_payload - wire_overhead(e.id)
            if len(e.data) > limit:
                self.counters["too_big"] += 1
                raise BadInput(
                    413,
                    f"event {e.id!r} is {len(e.data)} bytes; the NATS server's max_payload is "
                    f"{max_payload} bytes with headers, so this event may carry {limit} bytes",
                    max_payload=max_payload,
                    limit=limit,
                    id=e.id,
                )
        return events

    # ------------------------------------------------------------------ log, logic, hand off

    async def accept(self, events: list[Event]) -> None:
        """Request/response: logged (per the mode, with the logic) before this returns,
        counted, then handed to a bridge in the background. Raises what refuses them."""
        self.hand_off(await self.log_and_process(events), accepted=len(events))

    def hand_off(self, processed: list[Event], *, accepted: int) -> None:
        """`accepted` events are logged: count them, hand what goes out to a bridge."""
        self.counters["accepted"] += accepted
        self.bridge.handoff(processed)

    async def log_and_process(self, events: list[Event]) -> list[Event]:
        """Log per the mode, run the logic; returns what goes to the bridge.

        rbml: log raw, then logic. sbml: logic, then log what goes out. hml: log raw while
        the logic runs; the answer still waits for the log. none: no log at all.
        """
        if self.mode == "none":
            # No log: JetStream's ack is the only persistence, so wait for it here.
            out = self.apply_logic(events)
            result = await self.bridge.send(out)
            if result is None or result["failed"]:
                raise QueueRefused(f"{len(result['failed']) if result else len(out)} events")
            return []  # already in JetStream: nothing left to hand off
        if self.mode == "rbml":
            await self.committer.submit(events)
            return self.apply_logic(events)
        if self.mode == "sbml":
            out = self.apply_logic(events)
            await self.committer.submit(out)
            return out
        # In the batch (or refused, nothing taken) before the logic runs, so the batch's
        # delay counts down meanwhile; `ensure_future(submit(...))` would not have run
        # before the logic returned. The Ray call itself goes out from the flusher's task
        # (this loop), at the batch's turn: under load one is always in flight anyway.
        logged = self.committer.enqueue(events)
        try:
            out = self.apply_logic(events)
        finally:
            await logged
        return out

    def apply_logic(self, events: list[Event]) -> list[Event]:
        """Kept events come back processed; rejects go on raw so the bridge settles them
        (dead letter or forget) through the one path replay uses too."""
        by_stream: dict[str, list[Event]] = {}
        first = events[0].stream if events else ""
        if all(e.stream == first for e in events):  # one request: one stream
            if events:
                by_stream[first] = events
        else:
            for e in events:
                by_stream.setdefault(e.stream, []).append(e)
        out: list[Event] = []
        for stream, items in by_stream.items():
            result = self.logic[stream].apply(items)
            out.extend(result.kept)
            out.extend(e for e, _ in result.invalid)
            out.extend(result.dropped)
        return out

    def one_way(self, events: list[Event]) -> None:
        """One-way: the producer was answered (or never is); logged and handed off in the
        background. Loss window: these die with the replica before their group commit."""
        self.counters["oneway_accepted"] += len(events)

        async def log_then_send() -> None:
            try:
                self.bridge.handoff(await self.log_and_process(events))
            except Exception as err:
                self.counters["oneway_lost"] += len(events)
                log.warning("one-way events lost (%d): %r", len(events), err)

        self._spawn(log_then_send())

    async def buffered(self, stream: str, frames: list[BufferedFrame]) -> None:
        """The stream pattern's raw frames from the buffer: the frame's dedup id becomes the
        event id, so a redelivered frame is the same event. Raising (log full) leaves them
        unacked: the buffer redelivers later, which is the backpressure of this pattern."""
        subject = self.cfg.streams[stream].subjects[0]
        now = now_ms()
        events = [Event(f.msg_id, stream, subject, f.data, now) for f in frames]
        try:
            processed = await self.log_and_process(events)
        except FencedError:
            self.refresh_logger()  # the buffer redelivers once this replica writes again
            raise
        self.bridge.handoff(processed)
        self.counters["buffered"] += len(events)
        self.counters["accepted"] += len(events)

    # ------------------------------------------------------------------ refusals

    def refused(self, err: Exception) -> str:
        """Count a 503 refusal and return its reason; a fenced write also makes this
        collector adopt the log's new epoch (in the background) so the resend can succeed."""
        counter, reason = refusal(err)
        self.counters[counter] += 1
        if isinstance(err, FencedError):
            self.refresh_logger()
        return reason

    def refresh_logger(self) -> None:
        if self._refreshing is not None and not self._refreshing.done():
            return

        async def refresh() -> None:
            try:
                epoch = await self.logger.refresh()
                log.warning("message log %s moved to epoch %d", self.logger.name, epoch)
            except Exception as err:  # noqa: BLE001 - the next fenced write tries again
                log.warning("could not adopt the message log's epoch: %r", err)

        self._refreshing = self._spawn(refresh())

    # ------------------------------------------------------------------ shutdown

    async def drain(self) -> None:
        """Wait for the one-way writes and hand-offs in hand (the transports have stopped)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.bridge.drain()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
