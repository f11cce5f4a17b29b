"""`BridgePath`: the bridge's whole data path, from a logged batch to its completion in the log.

One module so a reader follows one batch from top to bottom here (`run`, then the methods
in the order they are called); the actor (`bridge.BrokerBridge`) only hands batches in,
and the replayer (`replayer.Replayer`) hands in what the logger still holds.

The path of one batch (decoded by the actor, or read back by the replayer):

1. raw events (HML: logged before their logic ran; and replayed ones) get their stream's
   logic (`run`): kept events go on, filtered ones are forgotten, invalid ones dead-lettered
   (`_settle_rejects`);
2. the batch is cut so no part carries one id in two streams (`_one_stream_per_id`: the
   publisher reports outcomes by id), and each part goes through the blind-retry horizon
   (`_check_horizon`, below);
3. what is to be sent is published, every event with `Nats-Msg-Id` = its id
   (`_publish_atomic`): as JetStream atomic batches where they win (`[nats] atomic_batches`,
   by default when the server fsyncs every write; a batch the stream refuses, e.g. for an
   id it already holds, goes out event by event), else event by event with many acks in
   flight (`runtime.nats.publisher.JetStreamPublisher`);
4. completion (`_complete`, book ch. 2 SBML): acked ids are handed to the group's
   `Forgetter`, which forgets them in the MessageLogger (with their stream sequences, for
   ack tokens) batched and off the publish path; failures move to the logger's failed store
   before the call returns, poison events are dead-lettered (`_dead_letter`).

The blind-retry horizon: an event is resent blind only while it is younger than half its
stream's duplicate window (`blind_retry_horizon`, measured from `received_ms`, which
precedes any publish of it). Older, an earlier copy may be stored with its id already
forgotten by the window, so the path first proves the id absent: it reads the
`Nats-Msg-Id` of every message the stream stored since `received_ms - clock_skew_s`
(`runtime.nats.publisher.find_stored`, bounded by `verify_max_messages` and
`verify_timeout_s`). Found: the entry is forgotten as published, with its sequence.
Absent: resent. Not provable because the server did not answer: stays failed and is
checked again at its next retry, never resent blind. Not provable because the range is
too big: parked (never retried automatically; `tierflow logger inspect` counts it,
`tierflow logger settle` retries or forgets it).

Poison events and dead letters: an event JetStream refuses for good (too big for the
server's max_payload, headers included; a 4xx API error) goes to
`deadletter.<stream>` with the reason in `Tf-Error`, and the rest of its batch is not
affected. A body too big for a dead-letter message is cut to fit (`Tf-Truncated` = its
real size) and the full event stays parked in the log, so nothing accepted is lost. A
dead-letter publish that fails moves the event to the failed store (retried with
backoff, so it cannot clog `pending()`); one that fails for good parks it.

Nothing here is a Ray call: the path runs on the bridge's data-plane loop, one Ray call
per batch reaches it, and it makes Ray calls only to the logger group, batched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from actors.queue.bridge_link import NatsLink
from actors.queue.forgetter import Forgetter
from actors.queue.logger import LoggerGroup, key_of
from runtime.clock import now_ms
from runtime.config import Config, atomic_batches_enabled
from runtime.data.compaction import CompactingLogic, stream_logic, target_subject
from runtime.data.events import Event
from runtime.data.logic import LogicResult, StreamLogic
from runtime.nats.publisher import (
    MSG_ID_HEADER,
    Failed,
    Outgoing,
    Published,
    ScanIncomplete,
    blind_retry_horizon,
    find_stored,
    header_bytes,
)

log = logging.getLogger(__name__)

DEADLETTER_PREFIX = "deadletter"
PARKED = "parked"  # prefix of the error of an entry parked in the log (see module doc)
UNVERIFIED = "past the blind-retry horizon, absence not proven"


class BridgePath:
    """Logged batch -> stream logic (HML) -> horizon check -> publish -> completion in the
    logger; see the module doc. `counters` is the bridge's (`bridge_status.COUNTERS`)."""

    # compacted streams (runtime/data/compaction.py): one stream lookup for all their keys
    _compacted: frozenset[str] = frozenset()

    def __init__(
        self,
        cfg: Config,
        link: NatsLink,
        counters: dict[str, int],
        *,
        clock_skew_s: float = 30.0,
        verify_max_messages: int = 200_000,  # ~8 s of headers-only reading measured here
        verify_timeout_s: float = 30.0,
    ) -> None:
        self.link = link
        self.counters = counters
        self.atomic = atomic_batches_enabled(cfg.nats.atomic_batches, cfg.nats.sync_interval)
        self.clock_skew_s = clock_skew_s
        self.verify_max_messages = verify_max_messages
        self.verify_timeout_s = verify_timeout_s
        self.logic: dict[str, StreamLogic | CompactingLogic] = {
            name: stream_logic(name, s) for name, s in cfg.streams.items()
        }
        self._compacted = frozenset(n for n, s in cfg.streams.items() if s.compact)
        self.forgetters: dict[str, Forgetter] = {}  # made on the data plane's loop

    # ------------------------------------------------------------------ 1. stream logic

    async def run(
        self, group: LoggerGroup, entries: list[Event], detail: bool = True
    ) -> dict[str, Any]:
        """Run the logic on raw entries (RBML/HML log before it), settle rejects, publish.

        Returns each id's stream sequence or error (`detail`), else only counts; see
        `BrokerBridge.publish`."""
        ready: list[Event] = [e for e in entries if e.processed]
        raw = [e for e in entries if not e.processed]
        by_stream: dict[str, list[Event]] = {}
        for e in raw:
            by_stream.setdefault(e.stream, []).append(e)
        for stream, items in by_stream.items():
            logic = self.logic.get(stream)
            if logic is None:  # stream removed from config: keep the data, route as logged
                ready.extend(items)
                continue
            result = logic.apply(items)
            ready.extend(result.kept)
            await self._settle_rejects(group, result)
        if not ready:
            return {"published": {}, "failed": {}} if detail else {"published": 0, "failed": 0}
        return await self._publish_events(ready, group, detail)

    async def _settle_rejects(self, group: LoggerGroup, result: LogicResult) -> None:
        """Filtered events are done; invalid ones go to the dead-letter subject first."""
        if result.invalid:
            reasons = {key_of(e): r for e, r in result.invalid}
            for part in _one_stream_per_id([e for e, _ in result.invalid]):
                await self._dead_letter(group, [(e, reasons[key_of(e)]) for e in part])
        if result.dropped:
            await group.forget([key_of(e) for e in result.dropped], None)
            self.counters["dropped"] += len(result.dropped)

    # ------------------------------------------------------------------ 2.-4. per part

    async def _publish_events(
        self, events: list[Event], group: LoggerGroup, detail: bool = True
    ) -> dict[str, Any]:
        """Each part: horizon check, publish, completion; the answers joined."""
        assert self.link.pub is not None
        out: dict[str, Any] = {"published": {}, "failed": {}, "deadlettered": {}}
        counts = dict.fromkeys(out, 0)
        for part in _one_stream_per_id(events):
            send, found, unproven, parked = await self._check_horizon(part)
            published, failed = await self._publish_atomic(send)
            published += found
            failed += unproven
            dead = await self._complete(group, part, published, failed, parked)
            if not detail:
                counts["published"] += len(published)
                counts["failed"] += sum(1 for f in failed + parked if f.id not in dead)
                counts["deadlettered"] += len(dead)
                continue
            out["published"].update({p.id: [p.stream, p.seq, p.duplicate] for p in published})
            out["failed"].update({f.id: f.error for f in failed + parked if f.id not in dead})
            out["deadlettered"].update(dead)
        return out if detail else counts

    # ------------------------------------------------------------------ 2. the horizon

    async def _check_horizon(
        self, events: Sequence[Event]
    ) -> tuple[list[Event], list[Published], list[Failed], list[Failed]]:
        """Split events into (resend, already stored, not proven now, parked): see the
        module doc. Fresh events cost one cached lookup per subject."""
        now = now_ms()
        send: list[Event] = []
        stale: dict[str, list[Event]] = {}
        unproven: list[Failed] = []
        targets: dict[str, tuple[str | None, float]] = {}
        for e in events:
            if e.subject not in targets:
                targets[e.subject] = await self.link.target(target_subject(e, self._compacted))
            stream, window = targets[e.subject]
            if now - e.received_ms < blind_retry_horizon(window) * 1000:
                send.append(e)
            elif stream is None:
                why = f"{UNVERIFIED}: no stream answers for {e.subject!r}"
                unproven.append(Failed(e.id, why, True))
            else:
                stale.setdefault(stream, []).append(e)
        found: list[Published] = []
        parked: list[Failed] = []
        for stream, items in stale.items():
            since = min(e.received_ms for e in items) - int(self.clock_skew_s * 1000)
            try:
                stored = await find_stored(
                    self.link.nc,
                    stream,
                    {e.id for e in items},
                    since,
                    max_messages=self.verify_max_messages,
                    timeout_s=self.verify_timeout_s,
                )
            except ScanIncomplete as err:
                self.counters["unverified"] += len(items)
                into = parked if err.too_big else unproven
                label = f"{PARKED}: {UNVERIFIED}" if err.too_big else UNVERIFIED
                into.extend(Failed(e.id, f"{label}: {err}", True) for e in items)
                continue
            self.counters["verified"] += len(items)
            for e in items:
                if e.id in stored:
                    found.append(Published(e.id, stream, stored[e.id], True))
                    self.counters["found_stored"] += 1
                else:
                    send.append(e)
        return send, found, unproven, parked

    # ------------------------------------------------------------------ 3. publish

    async def _publish_atomic(
        self, events: Sequence[Event]
    ) -> tuple[list[Published], list[Failed]]:
        """Publish each stream's share of `events` as atomic batches (the publisher falls
        back to per-event publishes where a batch is refused); events whose subject no
        stream answers for go out one by one, to be reported as the server answers.

        The shares go out concurrently: a group spanning streams waits for the slowest
        stream's commit, not for the sum of them. Each share keeps its events in input
        order (one publisher call per stream, and the publisher keeps a stream's order);
        exactly-once rests on the ids, not on which share goes first."""
        pub = self.link.pub
        assert pub is not None
        by_stream: dict[str | None, list[Outgoing]] = {}
        streams: dict[str, str | None] = {}  # subject -> stream, for this call
        subject = events[0].subject if events else ""
        if events and all(e.subject == subject for e in events):  # the usual case: one subject
            stream, _ = await self.link.target(target_subject(events[0], self._compacted))
            by_stream[stream if self.atomic else None] = [
                Outgoing(e.id, subject, e.data) for e in events
            ]
        else:
            for e in events:
                if e.subject not in streams:
                    # cached across calls too
                    stream, _ = await self.link.target(target_subject(e, self._compacted))
                    streams[e.subject] = stream if self.atomic else None  # None: event by event
                by_stream.setdefault(streams[e.subject], []).append(
                    Outgoing(e.id, e.subject, e.data)
                )

        async def share(
            stream: str | None, items: list[Outgoing]
        ) -> tuple[list[Published], list[Failed]]:
            if stream is None:  # not atomic, or no stream answers: acks per event
                return await pub.publish_batch(items)
            return await pub.publish_atomic(items, stream=stream)

        if len(by_stream) == 1:  # the usual case: no task to make
            ((stream, items),) = by_stream.items()
            return await share(stream, items)
        published: list[Published] = []
        failed: list[Failed] = []
        for ok, bad in await asyncio.gather(*(share(s, i) for s, i in by_stream.items())):
            published += ok
            failed += bad
        return published, failed

    # ------------------------------------------------------------------ 4. completion

    async def _complete(
        self,
        group: LoggerGroup,
        events: Sequence[Event],
        published: Sequence[Published],
        failed: Sequence[Failed],
        parked: Sequence[Failed] = (),
    ) -> dict[str, str]:
        """SBML completion: forget what JetStream holds, dead-letter what it refuses for
        good, move the rest to the failed store for retry (or park it); returns the
        dead-lettered ids with their reasons. The log is keyed by (stream, id); `events`
        carry each id in one stream only."""
        by_id = {e.id: e for e in events}
        duplicates = 0
        if published:  # acked: forgotten off this path, batched with other calls' acks
            keys: list[tuple[str, str]] = []
            seqs: dict[tuple[str, str], tuple[str, int]] = {}
            for p in published:  # one pass: keys, token sequences, duplicates
                e = by_id[p.id]
                key = (e.stream, e.id)  # key_of(e)
                keys.append(key)
                if e.token:  # sequences matter only to ack-token records
                    seqs[key] = (p.stream, p.seq)
                if p.duplicate:
                    duplicates += 1
            await self._forgetter(group).add(keys, seqs)
        retry = [(by_id[f.id], f.error) for f in failed if f.retryable]
        poison = [(by_id[f.id], f.error) for f in failed if not f.retryable]
        dead = await self._dead_letter(group, poison) if poison else {}
        if retry:
            await group.fail(retry, now_ms())
        if parked:
            await group.fail([(by_id[f.id], f.error) for f in parked], now_ms(), park=True)
            self.counters["parked"] += len(parked)
        self.counters["published"] += len(published) - duplicates
        self.counters["duplicates"] += duplicates
        self.counters["failed"] += len(failed)
        return dead

    async def _dead_letter(
        self, group: LoggerGroup, items: Sequence[tuple[Event, str]]
    ) -> dict[str, str]:
        """Publish each event to `deadletter.<stream>` with its reason; forget the ones
        recorded whole, park the ones whose body had to be cut (the log keeps the full
        event), move failed dead-letter publishes to the failed store (retried with
        backoff) or, when they can never succeed, park them. Past the deadletter stream's
        blind-retry horizon a record is first looked for, as for any resend. Returns
        {id: reason} of the events recorded. `items` carry each id in one stream only."""
        assert self.link.pub is not None
        max_payload = self.link.nc.max_payload
        # one deadletter stream holds every stream's records: its ids carry the stream
        by_id = {dead_letter_id(e.stream, e.id): (e, reason) for e, reason in items}
        send, found, unproven, unprovable = await self._check_horizon(
            [
                msgspec.structs.replace(e, id=dl_id, subject=f"{DEADLETTER_PREFIX}.{e.stream}")
                for dl_id, (e, _) in by_id.items()
            ]
        )
        records = {d.id: _dead_record(*by_id[d.id], d.subject, max_payload) for d in send}
        published, failed = await self.link.pub.publish_batch([r for r, _ in records.values()])
        published += found
        failed += unproven
        # a body too big for a record was cut, now or when an earlier attempt recorded it
        cut = {
            p.id
            for p in published
            if _dead_record(*by_id[p.id], f"{DEADLETTER_PREFIX}.x", max_payload)[1]
        }
        whole = [by_id[p.id][0] for p in published if p.id not in cut]
        if whole:
            await group.forget([key_of(e) for e in whole], None)
        to_park = [
            (
                by_id[p.id][0],
                f"{PARKED}: dead-lettered with its body cut to fit, the full "
                f"event is kept here: {by_id[p.id][1]}",
            )
            for p in published
            if p.id in cut
        ]
        to_park += [
            (
                by_id[f.id][0],
                f"{PARKED}: dead-letter publish refused: {f.error} (for: {by_id[f.id][1]})",
            )
            for f in failed
            if not f.retryable
        ]
        to_park += [(by_id[f.id][0], f"{f.error} (for: {by_id[f.id][1]})") for f in unprovable]
        retry = [
            (by_id[f.id][0], f"dead-letter publish failed: {f.error} (for: {by_id[f.id][1]})")
            for f in failed
            if f.retryable
        ]
        if to_park:
            await group.fail(to_park, now_ms(), park=True)
            self.counters["parked"] += len(to_park)
        if retry:  # to the failed store: retried with backoff, never clogging pending()
            log.warning("dead-letter publish failed for %d events", len(retry))
            await group.fail(retry, now_ms())
        self.counters["deadlettered"] += len(published)
        return {by_id[p.id][0].id: by_id[p.id][1] for p in published}

    # ------------------------------------------------------------------ 4. forgets

    def _forgetter(self, group: LoggerGroup) -> Forgetter:
        forgetter = self.forgetters.get(group.name)
        if forgetter is None:
            forgetter = self.forgetters[group.name] = Forgetter(group.forget)
        return forgetter

    async def flush_forgets(self) -> None:
        """Return once every acked entry handed over so far is forgotten (or left to the
        replayer after repeated refusals)."""
        for forgetter in list(self.forgetters.values()):
            await forgetter.flush()

    async def close(self) -> None:
        """Forget the acked keys still waiting if that is quick; what is left stays logged
        and is resent as duplicates by a replayer."""
        for forgetter in self.forgetters.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(forgetter.flush(), 5.0)
            forgetter.cancel()


