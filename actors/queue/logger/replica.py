"""`LoggerReplica`: the Ray actor of one replica of a logger group.

Every mutating call carries the writer's epoch and is fenced (`runtime.state.replication`); the
fence is persisted in the store's `meta`, handed to the `LogWriter` ahead of the write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pykka

from actors.queue.logger.errors import LogUnavailable
from actors.queue.logger.records import (
    CATCHING_UP_KEY,
    FENCE_KEY,
    PARKED_MS,
    LogKey,
    _log_key,
    decode_forget,
)
from actors.queue.logger.writer import WakingFuture, WriterClient, WriterOp, _Crash
from runtime.data.events import decode_batch, encode_batch
from runtime.inline import join_parts
from runtime.state.replication import Fence, ReplicaMixin
from runtime.supervision.policy import backoff_delay
from runtime.supervision.ray_actors import SupervisedActor

log = logging.getLogger(__name__)


def _park_delay(attempts: int) -> int:
    """The retry delay of a parked entry: never due (see `PARKED_MS`)."""
    return PARKED_MS


def _wait_all(futures: Sequence[pykka.Future[Any]], timeout: float) -> list[Any]:
    return [f.get(timeout=timeout) for f in futures]


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def _answers(futures: Sequence[pykka.Future[Any]], timeout: float) -> list[Any]:
    """The writer's answers to `futures`, awaited on this loop: the writer's thread wakes it
    when the last is set (it answers in order, so the others are set by then), with no
    executor thread blocked in `get` meanwhile. Raises what `get` raises; pykka.Timeout
    after `timeout`."""
    loop = asyncio.get_running_loop()
    last = futures[-1]
    if not isinstance(last, WakingFuture):
        return await loop.run_in_executor(None, _wait_all, futures, timeout)
    done: asyncio.Future[None] = loop.create_future()

    def wake() -> None:  # on the writer's thread
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_resolve, done)

    last.when_set(wake)
    try:
        await asyncio.wait_for(done, timeout)
    except TimeoutError:
        raise pykka.Timeout(f"{timeout} seconds") from None
    return [f.get(timeout=timeout) for f in futures]


class LoggerReplica(SupervisedActor, ReplicaMixin):
    """One replica of a logger group (wrap with `ray.remote`;
    `cluster.deploy.logger.start_logger_group` does).

    The store lives in `state_dir/logger/<actor name>`; `__init__` (rerun by Ray after a
    crash) reopens it. A replica whose directory is new while it has peers (`replicas > 1`)
    is `catching_up`: it takes writes but refuses reads and exports until the group copied
    a peer into it (`LoggerGroup.catch_up`); the flag is persisted, so a restart in the
    middle of a copy stays catching up.

    Fencing: each mutating call carries the writer's epoch; an older one than the replica
    accepted raises FencedError. The fence check and the hand-off to the writer happen with
    no await in between, and the writer runs its mailbox in order, so once `set_epoch`
    returned no write with an older epoch can still land.
    """

    def __init__(
        self,
        state_dir: str,
        group: str,
        *,
        max_events: int,
        max_bytes: int,
        replicas: int = 1,
        max_done_tokens: int = 100_000,
        retry_base_ms: int = 500,
        retry_cap_ms: int = 30_000,
        op_timeout_s: float = 30.0,
        restart_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(state_dir)
        self.group = group
        self.retry_base_ms = retry_base_ms
        self.retry_cap_ms = retry_cap_ms
        self._op_timeout_s = op_timeout_s
        self._restart_timeout_s = restart_timeout_s
        self.path = pathlib.Path(state_dir) / "logger" / self.name
        self._started = False
        self._writer = WriterClient(
            self.path,
            {
                "max_events": max_events,
                "max_bytes": max_bytes,
                "max_done_tokens": max_done_tokens,
            },
            label=self.name,
            on_escalate=self._writer_gave_up,
        )
        raw = self._writer.call("get_meta", FENCE_KEY)
        self._loaded_fence = Fence.from_bytes(raw) if raw is not None else None
        flag = self._writer.call("get_meta", CATCHING_UP_KEY)
        if flag is None:
            # first start on this directory (the flag is written before any call can be
            # accepted): an empty store with peers must be copied from one before it counts
            counts = self._writer.call("counts")
            empty = not (counts["transient"] or counts["failed"] or counts["tokens"])
            self.catching_up = empty and replicas > 1
            self._writer.call("put_meta", {CATCHING_UP_KEY: b"1" if self.catching_up else b"0"})
        else:
            self.catching_up = flag == b"1"
        self._fence_dirty = False
        self._replicas = replicas
        self._copy = ""  # the catch-up under way (`begin_catch_up`)
        self._started = True

    def _writer_gave_up(self, reason: str) -> None:
        """The writer's supervisor gave up (crash loop). Once started, end the process so
        Ray restarts the whole replica and a fresh `__init__` reopens the store (on a timer,
        never inside a Ray call). During `__init__` the error is raised instead: a store
        that cannot even open (corrupt, unreadable) fails the actor's creation, which names
        the path and the repair command, rather than a restart loop."""
        log.error("logger replica %s: log writer gave up: %s", self.name, reason)
        if self._started:
            threading.Timer(0.05, os._exit, (1,)).start()

    # -- ReplicaMixin hooks: the fence lives in the store's meta ----------------------

    def _load_fence(self) -> Fence | None:
        return self._loaded_fence

    def _save_fence(self, fence: Fence) -> None:
        self._fence_dirty = True  # written by the next hand-off, ahead of the write

    async def set_epoch(
        self, epoch: int, primary_index: int, in_sync: Sequence[int] | None = None
    ) -> int:
        """Accept a promotion (or a new in-sync set), durably, after every write admitted
        before it."""
        self.fence.advance(epoch, primary_index, in_sync)
        self._fence_dirty = True
        await self._op(None)
        return self.fence.epoch

    # -- the writer --------------------------------------------------------------------

    def _retry_delay_ms(self, attempts: int) -> int:
        return int(
            backoff_delay(
                max(0, attempts - 1),
                base=self.retry_base_ms,
                factor=2.0,
                cap=self.retry_cap_ms,
                jitter=0.0,
                rand=0.0,
            )
        )

    def _submit(self, ref: pykka.ActorRef[Any], method: str | None, args: tuple[Any, ...]) -> Any:
        """Hand the fence (if changed; always when `method` is None) and the call to the
        writer, in this order, with no await in between."""
        futures = []
        sent_fence = False
        try:
            if self._fence_dirty or method is None:
                futures.append(
                    ref.ask(
                        WriterOp("put_meta", ({FENCE_KEY: self.fence.to_bytes()},)), block=False
                    )
                )
                self._fence_dirty = False
                sent_fence = True
            if method is not None:
                futures.append(ref.ask(WriterOp(method, args), block=False))
        except BaseException:
            self._fence_dirty = self._fence_dirty or sent_fence
            raise
        return futures, sent_fence

    async def _op(self, method: str | None, *args: Any, epoch: int | None = None) -> Any:
        """Run a store call on the writer; fenced when `epoch` is given."""
        loop = asyncio.get_running_loop()
        for _ in range(5):
            ref = self._writer.cached()
            if ref is None:
                ref = await loop.run_in_executor(
                    None, self._writer.current, self._restart_timeout_s
                )
            try:
                if epoch is None:
                    futures, sent_fence = self._submit(ref, method, args)
                else:
                    futures, sent_fence = self.fenced_write(
                        epoch, lambda r=ref: self._submit(r, method, args)
                    )
            except pykka.ActorDeadError:
                continue  # dead before it took anything: retry (and re-check the fence)
            if not futures:
                return None
            try:
                results = await _answers(futures, self._op_timeout_s)
            except pykka.ActorDeadError:
                self._fence_dirty = self._fence_dirty or sent_fence
                continue
            except pykka.Timeout:
                self._fence_dirty = self._fence_dirty or sent_fence
                raise LogUnavailable(
                    self.name, f"log writer did not answer within {self._op_timeout_s}s"
                ) from None
            except BaseException:
                self._fence_dirty = self._fence_dirty or sent_fence
                raise
            return results[-1]
        raise LogUnavailable(self.name, "log writer kept dying")

    def _readable(self) -> None:
        if self.catching_up:
            raise LogUnavailable(self.name, "catching up from a peer")

    # -- writes (fenced) -----------------------------------------------------------------

    async def append(self, epoch: int, batch: bytes, *more: bytes) -> int:
        """Log an encoded batch; returns how many events were new here. The store decodes
        it on the writer's thread and keeps each event in the bytes it came in. `more`:
        the rest of the batch when the caller cut it into parts Ray sends inline
        (`runtime.inline.inline_parts`), joined here in order."""
        return await self._op("append", join_parts(batch, more), epoch=epoch)

    async def forget(
        self,
        epoch: int,
        keys: Sequence[LogKey] | bytes,
        seqs: Mapping[LogKey, tuple[str, int] | None] | None = None,
    ) -> int:
        """Drop (stream, id) keys (acked); returns how many this replica held. `keys` may be
        `encode_forget`'s blob (keys and sequences in one, as `LoggerGroup.forget` sends).
        The store is handed storage keys either way."""
        if isinstance(keys, bytes):
            listed, known = decode_forget(keys)
        else:
            listed = [_log_key(tuple(k)) for k in keys]  # type: ignore[arg-type]
            known = {_log_key(tuple(k)): s for k, s in (seqs or {}).items()}  # type: ignore[arg-type]
        return await self._op("forget", listed, known, epoch=epoch)

    async def fail(
        self, epoch: int, batch: bytes, errors: Sequence[str], now_ms: int, park: bool = False
    ) -> int:
        """`batch` holds the failed events (encoded), `errors` their errors, in order."""
        events = decode_batch(batch)
        if len(events) != len(errors):
            raise ValueError(f"{len(events)} events but {len(errors)} errors")
        items = list(zip(events, errors, strict=True))
        delay = _park_delay if park else self._retry_delay_ms
        return await self._op("fail", items, now_ms, delay, epoch=epoch)

    async def settle(self, epoch: int, keys: list[LogKey], action: str, now_ms: int) -> int:
        """Parked entries: "retry" (due now) or "forget"; see LogStore.settle."""
        return await self._op("settle", [tuple(k) for k in keys], action, now_ms, epoch=epoch)

    async def parked(self, limit: int = 1000) -> list[dict[str, Any]]:
        self._readable()
        return await self._op("parked", limit)

    async def import_(self, epoch: int, entries: list[tuple[str, bytes, bytes]]) -> int:
        return await self._op("import_", entries, epoch=epoch)

    async def begin_catch_up(self, epoch: int, copy: str = "") -> None:
        """Empty the store and refuse reads until `finish_catch_up` of the same `copy`.
        A copy begun later (another holder healing at once) empties the store again, so
        the earlier copy's finish is refused rather than passing a half copy as whole."""
        self.catching_up = True
        self._copy = copy
        keep = {CATCHING_UP_KEY: b"1", FENCE_KEY: self.fence.to_bytes()}
        await self._op("reset", keep, epoch=epoch)

    async def finish_catch_up(self, epoch: int, copy: str = "") -> None:
        if copy != self._copy:
            raise LogUnavailable(self.name, "another catch-up began since this one")
        await self._op("put_meta", {CATCHING_UP_KEY: b"0"}, epoch=epoch)
        self.catching_up = False

    # -- reads -------------------------------------------------------------------------

    async def pending(self, older_than_ms: int, now_ms: int, limit: int) -> bytes:
        self._readable()
        return encode_batch(await self._op("pending", older_than_ms, now_ms, limit))

    async def due_failed(self, now_ms: int, limit: int) -> bytes:
        self._readable()
        return encode_batch(await self._op("due_failed", now_ms, limit))

    async def failed_entry(self, key: LogKey) -> dict[str, Any] | None:
        fe = await self._op("failed_entry", tuple(key))
        if fe is None:
            return None
        return {"error": fe.error, "attempts": fe.attempts, "next_retry_ms": fe.next_retry_ms}

    async def token_status(self, token: str) -> dict[str, Any] | None:
        self._readable()
        return await self._op("token_status", token)

    async def counts(self, readable: bool = False) -> dict[str, int]:
        """This store's counts; with `readable`, refused while catching up (they are not
        the group's then)."""
        if readable:
            self._readable()
        return await self._op("counts")

    async def scan_counts(self) -> dict[str, int]:
        return await self._op("scan_counts")

    async def export(
        self, after: bytes | None, limit: int
    ) -> tuple[list[tuple[str, bytes, bytes]], bytes | None]:
        self._readable()
        return await self._op("export", after, limit)

    async def entry_keys(self, after: bytes | None, limit: int) -> tuple[list[bytes], bytes | None]:
        self._readable()
        return await self._op("entry_keys", after, limit)

    async def holds(self, keys: list[bytes]) -> list[bool]:
        self._readable()
        return await self._op("holds", keys)

    async def _check_disk(self) -> None:
        """A store without the catching-up flag lost its directory under this running
        replica (the writer reopened an empty one): its contents must not pass for the
        group's, so it is marked catching up (heal then promotes a peer and rebuilds it)."""
        if self.catching_up or self._replicas < 2:
            return
        if await self._op("get_meta", CATCHING_UP_KEY) is None:
            log.error(
                "logger replica %s: store %s lost under it; catching up", self.name, self.path
            )
            self.catching_up = True
            self._fence_dirty = True  # the fence went with the directory
            await self._op("put_meta", {CATCHING_UP_KEY: b"1"})

    async def status(self) -> dict[str, Any]:
        await self._check_disk()
        return {
            **self.heartbeat(),
            "group": self.group,
            "path": str(self.path),
            "epoch": self.fence.epoch,
            "primary": self.fence.primary,
            "in_sync": None if self.fence.in_sync is None else list(self.fence.in_sync),
            "catching_up": self.catching_up,
            "counts": await self._op("counts"),
            "parked": await self._op("parked_count"),
        }

    async def crash_writer(self) -> None:
        """Fault injection: make the LogWriter fail (its supervisor restarts it)."""
        ref = self._writer.cached() or self._writer.current(self._restart_timeout_s)
        ref.tell(_Crash("injected"))
