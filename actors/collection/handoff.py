"""The Collector's side of the BrokerBridge: logged batches go out in few, big Ray calls.

Its own module because two callers share one budget of Ray calls (`max_bridge_calls`) and
the rules that keep it to one call per batch, never one per event:

- a producer waiting for JetStream's ack (`?wait=queued`, and every answer when
  `logging.mode = "none"`) calls at once with its batch (`send`);
- everything else is handed off in the background (`handoff`): at most
  `max_handoff_calls` senders, each joining every batch waiting into one call (group
  commit of hand-offs, `take_batches`), and past `max_handoff_events` held in memory a
  batch is left to the log, whose bridge replayer publishes it once it is stale.

A failed call loses nothing: the events are in the MessageLogger (RBML/SBML/HML), and the
bridge's replayer publishes what no call did.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine, Sequence
from typing import Any

import ray

from actors.collection.group_commit import take_batches
from runtime.data.events import Event, encode_batch
from runtime.inline import inline_parts

log = logging.getLogger(__name__)

__all__ = ["BridgeHandoff"]


class BridgeHandoff:
    """Calls to the collector's bridges (round robin), at most `max_bridge_calls` at once.

    `counters` is the collector's: `handoffs` (calls made), `bridge_errors` (calls that
    failed) and `handoffs_deferred` (events left to the log's replayer).
    """

    def __init__(
        self,
        bridges: Sequence[str],
        *,
        namespace: str,
        logger_name: str,
        counters: dict[str, int],
        max_bridge_calls: int = 4,
        max_handoff_calls: int = 2,
        max_call_events: int = 4000,
        max_handoff_events: int = 50_000,
    ) -> None:
        self.bridge_names = list(bridges)
        self.namespace = namespace
        self.logger_name = logger_name
        self.counters = counters
        # Python >= 3.10: bound to the loop that first waits on it (the data plane's)
        self._slots = asyncio.Semaphore(max_bridge_calls)
        # of those, background hand-offs: fewer calls at once make each one bigger (the
        # bridge publishes a call's events as atomic batches, cheaper per event when big)
        self.max_handoff_calls = max(1, min(max_handoff_calls, max_bridge_calls))
        # hand-offs waiting for a bridge call go together, up to this many events a call
        self.max_call_events = max_call_events
        self.max_handoff_events = max_handoff_events
        self._waiting: deque[list[Event]] = deque()
        self.waiting_events = 0  # in `_waiting` or in a hand-off call
        self.senders = 0
        self._rr = 0
        self.tasks: set[asyncio.Task[Any]] = set()

    async def send(self, events: list[Event]) -> dict[str, Any] | None:
        """One Ray call for the batch, answered per id (sequences, failures); None if no
        bridge answered (the log, if any, still holds the events)."""
        async with self._slots:
            return await self.call(events)

    async def call(self, events: list[Event], *, detail: bool = True) -> dict[str, Any] | None:
        """The Ray call itself; the caller holds a slot. `detail=False`: the answer is
        counts only (a hand-off reads none of it)."""
        try:
            self.counters["handoffs"] += 1
            # parts Ray sends inline in the call, not through the object store
            first, *more = inline_parts(encode_batch(events))
            return await self._bridge().publish.remote(first, self.logger_name, detail, *more)
        except Exception as err:
            self.counters["bridge_errors"] += 1
            log.warning("bridge call failed; the replayer will publish: %r", err)
            return None

    def handoff(self, events: list[Event]) -> None:
        """Hand a logged batch to a bridge in the background. Past `max_handoff_events`
        in memory the batch is left to the log: the bridge's replayer publishes it once
        it is stale, so memory stays bounded while nothing is lost.

        Group commit: up to `max_handoff_calls` senders; each, once it holds a bridge slot,
        takes every batch waiting (oldest first, up to `max_call_events`) into one call, so
        a backlog makes calls bigger rather than longer queues of small ones."""
        if not events:
            return
        if self.waiting_events + len(events) > self.max_handoff_events:
            self.counters["handoffs_deferred"] += len(events)
            return
        self.waiting_events += len(events)
        self._waiting.append(events)
        if self.senders < self.max_handoff_calls:
            self.senders += 1
            self._spawn(self._send_waiting())

    async def drain(self) -> None:
        """Wait for the hand-offs in hand (a failed one is already counted and logged)."""
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def _bridge(self) -> Any:
        self._rr = (self._rr + 1) % len(self.bridge_names)
        return ray.get_actor(self.bridge_names[self._rr], namespace=self.namespace)

    async def _send_waiting(self) -> None:
        try:
            while self._waiting:  # bounded: each pass takes at least one batch out
                async with self._slots:
                    events = take_batches(self._waiting, self.max_call_events)
                    if not events:  # another sender took them meanwhile
                        break
                    try:
                        await self.call(events, detail=False)
                    finally:
                        self.waiting_events -= len(events)
        finally:
            self.senders -= 1

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
