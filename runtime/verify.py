"""Read back what a JetStream stream holds, to prove nothing acknowledged was lost.

The zero-loss verdict is: every acknowledged id is in the stream exactly once. That is
checked against the `Nats-Msg-Id` header of every stored message, read in bulk with an
ordered ephemeral consumer (one round trip per batch, not one per message).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MSG_ID = "Nats-Msg-Id"


async def stream_ids(
    nc: Any, stream: str, subject: str | None = None, *, batch: int = 2000, timeout: float = 60.0
) -> Counter[str]:
    """How many times each `Nats-Msg-Id` occurs in `stream` (optionally one subject)."""
    js = nc.jetstream()
    info = await js.stream_info(stream)
    last = info.state.last_seq
    found: Counter[str] = Counter()
    if info.state.messages == 0:
        return found
    sub = await js.pull_subscribe(
        subject or ">", stream=stream, config=_ordered_from(info.state.first_seq)
    )
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seq = 0
        while seq < last:
            if loop.time() > deadline:
                raise TimeoutError(f"read {sum(found.values())} of {stream} in {timeout} s")
            try:
                msgs = await sub.fetch(batch, timeout=2)
            except TimeoutError:
                if subject:  # a filtered read may end before the stream's last seq
                    break
                continue
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                found[(msg.headers or {}).get(MSG_ID, f"<no id, seq {seq}>")] += 1
    finally:
        await sub.unsubscribe()
    return found


def _ordered_from(start_seq: int) -> Any:
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    return ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start_seq,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
        max_waiting=1,
    )


@dataclass
class Verdict:
    """What a zero-loss check found."""

    acknowledged: int
    stored: int
    lost: list[str] = field(default_factory=list)
    duplicated: dict[str, int] = field(default_factory=dict)
    unexpected: int = 0  # stored ids no producer was told were accepted (allowed: see below)

    @property
    def ok(self) -> bool:
        return not self.lost and not self.duplicated

    def __str__(self) -> str:
        return (
            f"acknowledged {self.acknowledged}, stored {self.stored}, lost {len(self.lost)}, "
            f"duplicated {len(self.duplicated)}, unacknowledged-but-stored {self.unexpected}"
            + (f"; first lost {self.lost[:5]}" if self.lost else "")
            + (f"; first duplicated {list(self.duplicated.items())[:5]}" if self.duplicated else "")
        )


def judge(acknowledged: Iterable[str], stored: Counter[str]) -> Verdict:
    """Every acknowledged id exactly once; no id twice.

    An id stored but never acknowledged is legal (the producer timed out or got a 503
    after the log had it, and will retry with the same id): counted, not a failure.
    """
    acked = set(acknowledged)
    return Verdict(
        acknowledged=len(acked),
        stored=sum(stored.values()),
        lost=sorted(i for i in acked if stored[i] == 0),
        duplicated={i: n for i, n in stored.items() if n > 1},
        unexpected=sum(1 for i in stored if i not in acked),
    )
