"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def fresh_ray(namespace: str) -> Iterator[None]:
    """A local Ray instance of its own for a module that needs its namespace as the
    driver's default: whatever instance an earlier module left up is shut down first
    (one driver connection per process)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        namespace=namespace,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def write_batches(directory: Path, batches: list[list[dict]]) -> str:
    """One JSON-lines file per micro-batch; mtimes fix the order the file source reads."""
    directory.mkdir(parents=True)
    base = time.time() - 10_000
    for i, rows in enumerate(batches):
        path = directory / f"batch-{i:04d}.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(path, (base + i, base + i))
    return str(directory)


def run_stream(df: Any, checkpoint: Path, mode: str) -> tuple[list[tuple[int, list]], Any]:
    """Run to completion (availableNow, a file per batch); non-empty batches' rows by id."""
    emitted: list[tuple[int, list]] = []

    def collect(batch: Any, batch_id: int) -> None:
        rows = batch.collect()
        if rows:
            emitted.append((batch_id, rows))

    q = (
        df.writeStream.foreachBatch(collect)
        .outputMode(mode)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(120), "stream did not finish in 120 s"
    assert q.exception() is None
    return emitted, q


def with_nats(fn: Any, url: str) -> Any:
    """Run `await fn(nc)` on a fresh NATS connection in a fresh loop (for sync tests that
    drive Spark, where no event loop is running)."""
    import asyncio

    from runtime.nats import connect

    async def main() -> Any:
        nc = await connect(url)
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(main())
