"""A logger group with one replica more than k+1, on a real local Ray with real LevelDB:
an in-sync replica that stops answering (SIGSTOP, as a cut-off host looks) is dropped and
writes go on at once; it is copied back in once it answers; writes never stand on fewer
than k+1 copies; a replica left out is emptied and copied before it counts after the
group restarts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.queue.logger import FAULT_SUFFIX, LoggerGroup, LogUnavailable
from cluster.deploy.logger import start_logger_group
from runtime.data.events import Event
from runtime.state.replication import ReplicaGroup
from runtime.waiting import await_until
from tests.support import fresh_ray

NAMESPACE = f"test-in-sync-{uuid.uuid4().hex[:8]}"
BIG = 1 << 40
DROP_AFTER_S = 1.0


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    with fresh_ray(NAMESPACE):
        yield


def ev(i: int) -> Event:
    return Event(f"e{i:04d}", "s", "s.raw", b'{"n": %d}' % i, 1_000)


async def start(name: str, state_dir: Path) -> tuple[ReplicaGroup, LoggerGroup]:
    return await asyncio.to_thread(
        start_logger_group,
        name,
        1,
        state_dir,
        NAMESPACE,
        max_bytes=BIG,
        extra=1,
        drop_after_s=DROP_AFTER_S,
    )


async def transient(group: ReplicaGroup, index: int) -> int:
    return int((await group.replicas[index].counts.remote())["transient"])


@contextlib.contextmanager
def paused(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


async def pid(group: ReplicaGroup, index: int) -> int:
    return int((await group.replicas[index].status.remote())["pid"])


async def test_a_silent_replica_is_dropped_and_writes_go_on(
    ray_local: None, tmp_path: Path
) -> None:
    group, client = await start("isr-a", tmp_path)
    stale = LoggerGroup.of(group, need=2, drop_after_s=DROP_AFTER_S)  # another holder
    try:
        await client.append([ev(i) for i in range(20)])
        assert client.members() == (0, 1, 2)
        epoch = client.epoch
        with paused([await pid(group, 2)]):
            # a write the silent replica would have blocked for `deadline_s`, then failed
            await asyncio.wait_for(client.append([ev(i) for i in range(20, 40)]), 30)
            assert client.members() == (0, 1)
            assert client.epoch == epoch + 1
            # a holder still on the old epoch is refused by the members, follows the new
            # set and writes on it without dropping anything more
            await asyncio.wait_for(stale.append([ev(i) for i in range(40, 50)]), 30)
            assert (stale.epoch, stale.members()) == (epoch + 1, (0, 1))
            assert [await transient(group, i) for i in (0, 1)] == [50, 50]

        async def back_in() -> bool:
            await client.heal()
            status = await group.replicas[2].status.remote()
            return client.members() == (0, 1, 2) and not status["catching_up"]

        await await_until(back_in, timeout=60, interval=0.5, what="replica 2 back in the set")
        assert await transient(group, 2) == 50
        await client.append([ev(i) for i in range(50, 55)])
        assert [await transient(group, i) for i in range(3)] == [55, 55, 55]
    finally:
        group.shutdown()


async def test_writes_stop_rather_than_stand_on_fewer_than_k_plus_one(
    ray_local: None, tmp_path: Path
) -> None:
    group, client = await start("isr-b", tmp_path)
    try:
        await client.append([ev(i) for i in range(10)])
        with paused([await pid(group, 1), await pid(group, 2)]):
            with pytest.raises(LogUnavailable):
                await asyncio.wait_for(client.append([ev(i) for i in range(10, 20)]), 60)
            assert client.members() == (0, 1, 2)
        await client.append([ev(i) for i in range(10, 20)])  # the producer's resend
        assert [await transient(group, i) for i in range(3)] == [20, 20, 20]
    finally:
        group.shutdown()


async def test_a_left_out_replica_is_copied_before_it_counts_after_a_restart(
    ray_local: None, tmp_path: Path
) -> None:
    group, client = await start("isr-c", tmp_path)
    try:
        await client.append([ev(i) for i in range(10)])
        broken = tmp_path / "logger" / ("isr-c-0" + FAULT_SUFFIX)  # the primary's store
        broken.write_text("error")
        await client.append([ev(i) for i in range(10, 30)])
        broken.unlink()
        assert client.members() == (1, 2)
        assert client.primary == 1
        assert await transient(group, 0) == 10  # it missed what came while it was out
    finally:
        group.shutdown()
    group, client = await start("isr-c", tmp_path)
    try:
        assert client.primary == 1
        assert [await transient(group, i) for i in range(3)] == [30, 30, 30]
        assert not (await group.replicas[0].status.remote())["catching_up"]
    finally:
        group.shutdown()
