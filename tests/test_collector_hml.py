"""HML: the raw events are in the group commit's batch before the stream's logic runs.

Unit tests of `GroupCommitter.enqueue` and `IngestPath.log_and_process` with the log's
flush and the logic faked (no Ray, no HTTP).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from actors.collection.group_commit import GroupCommitPolicy, GroupCommitter, Overloaded
from actors.collection.handoff import BridgeHandoff
from actors.collection.ingest import COUNTERS, IngestPath
from runtime.config import validate
from runtime.data.events import Event


def _events(tag: str, n: int) -> list[Event]:
    return [Event(f"{tag}-{i}", "s", "raw.s", b"{}", 0) for i in range(n)]


class _Log:
    """The log's flush: records every batch and when it finished."""

    def __init__(self) -> None:
        self.flushed: list[list[str]] = []

    async def __call__(self, events: list[Event]) -> None:
        await asyncio.sleep(0)
        self.flushed.append([e.id for e in events])


class _Logic:
    """Keeps every event; notes what the committer held when it ran, or raises."""

    def __init__(self, committer: GroupCommitter[Any], fail: bool = False) -> None:
        self.committer = committer
        self.fail = fail
        self.seen_pending: list[int] = []

    def apply(self, items: list[Event]) -> Any:
        self.seen_pending.append(self.committer.pending_events)
        if self.fail:
            raise RuntimeError("logic broke")
        return SimpleNamespace(kept=list(items), invalid=[], dropped=[])


def _ingest(
    *, fail: bool = False, max_pending: int = 100
) -> tuple[IngestPath, _Log, _Logic, GroupCommitter[Any]]:
    cfg = validate({"logging": {"mode": "hml"}, "streams": {"s": {"subjects": ["raw.s"]}}})
    log = _Log()
    committer: GroupCommitter[Any] = GroupCommitter(
        log, GroupCommitPolicy(1000, 1 << 20, 1.0), max_pending_events=max_pending
    )
    counters = dict.fromkeys(COUNTERS, 0)
    bridge = BridgeHandoff(["bridge-0"], namespace="test", logger_name="log", counters=counters)
    ingest = IngestPath(
        cfg,
        logger=SimpleNamespace(name="log"),  # type: ignore[arg-type]
        committer=committer,
        bridge=bridge,
        counters=counters,
    )
    logic = _Logic(committer, fail)
    ingest.logic = {"s": logic}  # type: ignore[dict-item]
    return ingest, log, logic, committer


@pytest.mark.unit
async def test_hml_events_are_in_the_batch_before_the_logic_runs() -> None:
    ingest, log, logic, committer = _ingest()
    events = _events("a", 5)
    out = await asyncio.wait_for(ingest.log_and_process(events), 10)
    assert logic.seen_pending == [5]  # taken by the committer before the logic ran
    assert log.flushed == [[e.id for e in events]]  # and logged before the answer
    assert out == events and committer.pending_events == 0
    await committer.aclose()


@pytest.mark.unit
async def test_hml_logic_error_still_logs_the_raw_events_then_raises() -> None:
    ingest, log, logic, committer = _ingest(fail=True)
    events = _events("b", 3)
    with pytest.raises(RuntimeError, match="logic broke"):
        await asyncio.wait_for(ingest.log_and_process(events), 10)
    assert log.flushed == [[e.id for e in events]]  # the raise came after the log write
    assert committer.pending_events == 0
    await committer.aclose()


@pytest.mark.unit
async def test_hml_overload_refuses_before_the_logic_and_takes_nothing() -> None:
    ingest, log, logic, committer = _ingest(max_pending=4)
    with pytest.raises(Overloaded):
        await ingest.log_and_process(_events("c", 5))
    assert logic.seen_pending == [] and committer.pending_events == 0
    await committer.aclose()
    assert log.flushed == []


@pytest.mark.unit
async def test_enqueue_takes_events_at_once_and_refuses_synchronously() -> None:
    log = _Log()
    gc: GroupCommitter[Any] = GroupCommitter(
        log, GroupCommitPolicy(1000, 1 << 20, 1.0), max_pending_events=6
    )
    first = gc.enqueue(_events("d", 4))
    assert gc.pending_events == 4  # no await yet: already in the open batch
    with pytest.raises(Overloaded):
        gc.enqueue(_events("e", 3))  # raised by the call itself, nothing taken
    assert gc.pending_events == 4
    second = gc.enqueue(_events("f", 2))
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert log.flushed == [[f"d-{i}" for i in range(4)] + ["f-0", "f-1"]]  # one flush
    await gc.aclose()


@pytest.mark.unit
async def test_next_flush_starts_before_the_finished_batchs_submitters_resume() -> None:
    """What a submitter does after its flush (answer, hand off, logic) runs while the
    next batch's write is in flight, not ahead of it."""
    order: list[str] = []
    gate = asyncio.Event()

    async def flush(events: list[Event]) -> None:
        order.append(f"flush {events[0].id}")
        if events[0].id == "a-0":
            await gate.wait()

    gc: GroupCommitter[Any] = GroupCommitter(flush, GroupCommitPolicy(1000, 1 << 20, 0.0))

    async def submitter(tag: str) -> None:
        await gc.submit(_events(tag, 1))
        order.append(f"resumed {tag}")

    first = asyncio.create_task(submitter("a"))
    for _ in range(100):  # bounded: a's flush starts within a few loop turns
        if order:
            break
        await asyncio.sleep(0)
    assert order == ["flush a-0"]
    second = asyncio.create_task(submitter("b"))
    for _ in range(100):
        if gc.pending_events == 2:
            break
        await asyncio.sleep(0)
    assert gc.pending_events == 2  # b waits in the open batch while a's flush runs
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert order == ["flush a-0", "flush b-0", "resumed a", "resumed b"]
    await gc.aclose()
