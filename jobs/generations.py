"""A job's generations in the analysis driver: its current batch view (jobs/batch_view.py),
recomputing one over the stream's history (jobs/recompute.py), serving it, and starting a
generation over on another copy of the stream.

Exists so that the views the driver's parts share (the reconcile thread starts a job's
query from its current generation, `recompute` and a change of copy make a new one,
`status` shows it) have one owner with one cache, and a new generation is always made the
same way: saved, served, then made current with the older generations' checkpoints
retired. Recomputing runs a Spark batch job, on the driver's recompute threads (a Ray
concurrency group) or its reconcile thread; it makes no Spark control call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.batch_view import (
    BatchView,
    checkpoint_dir,
    fresh_generation,
    load_view,
    retire_checkpoints,
    save_view,
)
from jobs.copies import Action, CopyId, record_copy
from jobs.recompute import recompute as recompute_view
from jobs.recompute import serve_view
from runtime.clock import now_ms

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from jobs.sql import StreamTable
    from runtime.job_specs import JobSpec
    from runtime.nats.server import NatsEndpoint

__all__ = ["Generations", "stream_end"]


def stream_end(nats: NatsEndpoint, stream: str) -> int:
    """The next sequence `stream` will write (a recompute's end, an idle query's target)."""
    from jobs.jetstream_read import stream_bounds  # loads pyspark: only in the actor

    async def go() -> int:
        nc = await nats.connect(name="analysis-driver-idle")
        try:
            return (await stream_bounds(nc, stream)).latest
        finally:
            await nc.close()

    return asyncio.run(go())


class Generations:
    """The jobs' batch views under `checkpoint_root`, cached (`views`).

    Args:
        nats: where the streams are, and where a view is served.
        checkpoint_root: where the views and each generation's checkpoint are.
        spark: the driver's Spark session, or None.
        table: the table a stream's history is read from on a copy (jobs/adhoc_sql.py).
    """

    def __init__(
        self,
        nats: NatsEndpoint,
        checkpoint_root: Path,
        spark: Callable[[], SparkSession | None],
        table: Callable[[str, CopyId], StreamTable],
    ) -> None:
        self.nats, self.checkpoint_root, self._spark, self._table = (
            nats,
            checkpoint_root,
            spark,
            table,
        )
        self.views: dict[str, BatchView | None] = {}

    def view(self, name: str) -> BatchView | None:
        """The job's current batch view (cached; a new generation replaces it)."""
        if name not in self.views:
            self.views[name] = load_view(self.checkpoint_root, name)
        return self.views[name]

    def checkpoint(self, name: str, view: BatchView | None) -> Path:
        """The checkpoint of job `name`'s generation `view` (None: the first)."""
        return checkpoint_dir(self.checkpoint_root, name, view)

    def serve(self, view: BatchView) -> None:
        """Publish the view's rows as the job's results; saved as served."""
        serve_view(self.nats, view)
        view.served = True
        save_view(self.checkpoint_root, view)
        self.views[view.name] = view

    def rebuild(self, spec: JobSpec, here: CopyId) -> BatchView:
        """Recompute `spec` over copy `here` up to its last sequence now; saved and served:
        from here on it is the job's current generation."""
        spark = self._spark()
        assert spark is not None
        view = recompute_view(
            spark,
            self.nats,
            spec,
            self._table(spec.stream, here),
            high_water=stream_end(self.nats, spec.stream) - 1,
            copy=here,
        )
        save_view(self.checkpoint_root, view)  # from here on, this generation is current
        self.views[spec.name] = view
        self.serve(view)
        return view

    def retire_older(self, name: str, view: BatchView) -> Path:
        """Remove the checkpoints of the job's generations before `view`; `view`'s."""
        keep = self.checkpoint(name, view)
        retire_checkpoints(self.checkpoint_root, name, keep)
        return keep

    def recompute(self, spec: JobSpec, here: CopyId) -> BatchView:
        """`rebuild` on the driver's request (`recompute`): the job's next generation, its
        checkpoint of copy `here`, the older ones retired."""
        view = self.rebuild(spec, here)
        record_copy(self.retire_older(spec.name, view), here)
        return view

    def on_copy(self, spec: JobSpec, action: Action, here: CopyId) -> BatchView:
        """The job's new generation over copy `here` after its positions were found to be
        of another copy (jobs/copy_tracker.py): recomputed for kinds that merge, started
        over with no rows for the others (the old copy's results are retired). Older
        generations' checkpoints are retired; the caller records the copy."""
        if action is Action.RECOMPUTE:
            new = self.rebuild(spec, here)
        else:
            new = fresh_generation(spec, now_ms(), here)
            save_view(self.checkpoint_root, new)
            self.views[spec.name] = new
            self.serve(new)  # no rows: the old copy's results are retired
        self.retire_older(spec.name, new)
        return new
