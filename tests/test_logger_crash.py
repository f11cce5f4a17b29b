"""LogStore killed with SIGKILL in the middle of appends and forgets: reopened, it holds
every entry an append returned for and no forget returned for, its in-memory index read
back in agreement with the disk. A real process on real LevelDB (not a unit test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from actors.queue.logger import LogStore

BIG = 1 << 40


CHILD = textwrap.dedent(
    """
    import sys
    from actors.queue.logger import LogStore
    from actors.queue.logger.records import _key
    from runtime.data.events import Event, encode_batch
    s = LogStore(sys.argv[1], max_events=10**6, max_bytes=1 << 40)
    for n in range(10**6):
        events = [Event(f"e{n}-{i}", "s", "s.raw", b"x" * 300, n) for i in range(50)]
        s.append(encode_batch(events))
        if n % 3:
            s.forget([_key("s", f"e{n}-{i}") for i in range(0, 50, 2)])
        print(n, flush=True)
    """
)


def test_after_a_sigkill_every_acknowledged_entry_is_there(tmp_path: Path) -> None:
    """A writer killed mid-stream: every append it returned from, minus the forgets it
    returned from, is in the reopened store, and the index read at open agrees."""
    path = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    done = -1
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded: the child writes a line per round
            done = int(line)
            if done >= 60:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert done >= 60
    s = LogStore(path, max_events=10**6, max_bytes=BIG)
    try:
        for n in range(done + 1):  # acknowledged rounds
            kept = range(1, 50, 2) if n % 3 else range(50)
            assert all(s.where(("s", f"e{n}-{i}")) == "transient" for i in kept), n
            if n % 3:
                assert all(s.where(("s", f"e{n}-{i}")) is None for i in range(0, 50, 2)), n
        scan = s.scan_counts()
        assert scan["index_mismatches"] == 0
        counts = s.counts()
        assert {k: scan[k] for k in counts} == counts
        assert scan["by_time"] == counts["transient"] >= 25 * (done + 1)
    finally:
        s.close()
