"""Logger replicas that drift from the primary, on a real local Ray with real LevelDB: a
forget one replica missed is reconciled, the drained check looks at every replica, a
primary back on an empty disk is replaced by a promoted replica (new epoch) and rebuilt,
and a replica that cannot come back makes writes answer an error with a reason instead of
hanging."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.queue.logger import (
    FAULT_SUFFIX,
    LogFull,
    LoggerGroup,
    LogUnavailable,
    key_of,
    replace_replica,
)
from cluster.deploy.logger import start_logger_group
from cluster.pipeline import _wait_logger_empty
from runtime.data.events import Event
from runtime.state.replication import ReplicaGroup
from runtime.waiting import WaitTimeout, await_until
from tests.support import fresh_ray

NAMESPACE = f"test-log-replicas-{uuid.uuid4().hex[:8]}"
BIG = 1 << 40
HANG_GUARD_S = 120.0  # a call still pending after this is a hang, not a slow machine


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    with fresh_ray(NAMESPACE):
        yield


def ev(i: int, *, token: str = "") -> Event:
    return Event(f"e{i:04d}", "s", "s.raw", b'{"n": %d}' % i, 1_000, token=token)


async def start(
    name: str, state_dir: Path, max_events: int = 100_000
) -> tuple[ReplicaGroup, LoggerGroup]:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        None,
        lambda: start_logger_group(
            name, 1, state_dir, NAMESPACE, max_events=max_events, max_bytes=BIG
        ),
    )


async def transient(group: ReplicaGroup) -> list[int]:
    return [(await h.counts.remote())["transient"] for h in group.replicas]


def fault(state_dir: Path, replica: str) -> Path:
    """The chaos hook: while this file exists every write of that replica's store fails."""
    path = state_dir / "logger" / (replica + FAULT_SUFFIX)
    path.write_text("error")
    return path


async def test_forget_missed_by_a_replica_is_retried_by_heal(
    ray_local: None, tmp_path: Path
) -> None:
    group, client = await start("lr4a", tmp_path)
    try:
        events = [ev(i) for i in range(20)]
        await client.append(events)
        broken = fault(tmp_path, "lr4a-1")
        with pytest.raises(LogUnavailable) as err:
            await client.forget([key_of(e) for e in events])
        assert err.value.replica == "lr4a-1"
        assert await transient(group) == [0, 20]  # the primary dropped what lr4a-1 keeps
        assert not await client.drained()  # the primary alone would say drained
        broken.unlink()

        await client.heal()
        assert await transient(group) == [0, 0]
        assert await client.drained()
    finally:
        group.shutdown()


async def test_missed_forgets_stop_counting_against_the_bound_once_healed(
    ray_local: None, tmp_path: Path
) -> None:
    """Entries a replica kept after a missed forget fill its bound: every append is refused
    (LogFull) although the primary is empty, until heal reconciles the replica."""
    group, client = await start("lr4c", tmp_path, max_events=20)
    try:
        events = [ev(i) for i in range(20)]
        await client.append(events)
        broken = fault(tmp_path, "lr4c-1")
        with pytest.raises(LogUnavailable):
            await client.forget([key_of(e) for e in events])
        broken.unlink()
        with pytest.raises(LogFull):
            await client.append([ev(100)])
        await client.heal()
        await client.append([ev(100)])
        assert await transient(group) == [1, 1]
    finally:
        group.shutdown()


async def test_a_fresh_client_reconciles_a_replica_holding_what_the_primary_dropped(
    ray_local: None, tmp_path: Path
) -> None:
    """The client that saw the forget fail is gone (a restarted bridge): heal compares the
    replicas with the primary, and drops an entry only once it was absent from the primary
    on two passes `grace` apart (an append in flight reaches the replicas one by one)."""
    group, client = await start("lr4b", tmp_path)
    try:
        events = [ev(i) for i in range(30)]
        await client.append(events)
        broken = fault(tmp_path, "lr4b-1")
        with pytest.raises(LogUnavailable):
            await client.forget([key_of(e) for e in events[:10]])
        broken.unlink()
        assert await transient(group) == [20, 30]

        fresh = LoggerGroup.of(group)
        fresh.reconcile_grace_s = 0.0
        await fresh.heal()  # first sight: suspects only
        assert await transient(group) == [20, 30]
        await fresh.heal()  # still absent from the primary: dropped on the replica
        assert await transient(group) == [20, 20]
        keys = [await h.export.remote(None, 1000) for h in group.replicas]
        assert keys[0][0] == keys[1][0]  # same entries, same values
        assert not await fresh.drained()  # 20 still to publish
    finally:
        group.shutdown()


