"""A Python process with the jetstream source's planner imported, forking one per query.

Spark starts every streaming query's Python source runner
(``pyspark.sql.streaming.python_streaming_source_runner``, which answers the query's
offsets) as a new interpreter (`PythonStreamingSourceRunner.init`, `createSimpleWorker`),
not from its forking daemon as it does the read workers. That interpreter imports pyspark,
numpy, pyarrow and this project's source before the query's first offset: about 0.7-0.9 s
of one core on this project's 2-core machine, on the critical path of every query start,
every driver restart and every standby's takeover (five queries at once in the demo).

The zygote does those imports once, in the process that registered the source, and then
forks a child per runner: Spark's launch (jobs/worker_python.sh) hands the zygote, through
`jobs.zygote_client`, the runner's arguments, environment, working directory and standard
streams, and the forked child runs the runner's ``__main__`` with them. Spark still sees a
process of its own (the client), which exits with the runner's status; when Spark kills it,
the zygote kills the runner. No zygote, or one not started yet, and the client starts the
interpreter as Spark would. Nothing in Python's standard library or pyspark forks a
pre-imported interpreter for an arbitrary module with another process's streams and
environment (multiprocessing's forkserver runs its own functions, with its own pipes), so
this is written here.

The server is single-threaded (a `selectors` loop), so a fork never copies a lock another
thread holds, and exits when the process that started it is gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ZYGOTE_ENV = "TIERFLOW_SOURCE_ZYGOTE"  # the socket's path, for jobs/worker_python.sh
OFF_ENV = "TIERFLOW_SOURCE_ZYGOTE_OFF"
RUNNER_MODULE = "pyspark.sql.streaming.python_streaming_source_runner"
# what the zygote imports before it serves: the runner and the source it unpickles
PRELOAD = (RUNNER_MODULE, "jobs.jetstream")
MAX_REQUEST = 1 << 20  # bytes of one request (arguments and environment)
POLL_S = 0.5  # how often the server looks for its parent and reaps children
DIR_PREFIX = "tf-zygote-"
STALE_AFTER_S = 60.0  # a zygote directory this old with no zygote answering is left over
STATUS = struct.Struct("!i")


# --------------------------------------------------------------------------- the server


def serve(path: str, parent: int, owns_dir: bool = False) -> None:
    """Import `PRELOAD`, then fork a runner per request on `path` until `parent` is gone;
    then remove the socket (and its directory, when `owns_dir`: the parent may have died
    without cleaning up)."""
    # stopped (a SIGTERM, e.g. to its process group): clean up as on the parent's exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for module in PRELOAD:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    partial = f"{path}.{os.getpid()}"
    listener.bind(partial)
    listener.listen(64)
    os.replace(partial, path)  # clients see the socket only once it accepts
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    try:
        while os.getppid() == parent:
            for key, _ in sel.select(POLL_S):
                if key.fileobj is listener:
                    _accept(listener, sel, children)
                else:
                    _client_gone(key.fileobj, key.data, sel, children)  # type: ignore[arg-type]
            _reap(sel, children)
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.unlink(path)
        if owns_dir:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _accept(
    listener: socket.socket, sel: selectors.BaseSelector, children: dict[int, socket.socket]
) -> None:
    conn, _ = listener.accept()
    conn.settimeout(5.0)
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
        if not data and not fds:  # a probe (`tidy`): connected, asked nothing
            conn.close()
            return
        request = json.loads(data)
    except (OSError, ValueError) as err:
        log.warning("source zygote: a bad request: %r", err)
        conn.close()
        return
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    pid = os.fork()
    if pid == 0:  # the runner: keeps none of the zygote's sockets
        for other in (listener, conn, *children.values()):
            other.close()
        sel.close()
        _run_runner(request, fds)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    sel.register(conn, selectors.EVENT_READ, pid)


def _client_gone(
    conn: socket.socket, pid: int, sel: selectors.BaseSelector, children: dict[int, socket.socket]
) -> None:
    """The client sends nothing after its request: readable means it is gone (Spark stopped
    the runner), so the runner goes too."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    sel.unregister(conn)


def _reap(sel: selectors.BaseSelector, children: dict[int, socket.socket]) -> None:
    for _ in range(len(children)):
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        with contextlib.suppress(OSError):
            conn.send(STATUS.pack(os.waitstatus_to_exitcode(status)))
        conn.close()


def _run_runner(request: dict[str, object], fds: list[int]) -> None:
    """In the forked child: become the process Spark launched, run the module, exit."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(str(request["cwd"]))
        for entry in reversed(str(env.get("PYTHONPATH", "")).split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        argv = request["argv"]
        assert isinstance(argv, list) and argv[:2] == ["-m", RUNNER_MODULE], argv
        import runpy

        sys.argv = [RUNNER_MODULE, *argv[2:]]
        # run as __main__ from its code, as `python -m` would; its imports are all loaded
        sys.modules.pop(RUNNER_MODULE, None)
        runpy.run_module(RUNNER_MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the runner's stderr, as Spark's would
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# --------------------------------------------------------------------------- starting one


@dataclass
class Zygote:
    path: str
    process: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None


_lock = threading.Lock()
_zygote: Zygote | None = None


def ensure_started(python: str) -> str:
    """This process's zygote's socket path (started now, once per process, in the
    background: runners that start before it listens start as Spark would). `python` is
    the workers' interpreter. The analysis driver calls this before its JVM starts, so the
    zygote has its imports done by the first query."""
    global _zygote
    with _lock:
        if _zygote is not None and _zygote.alive():
            return _zygote.path
        tidy(Path(tempfile.gettempdir()))
        directory = tempfile.mkdtemp(prefix=DIR_PREFIX)
        path = os.path.join(directory, "s")
        root = str(Path(__file__).resolve().parent.parent)
        paths = [root, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        child_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "OPENBLAS_NUM_THREADS": "1",  # numpy's pool would be threads a fork cannot copy
        }
        process = subprocess.Popen(
            [python, "-m", "jobs.source_zygote", path, str(os.getpid()), "owns-dir"],
            env=child_env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        _zygote = Zygote(path, process)
        return path


def tidy(tmp: Path, min_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove this user's zygote directories whose zygote is gone without cleaning up
    (SIGKILLed with its process group): no socket answers there, and the directory is old
    enough not to be a zygote still importing. Returns what went."""
    gone = []
    now = time.time()
    for directory in tmp.glob(f"{DIR_PREFIX}*"):
        try:
            st = directory.stat()
            if st.st_uid != os.getuid() or now - st.st_mtime < min_age_s:
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                probe.connect(str(directory / "s"))
                continue  # a live zygote
            except OSError:
                pass
            finally:
                probe.close()
        except OSError:
            continue
        shutil.rmtree(directory, ignore_errors=True)
        gone.append(directory)
    return gone


def enabled(master: str) -> bool:
    """A zygote serves runners on this machine only (``local`` masters), unless
    ``TIERFLOW_SOURCE_ZYGOTE_OFF`` is set (Spark then starts each runner itself)."""
    return master.startswith("local") and not os.environ.get(OFF_ENV)


def prestart(master: str) -> None:
    """Start the zygote before the JVM, when it will be used: its imports overlap the
    JVM's start instead of the first query's."""
    if enabled(master):
        ensure_started(os.environ.get("PYSPARK_PYTHON") or sys.executable)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), owns_dir=sys.argv[3:] == ["owns-dir"])
