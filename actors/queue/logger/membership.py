"""`Membership`: who is in a logger group's in-sync set, as one `LoggerGroup` holder keeps it.

The write path (`group.py`) sends each write to the in-sync set and hands this module what
came back; here the set changes, always under a new epoch every remaining member accepted
(`Fence.advance`, pure rules in `in_sync.py`):

- drop: members silent for `drop_after_s` while the others took the write leave the set
  (`drop_silent`), when at least `need` and a caught-up leader remain;
- follow: the newest whole configuration the replicas accepted is adopted (`refresh`,
  `follow_primary`), and a primary back on an empty disk is replaced (`promote_healthy`);
- heal: replicas that came back empty, or were dropped and answer again, are copied from
  the primary (`catch_up`, `heal`); forgets a replica missed are sent again and its keys
  compared with the primary's (`_reconcile`).

Kept apart from the write path so `group.py` reads as the MessageLogger's data path; the
epoch, primary and in-sync set themselves stay fields of `LoggerGroup` (they pickle with it
and every write carries the epoch).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from actors.queue.logger.errors import LogUnavailable
from actors.queue.logger.in_sync import Config, members, newest, with_, without
from actors.queue.logger.records import LogKey, _split_key
from runtime.state.replication import FencedError

if TYPE_CHECKING:  # group.py imports this module
    from actors.queue.logger.group import LoggerGroup

log = logging.getLogger(__name__)

# a replica outside the in-sync set: not written to, its answer not waited for
SKIPPED = object()


class Membership:
    """The in-sync set of one logger group as seen by one holder (`group`), and what the
    holder learned of each replica: forgets it missed, keys it holds that the primary may
    have dropped, where the key scan of it goes on, whether it is catching up.

    Plain data plus a reference to its `LoggerGroup`, so it pickles with the group (as
    the group's transient fields did before) into the Collector's and Bridge's kwargs.
    """

    def __init__(self, group: LoggerGroup) -> None:
        self.group = group
        # per replica: forgets it missed while the others took them; keys absent from the
        # primary -> when first seen; where the scan of its keys goes on
        self.missed: dict[int, dict[LogKey, None]] = {}
        self.suspects: dict[int, dict[bytes, float]] = {}
        self.scan_at: dict[int, bytes] = {}
        # replicas known to be catching up (never chosen to lead)
        self.behind: set[int] = set()

    # -- dropping silent members -------------------------------------------------------

    def _without(self, lost: Sequence[int]) -> Config | None:
        """The next configuration without replicas `lost`; None when dropping is off or
        too few (or no caught-up leader) would remain."""
        g = self.group
        if g.drop_after_s is None:
            return None
        return without(g.config(), lost, g.size, g._needed(), sorted(self.behind))

    def droppable(self, silent: Sequence[int]) -> bool:
        """Whether the set may go on without `silent` (the write path then stops waiting
        for them after `drop_after_s`)."""
        return self._without(silent) is not None

    async def drop_silent(self, results: list[Any]) -> list[Any]:
        """Drop the in-sync replicas that answered LogUnavailable from the set when every
        other one took the write and enough remain; their answers become `SKIPPED`."""
        silent = [i for i, r in enumerate(results) if isinstance(r, LogUnavailable)]
        others_ok = all(
            r is SKIPPED or not isinstance(r, BaseException)
            for i, r in enumerate(results)
            if i not in silent
        )
        if not silent or not others_ok or not self.droppable(silent):
            return results
        if not await self._drop(silent):
            return results
        return [SKIPPED if i in silent else r for i, r in enumerate(results)]

    async def _drop(self, lost: Sequence[int]) -> bool:
        """Announce the next epoch without replicas `lost`; True once every remaining
        member accepted it (writes of the old epoch are refused from then on)."""
        g = self.group
        config = self._without(lost)
        if config is None or not await self._announce(config):
            return False
        log.warning(
            "%s: replicas %s dropped from the in-sync set under epoch %d (primary %d): "
            "they did not answer; writes go on on %s",
            g.name,
            [g.replica_name(i) for i in lost],
            config.epoch,
            config.primary,
            list(members(config, g.size)),
        )
        return True

    async def _announce(self, config: Config) -> bool:
        """`config` on every member of its set; adopted when all accepted it. Otherwise
        (another holder decided the epoch, or a member did not answer) the newest whole
        configuration is adopted instead and False returned."""
        g = self.group
        assert config.in_sync is not None
        answers = await asyncio.gather(
            *(
                g._call(
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
            g._adopt(config)
            return True
        log.warning("%s: epoch %d %s not accepted: %r", g.name, config.epoch, config, answers)
        try:
            await self.refresh()
        except LogUnavailable as err:
            log.warning("%s: %s", g.name, err)
        return False

    def note_missed_forgets(self, results: Sequence[Any], keys: Sequence[LogKey]) -> None:
        """A replica that missed a forget the others took keeps entries already published;
        `heal` sends it again. Bounded: past the bound the key scan of `heal` finds them."""
        asked = [r for r in results if r is not SKIPPED]
        if all(isinstance(r, BaseException) for r in asked):
            return  # nothing dropped anywhere: the caller retries the whole forget
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                missed = self.missed.setdefault(i, {})
                room = self.group.max_missed_forgets - len(missed)
                missed.update(dict.fromkeys(tuple(k) for k in list(keys)[: max(0, room)]))

    # -- following the replicas' configuration -----------------------------------------

    async def status(self) -> list[dict[str, Any]]:
        """Every replica's status, or {"replica", "error"} for one that did not answer;
        notes which are catching up."""
        g = self.group

        async def one(i: int) -> dict[str, Any]:
            try:
                answer: dict[str, Any] = await g._call(i, "status", deadline_s=None)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                return {"name": g.replica_name(i), "error": str(exc)}
            if answer.get("catching_up"):
                self.behind.add(i)
            else:
                self.behind.discard(i)
            return answer

        return list(await asyncio.gather(*(one(i) for i in range(g.size))))

    async def refresh(self) -> int:
        """Adopt the newest whole configuration (epoch, primary, in-sync set) the replicas
        accepted (`in_sync.newest`); returns its epoch. Answers are read as they come: a
        replica that does not answer delays it only while no whole configuration shows."""
        g = self.group

        async def one(i: int) -> tuple[int, dict[str, Any] | None]:
            try:
                return i, await g._call(i, "status", deadline_s=None)
            except Exception:  # noqa: BLE001 - a replica down: the others decide
                return i, None

        calls = [asyncio.ensure_future(one(i)) for i in range(g.size)]
        statuses: list[dict[str, Any]] = [{"error": "no answer yet"}] * g.size
        found: Config | None = None
        try:
            for done in asyncio.as_completed(calls):
                index, answer = await done
                if answer is None:
                    continue
                statuses[index] = answer
                found = newest(statuses, g.size)
                answered = [s["epoch"] for s in statuses if "epoch" in s]
                if found is not None and found.epoch >= max(answered):
                    break
        finally:
            for c in calls:
                c.cancel()
        if found is None:
            raise LogUnavailable(g.name, "no replica knows its primary")
        if found.epoch >= g.epoch:
            g._adopt(found)
        return g.epoch

    async def follow_primary(self, statuses: Sequence[Mapping[str, Any]]) -> bool:
        """Adopt the newest whole configuration the replicas report; if its primary came
        back empty (catching up), promote a healthy replica; if it does not answer and
        may be dropped, drop it. Returns whether the primary changed."""
        g = self.group
        before = (g.epoch, g.primary)
        found = newest(statuses, g.size)
        if found is not None and found.epoch > g.epoch and g.follow_epochs:
            g._adopt(found)
        current = statuses[g.primary] if g.primary < len(statuses) else {}
        if current.get("catching_up") and not current.get("error"):
            await self.promote_healthy(statuses)
        elif current.get("error") and self.droppable([g.primary]):
            await self._drop([g.primary])
        return (g.epoch, g.primary) != before

    async def promote_healthy(self, statuses: Sequence[Mapping[str, Any]]) -> int | None:
        """Make the lowest-indexed replica that answers and is not catching up the primary
        under a new epoch (every holder picks the same one, so two promoting at once agree);
        returns it, or None (logged) when no replica can lead: reads then keep failing and
        writes keep needing every replica, so nothing is acknowledged on fewer copies."""
        g = self.group
        inside = g.members()
        healthy = [
            i
            for i, s in enumerate(statuses)
            if i in inside and not s.get("error") and not s.get("catching_up")
        ]
        if not healthy:
            log.error("%s: no healthy replica to promote: %s", g.name, statuses)
            return None
        index = healthy[0]
        epoch = 1 + max([g.epoch, *(s.get("epoch", 0) for s in statuses if not s.get("error"))])
        in_sync = None if g.in_sync is None else list(g.in_sync)
        results = await asyncio.gather(
            *(
                g._call(i, "set_epoch", epoch, index, in_sync, deadline_s=None)
                for i in range(g.size)
            ),
            return_exceptions=True,
        )
        if results[index] != epoch:  # it went down, or another holder promoted further
            log.warning("%s: promoting %d under epoch %d: %r", g.name, index, epoch, results)
            await self.refresh()
            return None
        g.epoch, g.primary = epoch, index
        log.warning(
            "%s: replica %d promoted under epoch %d (the primary came back empty); "
            "not acknowledged by %s",
            g.name,
            index,
            epoch,
            [i for i, r in enumerate(results) if r != epoch],
        )
        return index

    # -- healing -----------------------------------------------------------------------

    async def catch_up(
        self,
        index: int,
        *,
        source: int | None = None,
        chunk: int = 2000,
        timeout_s: float = 600.0,
        rejoin: bool = False,
    ) -> int:
        """Copy every entry of `source` (default: the primary) into replica `index`; see
        `LoggerGroup.catch_up`. Returns the number of entries copied."""
        g = self.group
        src = g.primary if source is None else source
        if src == index:
            raise ValueError(f"replica {index} cannot catch up from itself")
        for pending in (self.missed, self.suspects, self.scan_at):
            pending.pop(index, None)
        call_deadline = max(g.deadline_s, 30.0)
        deadline = time.monotonic() + timeout_s
        copy = uuid.uuid4().hex
        self.behind.add(index)
        await g._call(index, "begin_catch_up", g.epoch, copy, deadline_s=call_deadline)
        if rejoin and not await self._announce(with_(g.config(), index, g.size)):
            return 0
        cursor: bytes | None = None
        copied = 0
        while True:
            if time.monotonic() > deadline:
                raise LogUnavailable(g.replica_name(index), f"catch-up over {timeout_s}s")
            entries, cursor = await g._call(src, "export", cursor, chunk, deadline_s=call_deadline)
            if entries:
                await g._call(index, "import_", g.epoch, entries, deadline_s=call_deadline)
                copied += len(entries)
            if cursor is None:
                break
        await g._call(index, "finish_catch_up", g.epoch, copy, deadline_s=call_deadline)
        self.behind.discard(index)
        log.info("%s caught up from %s: %d entries", g.replica_name(index), src, copied)
        return copied

    async def heal(self) -> dict[int, int]:
        """Catch up replicas that came back empty or were dropped and answer again, and
        reconcile the others; see `LoggerGroup.heal`. Returns {index: entries copied}."""
        g = self.group
        statuses = await self.status()
        if await self.follow_primary(statuses):
            statuses = await self.status()
        primary = statuses[g.primary] if g.primary < len(statuses) else {}
        if primary.get("error") or primary.get("catching_up"):
            return {}  # nothing trustworthy to copy from (no healthy replica: logged)
        healed: dict[int, int] = {}
        inside = g.members()
        for i, st in enumerate(statuses):
            if i != g.primary and i in inside and st.get("catching_up"):
                healed[i] = await self.catch_up(i)
        for i, st in enumerate(statuses):
            if i not in inside and not st.get("error"):
                try:
                    healed[i] = await self.catch_up(i, rejoin=True)
                except (LogUnavailable, FencedError) as err:  # the next heal tries again
                    log.warning("%s: taking %d back: %s", g.name, i, err)
        for i, st in enumerate(statuses):
            ok = not st.get("error") and not st.get("catching_up")
            if ok and i != g.primary and i in inside and i not in healed:
                await self._reconcile(i, primary, st)
        return healed

    async def _reconcile(
        self, index: int, primary: Mapping[str, Any], status: Mapping[str, Any]
    ) -> int:
        """Drop from replica `index` the entries the primary no longer holds (forgets it
        missed): first the ones this holder saw it miss, then, when its counts differ from
        the primary's, one page of a key scan compared with the primary. An entry absent
        from the primary is dropped only when still absent `reconcile_grace_s` after it was
        first seen (an append in flight may have reached this replica first). Returns the
        entries dropped."""
        g = self.group
        dropped = 0
        missed = self.missed.pop(index, None)
        if missed:
            try:
                await g._call(index, "forget", g.epoch, list(missed), {}, deadline_s=None)
            except (LogUnavailable, FencedError):
                self.missed.setdefault(index, {}).update(missed)
                return 0
            dropped += len(missed)
        now = time.monotonic()
        suspects = self.suspects.setdefault(index, {})
        ripe = [k for k, seen in suspects.items() if now - seen >= g.reconcile_grace_s]
        if ripe:
            held = await g._call(g.primary, "holds", ripe, deadline_s=None)
            gone = [k for k, h in zip(ripe, held, strict=True) if not h]
            if gone:
                keys = [_split_key(k) for k in gone]
                await g._call(index, "forget", g.epoch, keys, {}, deadline_s=None)
                dropped += len(gone)
            for k in ripe:
                suspects.pop(k, None)
        mine, theirs = status.get("counts", {}), primary.get("counts", {})
        differ = any(mine.get(f) != theirs.get(f) for f in ("transient", "failed"))
        if differ or index in self.scan_at:
            page, cursor = await g._call(
                index, "entry_keys", self.scan_at.get(index), g.reconcile_page, deadline_s=None
            )
            held = await g._call(g.primary, "holds", page, deadline_s=None) if page else []
            for k, h in zip(page, held, strict=True):
                if not h:
                    suspects.setdefault(k, now)
            if cursor is None:
                self.scan_at.pop(index, None)
            else:
                self.scan_at[index] = cursor
        if dropped:
            log.warning(
                "%s: replica %d reconciled: %d entries the primary dropped",
                g.name,
                index,
                dropped,
            )
        return dropped
