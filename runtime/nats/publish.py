"""nats-py's publishes for code inside a cancellable loop.

nats-py flushes through `_flush_pending`, which catches `CancelledError` and carries on, so a
cancel landing there is lost (`raise_swallowed_cancel`). A leaf module (asyncio only), so the
lease and the Spark source's processes can use it without importing runtime/nats/server.py.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.api import PubAck


def raise_swallowed_cancel() -> None:
    """Raise the current task's cancellation if nats-py swallowed it.

    nats-py's publish (and every request built on it: `js.publish`, KV puts) flushes
    through `_flush_pending`, which catches `CancelledError` and returns, so a cancel
    landing there is lost and a loop around the publish runs on. A stopped webhook sender
    kept fetching and posting until its lease went stale (a gateway's shutdown took 30 s).
    Call it after such a call, once what it returned is recorded."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def publish(
    nc: Client,
    subject: str,
    payload: bytes = b"",
    *,
    reply: str = "",
    headers: dict[str, str] | None = None,
) -> None:
    """`nc.publish` that raises a cancellation it swallowed (see `raise_swallowed_cancel`)."""
    await nc.publish(subject, payload, reply=reply, headers=headers)
    raise_swallowed_cancel()


async def js_publish(js: JetStreamContext, subject: str, payload: bytes, **kw: Any) -> PubAck:
    """`js.publish` that raises a cancellation it swallowed; the message may be stored then
    (as with any cancel after sending), so its writer needs a dedup id or a fence."""
    ack = await js.publish(subject, payload, **kw)
    raise_swallowed_cancel()
    return ack


__all__ = ["js_publish", "publish", "raise_swallowed_cancel"]
