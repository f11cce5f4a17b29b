"""MessageLogger on a real local Ray with real LevelDB: replica groups, crashes, catch-up,
fencing. One Ray instance for the module; each test starts its own small group (k=1)."""

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
    LogFull,
    LoggerGroup,
    LogUnavailable,
    inspect,
    key_of,
    replace_replica,
)
from actors.queue.logger.group import PUT_ONCE_BYTES
from cluster.deploy.logger import start_logger_group
from runtime.data.events import Event, encode_batch
from runtime.state.replication import FencedError, ReplicaGroup
from runtime.waiting import await_until
from tests.support import fresh_ray

NAMESPACE = f"test-logger-{uuid.uuid4().hex[:8]}"
BIG = 1 << 40


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    with fresh_ray(NAMESPACE):
        yield


def ev(i: int, *, token: str = "", ms: int = 1_000) -> Event:
    return Event(f"e{i:06d}", "s", "s.raw", b'{"n": %d}' % i, ms, token=token)


async def start(name: str, state_dir: Path, **kw: Any) -> tuple[ReplicaGroup, LoggerGroup]:
    kw.setdefault("max_events", 100_000)
    kw.setdefault("max_bytes", BIG)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        None, lambda: start_logger_group(name, 1, state_dir, NAMESPACE, **kw)
    )


async def keys_of(handle: Any, ns: str = "transient") -> set[str]:
    """The event id of every entry the replica holds in `ns`, via its export (keys are
    `stream NUL id`)."""
    keys: set[str] = set()
    cursor = None
    for _ in range(1000):
        entries, cursor = await handle.export.remote(cursor, 5000)
        keys |= {k.split(b"\x00", 1)[-1].decode() for n, k, _ in entries if n == ns}
        if cursor is None:
            return keys
    raise AssertionError("export did not finish")


async def export_all(handle: Any) -> list[tuple[str, bytes, bytes]]:
    out: list[tuple[str, bytes, bytes]] = []
    cursor = None
    for _ in range(1000):
        entries, cursor = await handle.export.remote(cursor, 5000)
        out += entries
        if cursor is None:
            return out
    raise AssertionError("export did not finish")


async def incarnation(handle: Any) -> str:
    return (await handle.heartbeat.remote())["incarnation"]


async def test_appends_and_forgets_agree_on_both_replicas(ray_local: None, tmp_path: Path) -> None:
    group, client = await start("lga", tmp_path)
    try:
        events = [ev(i, token=f"T{i // 500}" if i < 1000 else "") for i in range(10_000)]
        for b in range(0, len(events), 500):
            await client.append(events[b : b + 500])
        pad = b'{"pad": "%s"}' % (b"x" * 1000)
        big = [Event(f"big{i}", "s", "s.raw", pad, 1_000) for i in range(200)]
        assert len(encode_batch(big)) > PUT_ONCE_BYTES  # sent as parts Ray inlines, joined
        await client.append(big)
        await client.forget([key_of(e) for e in big])
        acked = [key_of(e) for e in events[::2]]
        for b in range(0, len(acked), 1000):
            part = acked[b : b + 1000]
            await client.forget(part, {k: ("s", n) for n, k in enumerate(part)})
        for handle in group.replicas:
            counts = await handle.counts.remote()
            scan = await handle.scan_counts.remote()
            assert counts["transient"] == 5_000 and counts["failed"] == 0
            assert {k: scan[k] for k in counts} == counts
        a, b = [await h.counts.remote() for h in group.replicas]
        assert a == b
        assert await keys_of(group.replicas[0]) == await keys_of(group.replicas[1])
        # reads through the client (primary)
        assert (await client.token_status("T0"))["state"] == "logged"  # odd ids still logged
        pending = await client.pending(older_than_ms=0, now_ms=2_000, limit=10)
        assert [e.id for e in pending] == [f"e{i:06d}" for i in range(1, 20, 2)]
        await client.fail([(pending[0], "nak")], now_ms=5_000)
        assert [e.id for e in await client.due_failed(now_ms=10_000)] == [pending[0].id]
        assert (await client.token_status("T0"))["state"] == "failed"
        assert [(await h.counts.remote())["failed"] for h in group.replicas] == [1, 1]
        # a crashed LogWriter inside a replica is restarted; the write goes through it
        await group.replicas[1].crash_writer.remote()
        await client.append([ev(20_000)])
        assert [(await h.counts.remote())["transient"] for h in group.replicas] == [5_000, 5_000]
    finally:
        group.shutdown()


async def test_sigkilled_replica_restarts_with_its_data(ray_local: None, tmp_path: Path) -> None:
    group, client = await start("lgb", tmp_path)
    try:
        acked: set[str] = set()
        first = [ev(i) for i in range(200)]
        await client.append(first)
        acked |= {e.id for e in first}
        victim = group.replicas[1]
        beat = await victim.heartbeat.remote()
        os.kill(beat["pid"], signal.SIGKILL)

        # keep writing while Ray restarts it: each append succeeds on both or raises
        outcomes = {"ok": 0, "unavailable": 0}
        n = 1_000
        restarted = False
        for _ in range(200):  # bounded; ends once the restarted replica took a write
            batch = [ev(n + j) for j in range(20)]
            n += 20
            try:
                await client.append(batch, deadline_s=1.0)
            except LogUnavailable as err:
                assert err.replica in ("lgb-0", "lgb-1")
                outcomes["unavailable"] += 1
                continue
            acked |= {e.id for e in batch}
            outcomes["ok"] += 1
            if not restarted:
                restarted = await incarnation(victim) != beat["incarnation"]
            else:
                break
        assert restarted, outcomes
        after = await victim.heartbeat.remote()
        assert after["pid"] != beat["pid"]
        # nothing acknowledged is missing from either replica
        for handle in group.replicas:
            assert acked <= await keys_of(handle)
            counts, scan = await handle.counts.remote(), await handle.scan_counts.remote()
            assert {k: scan[k] for k in counts} == counts
    finally:
        group.shutdown()


