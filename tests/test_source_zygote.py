"""The source zygote (jobs/source_zygote.py, jobs/zygote_client.py): a query's source runner
forked with the launch's environment, directory and streams, its status handed back, gone
when Spark stops its process, and started as Spark would when there is no zygote.

Spark's side is played by a Unix socket the runner connects back to (pyspark's
``PYTHON_WORKER_FACTORY_SOCK_PATH``, which needs no secret): the runner's first word there
is its pid, as it is to the JVM. The same zygote under a real Spark query is in
tests/test_jetstream_worker_python.py."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs import source_zygote, zygote_client
from jobs.source_zygote import RUNNER_MODULE, ZYGOTE_ENV
from jobs.spark_session import WORKER_PYTHON, WORKER_PYTHON_ENV
from runtime.waiting import wait_until

pytestmark = pytest.mark.timeout(120)
CLIENT = Path(zygote_client.__file__)
ROOT = str(Path(source_zygote.__file__).resolve().parent.parent)


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    path = str(tmp_path / "zygote.sock")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.source_zygote", path, str(os.getpid())], env=env
    )
    try:
        wait_until(lambda: Path(path).is_socket(), 60, 0.05, what="the zygote's socket")
        yield path, proc
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def spark_side(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "jvm.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(60)
    try:
        yield path, listener
    finally:
        listener.close()


def launch(zygote_path: str, spark_path: str, cwd: Path) -> subprocess.Popen[bytes]:
    """What jobs/worker_python.sh runs for a runner, with the zygote at `zygote_path`."""
    env = {
        **os.environ,
        ZYGOTE_ENV: zygote_path,
        WORKER_PYTHON_ENV: sys.executable,
        "PYTHONPATH": ROOT,
        "PYTHON_WORKER_FACTORY_SOCK_PATH": spark_path,
    }
    return subprocess.Popen(
        [sys.executable, "-S", "-E", str(CLIENT), "-m", RUNNER_MODULE],
        env=env,
        cwd=cwd,
        stderr=subprocess.PIPE,
    )


def runner_pid(listener: socket.socket) -> tuple[int, socket.socket]:
    conn, _ = listener.accept()
    conn.settimeout(60)
    return struct.unpack("!i", conn.recv(4, socket.MSG_WAITALL))[0], conn


def test_the_runner_is_forked_with_the_launchs_environment_and_stops_with_it(
    zygote: tuple[str, subprocess.Popen[bytes]],
    spark_side: tuple[str, socket.socket],
    tmp_path: Path,
) -> None:
    path, proc = zygote
    client = launch(path, spark_side[0], tmp_path)
    pid, conn = runner_pid(spark_side[1])
    try:
        # forked, not started; it found this socket from the launch's environment alone
        assert pid != client.pid and parent_of(pid) == proc.pid
        assert Path(f"/proc/{pid}/cwd").resolve() == tmp_path.resolve()
        # Spark stops a runner by stopping the process it started: the runner goes too
        client.send_signal(signal.SIGTERM)
        client.wait(30)
        wait_until(lambda: not running(pid), 30, 0.05, what="the runner's end")
    finally:
        conn.close()
        if client.poll() is None:
            client.kill()


def test_the_runners_status_and_stderr_reach_the_launch(
    zygote: tuple[str, subprocess.Popen[bytes]],
    spark_side: tuple[str, socket.socket],
    tmp_path: Path,
) -> None:
    """Spark closing its end mid-handshake fails the runner: the launch exits non-zero with
    the runner's traceback on its stderr, as a runner Spark started itself would."""
    client = launch(zygote[0], spark_side[0], tmp_path)
    pid, conn = runner_pid(spark_side[1])
    conn.close()
    _, err = client.communicate(timeout=60)
    assert client.returncode != 0
    assert b"Traceback" in err, err[-2000:]
    assert not running(pid)


def test_without_a_zygote_the_launch_is_the_runner_itself(
    spark_side: tuple[str, socket.socket], tmp_path: Path
) -> None:
    client = launch(str(tmp_path / "no-zygote.sock"), spark_side[0], tmp_path)
    pid, conn = runner_pid(spark_side[1])
    try:
        assert pid == client.pid  # exec'd into the interpreter Spark asked for
    finally:
        conn.close()
        client.communicate(timeout=60)


def test_the_wrapper_hands_only_a_source_runner_to_a_listening_zygote(
    zygote: tuple[str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """jobs/worker_python.sh: the runner module with a zygote socket goes through the
    client; anything else, or a path that is not a socket, starts Python directly."""
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, WORKER_PYTHON_ENV: str(fake), ZYGOTE_ENV: zygote[0]}

    def argv(*args: str, **extra: str) -> list[str]:
        out = subprocess.run(
            [str(WORKER_PYTHON), *args], env={**env, **extra}, capture_output=True, timeout=30
        )
        return out.stdout.decode().split()

    client = str(Path(WORKER_PYTHON).parent / "zygote_client.py")
    assert argv("-m", RUNNER_MODULE) == ["-S", "-E", client, "-m", RUNNER_MODULE]
    assert argv("-m", "pyspark.daemon") == ["-m", "pyspark.daemon"]
    no_socket = str(tmp_path / "none")
    assert argv("-m", RUNNER_MODULE, **{ZYGOTE_ENV: no_socket}) == ["-m", RUNNER_MODULE]


def test_a_zygote_whose_parent_is_gone_exits_and_removes_its_socket(tmp_path: Path) -> None:
    """The zygote outlives nothing: its parent gone (SIGKILLed, no clean-up), it stops
    serving and removes the directory it was given."""
    directory = tmp_path / "owned"
    directory.mkdir()
    path = directory / "s"
    starter = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'jobs.source_zygote', {str(path)!r}, "
        "str(__import__('os').getpid()), 'owns-dir'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", starter],
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        zygote = int(parent.stdout.readline())
        wait_until(lambda: path.is_socket(), 60, 0.05, what="the zygote's socket")
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not running(zygote), 30, 0.1, what="the zygote's exit")
        assert not directory.exists()
    finally:
        if parent.poll() is None:
            parent.kill()


def test_directories_of_zygotes_gone_without_clean_up_are_tidied(
    zygote: tuple[str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A zygote SIGKILLed with its process group leaves its directory; the next zygote's
    start removes such directories, never a live zygote's or one too new to judge."""
    tmp = tmp_path / "tmp"
    live, dead, new = (tmp / f"{source_zygote.DIR_PREFIX}{n}" for n in ("live", "dead", "new"))
    for d in (live, dead, new):
        d.mkdir(parents=True)
    (live / "s").symlink_to(zygote[0])  # answers: a live zygote's socket
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(dead / "s"))
    stale.close()  # a socket file nobody listens on
    old = os.stat(dead).st_mtime - 120
    for d in (live, dead):
        os.utime(d, (old, old))
    assert source_zygote.tidy(tmp) == [dead]
    assert live.exists() and new.exists() and not dead.exists()