def _one_stream_per_id(events: Sequence[Event]) -> list[list[Event]]:
    """Split a batch so no part carries one id in two streams (two distinct events: the log
    keys by (stream, id)), since the publisher reports outcomes by id. One part when ids
    are unique across streams, the usual case."""
    if events:
        first = events[0].stream
        if all(e.stream == first for e in events):  # one stream: ids cannot clash
            return [list(events)]
    parts: list[tuple[list[Event], dict[str, str]]] = []
    for e in events:
        for part, streams in parts:
            if streams.setdefault(e.id, e.stream) == e.stream:
                part.append(e)
                break
        else:
            parts.append(([e], {e.id: e.stream}))
    return [part for part, _ in parts]


def dead_letter_id(stream: str, id_: str) -> str:
    """The `Nats-Msg-Id` of a dead-letter record: the same event id may be invalid in two
    streams, and one deadletter stream deduplicates both, so the id names its stream."""
    return f"{stream}:{id_}"


def _dead_record(e: Event, reason: str, subject: str, max_payload: int) -> tuple[Outgoing, bool]:
    """The dead-letter message of `e` and whether its body had to be cut to fit the
    server's max_payload (headers included): then `Tf-Truncated` holds its real size."""
    dl_id = dead_letter_id(e.stream, e.id)
    headers = {"Tf-Error": reason[:200], "Tf-Subject": e.subject, "Tf-Id": e.id}
    room = max_payload - header_bytes(
        {**headers, "Tf-Truncated": str(len(e.data)), MSG_ID_HEADER: dl_id}
    )
    cut = len(e.data) > room
    if cut:
        headers["Tf-Truncated"] = str(len(e.data))
    data = e.data[: max(0, room)] if cut else e.data
    return Outgoing(id=dl_id, subject=subject, data=data, headers=headers), cut
