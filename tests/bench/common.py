"""What every benchmark shares: the machine's label, quantiles, the JSON it writes, and
py-spy profiles of the processes a figure depends on.

Profiles are sampled with py-spy from outside the process (`--nonblocking`, so the
target is never paused) and only from the thread holding the GIL (`--gil`): a profile shows
where Python-level CPU went, and `busy` is the share of the window the GIL was held (native
work that releases the GIL, such as LevelDB's fsync or the JVM, does not show).
A profile costs py-spy's own CPU (a few % of a core per target) on the same cores: the
bench that takes one says so next to its figure.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPORTS = Path(os.environ.get("TIERFLOW_BENCH_REPORTS", "reports"))
PY_SPY_RATE = 67  # samples/s: coarse enough to stay cheap, fine enough for 10 s windows
OUR_CODE = ("runtime/", "actors/", "jobs/", "tests/bench/")
# Leaves that are waiting, not working, even when py-spy reports the GIL held (seen with
# `--nonblocking` in Ray's worker loop and PySpark's forked daemon): left out of the shares.
IDLE_LEAVES = frozenset({"manager", "main_loop", "select", "poll", "wait", "sleep", "accept"})


def machine() -> dict[str, Any]:
    """The label every absolute figure carries: cores, memory, CPU model, load at start."""
    import psutil

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": model or platform.processor(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by rank (None for no samples)."""
    if not values:
        return None
    data = sorted(values)
    return data[min(len(data) - 1, int(q * len(data)))]


def summary(ms: Sequence[float]) -> dict[str, Any]:
    """p50/p99/max of latencies in ms, and how many there were."""
    return {
        "n": len(ms),
        "p50_ms": quantile(ms, 0.5),
        "p99_ms": quantile(ms, 0.99),
        "max_ms": max(ms) if ms else None,
    }


def write_report(name: str, data: Mapping[str, Any]) -> Path:
    """reports/bench_<name>.json, labelled with the machine and the run it belongs to."""
    REPORTS.mkdir(parents=True, exist_ok=True)
    path = REPORTS / f"bench_{name}.json"
    body = {
        "bench": name,
        "run": os.environ.get("TIERFLOW_BENCH_RUN", ""),
        "written_at": time.time(),
        "machine": machine(),
        **data,
    }
    path.write_text(json.dumps(body, indent=2, default=str))
    return path


# --------------------------------------------------------------------------- profiles


def summarize_collapsed(lines: Iterator[str], seconds: float, top: int = 8) -> dict[str, Any]:
    """Summarize py-spy's raw (collapsed) stacks: CPU share of the busiest leaf functions and
    of the deepest frame in tierflow's own code; `busy` is GIL-held seconds per second."""
    leaf: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        raw = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread ("))]
        if not raw or raw[-1].partition(" (")[0].rsplit(".", 1)[-1] in IDLE_LEAVES:
            continue
        total += n
        leaf[_frame(raw[-1])] += n
        mine = [f for f in raw if _ours(f)]
        ours[_frame(mine[-1]) if mine else "(not in tierflow's code)"] += n

    def share(c: Counter[str]) -> list[list[Any]]:
        return [[name, round(n / total, 3)] for name, n in c.most_common(top)] if total else []

    return {
        "samples": total,
        "busy": round(total / (PY_SPY_RATE * seconds), 2) if seconds else None,
        "leaf": share(leaf),
        "tierflow": share(ours),
    }


def _ours(raw: str) -> bool:
    """A frame in tierflow's code (py-spy shortens paths: relative or absolute)."""
    where = raw.partition(" (")[2]
    return where.startswith(OUR_CODE) or any("/" + p in where for p in OUR_CODE)


def _frame(raw: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: lines vary, functions do not."""
    func, _, where = raw.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{func} ({where})" if where else func


class Profiler:
    """py-spy record on several processes at once, for `seconds`; `results()` waits for
    them and returns one summary per label (or the reason there is none)."""

    def __init__(
        self, pids: Mapping[str, int], seconds: float, *, subprocesses: Sequence[str] = ()
    ) -> None:
        self.seconds = seconds
        venv = Path(sys.executable).parent / "py-spy"
        self.spy = str(venv) if venv.exists() else shutil.which("py-spy") or "py-spy"
        self.dir = Path(tempfile.mkdtemp(prefix="tierflow-spy-"))
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        for label, pid in pids.items():
            out = self.dir / f"{label}.txt"
            cmd = [self.spy, "record", "--nonblocking", "--gil", "-r", str(PY_SPY_RATE)]
            cmd += ["-d", str(max(1, round(seconds))), "-f", "raw", "-o", str(out), "-p", str(pid)]
            if label in subprocesses:
                cmd.append("--subprocesses")
            try:
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            except OSError as err:
                self.procs[label] = (None, out)  # type: ignore[assignment]
                (self.dir / f"{label}.err").write_text(repr(err))
                continue
            self.procs[label] = (proc, out)

    def results(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for label, (proc, path) in self.procs.items():
            if proc is None:
                out[label] = {"error": (self.dir / f"{label}.err").read_text()}
                continue
            try:
                _, err = proc.communicate(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate(timeout=10)
            if path.exists() and path.stat().st_size:
                with path.open() as f:
                    out[label] = summarize_collapsed(iter(f), self.seconds)
            else:
                tail = " ".join((err or b"").decode(errors="replace").strip().splitlines()[-2:])
                why = f"py-spy: {tail}" if proc.returncode else "no busy samples in the window"
                out[label] = {"error": why}
        shutil.rmtree(self.dir, ignore_errors=True)
        return out


def print_profile(title: str, profiles: Mapping[str, Any], top: int = 4) -> None:
    """A few lines per process: busy share and the hottest tierflow frames and leaves."""
    print(f"py-spy, {title}:")
    for label, p in profiles.items():
        if "error" in p:
            print(f"  {label}: no profile ({p['error']})")
            continue
        hot = ", ".join(f"{name} {frac:.0%}" for name, frac in p["tierflow"][:top])
        leaf = ", ".join(f"{name} {frac:.0%}" for name, frac in p["leaf"][:top])
        print(f"  {label}: busy {p['busy']} cores; tierflow frames: {hot}")
        print(f"  {'':<{len(label)}}  leaves: {leaf}")
