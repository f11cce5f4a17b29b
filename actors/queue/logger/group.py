"""`LoggerGroup`: the picklable client of one logger group, as Collector and Bridge hold it.

The MessageLogger's data path on the holder's side: writes go to every replica of the
in-sync set (every replica unless the group has more than k+1, `in_sync.py`) and succeed
only when all acknowledged; reads go to the primary. Who is in that set, and keeping the
group whole (`refresh`, `heal`, promotion, dropping a silent member) is `membership.py`'s;
`LoggerGroup` delegates to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from actors.queue.logger.errors import LogFull, LogUnavailable
from actors.queue.logger.in_sync import Config, members
from actors.queue.logger.membership import SKIPPED, Membership
from actors.queue.logger.records import LogKey, encode_forget
from runtime import clock
from runtime.data.events import Event, decode_batch, encode_batch
from runtime.inline import inline_parts
from runtime.state.replication import EpochFenced, FencedError, ReplicaGroup

# Ray sends a call's arguments up to 100 KiB inline (`max_direct_call_object_size`) and
# copies bigger ones into the object store once per call; a write going to every replica
# puts such an argument once and passes the reference (about 0.7 ms of the caller's CPU
# saved per extra replica, measured with batches of 150-600 KB).
PUT_ONCE_BYTES = 100 * 1024
# An append's batch travels instead as parts Ray sends inline (`runtime.inline`): no object
# store at all, whose raylet work cost about 0.05 core-s per 10k events at HML k=1.


def _cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's RayTaskError wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


@dataclass
class LoggerGroup:
    """Client of one logger group: plain data plus Ray handles, so it pickles into the
    Collector's and the Bridge's kwargs.

    Writes (`append`, `forget`, `fail`) go to every replica of the in-sync set concurrently
    and return only when all of it acknowledged (in_sync.py: never fewer than k+1). A member
    silent for `drop_after_s` while the others took the write is dropped by announcing the
    next epoch without it, and the write stands; otherwise a replica that fails or misses
    `deadline_s` makes the call raise LogUnavailable naming it (the collector answers 503).
    LogFull and FencedError from any replica propagate as themselves. Reads go to the
    primary; `heal` copies a dropped replica back in. Changes to the in-sync set (drops,
    `refresh`, `heal`, promotion) are `Membership`'s (membership.py); this class keeps the
    configuration it carries on every write (`epoch`, `primary`, `in_sync`).

    The epoch is the one the group's controller announced when this client was made. After
    a promotion writes raise FencedError; the holder takes a new client from the controller
    (`LoggerGroup.of(replica_group)`) or adopts the replicas' epoch on purpose (`refresh`).
    Handles of replaced replicas are looked up again by name.
    """

    name: str
    namespace: str
    size: int
    epoch: int
    primary: int = 0
    deadline_s: float = 5.0
    handles: list[Any] = field(default_factory=list)
    # Adopt a newer epoch the replicas accepted (a promotion by `heal` in another holder)
    # and retry once, for writes refused as fenced and reads of a primary that cannot serve.
    follow_epochs: bool = True
    # `heal` drops an entry a replica holds and the primary does not only when the primary
    # lacked it on two checks this far apart: appends reach replicas one by one.
    reconcile_grace_s: float = 30.0
    reconcile_page: int = 5000
    max_missed_forgets: int = 100_000
    # the replicas a write needs (None: every one), the copies an acknowledged write must
    # be on (None: every replica), and how long an in-sync replica may stay silent in a
    # write the others answered before it is dropped from the set when enough remain
    # (None: never dropped; the write waits `deadline_s` and fails)
    in_sync: tuple[int, ...] | None = None
    need: int | None = None
    drop_after_s: float | None = None
    # what this holder learned of the in-sync set beyond its configuration (forgets a
    # replica missed, replicas catching up): made per client (`dataclasses.replace` starts
    # afresh), pickled along with the fields, left out of repr and ==
    _membership: Membership = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._membership = Membership(self)

    @classmethod
    def of(
        cls,
        group: ReplicaGroup,
        *,
        deadline_s: float = 5.0,
        need: int | None = None,
        drop_after_s: float | None = None,
    ) -> LoggerGroup:
        return cls(
            name=group.role,
            namespace=group.namespace,
            size=len(group.replicas),
            epoch=group.epoch,
            primary=group.primary or 0,
            deadline_s=deadline_s,
            handles=group.replicas,
            need=need,
            drop_after_s=drop_after_s,
        )

    def config(self) -> Config:
        return Config(self.epoch, self.primary, self.in_sync)

    def members(self) -> tuple[int, ...]:
        """The replicas every write needs now."""
        return members(self.config(), self.size)

    def _needed(self) -> int:
        return self.size if self.need is None else self.need

    def _adopt(self, config: Config) -> None:
        self.epoch, self.primary, self.in_sync = config

    def replica_name(self, index: int) -> str:
        return f"{self.name}-{index}"

    # -- plumbing ----------------------------------------------------------------------

    async def _handle(self, index: int, *, fresh: bool = False) -> Any:
        if not fresh and index < len(self.handles) and self.handles[index] is not None:
            return self.handles[index]
        loop = asyncio.get_running_loop()
        handle = await loop.run_in_executor(
            None, lambda: ray.get_actor(self.replica_name(index), namespace=self.namespace)
        )
        while len(self.handles) < self.size:
            self.handles.append(None)
        self.handles[index] = handle
        return handle

    async def _call(self, index: int, method: str, *args: Any, deadline_s: float | None) -> Any:
        """One remote call; errors come back as LogUnavailable, FencedError or LogFull."""
        timeout = self.deadline_s if deadline_s is None else deadline_s
        for attempt in range(2):
            try:
                handle = await self._handle(index, fresh=attempt > 0)
            except ValueError:  # no actor under that name right now (being replaced)
                raise LogUnavailable(self.replica_name(index), "no such actor") from None
            try:
                ref = getattr(handle, method).remote(*args)
                # asyncio.timeout, not wait_for: Python 3.11's wait_for wraps the ObjectRef
                # in a task of its own (about 25 us of the caller's CPU per call, measured)
                async with asyncio.timeout(timeout):
                    return await ref
            except TimeoutError:
                raise LogUnavailable(
                    self.replica_name(index), f"no answer within {timeout}s"
                ) from None
            except ActorDiedError as exc:
                if attempt == 0:
                    continue  # maybe replaced under the same name: look it up again
                raise LogUnavailable(self.replica_name(index), f"dead: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - classified below
                cause = _cause(exc)
                if isinstance(cause, EpochFenced):
                    raise EpochFenced(cause.current, cause.offered) from None
                if isinstance(cause, LogFull):
                    raise LogFull(*cause.args) from None
                if isinstance(cause, LogUnavailable):
                    raise LogUnavailable(*cause.args) from None
                raise LogUnavailable(self.replica_name(index), repr(cause)) from exc
        raise AssertionError("unreachable")

    async def _all(
        self,
        method: str,
        *args: Any,
        deadline_s: float | None,
        forgotten: Sequence[LogKey] = (),
    ) -> list[Any]:
        """One fenced write on every in-sync replica; `args[0]` is the epoch. Refused as
        fenced, a following client adopts the newer configuration and sends it once more
        (idempotent). In-sync replicas that do not answer are dropped from the set when
        enough remain (`drop_after_s`): the write then stands on the others.
        `forgotten`: the keys of a forget, noted for a replica that missed it.
        Returns one answer per replica, `SKIPPED` for those outside the set."""
        results = await self._gather(method, args, deadline_s)
        fenced = any(isinstance(r, FencedError) for r in results)
        follow = fenced and self.follow_epochs and bool(args) and args[0] == self.epoch
        if follow and await self.refresh() > args[0]:
            args = (self.epoch, *args[1:])
            results = await self._gather(method, args, deadline_s)
        results = await self._membership.drop_silent(results)
        if method == "forget":
            self._membership.note_missed_forgets(results, forgotten)
        errors = [r for r in results if isinstance(r, BaseException)]
        for kind in (FencedError, LogFull, LogUnavailable):
            found = [e for e in errors if isinstance(e, kind)]
            if found:
                if kind is LogUnavailable and len(found) > 1:
                    names = ", ".join(e.replica for e in found)
                    raise LogUnavailable(found[0].replica, f"{found[0].reason} (down: {names})")
                raise found[0]
        if errors:
            raise errors[0]
        return results

    async def _gather(
        self, method: str, args: tuple[Any, ...], deadline_s: float | None
    ) -> list[Any]:
        """Each replica's answer (an exception for one that failed), `SKIPPED` outside the
        set. When others all answered and the silent ones could be dropped, the silent
        ones are not waited for past `drop_after_s` (LogUnavailable for them)."""
        targets = self.members()
        if len(targets) > 1 and any(
            isinstance(a, bytes) and len(a) > PUT_ONCE_BYTES for a in args
        ):  # one copy in the object store for every replica, not one per call
            args = tuple(
                ray.put(a) if isinstance(a, bytes) and len(a) > PUT_ONCE_BYTES else a for a in args
            )
        results: list[Any] = [SKIPPED] * self.size
        if self.drop_after_s is None or len(targets) <= self._needed():
            answers = await asyncio.gather(
                *(self._call(i, method, *args, deadline_s=deadline_s) for i in targets),
                return_exceptions=True,
            )
            for i, answer in zip(targets, answers, strict=True):
                results[i] = answer
            return results
        calls = {
            i: asyncio.ensure_future(self._call(i, method, *args, deadline_s=deadline_s))
            for i in targets
        }
        _, pending = await asyncio.wait(calls.values(), timeout=self.drop_after_s)
        silent = [i for i, c in calls.items() if c in pending]
        answered_ok = all(c.exception() is None for c in calls.values() if c not in pending)
        if silent and answered_ok and self._membership.droppable(silent):
            for i in silent:
                calls[i].cancel()
                results[i] = LogUnavailable(
                    self.replica_name(i), f"no answer within {self.drop_after_s}s"
                )
        elif pending:
            await asyncio.wait(pending)
        for i, c in calls.items():
            if results[i] is SKIPPED:
                results[i] = c.exception() or c.result()
        return results

    # -- writes ------------------------------------------------------------------------

    async def append(
        self, events: Sequence[Event] | bytes, *, deadline_s: float | None = None
    ) -> None:
        """Returns once every replica holds the batch (synced); see the class doc."""
        batch = events if isinstance(events, bytes) else encode_batch(events)
        if not isinstance(events, bytes) and not events:
            return
        await self._all("append", self.epoch, *inline_parts(batch), deadline_s=deadline_s)

    async def forget(
        self,
        keys: Sequence[LogKey],
        seqs: Mapping[LogKey, tuple[str, int] | None] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> None:
        """Drop acked (stream, id) keys on every replica (`key_of(event)`)."""
        if keys:
            # one msgpack blob of storage keys, not a pickled tuple per key; a bare id is
            # refused here (TypeError), not on the replicas
            blob = encode_forget(keys, seqs)
            await self._all("forget", self.epoch, blob, deadline_s=deadline_s, forgotten=keys)

    async def fail(
        self,
        items: Sequence[tuple[Event, str]],
        now_ms: int | None = None,
        *,
        deadline_s: float | None = None,
        park: bool = False,
    ) -> None:
        if not items:
            return
        batch = encode_batch([e for e, _ in items])
        errors = [str(err) for _, err in items]
        now = clock.now_ms() if now_ms is None else now_ms
        await self._all("fail", self.epoch, batch, errors, now, park, deadline_s=deadline_s)

    async def settle(
        self, keys: Sequence[LogKey], action: str, *, deadline_s: float | None = None
    ) -> None:
        """An operator's decision on parked (stream, id) entries: "retry" or "forget"."""
        if keys:
            keys = [tuple(k) for k in keys]  # type: ignore[misc]
            await self._all(
                "settle", self.epoch, keys, action, clock.now_ms(), deadline_s=deadline_s
            )

    async def parked(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The primary's parked entries (stream, id, error, attempts, bytes)."""
        return await self._call(self.primary, "parked", limit, deadline_s=None)

    # -- reads (primary) ---------------------------------------------------------------

    async def pending(
        self, older_than_ms: int, now_ms: int | None = None, limit: int = 1000
    ) -> list[Event]:
        now = clock.now_ms() if now_ms is None else now_ms
        raw = await self._read("pending", older_than_ms, now, limit)
        return decode_batch(raw)

    async def due_failed(self, now_ms: int | None = None, limit: int = 1000) -> list[Event]:
        now = clock.now_ms() if now_ms is None else now_ms
        raw = await self._read("due_failed", now, limit)
        return decode_batch(raw)

    async def token_status(self, token: str) -> dict[str, Any] | None:
        return await self._read("token_status", token)

    async def _read(self, method: str, *args: Any) -> Any:
        """A read of the primary. If it cannot serve (back on an empty disk, catching up)
        a following client adopts a newer primary, promoting a healthy replica if none was,
        and reads once more."""
        try:
            return await self._call(self.primary, method, *args, deadline_s=None)
        except LogUnavailable:
            if not self.follow_epochs:
                raise
            before = (self.epoch, self.primary)
            await self._membership.follow_primary(await self.status())
            if (self.epoch, self.primary) == before:
                raise
        return await self._call(self.primary, method, *args, deadline_s=None)

    async def counts(self, index: int | None = None) -> dict[str, int]:
        """Replica `index`'s counts, or the group's: the primary's, following a promotion
        when the primary came back empty (its zeros are not the group's)."""
        if index is None:
            return await self._read("counts", True)
        return await self._call(index, "counts", deadline_s=None)

    async def status(self) -> list[dict[str, Any]]:
        """Every replica's status, or {"replica", "error"} for one that did not answer."""
        return await self._membership.status()

    async def drained(self) -> bool:
        """True when every in-sync replica answers and holds nothing transient or failed: a
        replica that missed a forget still holds entries the primary dropped (until `heal`
        reconciles it), and would replay them if promoted. One outside the set is emptied
        before it counts again."""
        for i in self.members():
            try:
                c = await self._call(i, "counts", deadline_s=None)
            except (LogUnavailable, FencedError):
                return False
            if c["transient"] or c["failed"]:
                return False
        return True

    # -- membership (membership.py) ---------------------------------------------------

    async def refresh(self) -> int:
        """Adopt the newest whole configuration (epoch, primary, in-sync set) the replicas
        accepted (`in_sync.newest`); returns its epoch. Answers are read as they come: a
        replica that does not answer delays it only while no whole configuration shows."""
        return await self._membership.refresh()

    async def catch_up(
        self,
        index: int,
        *,
        source: int | None = None,
        chunk: int = 2000,
        timeout_s: float = 600.0,
        rejoin: bool = False,
    ) -> int:
        """Copy every entry of `source` (default: the primary) into replica `index`, which is
        emptied first and counts for reads again once done. Writes keep flowing to it
        meanwhile. With `rejoin` (a replica dropped from the in-sync set) it is taken back
        into the set once emptied, so every write from then on reaches it, and the copy
        brings what came before. Returns the number of entries copied."""
        return await self._membership.catch_up(
            index, source=source, chunk=chunk, timeout_s=timeout_s, rejoin=rejoin
        )

    async def heal(self) -> dict[int, int]:
        """Catch up every replica that came back empty (Ray restarted it on a fresh disk,
        or its directory was lost) from the primary, and every replica dropped from the
        in-sync set that answers again (taken back in); returns {index: entries copied}.
        Promotes a healthy replica first when the primary came back empty, and reconciles
        forgets the others missed.

        Cheap when all is well (one status call per replica), so a periodic loop (the
        bridge's replayer) can run it: a lost replica is replaced by Ray and caught up
        here without an operator.
        """
        return await self._membership.heal()

    async def promote_healthy(self, statuses: Sequence[Mapping[str, Any]]) -> int | None:
        """Make the lowest-indexed replica that answers and is not catching up the primary
        under a new epoch (every holder picks the same one, so two promoting at once agree);
        returns it, or None (logged) when no replica can lead: reads then keep failing and
        writes keep needing every replica, so nothing is acknowledged on fewer copies."""
        return await self._membership.promote_healthy(statuses)


async def catch_up_all(client: LoggerGroup, indexes: Sequence[int]) -> None:
    """Catch up replicas `indexes` one after the other (a group started with some empty)."""
    for i in indexes:
        await client.catch_up(i)


async def replace_replica(
    group: ReplicaGroup, index: int, *, chunk: int = 2000, timeout_s: float = 60.0
) -> int:
    """Replace replica `index` (a lost node, a dead or damaged store) with a fresh actor and
    catch it up from the primary; returns the entries copied."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, group.replace, index, timeout_s)
    client = LoggerGroup.of(group)
    return await client.catch_up(index, chunk=chunk)
