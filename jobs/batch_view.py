"""Batch views (the Lambda architecture's batch layer): what a recompute leaves behind.

`tierflow jobs recompute NAME` (jobs/recompute.py) runs a job's spec as a Spark batch job
over the stream's whole history (archive plus live tail) up to a high-water sequence, and
keeps the result here as a `BatchView`: the result rows served right after, and the merge
base the speed layer adds its own results to. The streaming job then runs from the
high-water sequence + 1 with fresh state, as a new *generation* of the job:

- its checkpoint is ``<checkpoint root>/<name>@<generation>``, so a crash anywhere in a
  recompute resumes the generation the saved view names, never the old state plus the view
  (which would count the history twice);
- its result ids are ``<name>@<generation>:<batchId>:<key>``, so they never collide with
  the previous generation's in the results stream's duplicate window;
- its KV values carry the generation, and a newer generation's value is never overwritten
  by an older one (jobs/sink.py).

Merging, per kind: counts add (`count`); exact item counts add per item and the top list
of the merged counts is exact because merged counts only grow (`topn`, jobs/topn.py
`TopBase`); HyperLogLog sketches union, register by register (`distinct`). A reservoir
`sample` and `custom` functions do not merge and cannot be recomputed; a generation of
theirs (`fresh_generation`) starts over from the stream's first sequence with nothing merged,
which is what the driver does when such a job moves to another copy of a replicated stream.
A view records the copy (jobs/copies.py) its high-water sequence belongs to: sequences of
one copy mean nothing on another.

The view is one msgpack file per job under ``<checkpoint root>/views/``, written atomically
before anything is served, so it is the record of which generation is current.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import msgspec

from jobs.copies import MERGEABLE, CopyId
from jobs.sketches import Distinct
from jobs.topn import TopBase
from runtime.errors import JobError
from runtime.job_specs import JobSpec
from runtime.state.files import write_atomic

VIEWS_DIR = "views"


class BatchView(msgspec.Struct, kw_only=True):
    """A job's batch view: its rows at `high_water` and the speed layer's merge base."""

    spec: JobSpec
    generation: int  # epoch ms of the recompute: later recomputes are newer generations
    high_water: int  # the last stream sequence the batch view counts (0: none)
    computed_at_ms: int
    seconds: float = 0.0
    events: int | None = None  # valid events the batch read (top-N counts them; others not)
    rows: list[dict[str, Any]] = []
    counts: dict[str, int] = {}  # count: result key -> count
    top: TopBase | None = None  # topn
    sketches: dict[str, bytes] = {}  # distinct: result key -> HLL sketch
    served: bool = False  # rows are in KV and on the results stream
    copy: CopyId | None = None  # the copy `high_water` is a sequence of (None: not recorded)

    @property
    def name(self) -> str:
        return self.spec.name

    def summary(self) -> dict[str, Any]:
        """What `tierflow jobs recompute` prints."""
        return {
            "name": self.name,
            "kind": self.spec.kind,
            "stream": self.spec.stream,
            "generation": self.generation,
            "high_water": self.high_water,
            "events": self.events,
            "keys": len(self.rows),
            "seconds": round(self.seconds, 2),
            "served": self.served,
        }


def check_mergeable(spec: JobSpec) -> None:
    """Refuse kinds whose batch and speed results do not merge."""
    if spec.kind not in MERGEABLE:
        raise JobError(
            f"job {spec.name!r}: a {spec.kind} job cannot be recomputed (its batch view and "
            f"live view do not merge; kinds that do: {', '.join(MERGEABLE)})"
        )


def fresh_generation(spec: JobSpec, generation: int, copy: CopyId | None) -> BatchView:
    """A generation with nothing merged, read from the stream's first sequence: for kinds
    that do not merge, moved to another copy (their results start over on it)."""
    return BatchView(
        spec=spec, generation=generation, high_water=0, computed_at_ms=generation, copy=copy
    )


def generation_name(name: str, generation: int) -> str:
    """The query's checkpoint directory name and result-id prefix for a generation."""
    return f"{name}@{generation}" if generation else name


def view_path(root: str | Path, name: str) -> Path:
    return Path(root) / VIEWS_DIR / f"{name}.msgpack"


def load_view(root: str | Path, name: str) -> BatchView | None:
    """The job's saved batch view, or None."""
    try:
        blob = view_path(root, name).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.msgpack.decode(blob, type=BatchView)
    except msgspec.DecodeError as err:
        raise JobError(f"batch view of job {name!r} is unreadable ({err}): recompute it") from None


def save_view(root: str | Path, view: BatchView) -> None:
    """Write the view atomically (fsync, then rename): the current generation's record."""
    write_atomic(view_path(root, view.name), msgspec.msgpack.encode(view))


def checkpoint_dir(root: str | Path, name: str, view: BatchView | None) -> Path:
    """Where the job's streaming query keeps its checkpoint in the current generation."""
    return Path(root) / generation_name(name, view.generation if view else 0)


def retire_checkpoints(root: str | Path, name: str, keep: Path) -> list[Path]:
    """Delete the job's checkpoints of other generations (their state is in the view)."""
    gone = []
    for path in [Path(root) / name, *Path(root).glob(f"{name}@*")]:
        if path != keep and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def merged_count(view: BatchView | None, row: dict[str, Any], count_as: str) -> dict[str, Any]:
    """A count result row (speed layer, since the view) with the view's count added."""
    if view is None:
        return row
    return {**row, count_as: int(row[count_as]) + view.counts.get(str(row["key"]), 0)}


def merged_sketch(view: BatchView | None, key: str, sketch: bytes) -> Distinct:
    """A distinct job's sketch (speed layer) unioned with the view's for the same key,
    estimated by the order-free estimator (`Distinct.order_free`) whether merged or not,
    so a merged view reports exactly what one sketch of the same items reports."""
    hll = Distinct.from_bytes(sketch)
    if view is not None and key in view.sketches:
        hll.merge(Distinct.from_bytes(view.sketches[key]))
    return hll.order_free()
