"""`LoggerGroup` and its in-sync set (`membership.py`) against in-process fake replicas: the
epochs a holder announces when it drops a silent member, takes one back or promotes a
healthy primary, the errors a write raises, forgets a replica missed sent again by `heal`,
and the client pickling with what it knows of the set. No Ray: the fakes answer
`handle.method.remote(...)` with a coroutine, as an ObjectRef would be awaited."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
from ray import cloudpickle

from actors.queue.logger.errors import LogFull, LogUnavailable
from actors.queue.logger.group import LoggerGroup
from actors.queue.logger.membership import Membership
from actors.queue.logger.records import _key, _split_key, decode_forget
from runtime.data.events import Event, decode_batch, encode_batch
from runtime.inline import join_parts
from runtime.state.replication import Fence, FencedError

pytestmark = pytest.mark.unit

DROP_AFTER_S = 0.05
DEADLINE_S = 0.3


class FakeReplica:
    """One replica in memory: a `Fence`, the entries it holds, and faults to play."""

    def __init__(self, index: int, peers: int) -> None:
        self.index = index
        self.fence = Fence()
        self.entries: dict[bytes, bytes] = {}
        self.catching_up = False
        self.silent = False  # never answers
        self.refuse: BaseException | None = None  # raised by every call
        self.calls: list[str] = []

    async def _gate(self) -> None:
        if self.silent:
            await asyncio.Event().wait()
        if self.refuse is not None:
            raise self.refuse

    async def set_epoch(self, epoch: int, primary: int, in_sync: list[int] | None = None) -> int:
        await self._gate()
        self.fence.advance(epoch, primary, in_sync)
        return self.fence.epoch

    async def append(self, epoch: int, batch: bytes, *more: bytes) -> int:
        await self._gate()
        self.fence.check(epoch)
        new = 0
        for ev in decode_batch(join_parts(batch, more)):
            new += _key(ev.stream, ev.id) not in self.entries
            self.entries.setdefault(_key(ev.stream, ev.id), encode_batch([ev]))
        return new

    async def forget(self, epoch: int, keys: Any, seqs: Any = None) -> int:
        await self._gate()
        self.fence.check(epoch)
        listed = decode_forget(keys)[0] if isinstance(keys, bytes) else [_key(*k) for k in keys]
        return sum(self.entries.pop(k, None) is not None for k in listed)

    async def status(self) -> dict[str, Any]:
        await self._gate()
        return {
            "epoch": self.fence.epoch,
            "primary": self.fence.primary,
            "in_sync": None if self.fence.in_sync is None else list(self.fence.in_sync),
            "catching_up": self.catching_up,
            "counts": await self.counts(),
        }

    async def counts(self, readable: bool = False) -> dict[str, int]:
        await self._gate()
        if readable and self.catching_up:
            raise LogUnavailable(f"g-{self.index}", "catching up from a peer")
        return {"transient": len(self.entries), "failed": 0, "tokens": 0}

    async def begin_catch_up(self, epoch: int, copy: str = "") -> None:
        await self._gate()
        self.fence.check(epoch)
        self.catching_up, self.entries = True, {}

    async def export(self, after: bytes | None, limit: int) -> tuple[list[Any], bytes | None]:
        await self._gate()
        keys = sorted(k for k in self.entries if after is None or k > after)[:limit]
        rest = len([k for k in self.entries if after is None or k > after]) > limit
        return [("e", k, self.entries[k]) for k in keys], (keys[-1] if rest else None)

    async def import_(self, epoch: int, entries: list[Any]) -> int:
        await self._gate()
        self.fence.check(epoch)
        self.entries.update({k: v for _, k, v in entries})
        return len(entries)

    async def finish_catch_up(self, epoch: int, copy: str = "") -> None:
        await self._gate()
        self.fence.check(epoch)
        self.catching_up = False

    async def entry_keys(self, after: bytes | None, limit: int) -> tuple[list[bytes], None]:
        await self._gate()
        return sorted(self.entries)[:limit], None

    async def holds(self, keys: list[bytes]) -> list[bool]:
        await self._gate()
        return [k in self.entries for k in keys]


class _Method:
    def __init__(self, replica: FakeReplica, name: str) -> None:
        self.replica, self.name = replica, name

    def remote(self, *args: Any) -> Any:
        self.replica.calls.append(self.name)
        return getattr(self.replica, self.name)(*args)


class FakeHandle:
    """What `LoggerGroup._call` needs of a Ray actor handle."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.__dict__["replica"], name)


