"""Operator tools on the logger's stores on disk, for `tierflow logger inspect|settle`.

They open replica directories under `state_dir/logger/` directly, so they need tierflow
stopped (a running replica holds its store's LOCK: `inspect` reports it, `settle_parked`
raises). Named `offline`, not `inspect`, so the module never hides the function the
package exports under that name.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from actors.queue.logger.records import (
    CATCHING_UP_KEY,
    COUNTS_KEY,
    FENCE_KEY,
    NS_BY_RETRY,
    NS_META,
    PARKED_MS,
    LogKey,
    _be,
    _Counts,
    _counts_dec,
)
from actors.queue.logger.store import LogStore
from runtime import clock
from runtime.state.checkpoint import CheckpointError, CheckpointLockedError, CheckpointStore
from runtime.state.replication import Fence


def settle_parked(
    state_dir: str | os.PathLike[str],
    group: str,
    action: str,
    keys: Sequence[LogKey] | None = None,
    *,
    now_ms: int | None = None,
) -> dict[str, int]:
    """Settle parked entries of logger group `group` in its stopped stores (every replica
    directory `state_dir/logger/<group>-<i>`, so the replicas stay identical): `keys`, or
    every entry parked on any replica when None. Returns {replica: entries changed}. A
    running replica's store is locked: CheckpointLockedError (stop tierflow first)."""
    root = pathlib.Path(state_dir) / "logger"
    pattern = re.compile(rf"{re.escape(group)}-\d+")
    paths = sorted(p for p in root.glob(f"{group}-*") if p.is_dir() and pattern.fullmatch(p.name))
    if not paths:
        raise FileNotFoundError(f"no logger group {group!r} under {root}")
    stores = []
    try:
        for path in paths:
            stores.append(LogStore(path, max_events=1 << 62, max_bytes=1 << 62, open_timeout_s=1))
        if keys is None:
            found: dict[LogKey, None] = {}
            for store in stores:
                found.update(dict.fromkeys((p["stream"], p["id"]) for p in store.parked(1 << 62)))
            keys = list(found)
        now = clock.now_ms() if now_ms is None else now_ms
        return {st.path.name: st.settle(keys, action, now) for st in stores}
    finally:
        for store in stores:
            store.close()


def inspect(state_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Per replica directory under `state_dir/logger/`: counts, epoch, catching_up. A store
    held by a running replica is reported as "locked (running)", never opened twice."""
    root = pathlib.Path(state_dir) / "logger"
    if not root.is_dir():
        return []
    rows = []
    for path in sorted(p for p in root.iterdir() if p.is_dir()):
        row: dict[str, Any] = {"replica": path.name, "path": str(path)}
        try:
            store = CheckpointStore(path, create=False)
        except CheckpointLockedError:
            rows.append({**row, "state": "locked (running)"})
            continue
        except CheckpointError as exc:
            rows.append({**row, "state": f"error: {exc}"})
            continue
        try:
            meta = store.namespace(NS_META)
            raw = meta.get(COUNTS_KEY)
            c = _counts_dec.decode(raw) if raw is not None else _Counts()
            fence = meta.get(FENCE_KEY)
            row.update(
                state="ok",
                transient=c.transient,
                failed=c.failed,
                parked=store.namespace(NS_BY_RETRY).count(start=_be(PARKED_MS)),
                bytes=c.bytes,
                tokens=c.tokens,
                epoch=Fence.from_bytes(fence).epoch if fence else 0,
                catching_up=meta.get(CATCHING_UP_KEY) == b"1",
            )
        except (CheckpointError, msgspec.DecodeError, ValueError) as exc:
            row["state"] = f"error: {exc}"
        finally:
            store.close()
        rows.append(row)
    return rows
