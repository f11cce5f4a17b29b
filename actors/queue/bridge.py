"""BrokerBridge: the actor side of NATS JetStream (book ch. 2 SBML completion, ch. 3).

A thin Ray front: it takes a logged batch in one Ray call (never one per event), hands it
to its data-plane loop, and answers what JetStream said. The work is in its parts:

- `bridge_path.BridgePath`: the whole data path of a batch, logged batch -> stream logic
  (HML) -> blind-retry horizon -> publish to JetStream (atomic batches, pipelined acks)
  -> completion in the MessageLogger (forget, fail, park, dead-letter);
- `forgetter.Forgetter`: acked entries forgotten in the logger, batched, off that path;
- `replayer.Replayer`: what the happy path left in the log is published again (stale
  transient entries, failed entries whose retry is due), and the logger groups healed;
- `bridge_link.NatsLink`: the NATS connection and publisher, replaced when it stays down,
  and which stream takes a subject;
- `bridge_status`: the counters and the `stats` answer.

Bridge replicas are interchangeable: a batch lives in the logger until a bridge has it
acknowledged, so a dead replica loses nothing; only replicas started with
`replay=True` scan the logger (one is enough; more would only resend duplicates).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from actors.queue.bridge_link import NatsLink
from actors.queue.bridge_path import DEADLETTER_PREFIX, PARKED, BridgePath, dead_letter_id
from actors.queue.bridge_status import bridge_stats, new_counters
from actors.queue.logger import LoggerGroup
from actors.queue.replayer import Replayer
from runtime.config import Config, validate
from runtime.data.events import decode_batch
from runtime.inline import join_parts
from runtime.loop_thread import LoopThread
from runtime.supervision.ray_actors import SupervisedActor

__all__ = ["DEADLETTER_PREFIX", "PARKED", "BrokerBridge", "dead_letter_id"]


class BrokerBridge(SupervisedActor):
    """Ray actor: publishes logged batches to JetStream and completes them in the logger."""

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
        self.cfg: Config = validate(config)
        self.replay = replay
        # Given at construction: Ray reruns __init__ with these on restart.
        self.loggers: dict[str, LoggerGroup] = {g.name: g for g in loggers}
        self.counters = new_counters()
        self.link = NatsLink(
            self.cfg,
            nats_url,
            name=name,
            counters=self.counters,
            max_in_flight=max_in_flight,
            ack_timeout_s=ack_timeout_s,
            reconnect_deadline_s=reconnect_deadline_s,
        )
        self.path = BridgePath(
            self.cfg,
            self.link,
            self.counters,
            clock_skew_s=clock_skew_s,
            verify_max_messages=verify_max_messages,
            verify_timeout_s=verify_timeout_s,
        )
        self.replayer = Replayer(
            self.path,
            self.loggers,
            self.counters,
            name=name,
            every_s=replay_every_s,
            # Older than any healthy publish round trip: only orphans qualify.
            stale_after_s=stale_after_s or (2 * ack_timeout_s + 1.0),
            batch=replay_batch,
        )
        self._dataplane = LoopThread(f"{name}-dataplane")
        self._dataplane.start(self._serve)

    def restore(self, store: Any) -> None:
        """Nothing to restore: what a bridge had in flight is still in the logger."""

    async def _serve(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
        """Connect, make sure the streams exist, run the replayer until stopped."""
        await self.link.open(ensure=True)
        replayer = asyncio.ensure_future(self.replayer.run()) if self.replay else None
        watchdog = asyncio.ensure_future(self.link.watch())
        ready()
        try:
            await stop.wait()
        finally:
            watchdog.cancel()
            if replayer is not None:
                replayer.cancel()
            await self.path.close()  # acked keys: forgotten if quick, else resent as duplicates
            await self.link.close()

    # ------------------------------------------------------------------ Ray methods

    async def ready(self) -> list[str]:
        """The logger groups this bridge completes (it serves once constructed)."""
        return sorted(self.loggers)

    async def stats(self) -> dict[str, Any]:
        return bridge_stats(
            self.counters,
            self.link.pub,
            atomic=self.path.atomic,
            forgetters=self.path.forgetters.values(),
            loggers=self.loggers,
        )

    def shutdown(self) -> bool:
        return self._dataplane.stop()

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
        work = self.path.run(self.loggers[logger], events, detail)
        return await self._dataplane.run(work)

    async def flush_forgets(self) -> None:
        """Return once every acked entry handed over so far is forgotten (or left to the
        replayer after repeated refusals): drains and tests."""
        await self._dataplane.run(self.path.flush_forgets())

    async def replay_now(self) -> int:
        """One replay pass on demand (tests, drains); returns how many entries were resent."""
        return await self._dataplane.run(self.replayer.replay_once())

    async def replay_once(self) -> int:
        """One pass over every attached logger; returns how many entries were resent."""
        return await self.replayer.replay_once()
