"""A cancellation that nats-py's publish swallowed (its `_flush_pending` catches
`CancelledError`) is raised again by runtime/nats/server.py's wrappers, so a loop around a
publish ends when its task is cancelled; the lease notes the revision it wrote first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from runtime.nats.lease import KvLease
from runtime.nats.server import js_publish, publish

pytestmark = pytest.mark.unit

ROUNDS = 200  # bounded: a loop that lost its cancel runs every round


async def _flush() -> None:
    """nats-py's flush: a cancel landing in it is caught and dropped."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0.002)


class SwallowingNc:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, str, Any]] = []

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: Any = None
    ) -> None:
        self.sent.append((subject, payload, reply, headers))
        await _flush()

    def jetstream(self, timeout: float) -> SwallowingJs:
        return SwallowingJs()


class Ack:
    def __init__(self, seq: int) -> None:
        self.seq = seq


class SwallowingJs:
    def __init__(self) -> None:
        self.seq = 0

    async def publish(self, subject: str, payload: bytes, **kw: Any) -> Ack:
        await _flush()
        self.seq += 1
        return Ack(self.seq)


async def rounds_until_cancelled(step: Callable[[], Awaitable[Any]]) -> int:
    """How many rounds a loop around `step` runs when cancelled after its first few."""
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        for _ in range(ROUNDS):
            rounds += 1
            await step()

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0.02)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled() or rounds == ROUNDS
    return rounds


async def test_the_fake_flush_loses_a_cancel_as_nats_py_does() -> None:
    """The control: a bare publish loop runs on after its cancel."""
    nc = SwallowingNc()
    assert await rounds_until_cancelled(lambda: nc.publish("s", b"x")) == ROUNDS


async def test_publish_raises_the_swallowed_cancel() -> None:
    nc = SwallowingNc()
    rounds = await rounds_until_cancelled(
        lambda: publish(nc, "s", b"x", reply="r", headers={"h": "1"})  # type: ignore[arg-type]
    )
    assert rounds < ROUNDS // 2
    assert nc.sent[0] == ("s", b"x", "r", {"h": "1"})


async def test_js_publish_raises_the_swallowed_cancel() -> None:
    js = SwallowingJs()
    rounds = await rounds_until_cancelled(lambda: js_publish(js, "s", b"x"))  # type: ignore[arg-type]
    assert rounds < ROUNDS // 2


async def test_a_renewal_loop_ends_on_its_cancel_holding_the_revision_it_wrote() -> None:
    """A lease renewed in a loop stops when cancelled, and its revision is the last one
    written, so a release can still delete the key at that revision."""
    kv: Any = type("Kv", (), {"_pre": "$KV.leases.", "_stream": "KV_leases"})()
    lease = KvLease(SwallowingNc(), kv, "k", holder="me", ttl_s=3)  # type: ignore[arg-type]
    js = lease._js
    assert await lease.try_acquire()
    rounds = await rounds_until_cancelled(lease.renew)
    assert rounds < ROUNDS // 2
    assert lease.revision == js.seq
