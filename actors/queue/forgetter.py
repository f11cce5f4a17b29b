"""`Forgetter`: SBML completion of acked events off the publish path (batched, asynchronous).

The bridge hands it the (stream, id) keys of events JetStream acknowledged, and the next
publish goes ahead at once instead of waiting for the logger's synced write on k+1
replicas. Guarantees:

- only keys handed to `add` are forgotten, and the bridge hands a key only after
  JetStream acknowledged its event: the logged copy stays until the queue holds one;
- keys added while a forget is in flight go together in the next one (group commit): one
  `forget` call at a time per logger group, at most `max_keys` keys each, in the order added;
- a call waits to grow (fewer, bigger calls: each costs a Ray call and a synced write on
  every replica) until `min_keys` are waiting or the oldest waiting key was added
  `linger_s` ago, whichever comes first; `flush` sends at once. Only forgets wait: the
  publish path and the acknowledgement to producers never do;
- every key added is forgotten, or, when the group refuses `attempts` times in a row, left
  in the log: the replayer resends it after `stale_after_s`, JetStream acknowledges the
  resend as a duplicate (same `Nats-Msg-Id`) and it is forgotten then. Nothing is lost and
  nothing is stored twice either way, only forgotten later;
- at most `max_pending` keys wait in memory: `add` waits for room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from itertools import islice, repeat
from typing import Any

from actors.queue.logger import LogKey

log = logging.getLogger(__name__)

Seq = tuple[str, int]
ForgetCall = Callable[[list[LogKey], dict[LogKey, Seq]], Awaitable[Any]]


class Forgetter:
    """Coalesces and sends the forgets of one logger group; see the module doc."""

    def __init__(
        self,
        forget: ForgetCall,
        *,
        max_keys: int = 20_000,
        max_pending: int = 200_000,
        min_keys: int = 4000,
        linger_s: float = 0.05,
        attempts: int = 4,
        backoff_s: float = 0.2,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if max_keys < 1 or max_pending < max_keys or attempts < 1 or linger_s < 0:
            raise ValueError(
                "need max_keys >= 1, max_pending >= max_keys, attempts >= 1, linger_s >= 0"
            )
        self._forget = forget
        self.max_keys, self.max_pending = max_keys, max_pending
        self.min_keys, self.linger_s = min(max(1, min_keys), max_keys), linger_s
        self.attempts, self.backoff_s = attempts, backoff_s
        self._sleep = sleep
        self._pending: dict[LogKey, Seq | None] = {}
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._room = asyncio.Event()
        self._room.set()
        self._enough = asyncio.Event()  # min_keys waiting, or a flush: stop lingering
        self._since = 0.0  # loop time the oldest waiting key was added
        self._flushing = 0
        self._sending = 0
        self.forgotten = 0  # keys sent in a forget the group took
        self.calls = 0
        self.errors = 0  # refused forget calls (each retried)
        self.left = 0  # keys left to the replayer after `attempts` refusals

    @property
    def pending(self) -> int:
        """Keys added and not yet taken by the group (in flight included)."""
        return len(self._pending) + self._sending

    async def add(self, keys: Sequence[LogKey], seqs: Mapping[LogKey, Seq] | None = None) -> None:
        """Queue acked keys (with their JetStream (stream, seq) for token records)."""
        if not keys:
            return
        while len(self._pending) >= self.max_pending:  # bounded: the sender drains it
            self._room.clear()
            await self._room.wait()
        if not self._pending:
            self._since = asyncio.get_running_loop().time()
        if seqs:
            for key in keys:
                self._pending[tuple(key)] = seqs.get(key)  # type: ignore[assignment]
        else:  # the usual case (no ack tokens): no lookup a key
            self._pending.update(zip(map(tuple, keys), repeat(None)))  # type: ignore[arg-type]
        if len(self._pending) >= self.min_keys:
            self._enough.set()
        self._idle.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def flush(self) -> None:
        """Return once every key added so far was sent (or left to the replayer); what
        waits is sent at once, without lingering."""
        self._flushing += 1
        self._enough.set()
        try:
            await self._idle.wait()
        finally:
            self._flushing -= 1

    def cancel(self) -> None:
        """Stop sending (shutdown): what is still queued stays in the log for the replayer."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        try:
            while self._pending:  # bounded: each pass takes up to max_keys keys out
                await self._linger()
                if len(self._pending) <= self.max_keys:  # all of it: no pop a key
                    taken, self._pending = self._pending, {}
                    take = list(taken)
                else:
                    take = list(islice(self._pending, self.max_keys))
                    taken = {k: self._pending.pop(k) for k in take}
                self._room.set()
                self._sending = len(take)
                try:
                    await self._send(take, {k: s for k, s in taken.items() if s is not None})
                finally:
                    self._sending = 0
        finally:
            if not self._pending:
                self._idle.set()

    async def _linger(self) -> None:
        """Wait (bounded by `linger_s` from the oldest key's add) for `min_keys` keys."""
        if self._flushing or len(self._pending) >= self.min_keys:
            return
        wait = self._since + self.linger_s - asyncio.get_running_loop().time()
        if wait <= 0:
            return
        self._enough.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._enough.wait(), wait)

    async def _send(self, keys: list[LogKey], seqs: dict[LogKey, Seq]) -> None:
        for attempt in range(self.attempts):
            try:
                self.calls += 1
                await self._forget(keys, seqs)
                self.forgotten += len(keys)
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - retried, then left to the replayer
                self.errors += 1
                log.warning(
                    "forget of %d acked keys failed (attempt %d): %r", len(keys), attempt + 1, err
                )
                if attempt + 1 < self.attempts:
                    await self._sleep(self.backoff_s * 2**attempt)
        self.left += len(keys)
        log.warning("%d acked keys stay logged; the replayer resends them as duplicates", len(keys))