def group_of(size: int, **options: Any) -> tuple[LoggerGroup, list[FakeReplica]]:
    replicas = [FakeReplica(i, size) for i in range(size)]
    for r in replicas:
        r.fence.advance(1, 0)
    client = LoggerGroup(
        name="g",
        namespace="test",
        size=size,
        epoch=1,
        deadline_s=DEADLINE_S,
        handles=[FakeHandle(r) for r in replicas],
        **options,
    )
    return client, replicas


def events(n: int, start: int = 0) -> list[Event]:
    return [Event(f"e{i}", "s", "s.x", b"{}", 1) for i in range(start, start + n)]


@pytest.fixture
def droppable() -> Iterator[tuple[LoggerGroup, list[FakeReplica]]]:
    """Three replicas, writes need two, a member silent for DROP_AFTER_S may be dropped."""
    yield group_of(3, need=2, drop_after_s=DROP_AFTER_S)


def test_a_silent_member_is_dropped_under_the_next_epoch_and_the_write_stands(
    droppable: tuple[LoggerGroup, list[FakeReplica]], caplog: pytest.LogCaptureFixture
) -> None:
    client, replicas = droppable
    replicas[2].silent = True
    with caplog.at_level(logging.WARNING):
        asyncio.run(asyncio.wait_for(client.append(events(3)), DEADLINE_S))
    assert (client.epoch, client.primary, client.in_sync) == (2, 0, (0, 1))
    assert [r.fence.epoch for r in replicas] == [2, 2, 1]
    assert replicas[0].fence.in_sync == (0, 1) and len(replicas[1].entries) == 3
    assert client.members() == (0, 1)
    assert "dropped from the in-sync set under epoch 2" in caplog.text
    # the next write goes to the set only: the silent one is not waited for any more
    asyncio.run(asyncio.wait_for(client.append(events(1, 3)), DROP_AFTER_S * 4))
    assert len(replicas[0].entries) == 4 and len(replicas[2].entries) == 0


def test_a_silent_primary_hands_over_to_a_caught_up_member(
    droppable: tuple[LoggerGroup, list[FakeReplica]],
) -> None:
    client, replicas = droppable
    replicas[0].silent = True
    asyncio.run(client.append(events(2)))
    assert (client.epoch, client.primary, client.in_sync) == (2, 1, (1, 2))
    assert replicas[1].fence.primary == 1


def test_without_room_to_drop_a_silent_member_fails_the_write_after_the_deadline() -> None:
    client, replicas = group_of(2, need=2, drop_after_s=DROP_AFTER_S)
    replicas[1].silent = True
    with pytest.raises(LogUnavailable) as err:
        asyncio.run(client.append(events(1)))
    assert err.value.replica == "g-1" and f"{DEADLINE_S}s" in err.value.reason
    assert client.epoch == 1 and client.in_sync is None
    assert [r.fence.epoch for r in replicas] == [1, 1]


def test_a_failing_member_is_dropped_but_log_full_and_fenced_propagate(
    droppable: tuple[LoggerGroup, list[FakeReplica]],
) -> None:
    client, replicas = droppable
    replicas[1].refuse = LogUnavailable("g-1", "writer kept dying")
    asyncio.run(client.append(events(1)))
    assert client.in_sync == (0, 2)
    replicas[2].refuse = LogFull("g-2", "full")
    with pytest.raises(LogFull):
        asyncio.run(client.append(events(1, 1)))
    assert client.in_sync == (0, 2)  # a full log is not silent: no drop


