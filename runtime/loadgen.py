"""A producer with known ids: drives a collector and records exactly what was accepted.

A real producer retries what was refused (503, a reset connection, a timeout) with the
SAME ids, so a retry never creates a second event; the generator does the same until
its deadline. What it reports as acknowledged is only what a collector answered 2xx
for: the set the zero-loss verdict (`runtime.verify.judge`) holds the pipeline to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()


@dataclass
class LoadReport:
    sent: int = 0
    acknowledged: set[str] = field(default_factory=set)
    refused: int = 0  # 503 answers (backpressure), each retried
    errors: int = 0  # connection errors and timeouts, each retried
    rejected: dict[int, int] = field(default_factory=dict)  # other 4xx: not retried
    latencies_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.acknowledged) / self.elapsed_s if self.elapsed_s else 0.0

    def quantile(self, q: float) -> float | None:
        if not self.latencies_ms:
            return None
        data = sorted(self.latencies_ms)
        return data[min(len(data) - 1, int(q * len(data)))]


def known_events(
    n: int, prefix: str = "ev", make: Callable[[int], dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """`n` events with ids `{prefix}-{i}`; `make(i)` supplies the body (default: tiny)."""
    return [{**(make(i) if make else {"n": i}), "id": f"{prefix}-{i}"} for i in range(n)]


async def drive(
    url: str,
    stream: str,
    events: Sequence[dict[str, Any]],
    *,
    batch: int = 100,
    concurrency: int = 8,
    rate: float = 0.0,
    deadline_s: float = 120.0,
    query: str = "",
    on_batch: Callable[[int], None] | None = None,
    until: asyncio.Event | None = None,
) -> LoadReport:
    """POST `events` in NDJSON batches with `concurrency` requests in flight.

    `rate` (events/s, 0 = as fast as answered) paces batch starts from a fixed schedule.
    A refused batch is retried with the same ids (short backoff) until `deadline_s`.
    Once `until` is set no new batch starts (a steady load for as long as something
    else takes); batches in flight still finish, retries included.
    """
    report = LoadReport()
    batches = [events[i : i + batch] for i in range(0, len(events), batch)]
    queue: asyncio.Queue[tuple[int, Sequence[dict[str, Any]]]] = asyncio.Queue()
    for item in enumerate(batches):
        queue.put_nowait(item)
    start = time.monotonic()
    stop_at = start + deadline_s
    target = f"{url}/v1/streams/{stream}/events{('?' + query) if query else ''}"
    headers = {"Content-Type": "application/x-ndjson"}
    timeout = aiohttp.ClientTimeout(total=30)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty() and time.monotonic() < stop_at:
            if until is not None and until.is_set():
                return
            idx, items = queue.get_nowait()
            if rate:
                due = start + idx * batch / rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if until is not None and until.is_set():
                    return
            body = b"\n".join(_enc.encode(e) for e in items)
            attempt = 0
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                try:
                    async with session.post(target, data=body, headers=headers) as resp:
                        payload = await resp.read()
                        status = resp.status
                except (TimeoutError, aiohttp.ClientError):
                    report.errors += 1
                    status, payload = 0, b""
                report.sent += len(items)
                if 200 <= status < 300:
                    report.latencies_ms.append((time.monotonic() - t0) * 1000)
                    report.acknowledged.update(_dec.decode(payload)["ids"])
                    if on_batch:
                        on_batch(idx)
                    break
                if status == 503 or status == 0:
                    report.refused += status == 503
                    attempt += 1
                    await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
                    continue
                report.rejected[status] = report.rejected.get(status, 0) + 1
                break

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    report.elapsed_s = time.monotonic() - start
    return report
