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
import gc
import json
import os
import platform
import re
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


class GcPauses:
    """The bench process's own garbage-collection pauses while it stands in for clients.

    Clients that the bench runs in its own process (1,000 WebSockets, the watchers) share
    its heap with everything earlier benches of the session left behind (hundreds of MB by
    the gateway bench in `make bench`): one full collection over that heap stops every
    client at once and stretches a whole event's deliveries, which real clients, each in
    a process of its own, never see. `frozen()` collects once and moves what exists into
    the permanent generation (`gc.freeze`) for the measured window, so collections there
    scan only what the window allocates; the pauses that remain are recorded (via
    `gc.callbacks`) and reported beside the figure, so none is hidden.
    """

    def __init__(self) -> None:
        self.pauses_ms: list[tuple[int, float]] = []  # (generation, ms)
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses_ms.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    @contextlib.contextmanager
    def frozen(self, freeze: bool = True) -> Iterator[GcPauses]:
        if freeze:
            gc.collect()
            gc.freeze()
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)
            if freeze:
                gc.unfreeze()

    @staticmethod
    def describe(g: Mapping[str, Any]) -> str:
        """A `summary` (with ``frozen``) as the benches print it."""
        return (
            f"collected {g['collections']} times ({g['full']} full, longest {g['max_ms']} ms; "
            f"heap {'frozen' if g['frozen'] else 'not frozen'})"
        )

    def summary(self) -> dict[str, Any]:
        """Collections in the window: count, the full (generation 2) ones, the longest."""
        return {
            "collections": len(self.pauses_ms),
            "full": sum(1 for g, _ in self.pauses_ms if g == 2),
            "max_ms": round(max((ms for _, ms in self.pauses_ms), default=0.0), 1),
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


# --------------------------------------------------------------------------- CPU by process


def _cpu_s(pid: int, children: bool) -> float:
    """CPU seconds `pid` used (with its reaped children's when `children`); 0 when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (from /proc's parent links)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat[1])
    out, todo = [], [pid]
    while todo:  # bounded: each pid is visited once
        here = todo.pop()
        kids = [p for p, pp in parent.items() if pp == here and p not in out]
        out.extend(kids)
        todo.extend(kids)
    return out


class CpuMeter:
    """CPU seconds per group of processes over a span: where a run's cores went. A group
    is its root pids alone (`roots`) or with every process under them (`trees`), counting
    the children they reaped in the span (a Python worker that exited)."""

    def __init__(self, roots: Mapping[str, int], trees: Mapping[str, int] | None = None) -> None:
        self.roots, self.trees = dict(roots), dict(trees or {})
        self.began = time.perf_counter()
        self.start = self._sample()

    def _sample(self) -> dict[str, dict[int, float]]:
        out = {label: {pid: _cpu_s(pid, False)} for label, pid in self.roots.items()}
        for label, root in self.trees.items():
            out[label] = {pid: _cpu_s(pid, True) for pid in descendants(root)}
        return out

    def stop(self) -> dict[str, float]:
        """CPU seconds per group since the start, and the span's wall `seconds`."""
        end = self._sample()
        out = {
            label: round(
                sum(max(0.0, v - self.start[label].get(pid, 0.0)) for pid, v in pids.items()), 2
            )
            for label, pids in end.items()
        }
        out["seconds"] = round(time.perf_counter() - self.began, 2)
        return out


# --------------------------------------------------------------------------- start-ups

# A restarted actor's process, phase by phase: the first frame (outermost first) that
# matches names the phase of a sample; `__init__` is the actor's own (see startup_phases).
STARTUP_PHASES = (
    ("load_actor_class", "actor class load"),
    ("deserialize_objects", "argument deserialization"),
    ("main_loop", "Ray worker loop"),  # as the leaf: waiting for a task
    ("<module>", "Ray worker start-up"),  # default_worker.py: imports ray, connects
)
TICK_S = 0.005


def birth_s(pid: int) -> float:
    """When `pid` started, on CLOCK_BOOTTIME (the kernel counts in ticks of 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


class BirthProfiler:
    """py-spy on a parent (the raylet) and every process it starts while it runs, idle
    threads included and timestamped (chrometrace): a process that does not exist yet when
    profiling starts (a restarted actor's worker) is sampled from its interpreter's start.
    Wall-clock, not CPU: waits inside a start-up (connecting, opening a store) count."""

    def __init__(self, parent_pid: int, seconds: float, rate: int = 50) -> None:
        venv = Path(sys.executable).parent / "py-spy"
        spy = str(venv) if venv.exists() else shutil.which("py-spy") or "py-spy"
        self.seconds, self.rate = seconds, rate
        self.dir = Path(tempfile.mkdtemp(prefix="tierflow-spy-"))
        self.out = self.dir / "trace.json"
        cmd = [spy, "record", "--subprocesses", "--idle", "--nonblocking", "-r", str(rate)]
        cmd += ["-d", str(max(1, round(seconds))), "-f", "chrometrace", "-o", str(self.out)]
        self.proc = subprocess.Popen(
            [*cmd, "-p", str(parent_pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def trace(self) -> list[dict[str, Any]] | str:
        """The chrometrace events, or why there are none."""
        try:
            _, err = self.proc.communicate(timeout=self.seconds + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
        try:
            if self.out.exists() and self.out.stat().st_size:
                return json.loads(self.out.read_text())
            tail = " ".join((err or b"").decode(errors="replace").strip().splitlines()[-2:])
            return f"py-spy: {tail or 'no trace written'}"
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


Stack = tuple[tuple[str, str], ...]  # (function, file) outermost first


def thread_spans(events: Sequence[Mapping[str, Any]], pid: int) -> list[list[Any]]:
    """Per thread of `pid`: [(start s, end s, stack)] from py-spy's begin/end events."""
    open_: dict[Any, list[tuple[str, str]]] = {}
    last: dict[Any, float] = {}
    spans: dict[Any, list[Any]] = {}
    for e in events:
        if str(e.get("pid")) != str(pid):
            continue
        tid, ts = e["tid"], e["ts"] / 1e6
        stack = open_.setdefault(tid, [])
        if tid in last and ts > last[tid] and stack:
            spans.setdefault(tid, []).append((last[tid], ts, tuple(stack)))
        last[tid] = ts
        if e["ph"] == "B":
            stack.append((e["name"], (e.get("args") or {}).get("filename", "")))
        elif stack:
            stack.pop()
    return list(spans.values())


def _module(path: str) -> str:
    """A file's module name, short: .../site-packages/aiohttp/web.py -> aiohttp."""
    for marker in ("site-packages/", "/work/main/"):
        if marker in path:
            rel = path.split(marker, 1)[1]
            parts = rel.removesuffix(".py").split("/")
            ours = rel.startswith(OUR_CODE)
            return ".".join(p for p in parts[:2] if p != "__init__") if ours else parts[0]
    p = Path(path)
    return p.parent.name if p.stem == "__init__" else p.stem


def _what(stack: Stack, init: str) -> str:
    """What a sample is doing, for a breakdown: the import it is in (the first library
    below tierflow's and Ray's own code), else tierflow's deepest frame, else the leaf."""
    mods = [_module(f) for name, f in stack if name == "<module>" and f]
    mods = [m for m in mods if m not in ("default_worker", "ray")]
    ours = [m for m in mods if m.startswith(("actors", "runtime", "jobs"))]
    libs = [m for m in mods if m not in ours]
    if libs:
        return f"import {libs[0]}" + (f" (for {ours[0]})" if ours else "")
    if ours:
        return f"import {ours[-1]}"
    mine = [(n, f) for n, f in stack if _ours(f" ({f})") and not n.startswith("<")]
    if mine:
        return _frame(f"{mine[-1][0]} ({mine[-1][1]})")
    name, f = stack[-1]
    return _frame(f"{name} ({re.sub(r'^.*/lib/python3[.0-9]*/', '', f)})") if f else name


def startup_phases(
    events: Sequence[Mapping[str, Any]], pid: int, init: str, top: int = 4, reused: bool = False
) -> dict[str, Any]:
    """Where a new worker process's start-up went, in wall-clock seconds from its first
    sample to the end of the actor's `__init__` (`init`, e.g. `Collector.__init__`).

    Every TICK_S the busiest thread names the phase: `__init__`, actor class load, argument
    deserialization (unpickling imports the modules the arguments need), Ray worker
    start-up; with no thread in any, "waiting for Ray" (the raylet handing the task over).
    Each phase lists what its time went to (`_what`). `reused`: the process was already
    running (an idle worker Ray had started before), so the time starts at its first
    sample working on the actor's creation task."""
    spans = thread_spans(events, pid)
    if not spans:
        return {"error": f"no samples of pid {pid}"}
    rank = {"__init__": 0, "actor class load": 1, "argument deserialization": 2}

    def is_init(n: str) -> bool:
        return n == init or n.endswith("." + init)  # a class defined in a function

    def phase(stack: Stack) -> str | None:
        names = [n for n, _ in stack]
        if any(is_init(n) for n in names):
            return "__init__"
        for key, label in STARTUP_PHASES:
            hits = [i for i, n in enumerate(names) if n == key or n.endswith("." + key)]
            if hits:
                return label if hits[0] < len(names) - 1 else None
        return None

    task = [t0 for s in spans for t0, _, st in s if phase(st) in rank]
    if reused and not task:
        return {"error": f"no sample of the creation task in pid {pid}"}
    first = min(task) if reused else min(s[0][0] for s in spans)
    marks = [t1 for s in spans for t0, t1, st in s if any(is_init(n) for n, _ in st)]
    if not marks:
        return {"error": f"no sample inside {init}"}
    end = max(marks)

    seconds: Counter[str] = Counter()
    what: dict[str, Counter[str]] = {}
    cursors = [0] * len(spans)
    t = first
    while t < end:
        best: tuple[str, Stack] | None = None
        for i, s in enumerate(spans):
            while cursors[i] < len(s) and s[cursors[i]][1] <= t:
                cursors[i] += 1
            if cursors[i] < len(s) and s[cursors[i]][0] <= t:
                st = s[cursors[i]][2]
                p = phase(st)
                if p is not None and (best is None or rank.get(p, 3) < rank.get(best[0], 3)):
                    best = (p, st)
        label = best[0] if best else "waiting for Ray"
        seconds[label] += TICK_S
        if best:
            what.setdefault(label, Counter())[_what(best[1], init)] += TICK_S
        t += TICK_S
    return {
        "reused": reused,
        "span_s": round(end - first, 3),
        "phases": [
            {
                "phase": label,
                "s": round(s, 3),
                "top": [[w, round(x, 3)] for w, x in what.get(label, Counter()).most_common(top)],
            }
            for label, s in seconds.most_common()
        ],
    }


def restart_lines(profiles: Mapping[str, Any], top: int = 3) -> list[str]:
    """One line per restart: born, phases with their top items, the rest until the ack."""
    lines = []
    for name, r in profiles.items():
        if "error" in r:
            lines.append(f"{name}: no profile ({r['error']})")
            continue
        phases = "; ".join(
            f"{ph['phase']} {ph['s']:.2f} s"
            + (
                " (" + ", ".join(f"{w} {x:.2f}" for w, x in ph["top"][:top]) + ")"
                if ph["top"]
                else ""
            )
            for ph in r["phases"]
        )
        rest = r.get("after_init_s")
        ack = "-" if r["ack_s"] is None else f"{r['ack_s']:.2f}"
        tail = f"; after __init__ until the next answer {rest:.2f} s" if rest is not None else ""
        start = (
            f"an idle worker born {-r['born_s']:.2f} s before the kill was reused; its task "
            if r.get("reused")
            else f"born {r['born_s']:.2f} s after the kill; birth "
        )
        lines.append(
            f"{name}: answered {ack} s after the kill; {start}"
            f"to end of __init__ {r['span_s']:.2f} s: {phases}{tail}"
        )
    return lines
