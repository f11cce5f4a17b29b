"""BrokerBridge: the actor side of NATS JetStream (book ch. 2 SBML completion, ch. 3).

The data path of one batch: decode -> publish each stream's events, every event with
`Nats-Msg-Id` = its id: as JetStream atomic batches where they win (`[nats] atomic_batches`,
by default when the server fsyncs every write; a batch the stream refuses, e.g. for an id
it already holds, goes out event by event), else event by event with many acks in flight
-> acked ids are handed to the group's `Forgetter`, which forgets them in the MessageLogger
(with their stream sequences, for ack tokens) batched and off the publish path -> failures
move to the logger's failed store before the call returns.

The replayer closes every gap the happy path leaves: entries still in the logger's
transient store after `stale_after_s` (a collector or bridge died with them in flight, or
the logger restarted) and failed entries whose retry time has come are published again
under the same ids. JetStream's duplicate window turns those resends into exactly-once,
so a bridge never needs to know whether an earlier attempt landed, as long as the resend
falls inside the window.

The blind-retry horizon: an event is resent blind only while it is younger than half its
stream's duplicate window (`blind_retry_horizon`, measured from `received_ms`, which
precedes any publish of it). Older, an earlier copy may be stored with its id
already forgotten by the window, so the bridge first proves the id absent: it reads the
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

Bridge replicas are interchangeable: a batch lives in the logger until a bridge has it
acknowledged, so a dead replica loses nothing; only replicas started with
`replay=True` scan the logger (one is enough; more would only resend duplicates).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from actors.queue.forgetter import Forgetter
from actors.queue.logger import LoggerGroup, key_of
from runtime.clock import now_ms
from runtime.config import Config, atomic_batches_enabled, validate
from runtime.data.compaction import CompactingLogic, stream_logic, target_subject
from runtime.data.events import Event, decode_batch
from runtime.data.logic import LogicResult, StreamLogic
from runtime.engines.services import connect_nats, ensure_streams
from runtime.inline import join_parts
from runtime.loop_thread import LoopThread
from runtime.nats.publisher import (
    MSG_ID_HEADER,
    Failed,
    JetStreamPublisher,
    Outgoing,
    Published,
    ScanIncomplete,
    blind_retry_horizon,
    find_stored,
    header_bytes,
)
from runtime.supervision.ray_actors import SupervisedActor

log = logging.getLogger(__name__)

DEADLETTER_PREFIX = "deadletter"
PARKED = "parked"  # prefix of the error of an entry parked in the log (see module doc)
UNVERIFIED = "past the blind-retry horizon, absence not proven"
_STREAM_CACHE_S = 30.0


class BrokerBridge(SupervisedActor):
    """Ray actor: publishes logged batches to JetStream and completes them in the logger."""

    # compacted streams (runtime/data/compaction.py): one stream lookup for all their keys
    _compacted: frozenset[str] = frozenset()

    def __init__(
        self,
        state_dir: str,
        *,
        name: str,
        config: dict[str, Any],
        nats_url: str,
        loggers: Sequence[LoggerGroup] = (),
        replay: bool = True,
        max_in_flight: int = 4096,
        ack_timeout_s: float = 5.0,
        replay_every_s: float = 0.5,
        stale_after_s: float | None = None,
        replay_batch: int = 4096,
        reconnect_deadline_s: float = 20.0,
        clock_skew_s: float = 30.0,
        verify_max_messages: int = 200_000,  # ~8 s of headers-only reading measured here
        verify_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(state_dir, name=name)
        self.reconnect_deadline_s = reconnect_deadline_s
        self.cfg: Config = validate(config)
        self.atomic = atomic_batches_enabled(
            self.cfg.nats.atomic_batches, self.cfg.nats.sync_interval
        )
        self.nats_url = nats_url
        self.replay = replay
        self.max_in_flight = max_in_flight
        self.ack_timeout_s = ack_timeout_s
        self.replay_every_s = replay_every_s
        # Older than any healthy publish round trip: only orphans qualify.
        self.stale_after_s = stale_after_s or (2 * ack_timeout_s + 1.0)
        self.replay_batch = replay_batch
        self.clock_skew_s = clock_skew_s
        self.verify_max_messages = verify_max_messages
        self.verify_timeout_s = verify_timeout_s
        # subject -> (JetStream stream or None, its duplicate window s, when looked up)
        self._targets: dict[str, tuple[str | None, float, float]] = {}
        windows = [s.duplicate_window_s for s in self.cfg.streams.values()]
        self._fallback_window_s = min(windows, default=120.0)
        # Given at construction: Ray reruns __init__ with these on restart.
        self.loggers: dict[str, LoggerGroup] = {g.name: g for g in loggers}
        self._forgetters: dict[str, Forgetter] = {}  # made on the data plane's loop
        self.logic: dict[str, StreamLogic | CompactingLogic] = {
            name: stream_logic(name, s) for name, s in self.cfg.streams.items()
        }
        self._compacted = frozenset(n for n, s in self.cfg.streams.items() if s.compact)
        self.counters = {
            "batches": 0,
            "published": 0,
            "duplicates": 0,
            "failed": 0,
            "replayed": 0,
            "deadlettered": 0,
            "dropped": 0,
            "reconnects": 0,
            "verified": 0,
            "found_stored": 0,
            "unverified": 0,
            "parked": 0,
            "replay_errors": 0,
        }
        self._pub: JetStreamPublisher | None = None
        self._nc: Any = None
        self._dataplane = LoopThread(f"{name}-dataplane")
        self._dataplane.start(self._serve)

    def restore(self, store: Any) -> None:
        """Nothing to restore: what a bridge had in flight is still in the logger."""

    # ------------------------------------------------------------------ lifecycle

    async def _serve(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
        """Connect, make sure the streams exist, run the replayer until stopped."""
        self._nc, self._pub = await self._open(ensure=True)
        replayer = asyncio.ensure_future(self._replay_loop()) if self.replay else None
        watchdog = asyncio.ensure_future(self._watch_connection())
        ready()
        try:
            await stop.wait()
        finally:
            watchdog.cancel()
            if replayer is not None:
                replayer.cancel()
            for forgetter in self._forgetters.values():  # acked keys: forget them if quick
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(forgetter.flush(), 5.0)
                forgetter.cancel()  # what is left stays logged: resent as duplicates
            await self._pub.close()
            await self._nc.close()

    async def _watch_connection(self) -> None:
        """Replace a NATS connection that stays down past `reconnect_deadline_s`.

        Seen under the chaos proxy's connection resets: nats-py's client stopped trying to
        reconnect and sat "not connected" for good, while the log filled with entries it
        could not publish (nothing lost, nothing moving). A fresh client is the cure; a
        server that is really down only costs a failed attempt per deadline until it is
        back. Publishes in flight on the old client fail and the replayer resends them.
        """
        loop = asyncio.get_running_loop()
        down_since: float | None = None
        while True:  # bounded by cancellation when the bridge stops
            await asyncio.sleep(1.0)
            if self._nc.is_connected:
                down_since = None
                continue
            down_since = down_since if down_since is not None else loop.time()
            if loop.time() - down_since < self.reconnect_deadline_s:
                continue
            log.error(
                "%s: NATS not connected for %.0f s; replacing the client",
                self.name,
                loop.time() - down_since,
            )
            self.counters["reconnects"] += 1
            try:
                await self._replace_connection()
                down_since = None
            except Exception as err:  # still unreachable: try again after another deadline
                log.warning("%s: new NATS connection failed: %r", self.name, err)
                down_since = loop.time()

    async def _open(self, *, ensure: bool = False) -> tuple[Any, JetStreamPublisher]:
        """A NATS connection as the bridge role and a started publisher on it (first
        making sure the configured streams exist, when `ensure`)."""
        nc = await connect_nats(self.cfg, self.nats_url, name=f"bridge-{self.name}", role="bridge")
        if ensure:
            await ensure_streams(nc, self.cfg)
        pub = JetStreamPublisher(nc, self.max_in_flight, self.ack_timeout_s)
        await pub.start()
        return nc, pub

    async def _replace_connection(self) -> None:
        nc, pub = await self._open()
        old_nc, old_pub = self._nc, self._pub
        self._nc, self._pub = nc, pub
        for closing in (old_pub.close(), old_nc.close()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(closing, 5.0)

    async def ready(self) -> list[str]:
        """The logger groups this bridge completes (it serves once constructed)."""
        return sorted(self.loggers)

    async def stats(self) -> dict[str, Any]:
        pub = self._pub
        return {
            **self.counters,
            "in_flight": pub.in_flight if pub else 0,
            "ack_p50_ms": _ms(pub.latency.quantile(0.5)) if pub else None,
            "ack_p99_ms": _ms(pub.latency.quantile(0.99)) if pub else None,
            "atomic_batches": self.atomic,
            "forgets_pending": sum(f.pending for f in self._forgetters.values()),
            "forget_calls": sum(f.calls for f in self._forgetters.values()),
            "forget_errors": sum(f.errors for f in self._forgetters.values()),
            "forgets_left": sum(f.left for f in self._forgetters.values()),
            "loggers": sorted(self.loggers),
        }

    def shutdown(self) -> bool:
        return self._dataplane.stop()

    # ------------------------------------------------------------------ the data path

    async def publish(
        self, batch: bytes, logger: str, detail: bool = True, *more: bytes
    ) -> dict[str, Any]:
        """Publish one logged batch; answer each id's stream sequence or error.

        One Ray call per batch (never per event). Events the collector already processed
        go out as they are; raw ones (and replayed ones) run the stream's logic here first.
        Returns once JetStream answered for every event, so a caller that answers
        `?wait=queued` after it tells the truth; failures are in the failed store by then,
        acked entries are forgotten shortly after (`Forgetter`, `flush_forgets`).

        `detail=False` (a background hand-off, which reads no answer): the same work, and
        the answer holds only counts (`{"published": n, "failed": n, "deadlettered": n}`),
        so no dict of every id is built and sent back through Ray.

        `more`: the rest of the batch when the caller cut it into parts Ray sends inline
        (`runtime.inline.inline_parts`), joined here in order.
        """
        self.counters["batches"] += 1
        events = decode_batch(join_parts(batch, more))
        work = self._process_and_publish(self.loggers[logger], events, detail)
        return await self._dataplane.run(work)

    async def _publish_events(
        self, events: list[Event], group: LoggerGroup, detail: bool = True
    ) -> dict[str, Any]:
        assert self._pub is not None
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
        pub = self._pub
        assert pub is not None
        by_stream: dict[str | None, list[Outgoing]] = {}
        streams: dict[str, str | None] = {}  # subject -> stream, for this call
        subject = events[0].subject if events else ""
        if events and all(e.subject == subject for e in events):  # the usual case: one subject
            stream, _ = await self._target(target_subject(events[0], self._compacted))
            by_stream[stream if self.atomic else None] = [
                Outgoing(e.id, subject, e.data) for e in events
            ]
        else:
            for e in events:
                if e.subject not in streams:
                    # cached across calls too
                    stream, _ = await self._target(target_subject(e, self._compacted))
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

    async def _target(self, subject: str) -> tuple[str | None, float]:
        """(JetStream stream capturing `subject`, its duplicate window in s), cached for a
        while; (None, the smallest configured window) when the server cannot say."""
        loop = asyncio.get_running_loop()
        hit = self._targets.get(subject)
        if hit is not None and loop.time() - hit[2] < _STREAM_CACHE_S:
            return hit[0], hit[1]
        if not self._nc.is_connected:  # nothing to ask; the publish fails at once anyway
            return None, self._fallback_window_s
        try:
            js = self._nc.jetstream()
            stream = await asyncio.wait_for(js.find_stream_name_by_subject(subject), 5.0)
            info = await asyncio.wait_for(js.stream_info(stream), 5.0)
            window = float(info.config.duplicate_window or 120.0)
        except Exception as err:  # noqa: BLE001 - unknown target: the caller decides
            log.debug("%s: no stream for %r: %r", self.name, subject, err)
            return None, self._fallback_window_s
        self._targets[subject] = (stream, window, loop.time())
        return stream, window

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
                targets[e.subject] = await self._target(target_subject(e, self._compacted))
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
                    self._nc,
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
        assert self._pub is not None
        max_payload = self._nc.max_payload
        # one deadletter stream holds every stream's records: its ids carry the stream
        by_id = {dead_letter_id(e.stream, e.id): (e, reason) for e, reason in items}
        send, found, unproven, unprovable = await self._check_horizon(
            [
                msgspec.structs.replace(e, id=dl_id, subject=f"{DEADLETTER_PREFIX}.{e.stream}")
                for dl_id, (e, _) in by_id.items()
            ]
        )
        records = {d.id: _dead_record(*by_id[d.id], d.subject, max_payload) for d in send}
        published, failed = await self._pub.publish_batch([r for r, _ in records.values()])
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

    def _forgetter(self, group: LoggerGroup) -> Forgetter:
        forgetter = self._forgetters.get(group.name)
        if forgetter is None:
            forgetter = self._forgetters[group.name] = Forgetter(group.forget)
        return forgetter

    async def flush_forgets(self) -> None:
        """Return once every acked entry handed over so far is forgotten (or left to the
        replayer after repeated refusals): drains and tests."""

        async def flush() -> None:
            for forgetter in list(self._forgetters.values()):
                await forgetter.flush()

        await self._dataplane.run(flush())

    # ------------------------------------------------------------------ replay

    async def replay_now(self) -> int:
        """One replay pass on demand (tests, drains); returns how many entries were resent."""
        return await self._dataplane.run(self.replay_once())

    async def replay_once(self) -> int:
        """One pass over every attached logger; returns how many entries were resent."""
        total = 0
        now = now_ms()
        for group in list(self.loggers.values()):
            try:  # one group that cannot be read or completed must not stop the others
                stale = int(self.stale_after_s * 1000)
                entries = await group.pending(stale, now, self.replay_batch)
                entries += await group.due_failed(now, self.replay_batch)
                if entries:
                    await self._process_and_publish(group, entries)
                    total += len(entries)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - logged and counted, the pass goes on
                self.counters["replay_errors"] += 1
                log.warning("%s: replay of logger group %s failed: %r", self.name, group.name, err)
        self.counters["replayed"] += total
        return total

    async def _process_and_publish(
        self, group: LoggerGroup, entries: list[Event], detail: bool = True
    ) -> dict[str, Any]:
        """Run the logic on raw entries (RBML/HML log before it), settle rejects, publish."""
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

    async def _replay_loop(self) -> None:
        passes = 0
        while True:
            try:
                if passes % 5 == 0:  # a replica back on an empty disk rejoins within seconds
                    for group in list(self.loggers.values()):
                        await group.heal()
                passes += 1
                await self.replay_once()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a logger restarting must not kill the loop
                log.warning("replay pass failed: %r", err)
            await asyncio.sleep(self.replay_every_s)


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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
