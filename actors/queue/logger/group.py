"""`LoggerGroup`: the picklable client of one logger group, as Collector and Bridge hold it.

Writes go to every replica of the in-sync set (every replica unless the group has more
than k+1, `in_sync.py`) and succeed only when all acknowledged; reads go to the primary.
It also keeps the group whole: `heal` catches up replicas that came back empty, copies
dropped ones back into the set, promotes a healthy one when the primary came back empty,
and reconciles forgets a replica missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from actors.queue.logger.errors import LogFull, LogUnavailable
from actors.queue.logger.in_sync import Config, members, newest, with_, without
from actors.queue.logger.records import LogKey, _split_key, encode_forget
from runtime import clock
from runtime.data.events import Event, decode_batch, encode_batch
from runtime.inline import inline_parts
from runtime.state.replication import EpochFenced, FencedError, ReplicaGroup

log = logging.getLogger(__name__)

# Ray sends a call's arguments up to 100 KiB inline (`max_direct_call_object_size`) and
# copies bigger ones into the object store once per call; a write going to every replica
# puts such an argument once and passes the reference (about 0.7 ms of the caller's CPU
# saved per extra replica, measured with batches of 150-600 KB).
PUT_ONCE_BYTES = 100 * 1024
# An append's batch travels instead as parts Ray sends inline (`runtime.inline`): no object
# store at all, whose raylet work cost about 0.05 core-s per 10k events at HML k=1.


# a replica outside the in-sync set: not written to, its answer not waited for
SKIPPED = object()


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
    primary; `heal` copies a dropped replica back in.

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
    # per replica: forgets it missed while the others took them; keys absent from the
    # primary -> when first seen; where the scan of its keys goes on
    _missed: dict[int, dict[LogKey, None]] = field(default_factory=dict, init=False, repr=False)
    _suspects: dict[int, dict[bytes, float]] = field(default_factory=dict, init=False, repr=False)
    _scan_at: dict[int, bytes] = field(default_factory=dict, init=False, repr=False)
    # replicas known to be catching up (never chosen to lead)
    _behind: set[int] = field(default_factory=set, init=False, repr=False)

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
        results = await self._drop_silent(results)
        if method == "forget":
            self._note_missed_forgets(results, forgotten)
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

    def _without(self, lost: Sequence[int]) -> Config | None:
        """The next configuration without replicas `lost`; None when dropping is off or
        too few (or no caught-up leader) would remain."""
        if self.drop_after_s is None:
            return None
        return without(self.config(), lost, self.size, self._needed(), sorted(self._behind))

    def _droppable(self, silent: Sequence[int]) -> bool:
        return self._without(silent) is not None

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
        if silent and answered_ok and self._droppable(silent):
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

    async def _drop_silent(self, results: list[Any]) -> list[Any]:
        """Drop the in-sync replicas that answered LogUnavailable from the set when every
        other one took the write and enough remain; their answers become `SKIPPED`."""
        silent = [i for i, r in enumerate(results) if isinstance(r, LogUnavailable)]
        others_ok = all(
            r is SKIPPED or not isinstance(r, BaseException)
            for i, r in enumerate(results)
            if i not in silent
        )
        if not silent or not others_ok or not self._droppable(silent):
            return results
        if not await self._drop(silent):
            return results
        return [SKIPPED if i in silent else r for i, r in enumerate(results)]

    async def _drop(self, lost: Sequence[int]) -> bool:
        """Announce the next epoch without replicas `lost`; True once every remaining
        member accepted it (writes of the old epoch are refused from then on)."""
        config = self._without(lost)
        if config is None or not await self._announce(config):
            return False
        log.warning(
            "%s: replicas %s dropped from the in-sync set under epoch %d (primary %d): "
            "they did not answer; writes go on on %s",
            self.name,
            [self.replica_name(i) for i in lost],
            config.epoch,
            config.primary,
            list(members(config, self.size)),
        )
        return True

    async def _announce(self, config: Config) -> bool:
        """`config` on every member of its set; adopted when all accepted it. Otherwise
        (another holder decided the epoch, or a member did not answer) the newest whole
        configuration is adopted instead and False returned."""
        assert config.in_sync is not None
        answers = await asyncio.gather(
            *(
                self._call(
                    i,
                    "set_epoch",
                    config.epoch,
                    config.primary,
                    list(config.in_sync),
                    deadline_s=None,
                )
                for i in config.in_sync
            ),
            return_exceptions=True,
        )
        if all(a == config.epoch for a in answers):
            self._adopt(config)
            return True
        log.warning("%s: epoch %d %s not accepted: %r", self.name, config.epoch, config, answers)
        try:
            await self.refresh()
        except LogUnavailable as err:
            log.warning("%s: %s", self.name, err)
        return False

    def _note_missed_forgets(self, results: Sequence[Any], keys: Sequence[LogKey]) -> None:
        """A replica that missed a forget the others took keeps entries already published;
        `heal` sends it again. Bounded: past the bound the key scan of `heal` finds them."""
        asked = [r for r in results if r is not SKIPPED]
        if all(isinstance(r, BaseException) for r in asked):
            return  # nothing dropped anywhere: the caller retries the whole forget
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                missed = self._missed.setdefault(i, {})
                room = self.max_missed_forgets - len(missed)
                missed.update(dict.fromkeys(tuple(k) for k in list(keys)[: max(0, room)]))

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
            await self._follow_primary(await self.status())
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

        async def one(i: int) -> dict[str, Any]:
            try:
                answer: dict[str, Any] = await self._call(i, "status", deadline_s=None)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                return {"name": self.replica_name(i), "error": str(exc)}
            if answer.get("catching_up"):
                self._behind.add(i)
            else:
                self._behind.discard(i)
            return answer

        return list(await asyncio.gather(*(one(i) for i in range(self.size))))

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

    # -- control -----------------------------------------------------------------------

    async def refresh(self) -> int:
        """Adopt the newest whole configuration (epoch, primary, in-sync set) the replicas
        accepted (`in_sync.newest`); returns its epoch. Answers are read as they come: a
        replica that does not answer delays it only while no whole configuration shows."""

        async def one(i: int) -> tuple[int, dict[str, Any] | None]:
            try:
                return i, await self._call(i, "status", deadline_s=None)
            except Exception:  # noqa: BLE001 - a replica down: the others decide
                return i, None

        calls = [asyncio.ensure_future(one(i)) for i in range(self.size)]
        statuses: list[dict[str, Any]] = [{"error": "no answer yet"}] * self.size
        found: Config | None = None
        try:
            for done in asyncio.as_completed(calls):
                index, answer = await done
                if answer is None:
                    continue
                statuses[index] = answer
                found = newest(statuses, self.size)
                answered = [s["epoch"] for s in statuses if "epoch" in s]
                if found is not None and found.epoch >= max(answered):
                    break
        finally:
            for c in calls:
                c.cancel()
        if found is None:
            raise LogUnavailable(self.name, "no replica knows its primary")
        if found.epoch >= self.epoch:
            self._adopt(found)
        return self.epoch

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
        src = self.primary if source is None else source
        if src == index:
            raise ValueError(f"replica {index} cannot catch up from itself")
        for pending in (self._missed, self._suspects, self._scan_at):
            pending.pop(index, None)
        call_deadline = max(self.deadline_s, 30.0)
        deadline = time.monotonic() + timeout_s
        copy = uuid.uuid4().hex
        self._behind.add(index)
        await self._call(index, "begin_catch_up", self.epoch, copy, deadline_s=call_deadline)
        if rejoin and not await self._announce(with_(self.config(), index, self.size)):
            return 0
        cursor: bytes | None = None
        copied = 0
        while True:
            if time.monotonic() > deadline:
                raise LogUnavailable(self.replica_name(index), f"catch-up over {timeout_s}s")
            entries, cursor = await self._call(
                src, "export", cursor, chunk, deadline_s=call_deadline
            )
            if entries:
                await self._call(index, "import_", self.epoch, entries, deadline_s=call_deadline)
                copied += len(entries)
            if cursor is None:
                break
        await self._call(index, "finish_catch_up", self.epoch, copy, deadline_s=call_deadline)
        self._behind.discard(index)
        log.info("%s caught up from %s: %d entries", self.replica_name(index), src, copied)
        return copied

    async def heal(self) -> dict[int, int]:
        """Catch up every replica that came back empty (Ray restarted it on a fresh disk,
        or its directory was lost) from the primary, and every replica dropped from the
        in-sync set that answers again (taken back in); returns {index: entries copied}.

        Cheap when all is well (one status call per replica), so a periodic loop (the
        bridge's replayer) can run it: a lost replica is replaced by Ray and caught up
        here without an operator.
        """
        statuses = await self.status()
        if await self._follow_primary(statuses):
            statuses = await self.status()
        primary = statuses[self.primary] if self.primary < len(statuses) else {}
        if primary.get("error") or primary.get("catching_up"):
            return {}  # nothing trustworthy to copy from (no healthy replica: logged)
        healed: dict[int, int] = {}
        inside = self.members()
        for i, st in enumerate(statuses):
            if i != self.primary and i in inside and st.get("catching_up"):
                healed[i] = await self.catch_up(i)
        for i, st in enumerate(statuses):
            if i not in inside and not st.get("error"):
                try:
                    healed[i] = await self.catch_up(i, rejoin=True)
                except (LogUnavailable, FencedError) as err:  # the next heal tries again
                    log.warning("%s: taking %d back: %s", self.name, i, err)
        for i, st in enumerate(statuses):
            ok = not st.get("error") and not st.get("catching_up")
            if ok and i != self.primary and i in inside and i not in healed:
                await self._reconcile(i, primary, st)
        return healed

    async def _follow_primary(self, statuses: Sequence[Mapping[str, Any]]) -> bool:
        """Adopt the newest whole configuration the replicas report; if its primary came
        back empty (catching up), promote a healthy replica; if it does not answer and
        may be dropped, drop it. Returns whether the primary changed."""
        before = (self.epoch, self.primary)
        found = newest(statuses, self.size)
        if found is not None and found.epoch > self.epoch and self.follow_epochs:
            self._adopt(found)
        current = statuses[self.primary] if self.primary < len(statuses) else {}
        if current.get("catching_up") and not current.get("error"):
            await self.promote_healthy(statuses)
        elif current.get("error") and self._droppable([self.primary]):
            await self._drop([self.primary])
        return (self.epoch, self.primary) != before

    async def promote_healthy(self, statuses: Sequence[Mapping[str, Any]]) -> int | None:
        """Make the lowest-indexed replica that answers and is not catching up the primary
        under a new epoch (every holder picks the same one, so two promoting at once agree);
        returns it, or None (logged) when no replica can lead: reads then keep failing and
        writes keep needing every replica, so nothing is acknowledged on fewer copies."""
        inside = self.members()
        healthy = [
            i
            for i, s in enumerate(statuses)
            if i in inside and not s.get("error") and not s.get("catching_up")
        ]
        if not healthy:
            log.error("%s: no healthy replica to promote: %s", self.name, statuses)
            return None
        index = healthy[0]
        epoch = 1 + max([self.epoch, *(s.get("epoch", 0) for s in statuses if not s.get("error"))])
        in_sync = None if self.in_sync is None else list(self.in_sync)
        results = await asyncio.gather(
            *(
                self._call(i, "set_epoch", epoch, index, in_sync, deadline_s=None)
                for i in range(self.size)
            ),
            return_exceptions=True,
        )
        if results[index] != epoch:  # it went down, or another holder promoted further
            log.warning("%s: promoting %d under epoch %d: %r", self.name, index, epoch, results)
            await self.refresh()
            return None
        self.epoch, self.primary = epoch, index
        log.warning(
            "%s: replica %d promoted under epoch %d (the primary came back empty); "
            "not acknowledged by %s",
            self.name,
            index,
            epoch,
            [i for i, r in enumerate(results) if r != epoch],
        )
        return index

    async def _reconcile(
        self, index: int, primary: Mapping[str, Any], status: Mapping[str, Any]
    ) -> int:
        """Drop from replica `index` the entries the primary no longer holds (forgets it
        missed): first the ones this client saw it miss, then, when its counts differ from
        the primary's, one page of a key scan compared with the primary. An entry absent
        from the primary is dropped only when still absent `reconcile_grace_s` after it was
        first seen (an append in flight may have reached this replica first). Returns the
        entries dropped."""
        dropped = 0
        missed = self._missed.pop(index, None)
        if missed:
            try:
                await self._call(index, "forget", self.epoch, list(missed), {}, deadline_s=None)
            except (LogUnavailable, FencedError):
                self._missed.setdefault(index, {}).update(missed)
                return 0
            dropped += len(missed)
        now = time.monotonic()
        suspects = self._suspects.setdefault(index, {})
        ripe = [k for k, seen in suspects.items() if now - seen >= self.reconcile_grace_s]
        if ripe:
            held = await self._call(self.primary, "holds", ripe, deadline_s=None)
            gone = [k for k, h in zip(ripe, held, strict=True) if not h]
            if gone:
                keys = [_split_key(k) for k in gone]
                await self._call(index, "forget", self.epoch, keys, {}, deadline_s=None)
                dropped += len(gone)
            for k in ripe:
                suspects.pop(k, None)
        mine, theirs = status.get("counts", {}), primary.get("counts", {})
        differ = any(mine.get(f) != theirs.get(f) for f in ("transient", "failed"))
        if differ or index in self._scan_at:
            page, cursor = await self._call(
                index, "entry_keys", self._scan_at.get(index), self.reconcile_page, deadline_s=None
            )
            held = await self._call(self.primary, "holds", page, deadline_s=None) if page else []
            for k, h in zip(page, held, strict=True):
                if not h:
                    suspects.setdefault(k, now)
            if cursor is None:
                self._scan_at.pop(index, None)
            else:
                self._scan_at[index] = cursor
        if dropped:
            log.warning(
                "%s: replica %d reconciled: %d entries the primary dropped",
                self.name,
                index,
                dropped,
            )
        return dropped


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
