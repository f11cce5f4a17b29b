"""Writing a small file so that a reader, or a restart after a crash, sees the old version or
the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to a temp file beside `path`, then rename it over `path` (atomic on
    POSIX). `durable` fsyncs the data first, so after a power loss the rename never names
    a file whose bytes did not reach the disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