def test_two_down_are_named_in_one_log_unavailable() -> None:
    client, replicas = group_of(3)
    for r in replicas[1:]:
        r.refuse = LogUnavailable(f"g-{r.index}", "down")
    with pytest.raises(LogUnavailable, match=r"down: g-1, g-2"):
        asyncio.run(client.append(events(1)))


def test_a_stale_client_follows_the_newer_epoch_or_raises_fenced() -> None:
    client, replicas = group_of(2)
    for r in replicas:
        r.fence.advance(5, 1)
    stale = dataclasses.replace(client, follow_epochs=False)
    with pytest.raises(FencedError):
        asyncio.run(stale.append(events(1)))
    asyncio.run(client.append(events(1)))
    assert (client.epoch, client.primary) == (5, 1)
    assert all(len(r.entries) == 1 for r in replicas)


def test_heal_takes_a_dropped_member_back_under_the_next_epoch(
    droppable: tuple[LoggerGroup, list[FakeReplica]],
) -> None:
    client, replicas = droppable
    replicas[2].silent = True
    asyncio.run(client.append(events(3)))
    replicas[2].silent = False
    healed = asyncio.run(client.heal())
    assert healed == {2: 3}
    assert (client.epoch, client.in_sync) == (3, (0, 1, 2))
    assert [r.fence.epoch for r in replicas] == [3, 3, 3]
    assert replicas[2].entries == replicas[0].entries and not replicas[2].catching_up
    assert asyncio.run(client.heal()) == {}  # all well: nothing to copy


def test_heal_promotes_a_healthy_replica_when_the_primary_came_back_empty() -> None:
    client, replicas = group_of(3)
    asyncio.run(client.append(events(4)))
    replicas[0].entries, replicas[0].catching_up = {}, True
    healed = asyncio.run(client.heal())
    assert (client.epoch, client.primary) == (2, 1)
    assert [r.fence.primary for r in replicas] == [1, 1, 1]
    assert healed == {0: 4} and not replicas[0].catching_up


def test_a_read_of_a_primary_back_empty_follows_the_promotion() -> None:
    client, replicas = group_of(2)
    asyncio.run(client.append(events(2)))
    replicas[0].catching_up = True
    assert asyncio.run(client.counts())["transient"] == 2
    assert (client.epoch, client.primary) == (2, 1)


def test_heal_sends_again_a_forget_a_replica_missed() -> None:
    client, replicas = group_of(3)
    asyncio.run(client.append(events(3)))
    replicas[2].refuse = LogUnavailable("g-2", "down")
    with pytest.raises(LogUnavailable):
        asyncio.run(client.forget([("s", "e0"), ("s", "e1")]))
    assert client._membership.missed == {2: {("s", "e0"): None, ("s", "e1"): None}}
    replicas[2].refuse = None
    asyncio.run(client.heal())
    assert [_split_key(k) for k in replicas[2].entries] == [("s", "e2")]
    assert client._membership.missed == {}


def test_refresh_adopts_the_newest_whole_configuration() -> None:
    client, replicas = group_of(3)
    for r in replicas[:2]:
        r.fence.advance(4, 1, [0, 1])
    replicas[2].silent = True
    assert asyncio.run(asyncio.wait_for(client.refresh(), DEADLINE_S * 2)) == 4
    assert (client.primary, client.in_sync) == (1, (0, 1))


def test_the_client_pickles_with_what_it_knows_of_the_set() -> None:
    client = LoggerGroup(name="g", namespace="test", size=3, epoch=2, in_sync=(0, 1))
    client._membership.behind.add(2)
    client._membership.missed[1] = {("s", "e0"): None}
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, pickle.loads)):
        copy = loads(dumps(client))
        assert isinstance(copy._membership, Membership)
        assert copy._membership.group is copy
        assert copy._membership.behind == {2} and copy._membership.missed == {
            1: {("s", "e0"): None}
        }
        assert (copy.epoch, copy.in_sync) == (2, (0, 1))
    fresh = dataclasses.replace(client, handles=[])
    assert fresh._membership.group is fresh and not fresh._membership.behind
    assert "_membership" not in repr(client)
    assert client == dataclasses.replace(client)