async def test_primary_back_on_an_empty_disk_is_replaced_by_a_promoted_replica(
    ray_local: None, tmp_path: Path
) -> None:
    group, client = await start("lr5", tmp_path)
    try:
        events = [ev(i, token="T" if i < 10 else "") for i in range(50)]
        await client.append(events)
        await client.forget([key_of(e) for e in events[:5]], {key_of(events[0]): ("S", 1)})
        old_epoch = client.epoch
        assert client.primary == 0
        collector_client = LoggerGroup.of(group)  # another holder, e.g. the collector's

        # the primary's disk is lost and Ray restarts it on an empty directory
        victim = group.replicas[0]
        beat = await victim.heartbeat.remote()
        shutil.rmtree(tmp_path / "logger" / "lr5-0")
        os.kill(beat["pid"], signal.SIGKILL)

        async def back_empty() -> dict[str, Any] | None:
            st = await victim.status.remote()
            return st if st["pid"] != beat["pid"] else None

        st = await await_until(back_empty, timeout=60, swallow=True, what="lr5-0 restarted")
        assert st["catching_up"] is True and st["counts"]["transient"] == 0

        # reads through the collector's client work again: a healthy replica is promoted
        status = await asyncio.wait_for(collector_client.token_status("T"), HANG_GUARD_S)
        assert status is not None and status["state"] == "logged" and status["acked"] == 5
        assert collector_client.primary == 1 and collector_client.epoch > old_epoch
        # the group's counts (status, autoscaling, scale-down) come from a primary that
        # holds the data, never from the empty one
        assert (await LoggerGroup.of(group).counts())["transient"] == 45

        # the bridge's heal adopts that epoch and rebuilds the empty replica from the new primary
        healed = await asyncio.wait_for(client.heal(), HANG_GUARD_S)
        assert healed == {0: 45 + 1}  # 45 entries and the token record
        assert (client.primary, client.epoch) == (1, collector_client.epoch)
        for h in group.replicas:
            s = await h.status.remote()
            assert (s["epoch"], s["primary"], s["catching_up"]) == (client.epoch, 1, False)
        assert await transient(group) == [45, 45]
        pending = await client.pending(older_than_ms=0, now_ms=10_000, limit=100)
        assert [e.id for e in pending] == [e.id for e in events[5:]]

        # writes from either client land on both replicas (k+1)
        await asyncio.wait_for(collector_client.append([ev(100)]), HANG_GUARD_S)
        await asyncio.wait_for(client.append([ev(101)]), HANG_GUARD_S)
        assert await transient(group) == [47, 47]

        # the controller (driver side) did not make that promotion: replacing a replica
        # through it copies from the primary the replicas name, not its stale one
        assert group.primary == 0
        copied = await asyncio.wait_for(replace_replica(group, 0), HANG_GUARD_S)
        assert copied == 47 + 1
        assert await transient(group) == [47, 47]

        # a replica that cannot come back: writes are refused with a reason, never hang
        ray.kill(group.replicas[0], no_restart=True)
        with pytest.raises(LogUnavailable) as err:
            await asyncio.wait_for(client.append([ev(102)]), HANG_GUARD_S)
        assert err.value.replica == "lr5-0" and err.value.reason
    finally:
        group.shutdown()


async def test_store_wiped_under_a_running_primary_is_rebuilt_not_trusted(
    ray_local: None, tmp_path: Path
) -> None:
    """The primary's directory is deleted while it runs and its LogWriter restarts in the
    same process (no `__init__` rerun): the reopened empty store must not pass for the
    primary's data (heal would reconcile the healthy replica against it and drop what it
    holds). It is marked catching up, a healthy replica is promoted, and it is rebuilt."""
    group, client = await start("lr5w", tmp_path)
    try:
        events = [ev(i) for i in range(40)]
        await client.append(events)
        shutil.rmtree(tmp_path / "logger" / "lr5w-0")
        await group.replicas[0].crash_writer.remote()  # reopens an empty directory

        async def reopened_empty() -> bool:
            return (await group.replicas[0].counts.remote())["transient"] == 0

        await await_until(reopened_empty, timeout=60, swallow=True, what="writer reopened")
        client.reconcile_grace_s = 0.0
        for _ in range(3):  # reconciliation needs two passes: give it every chance
            await asyncio.wait_for(client.heal(), HANG_GUARD_S)
        assert client.primary == 1
        assert await transient(group) == [40, 40]
        pending = await client.pending(older_than_ms=0, now_ms=10_000, limit=100)
        assert [e.id for e in pending] == [e.id for e in events]
    finally:
        group.shutdown()


async def test_scale_down_waits_for_every_replica_to_drain(ray_local: None, tmp_path: Path) -> None:
    """`tierflow scale logger` shuts a group down once it is drained: while a replica still
    holds entries (a forget it missed), the wait must not see the group drained from the
    primary's counts alone."""
    group, client = await start("lr4d", tmp_path)
    loop = asyncio.get_running_loop()
    try:
        events = [ev(i) for i in range(10)]
        await client.append(events)
        broken = fault(tmp_path, "lr4d-1")
        with pytest.raises(LogUnavailable):
            await client.forget([key_of(e) for e in events])
        broken.unlink()
        with pytest.raises(WaitTimeout):  # nothing changes the replica until heal runs
            await loop.run_in_executor(None, lambda: _wait_logger_empty(client, timeout_s=3))
        await client.heal()
        await loop.run_in_executor(None, lambda: _wait_logger_empty(client, timeout_s=60))
    finally:
        group.shutdown()