async def test_lost_replica_and_store_are_replaced_and_caught_up(
    ray_local: None, tmp_path: Path
) -> None:
    group, client = await start("lgc", tmp_path)
    try:
        events = [ev(i, token=f"T{i % 5}", ms=1_000 + i) for i in range(3_000)]
        for b in range(0, len(events), 500):
            await client.append(events[b : b + 500])
        await client.forget([key_of(e) for e in events[:1000]], None)
        await client.fail([(e, "nak") for e in events[1000:1100]], now_ms=50)

        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: ray.kill(group.replicas[1], no_restart=True))
        shutil.rmtree(tmp_path / "logger" / "lgc-1")
        with pytest.raises(LogUnavailable) as err:
            await client.append([ev(90_000)])
        assert err.value.replica == "lgc-1"

        copied = await replace_replica(group, 1, chunk=700)
        primary, fresh = group.replicas
        want = await export_all(primary)
        assert copied == len(want)
        assert await export_all(fresh) == want  # exactly the primary's entries
        stored = [await h.counts.remote() for h in (fresh, primary)]
        for c in stored:  # `logged` counts a process's own appends; a copy imports
            c.pop("logged")
        assert stored[0] == stored[1]
        status = await fresh.status.remote()
        assert status["catching_up"] is False and status["epoch"] == group.epoch
        # the old client finds the replacement by name and writes to both again
        await client.append([ev(90_001)])
        for handle in group.replicas:
            assert "e090001" in await keys_of(handle)
    finally:
        group.shutdown()


async def test_group_restart_catches_up_an_empty_replica(ray_local: None, tmp_path: Path) -> None:
    group, client = await start("lge", tmp_path)
    await client.append([ev(i) for i in range(300)])
    group.shutdown()  # every replica stops; the stores stay
    shutil.rmtree(tmp_path / "logger" / "lge-0")  # the primary's store is lost

    def stopped_row() -> dict[str, Any] | None:  # the killed process lets go of its LOCK
        rows = {r["replica"]: r for r in inspect(tmp_path)}
        return rows["lge-1"] if rows["lge-1"]["state"] == "ok" else None

    row = await await_until(stopped_row, timeout=30, what="lge-1 released")
    assert row["transient"] == 300

    group, client = await start("lge", tmp_path)
    try:
        assert group.primary == 1  # the replica with data leads
        for handle in group.replicas:
            assert (await handle.counts.remote())["transient"] == 300
            assert (await handle.status.remote())["catching_up"] is False
        rows = {r["replica"]: r for r in inspect(tmp_path)}
        assert rows["lge-0"]["state"] == "locked (running)"
    finally:
        group.shutdown()


async def test_old_epoch_is_fenced_on_every_replica(ray_local: None, tmp_path: Path) -> None:
    group, client = await start("lgd", tmp_path, max_events=50)
    client.follow_epochs = False  # a strict holder: adopts a new epoch only on purpose
    try:
        await client.append([ev(i) for i in range(10)])
        old = client.epoch
        loop = asyncio.get_running_loop()
        new = await loop.run_in_executor(None, group.promote, 1)
        assert new > old

        with pytest.raises(FencedError):
            await client.append([ev(100)])
        for handle in group.replicas:
            with pytest.raises(FencedError):
                await handle.append.remote(old, encode_batch([ev(101)]))
            with pytest.raises(FencedError):
                await handle.forget.remote(old, [("s", "e000001")], None)
            keys = await keys_of(handle)
            assert "e000100" not in keys and "e000101" not in keys
            assert "e000001" in keys

        # the fence is durable: a restarted replica still refuses the old epoch
        victim = group.replicas[0]
        beat = await victim.heartbeat.remote()
        os.kill(beat["pid"], signal.SIGKILL)
        await await_until(
            lambda: incarnation(victim), timeout=30, swallow=True, what="replica 0 answers"
        )
        with pytest.raises(FencedError):
            await victim.append.remote(old, encode_batch([ev(102)]))

        current = LoggerGroup.of(group)
        await current.append([ev(103)])
        assert current.primary == 1
        assert (await current.counts())["transient"] == 11
        # LogFull from the replicas propagates as LogFull; nothing of the batch lands
        with pytest.raises(LogFull):
            await current.append([ev(200 + i) for i in range(40)])
        assert [(await h.counts.remote())["transient"] for h in group.replicas] == [11, 11]
        # a stale client adopts the new epoch only on purpose
        assert await client.refresh() == new
        await client.append([ev(104)])
        # a following one (the default) adopts it when fenced, and resends
        follower = LoggerGroup.of(group)
        follower.epoch, follower.primary = old, 0
        await follower.append([ev(105)])
        assert (follower.epoch, follower.primary) == (new, 1)
        for handle in group.replicas:
            assert "e000105" in await keys_of(handle)
    finally:
        group.shutdown()
