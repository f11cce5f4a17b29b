"""`Replayer`: the bridge's passes over the logger, closing every gap the happy path leaves.

The happy path (`bridge_path.BridgePath` fed by the collector's hand-off) completes what it
publishes; what it cannot is still in the log, and a replay pass publishes it again under
the same ids through the same path: entries still in the logger's transient store after
`stale_after_s` (a collector or bridge died with them in flight, the logger restarted, a
hand-off was dropped, or what the log held when this bridge started) and failed entries
whose retry time has come. JetStream's duplicate window turns those resends into
exactly-once, so a bridge never needs to know whether an earlier attempt landed, as long as
the resend falls inside the window (past it, the path proves absence first).

The loop also heals the logger groups every fifth pass (`LoggerGroup.heal`: a replica back
on an empty disk is caught up and rejoins within seconds), because it is the one periodic
task a bridge runs against its groups and a heal is cheap when all is well.

Its own part because it is the bridge's only work that no caller asks for. Bridge replicas
are interchangeable: only those started with `replay=True` run the loop (one is enough;
more would only resend duplicates); `replay_once` also runs on demand (drains, tests).
"""

from __future__ import annotations

import asyncio
import logging

from actors.queue.bridge_path import BridgePath
from actors.queue.logger import LoggerGroup
from runtime.clock import now_ms

log = logging.getLogger(__name__)

HEAL_EVERY = 5  # passes


class Replayer:
    """Replay passes over `loggers` through `path`; see the module doc. `counters` is the
    bridge's (`bridge_status.COUNTERS`): `replayed`, `replay_errors`."""

    def __init__(
        self,
        path: BridgePath,
        loggers: dict[str, LoggerGroup],
        counters: dict[str, int],
        *,
        name: str,
        every_s: float = 0.5,
        stale_after_s: float = 11.0,
        batch: int = 4096,
    ) -> None:
        self.path = path
        self.loggers = loggers
        self.counters = counters
        self.name = name
        self.every_s = every_s
        self.stale_after_s = stale_after_s
        self.batch = batch

    async def replay_once(self) -> int:
        """One pass over every attached logger; returns how many entries were resent."""
        total = 0
        now = now_ms()
        for group in list(self.loggers.values()):
            try:  # one group that cannot be read or completed must not stop the others
                stale = int(self.stale_after_s * 1000)
                entries = await group.pending(stale, now, self.batch)
                entries += await group.due_failed(now, self.batch)
                if entries:
                    await self.path.run(group, entries)
                    total += len(entries)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - logged and counted, the pass goes on
                self.counters["replay_errors"] += 1
                log.warning("%s: replay of logger group %s failed: %r", self.name, group.name, err)
        self.counters["replayed"] += total
        return total

    async def run(self) -> None:
        """Heal and replay until cancelled (the bridge stops)."""
        passes = 0
        while True:
            try:
                if passes % HEAL_EVERY == 0:  # a replica back on an empty disk rejoins soon
                    for group in list(self.loggers.values()):
                        await group.heal()
                passes += 1
                await self.replay_once()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a logger restarting must not kill the loop
                log.warning("replay pass failed: %r", err)
            await asyncio.sleep(self.every_s)
