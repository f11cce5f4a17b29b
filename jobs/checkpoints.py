"""What a streaming query's checkpoint says it has committed, read without Spark.

Spark writes ``offsets/<id>`` (the batch's end offsets) before running a batch and
``commits/<id>`` after its sink finished it, so the newest batch with both is the last
whose output is durable. The driver's status and the archive's position read it here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["committed"]


def committed(checkpoint: str | os.PathLike[str]) -> tuple[int, dict[str, Any] | None] | None:
    """(batch id, first source's end offset) of a query's last committed batch, from its
    checkpoint; None when no batch was committed yet."""
    done = _last_commit(Path(checkpoint))
    if done is None:
        return None
    batch, offsets = done
    return batch, offsets[0] if offsets else None


def committed_offsets(checkpoint: str | os.PathLike[str]) -> list[dict[str, Any] | None]:
    """Every source's end offset of a query's last committed batch, in the order of its
    sources ([] when none was committed)."""
    done = _last_commit(Path(checkpoint))
    return done[1] if done is not None else []


def _last_commit(root: Path) -> tuple[int, list[dict[str, Any] | None]] | None:
    """The last committed batch's id and its sources' end offsets ([] when its offsets
    file is gone); None when no batch was committed."""
    try:
        ids = [int(p.name) for p in (root / "commits").iterdir() if p.name.isdigit()]
    except FileNotFoundError:
        return None
    if not ids:
        return None
    batch = max(ids)
    try:
        lines = (root / "offsets" / str(batch)).read_text().splitlines()
    except FileNotFoundError:
        return batch, []
    return batch, _offsets(lines)


def _offsets(lines: list[str]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for line in lines[2:]:  # "v1", the batch's metadata, then one line per source
        try:
            offset = json.loads(line) if line not in ("", "-") else None
        except ValueError:
            offset = None
        out.append(offset if isinstance(offset, dict) else None)
    return out
