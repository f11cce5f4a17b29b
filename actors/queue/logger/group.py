"""`LoggerGroup`: the picklable client of one logger group, as Collector and Bridge hold it.

Writes go to every replica and succeed only when all acknowledged; reads go to the
primary. It also keeps the group whole: `heal` catches up replicas that came back empty,
promotes a healthy one when the primary did, and reconciles forgets a replica missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from actors.queue.logger.errors import LogFull, LogUnavailable
from actors.queue.logger.records import LogKey, _split_key, encode_forget
from runtime import clock
from runtime.events import Event, decode_batch, encode_batch
from runtime.inline import inline_parts
from runtime.replication import FencedError, ReplicaGroup

log = logging.getLogger(__name__)

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

    Writes (`append`, `forget`, `fail`) go to every replica concurrently and return only
    when all acknowledged; a replica that fails or misses `deadline_s` makes the call raise
    LogUnavailable naming it (the collector answers 503). LogFull and FencedError from any
    replica propagate as themselves. Reads go to the primary.

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
    # per replica: forgets it missed while the others took them; keys absent from the
    # primary -> when first seen; where the scan of its keys goes on
    _missed: dict[int, dict[LogKey, None]] = field(default_factory=dict, init=False, repr=False)
    _suspects: dict[int, dict[bytes, float]] = field(default_factory=dict, init=False, repr=False)
    _scan_at: dict[int, bytes] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def of(cls, group: ReplicaGroup, *, deadline_s: float = 5.0) -> LoggerGroup:
        return cls(
            name=group.role,
            namespace=group.namespace,
            size=len(group.replicas),
            epoch=group.epoch,
            primary=group.primary or 0,
            deadline_s=deadline_s,
            handles=group.replicas,
        )

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
                if isinstance(cause, FencedError):
                    raise FencedError(cause.current, cause.offered) from None
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
        """One fenced write on every replica; `args[0]` is the epoch. Refused as fenced,
        a following client adopts the newer epoch and sends it once more (idempotent).
        `forgotten`: the keys of a forget, noted for a replica that missed it."""
        results = await self._gather(method, args, deadline_s)
        fenced = any(isinstance(r, FencedError) for r in results)
        follow = fenced and self.follow_epochs and bool(args) and args[0] == self.epoch
        if follow and await self.refresh() > args[0]:
            args = (self.epoch, *args[1:])
            results = await self._gather(method, args, deadline_s)
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

    async def _gather(
        self, method: str, args: tuple[Any, ...], deadline_s: float | None
    ) -> list[Any]:
        if self.size > 1 and any(
            isinstance(a, bytes) and len(a) > PUT_ONCE_BYTES for a in args
        ):  # one copy in the object store for every replica, not one per call
            args = tuple(
                ray.put(a) if isinstance(a, bytes) and len(a) > PUT_ONCE_BYTES else a for a in args
            )
        return await asyncio.gather(
            *(self._call(i, method, *args, deadline_s=deadline_s) for i in range(self.size)),
            return_exceptions=True,
        )

    def _note_missed_forgets(self, results: Sequence[Any], keys: Sequence[LogKey]) -> None:
        """A replica that missed a forget the others took keeps entries already published;
        `heal` sends it again. Bounded: past the bound the key scan of `heal` finds them."""
        if all(isinstance(r, BaseException) for r in results):
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
        out: list[dict[str, Any]] = []
        for i in range(self.size):
            try:
                out.append(await self._call(i, "status", deadline_s=None))
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                out.append({"name": self.replica_name(i), "error": str(exc)})
        return out

    async def drained(self) -> bool:
        """True when EVERY replica answers and holds nothing transient or failed: a replica
        that missed a forget still holds entries the primary dropped (until `heal`
        reconciles it), and would replay them if promoted."""
        for i in range(self.size):
            try:
                c = await self._call(i, "counts", deadline_s=None)
            except (LogUnavailable, FencedError):
                return False
            if c["transient"] or c["failed"]:
                return False
        return True

    # -- control -----------------------------------------------------------------------

    async def refresh(self) -> int:
        """Adopt the newest epoch (and its primary) the replicas accepted; returns it."""
        answers = await asyncio.gather(
            *(self._call(i, "status", deadline_s=None) for i in range(self.size)),
            return_exceptions=True,
        )
        known = [a for a in answers if isinstance(a, dict) and a.get("primary") is not None]
        if not known:
            raise LogUnavailable(self.name, "no replica knows its primary")
        best = max(known, key=lambda a: a["epoch"])
        self.epoch, self.primary = best["epoch"], best["primary"]
        return self.epoch

    async def catch_up(
        self, index: int, *, source: int | None = None, chunk: int = 2000, timeout_s: float = 600.0
    ) -> int:
        """Copy every entry of `source` (default: the primary) into replica `index`, which is
        emptied first and counts for reads again once done. Writes keep flowing to it
        meanwhile. Returns the number of entries copied."""
        src = self.primary if source is None else source
        if src == index:
            raise ValueError(f"replica {index} cannot catch up from itself")
        for pending in (self._missed, self._suspects, self._scan_at):
            pending.pop(index, None)
        call_deadline = max(self.deadline_s, 30.0)
        deadline = time.monotonic() + timeout_s
        await self._call(index, "begin_catch_up", self.epoch, deadline_s=call_deadline)
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
        await self._call(index, "finish_catch_up", self.epoch, deadline_s=call_deadline)
        log.info("%s caught up from %s: %d entries", self.replica_name(index), src, copied)
        return copied

    async def heal(self) -> dict[int, int]:
        """Catch up every replica that came back empty (Ray restarted it on a fresh disk,
        or its directory was lost) from the primary; returns {index: entries copied}.

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
        for i, st in enumerate(statuses):
            if i != self.primary and st.get("catching_up"):
                healed[i] = await self.catch_up(i)
        for i, st in enumerate(statuses):
            ok = not st.get("error") and not st.get("catching_up")
            if ok and i != self.primary and i not in healed:
                await self._reconcile(i, primary, st)
        return healed

    async def _follow_primary(self, statuses: Sequence[Mapping[str, Any]]) -> bool:
        """Adopt the newest epoch the replicas report; if its primary came back empty
        (catching up), promote a healthy replica. Returns whether the primary changed."""
        before = (self.epoch, self.primary)
        known = [s for s in statuses if not s.get("error") and s.get("primary") is not None]
        if known and self.follow_epochs:
            best = max(known, key=lambda s: s["epoch"])
            if best["epoch"] > self.epoch:
                self.epoch, self.primary = best["epoch"], best["primary"]
        current = statuses[self.primary] if self.primary < len(statuses) else {}
        if current.get("catching_up") and not current.get("error"):
            await self.promote_healthy(statuses)
        return (self.epoch, self.primary) != before

    async def promote_healthy(self, statuses: Sequence[Mapping[str, Any]]) -> int | None:
        """Make the lowest-indexed replica that answers and is not catching up the primary
        under a new epoch (every holder picks the same one, so two promoting at once agree);
        returns it, or None (logged) when no replica can lead: reads then keep failing and
        writes keep needing every replica, so nothing is acknowledged on fewer copies."""
        healthy = [
            i for i, s in enumerate(statuses) if not s.get("error") and not s.get("catching_up")
        ]
        if not healthy:
            log.error("%s: no healthy replica to promote: %s", self.name, statuses)
            return None
        index = healthy[0]
        epoch = 1 + max([self.epoch, *(s.get("epoch", 0) for s in statuses if not s.get("error"))])
        results = await asyncio.gather(
            *(self._call(i, "set_epoch", epoch, index, deadline_s=None) for i in range(self.size)),
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
